"""An engine client in each frontend worker (vLLM's ``--api-server-count`` shape).

With ``--frontend-workers N`` (N > 1) and ``--frontend-direct on``, the vLLM backend in the core starts its engine
core with N + 1 clients: index 0 is the core's own (Triton's tensor requests, health, LoRA, metrics), index ``i``
(1..N) belongs to frontend worker ``i - 1``. The engine's ``EngineInfo.engine_clients`` tells the workers where
(``llm_backends/vllm/engine.py start_engine_with_clients``). A worker builds its client for a model version once
its snapshot shows the version: for the versions loaded at the server's start before the worker serves the ports
(workers/main.py: the server is ready once they are built), for those loaded later (and in a worker started again)
in the background; until the client is up, and whenever it cannot be built, generations are relayed through the
core. On its client the worker runs the backend's own ``Generator``: GenerationRequest -> SamplingParams -> the
engine -> GenerationDelta, with no hop to the core per token.

What the core keeps: the worker tells it, in one :class:`~.protocol.WorkerGenerations` message per loop turn and
version, how many generations it started and finished and its statistics counters for the version; the core
counts the first two as the version's requests in flight (a drain or an unload waits for them) and adds the
counters to the version's statistics (``ModelStats.remote``, as for the direct path's instance processes), and
the increments of its ``tideserve:*`` LLM metrics and of its client's ``vllm:*`` families to the model's
(:func:`engine_values`: vLLM's families count every client's requests, as with ``--api-server-count``). A
worker that goes away has its unfinished generations counted as finished (the engine core then finishes or drops
what it was generating for it: its outputs go to a client no longer there). The worker closes its client once the
version leaves its snapshot (unloading) and its own generations there have ended.

Deadlines are the Generator's own (the model's ``max_queue_delay_ms``, the request's timeout); a worker sees only
its own requests in the engine, so a request at its deadline without a first token is refused (the Generator's
"placed" estimate, which needs all of the engine's requests, is off in a worker).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from ..dataplane import DeltaStream
from ..errors import InternalError, ServerError, Status, Unavailable
from ..stats import ModelStats
from ..generation import GenerationRequest

if TYPE_CHECKING:
    from .remote import RemoteDataPlane, RemoteRuntime

log = logging.getLogger(__name__)

# set by the server before its models load: how many frontend workers take an engine client (0: none)
ENGINE_CLIENT_WORKERS = 0


def configure(options) -> None:
    """From the server's options: N with ``--frontend-workers N`` (N > 1) and ``--frontend-direct on``, else 0."""
    global ENGINE_CLIENT_WORKERS
    workers = getattr(options, "frontend_workers", 1)
    ENGINE_CLIENT_WORKERS = workers if getattr(options, "frontend_direct", False) else 0


def engine_client_workers() -> int:
    """(The backend API's) how many frontend workers take an engine client of their own, 0: none."""
    return ENGINE_CLIENT_WORKERS


# -- the core's side ----------------------------------------------------------------------------------------------
class CoreCounts:
    """What each worker link reported (``WorkerGenerations``): its unfinished generations by runtime uid."""

    def __init__(self, repository) -> None:
        self.repository = repository
        self.unfinished: dict[int, dict[int, int]] = {}  # worker index -> uid -> generations started, not finished

    def _runtime(self, uid: int):
        for runtime in self.repository.runtimes():
            if runtime.uid == uid:
                return runtime
        return None

    def received(self, index: int, message) -> None:
        runtime = self._runtime(message.uid)
        if runtime is None:
            return
        counts = self.unfinished.setdefault(index, {})
        for _ in range(message.started):
            runtime.request_started()
        for _ in range(message.finished):
            runtime.request_finished()
        counts[message.uid] = counts.get(message.uid, 0) + message.started - message.finished
        if message.counters is not None:
            runtime.stats.remote[("worker", index)] = message.counters
        model = runtime.model
        if message.llm and getattr(model, "metrics", None) is not None:
            if log.isEnabledFor(logging.DEBUG):  # (which worker's message brought which counts: the tests' log)
                log.debug("model '%s': frontend worker %d's LLM counters moved %s", runtime.name, index,
                          {name: values[0] for name, values in message.llm.items() if name in _COUNTERS})
            add_llm_increments(model.metrics, (runtime.name, str(runtime.version)), message.llm)
        current = True  # the message's gauges are the engine's latest (not older than those already set)
        if message.state is not None and callable(getattr(model, "engine_state", None)):
            from tideserve.llm_backends.vllm.engine import EngineState

            running, waiting, kv, *at = message.state
            current = model.engine_state(EngineState(int(running), int(waiting), kv, at[0] if at else 0.0)) is not False
        if message.engine and (registry := getattr(model, "vllm_registry", None)) is not None:
            add_engine_increments(registry, message.engine, gauges=current)

    def lost(self, index: int) -> None:
        """Worker ``index`` went away: its generations no longer count as in flight; its counters stay counted."""
        for uid, count in self.unfinished.pop(index, {}).items():
            runtime = self._runtime(uid)
            if runtime is None:
                continue
            for _ in range(max(count, 0)):
                runtime.request_finished()
            runtime.stats.retire(("worker", index))


# the LLM metrics (llm_backends/metrics.py LLMMetrics) a worker's Generator records, sent to the core as increments
_HISTOGRAMS = ("time_to_first_token", "inter_token_latency", "e2e_latency", "queue_time", "prompt_tokens_hist",
               "generation_tokens_hist")
_COUNTERS = ("prompt_tokens", "generation_tokens", "request_success", "request_aborted")


def llm_values(metrics, labels: tuple[str, str]) -> dict[str, list[float]]:
    """The worker's LLM metrics of one version: per histogram its bucket counts (not cumulative) and sum, per
    counter its value (prometheus_client's members, as llm_backends/metrics.py observe_many writes them)."""
    out = {}
    for name in _HISTOGRAMS:
        child = getattr(metrics, name).labels(*labels)
        out[name] = [bucket.get() for bucket in child._buckets] + [child._sum.get()]
    for name in _COUNTERS:
        out[name] = [getattr(metrics, name).labels(*labels)._value.get()]
    return out


def add_llm_increments(metrics, labels: tuple[str, str], increments: dict[str, list[float]]) -> None:
    """Add a worker's increments (:func:`llm_values` differences) to the core's LLM metrics."""
    for name, values in increments.items():
        family = getattr(metrics, name, None)
        if family is None:
            continue
        child = family.labels(*labels)
        if name in _COUNTERS:
            if values[0] > 0:
                child.inc(values[0])
            continue
        buckets = child._buckets
        if len(values) != len(buckets) + 1:
            continue
        for bucket, value in zip(buckets, values):
            if value > 0:
                bucket.inc(value)
        if values[-1]:
            child._sum.inc(values[-1])


# The engine's own vllm:* families (vLLM's PrometheusStatLogger in each client; llm_backends/vllm/prometheus.py).
# Each client's logger counts what its outputs carry: the iteration stats of its own requests (tokens, successes,
# the latency histograms), and the scheduler stats of the steps the engine core sent to it (the engine sends each
# step's scheduler stats to one client only: the prefix-cache counters are split between the clients, never
# repeated). So the counters and histograms of all clients add up to the engine's; a worker sends the core the
# increments of its registry. The gauges (running, waiting, KV cache usage) are the engine's one value: the core
# takes a worker's as they stand after a step whose scheduler stats came to that worker (the most recent one).
_OWN_GAUGES = frozenset({"vllm:engine_sleep_state", "vllm:cache_config_info", "vllm:lora_requests_info"})


def _children(metric):
    """(label values, child) of each child of a prometheus_client metric (the metric itself when unlabelled)."""
    if not metric._labelnames:
        return [((), metric)]
    with metric._lock:
        return list(metric._metrics.items())


def engine_values(registry, counters: bool = True, gauges: bool = True) -> dict[tuple, list[float]]:
    """The values of a vllm:* registry by (family, label values): with ``counters``, a counter's value, a
    histogram's bucket counts (not cumulative) and sum; with ``gauges``, a gauge's value (those the scheduler's
    stats set) under ``("gauge", family, label values)``."""
    out: dict[tuple, list[float]] = {}
    for metric in list(registry._collector_to_names):
        kind = getattr(metric, "_type", None)
        name = getattr(metric, "_name", None)
        if not counters and kind != "gauge":
            continue
        if kind == "counter":
            for labels, child in _children(metric):
                out[(name, labels)] = [child._value.get()]
        elif kind == "histogram":
            for labels, child in _children(metric):
                out[(name, labels)] = [bucket.get() for bucket in child._buckets] + [child._sum.get()]
        elif kind == "gauge" and gauges and name not in _OWN_GAUGES:
            for labels, child in _children(metric):
                out[("gauge", name, labels)] = [child._value.get()]
    return out


def engine_increments(now: dict[tuple, list[float]], sent: dict[tuple, list[float]]) -> list:
    """What to send of :func:`engine_values` ``now`` after ``sent``: counters' and histograms' increments (those
    not zero), gauges' values; as the message's ``[family, label values, values]`` entries."""
    out = []
    for key, values in now.items():
        if key[0] == "gauge":
            out.append((key[1], list(key[2]), values))
            continue
        before = sent.get(key)
        diff = values if before is None else [a - b for a, b in zip(values, before)]
        if any(diff):
            out.append((key[0], list(key[1]), diff))
    return out


def add_engine_increments(registry, entries, gauges: bool = True) -> None:
    """Add a worker's :func:`engine_increments` to the core's vllm:* registry (gauges: set, where ``gauges``)."""
    metrics = getattr(registry, "_tideserve_by_name", None)
    if metrics is None or len(metrics) != len(registry._collector_to_names):  # (built once; again if one came)
        metrics = {getattr(metric, "_name", None): metric for metric in list(registry._collector_to_names)}
        registry._tideserve_by_name = metrics
    for name, labels, values in entries:
        metric = metrics.get(name)
        if metric is None:
            continue
        try:
            child = metric.labels(*labels) if metric._labelnames else metric
        except ValueError:  # (another label set than this engine's)
            continue
        kind = metric._type
        if kind == "gauge":
            if gauges:
                child.set(values[0])
        elif kind == "counter":
            if values[0] > 0:
                child.inc(values[0])
        elif kind == "histogram" and len(values) == len(child._buckets) + 1:
            for bucket, value in zip(child._buckets, values):
                if value > 0:
                    bucket.inc(value)
            if values[-1]:
                child._sum.inc(values[-1])


# a worker reads its vllm:* registry and its LLM metrics at a generation's start or end, else at most this often
ENGINE_VALUES_EVERY_S = 0.5
# and sends the core the engine's scheduler state (running, waiting, KV cache: gauges) at most this often, not after
# every step whose stats came to its client (a message per engine step: 11 % of a worker's samples at 64 streams)
STATE_EVERY_S = 0.05


# -- the worker's side --------------------------------------------------------------------------------------------
_FAILURE_REASON = {Status.CANCELLED: "CANCELED", Status.UNAVAILABLE: "REJECTED"}


class WorkerGenerationStream(DeltaStream):
    """One typed generation run on the worker's engine client: the Generator's sender and the frontend's reader
    (closing it early cancels the request, which aborts it in the engine through this worker's client) are the
    core's (:class:`~tideserve.dataplane.DeltaStream`); what is recorded at the end is this worker's: statistics go
    to its own counters of the version, the generation's end to the core's count in flight."""

    __slots__ = ("_client",)

    def __init__(self, client: _Client, model_name: str, generation: GenerationRequest, **identity) -> None:
        super().__init__(asyncio.get_running_loop(), model_name, generation, **identity)
        self._client = client

    @property
    def runtime(self):
        return self._client.remote

    def _end(self) -> None:
        self._done = True
        now = time.monotonic_ns()
        elapsed = now - self.arrival_ns
        stats = self._client.stats
        self._executed(stats, now)
        error = self._error
        if error is None:
            if self._first_ns:
                stats.record_first_response(self._first_ns - self.arrival_ns)
                stats.record_success(elapsed)
            else:
                stats.record_success(elapsed, True)
        else:
            stats.record_first_response(self._first_ns - self.arrival_ns if self._first_ns else elapsed)
            stats.record_failure(elapsed, _FAILURE_REASON.get(error.status, "BACKEND"))
        self._client.finished()

    def cancel(self) -> None:
        """The client went away: the Generator aborts the engine request."""
        if self._done:
            return
        self._done = True
        self._cancel_request()
        now = time.monotonic_ns()
        stats = self._client.stats
        self._executed(stats, now)
        if self._first_ns:
            stats.record_first_response(self._first_ns - self.arrival_ns)
        stats.record_failure(now - self.arrival_ns, "CANCELED")
        self._client.finished()

    def _executed(self, stats, now: int) -> None:
        """The request's execution, recorded with its end (the engine runs one request per execution)."""
        stats.record_queue(0, 1)
        stats.record_execution(1, 1, 0, now - self.queue_start_ns, 0, 1)


class _NoClient(Exception):
    """The engine has no client for this worker."""


class _Client:
    """One model version's engine client in this worker, and the Generator on it."""

    def __init__(self, clients: EngineClients, runtime: RemoteRuntime, blob: bytes) -> None:
        self.clients = clients
        self.uid = runtime.uid
        self.name = runtime.name
        self.remote = runtime
        self.stats = ModelStats(runtime.name, str(runtime.version))
        self.metrics = None  # the Generator's LLMMetrics (a registry of its own; increments go to the core)
        self._sent: dict[str, list[float]] = {}  # the LLM metrics' values at the last message
        self._llm_read = 0.0  # when (monotonic) they were last read
        self.vllm_registry = None  # the vllm:* families of this client's PrometheusStatLogger (increments go to the core)
        self._engine_sent: dict[tuple, list[float]] = {}  # their values at the last message that carried them
        self._engine_read = 0.0  # when (monotonic) they were last read
        self.state = None  # the engine's scheduler state after a step whose stats came to this client, not yet sent
        self.state_sent = 0.0  # when (monotonic) a state was last sent
        self.blob = blob
        self.engine = None
        self.generator = None
        self.inflight = 0
        self.running: set[WorkerGenerationStream] = set()  # the streams whose generation task runs
        self.retiring = False
        self.closed = False
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._build(), name=f"{self.name}-engine-client")

    async def _build(self) -> None:
        try:
            engine, generator = await asyncio.to_thread(self._make)
        except _NoClient as exc:
            log.info("model '%s': %s; its generations go through the core", self.name, exc)
            return
        except TimeoutError:  # a worker started again: the engine sent its ready message to its predecessor
            log.warning("model '%s': the engine core did not greet frontend worker %d's client (a worker started "
                        "again after the engine); its generations go through the core", self.name,
                        self.clients.index - 1)
            return
        except Exception:
            log.exception("model '%s': frontend worker %d could not reach the engine core with a client of its "
                          "own; its generations go through the core", self.name, self.clients.index - 1)
            return
        if self.retiring or self.closed:  # unloaded meanwhile
            await asyncio.to_thread(engine.shutdown)
            return
        self.engine, self.generator = engine, generator
        log.info("model '%s' version %s: frontend worker %d runs its generations on engine client %d",
                 self.name, self.remote.version, self.clients.index - 1, self.clients.index)

    def _make(self):
        """On a thread: import vLLM, connect to the engine core at this worker's addresses, build the Generator."""
        import pickle

        from prometheus_client import CollectorRegistry
        from tideserve.llm_backends.metrics import LLMMetrics
        from tideserve.llm_backends.vllm import config as vllm_config
        from tideserve.llm_backends.vllm.engine import WORKER_READY_TIMEOUT_S
        from tideserve.llm_backends.vllm.generation import Generator
        from tritonclient.grpc import model_config_pb2 as mc
        from vllm.v1.engine import core_client
        from vllm.v1.engine.async_llm import AsyncLLM

        from ..datatypes import config_to_datatype, numpy_dtype

        spec = pickle.loads(self.blob)
        index = self.clients.index
        if index >= spec["count"]:
            raise _NoClient(f"the engine takes {spec['count'] - 1} worker clients; this is worker {index - 1}")
        # the engine sent its ready message at its start; a worker started again later waits for it in vain
        core_client.VLLM_ENGINE_READY_TIMEOUT_S = WORKER_READY_TIMEOUT_S
        from tideserve.llm_backends.vllm.engine import _StateLogger
        from tideserve.llm_backends.vllm.prometheus import prometheus_logger

        # the engine sends each step's scheduler stats to one client: those that come here go to the core
        registry = CollectorRegistry(auto_describe=False)  # (their increments go to the core's: engine_increments)
        loggers = [lambda _config, _index=0: _StateLogger(self._state), prometheus_logger(registry)]
        engine = AsyncLLM.from_vllm_config(
            spec["config"], stat_loggers=loggers,
            client_addresses={"input_address": spec["inputs"][index - 1], "output_address": spec["outputs"][index - 1]},
            client_count=spec["count"], client_index=index)
        try:
            config = self.remote.config
            options = vllm_config.backend_options(config)
            dtypes = {t.name: numpy_dtype(config_to_datatype(mc.DataType.Name(t.data_type)))
                      for t in config.output if t.data_type != mc.TYPE_STRING}
            self.metrics = LLMMetrics(CollectorRegistry())
            generator = Generator(engine, self.name, str(self.remote.version), self.metrics,
                                  dtypes, max_queue_delay_ms=options.max_queue_delay_ms)
            generator.order.enabled = False  # this worker sees only its own requests (see the module docstring)
            self.vllm_registry = registry
            from vllm import envs as vllm_envs

            # as the backend does in the core: vLLM reads its environment variables on every access unless cached,
            # and its output handler reads some on every step (4 % of a worker's CPU in a 64-stream profile)
            vllm_envs.enable_envs_cache()
        except BaseException:
            engine.shutdown()
            raise
        return engine, generator

    def run(self, model_name: str, generation: GenerationRequest, identity: dict) -> WorkerGenerationStream:
        loop = asyncio.get_running_loop()
        stream = WorkerGenerationStream(self, model_name, generation, **identity)
        stream.queue_start_ns = time.monotonic_ns()
        self.inflight += 1
        self.clients.note(self.uid, started=1)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("model '%s': request %s runs on this worker's engine client %d", self.name, stream.id,
                      self.clients.index)
        task = loop.create_task(self.generator.run(stream))
        task.add_done_callback(lambda t, s=stream: self._generated(t, s))
        self.running.add(stream)
        return stream

    def _generated(self, task: asyncio.Task, stream: WorkerGenerationStream) -> None:
        self.running.discard(stream)
        if task.cancelled():
            stream.send_error(Unavailable(f"model '{self.name}' was unloaded before the request finished"))
        elif (exc := task.exception()) is not None:
            log.error("model '%s': request generation failed", self.name, exc_info=exc)
            stream.send_error(InternalError(f"model '{self.name}' failed to run the request"))
        self.clients.note(self.uid, settled=True)

    def _state(self, state) -> None:
        """The engine's state after a step whose stats came to this client (on the worker's loop)."""
        self.state = state
        self.clients.note(self.uid)

    def llm_increments(self, changed: bool) -> dict[str, list[float]] | None:
        """The LLM metrics' increments since they were last read (None: none), read when a generation started or
        ended (``changed``) or ``ENGINE_VALUES_EVERY_S`` after the last read (not on every engine step)."""
        from tideserve.llm_backends.metrics import _BULK_OBSERVE

        metrics = self.metrics
        if metrics is None or not _BULK_OBSERVE:  # (prometheus_client's members differ: not sent)
            return None
        now = time.monotonic()
        if not changed and now - self._llm_read < ENGINE_VALUES_EVERY_S:
            return None
        self._llm_read = now
        current = llm_values(metrics, (self.name, str(self.remote.version)))
        sent, self._sent = self._sent, current
        out = {}
        for name, values in current.items():
            before = sent.get(name)
            diff = values if before is None else [a - b for a, b in zip(values, before)]
            if any(diff):
                out[name] = diff
        return out or None

    def engine_increments(self, ended: bool, state: bool) -> list | None:
        """The vllm:* families' increments since they were last sent (with the gauges where ``state``: this
        client's logger has just set them from a step's scheduler stats), read when a generation ended
        (``ended``) or ``ENGINE_VALUES_EVERY_S`` after the last read; None: nothing to send."""
        registry = self.vllm_registry
        if registry is None:
            return None
        now = time.monotonic()
        if not ended and now - self._engine_read < ENGINE_VALUES_EVERY_S:
            if not state:
                return None
            return engine_increments(engine_values(registry, counters=False), {}) or None
        self._engine_read = now
        values = engine_values(registry, gauges=state)
        out = engine_increments(values, self._engine_sent)
        self._engine_sent = {k: v for k, v in values.items() if k[0] != "gauge"}
        return out or None

    def finished(self) -> None:
        """A generation's stream ended (the reader saw its end or closed it): told to the core now, with the
        statistics and LLM metrics it counted, before the frontend writes the answer's end, so that a client that
        reads them once it has the answer finds the request there (as in the one process)."""
        self.inflight -= 1
        self.clients.note(self.uid, finished=1, now=True)
        if self.retiring and self.inflight <= 0:
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.clients.clients.pop(self.uid, None)
        engine, self.engine, self.generator = self.engine, None, None
        if engine is not None:
            asyncio.get_running_loop().create_task(_shutdown(engine, self.name))


async def _shutdown(engine, name: str) -> None:
    handler = getattr(engine, "output_handler", None)
    if handler is not None and not handler.done():  # stopped before the client, as the backend stops its own
        handler.cancel()
        await asyncio.gather(handler, return_exceptions=True)
    try:
        await asyncio.to_thread(engine.shutdown)
    except Exception:
        log.exception("model '%s': closing the worker's engine client", name)


class EngineClients:
    """A frontend worker's engine clients, one per model version whose engine takes them (by runtime uid), and its
    statistics of the versions whose requests it served itself (theirs, and those of ``record_runs``)."""

    def __init__(self, plane: RemoteDataPlane, index: int) -> None:
        self.plane = plane
        self.index = index  # this worker's client index (its worker index + 1)
        self.clients: dict[int, _Client] = {}
        self.stats: dict[int, ModelStats] = {}  # by uid: this worker's statistics of each version (kept once closed)
        self._notes: dict[int, list] = {}  # uid -> [started, finished, settled] not yet told to the core
        self._counters_sent: dict[int, dict] = {}  # uid -> the statistics counters last sent
        self._deferred: set[int] = set()  # uids whose engine state waits for STATE_EVERY_S
        self._flush_scheduled = False

    def generate(self, model_name: str, generation: GenerationRequest, *, model_version: str = "", **identity):
        """A GenerationStream run on this worker's engine client, or None: the request goes through the core."""
        try:
            runtime = self.plane.model(model_name, model_version)
        except ServerError:
            return None  # the core answers it
        engine = runtime.engine
        if engine is None or not engine.engine_clients:
            return None
        client = self.clients.get(runtime.uid)
        if client is None:
            client = self.clients[runtime.uid] = _Client(self, runtime, engine.engine_clients)
            self.stats[runtime.uid] = client.stats
            client.start()
            return None
        if client.generator is None or client.retiring:
            return None
        return client.run(model_name, generation, dict(identity, model_version=model_version))

    def record_runs(self, runtime: RemoteRuntime, count: int, elapsed_ns: int) -> None:
        """``count`` requests of ``runtime`` this worker's frontend served itself (``record_frontend_runs``), counted
        in this worker's statistics of the version and sent to the core now, before their answers go out."""
        stats = self.stats.get(runtime.uid)
        if stats is None:
            stats = self.stats[runtime.uid] = ModelStats(runtime.name, str(runtime.version))
        stats.record_runs(count, elapsed_ns)
        self.note(runtime.uid, now=True)

    def start_building(self) -> None:
        """Build now the clients the core's current snapshot calls for (the versions loaded before this worker
        started), in the background."""
        snapshot = self.plane.link.snapshot
        if snapshot is not None:
            self.snapshot_applied({uid for table in snapshot.lookups.values() for uid in table.values()
                                   if isinstance(uid, int)})

    async def built(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until each client being built is up or has given up (its generations
        then go through the core)."""
        tasks = [client.task for client in self.clients.values() if client.task is not None]
        if not tasks:
            return
        started = time.monotonic()
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        if pending:
            log.warning("frontend worker %d: %d engine client(s) not built after %.0f s; serving meanwhile (their "
                        "generations go through the core until they are)", self.index - 1, len(pending), timeout)
        else:
            log.info("frontend worker %d: engine clients built in %.1f s", self.index - 1, time.monotonic() - started)

    def abort_all(self, error: ServerError) -> None:
        """End every generation running on this worker's clients with ``error`` (the server's exit timeout ran out);
        the engine aborts them."""
        for client in list(self.clients.values()):
            for stream in list(client.running):
                stream.abort(error)

    def snapshot_applied(self, live: set[int]) -> None:
        """The core's snapshot: a version whose engine takes this worker's client gets it built now (in the
        background); versions no longer in it are unloading: their clients close once idle."""
        runtimes = self.plane.link.runtimes
        for uid in live:
            runtime = runtimes.get(uid)
            if runtime is not None and uid not in self.clients and uid not in self.stats:
                engine = runtime.engine
                if engine is not None and engine.engine_clients:
                    client = self.clients[uid] = _Client(self, runtime, engine.engine_clients)
                    self.stats[uid] = client.stats
                    client.start()
        for uid, client in list(self.clients.items()):
            if uid not in live and not client.retiring:
                client.retiring = True
                if client.inflight <= 0:
                    client.close()
        for uid in [uid for uid in self.stats if uid not in live and uid not in self.clients]:
            del self.stats[uid]  # (its last counters were sent)
            self._counters_sent.pop(uid, None)

    def note(self, uid: int, started: int = 0, finished: int = 0, settled: bool = False, now: bool = False) -> None:
        """Tell the core (with the loop's next turn, or at once with ``now``) of generations ``started`` and
        ``finished`` (their streams ended), or that one has ``settled``: its Generator returned, so its LLM metrics
        are all recorded (what it counts after the stream's end, an aborted request's say, must not wait for the
        worker's next generation)."""
        entry = self._notes.get(uid)
        if entry is None:
            entry = self._notes[uid] = [0, 0, False]
        entry[0] += started
        entry[1] += finished
        entry[2] = entry[2] or settled
        if now:
            self._flush()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        from .protocol import WorkerGenerations

        self._flush_scheduled = False
        notes, self._notes = self._notes, {}
        now = time.monotonic()
        for uid, (started, finished, settled) in notes.items():
            changed = started > 0 or finished > 0
            ended = finished > 0 or settled
            stats = self.stats.get(uid)
            counters = stats.export() if stats is not None else None
            if counters is not None and counters == self._counters_sent.get(uid):
                counters = None  # (the core keeps the last it got)
            client = self.clients.get(uid)
            llm = state = engine = None
            if client is not None:
                llm = client.llm_increments(changed or settled)
                if client.state is not None:
                    if changed or now - client.state_sent >= STATE_EVERY_S:
                        found, client.state = client.state, None
                        client.state_sent = now
                        state = [found.running, found.waiting, found.kv_cache_usage, found.at]
                    else:  # the latest state goes with the next message, at the latest STATE_EVERY_S after the last
                        self._later(uid, client.state_sent + STATE_EVERY_S - now)
                engine = client.engine_increments(ended, state is not None)
            if not changed and counters is None and llm is None and state is None and engine is None:
                continue
            try:
                self.plane.link.send(WorkerGenerations(uid, started, finished, counters, llm, state, engine))
            except ServerError:  # the core is gone
                return
            if counters is not None:
                self._counters_sent[uid] = counters

    def _later(self, uid: int, delay: float) -> None:
        if uid in self._deferred:
            return
        self._deferred.add(uid)

        def due() -> None:
            self._deferred.discard(uid)
            self.note(uid)

        asyncio.get_running_loop().call_later(max(delay, 0.0), due)


__all__ = ["ENGINE_CLIENT_WORKERS", "CoreCounts", "EngineClients", "configure", "engine_client_workers"]
