"""A loaded model version: backend model, instances, scheduler, validator and statistics."""

from __future__ import annotations

import asyncio
import enum
import inspect
import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from tritonclient.grpc import model_config_pb2 as mc

from . import response_cache
from .backend import Backend, InstanceContext, Model, ModelContext, ModelInstance, call_hook
from .errors import InternalError, ServerError, Unavailable, as_server_error
from .generation import EngineInfo
from .stats import ModelStats
from .types import InferenceRequest
from .validation import RequestValidator

log = logging.getLogger(__name__)


class ModelState(str, enum.Enum):
    LOADING = "LOADING"
    READY = "READY"
    UNLOADING = "UNLOADING"
    UNAVAILABLE = "UNAVAILABLE"


class InstanceSlot:
    """A ModelInstance with its own worker thread (blocking execute runs there)."""

    def __init__(self, instance: ModelInstance) -> None:
        self.instance = instance
        self.is_async = inspect.iscoroutinefunction(instance.execute)
        self.hands_over = not self.is_async and instance.releases_gil  # see _run_in_thread
        # it takes its next batch while it runs one (ModelInstance.submit): see ModelRuntime._execute_ahead
        self.queues = getattr(type(instance), "submit", ModelInstance.submit) is not ModelInstance.submit
        self.last_run_ns = 0  # how long its last batch took (execute, hand-overs included)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=instance.ctx.name)
        self.limits = None  # what the rate limiter makes it wait for (schedulers/rate_limiter.py), if on

    async def call(self, fn, *args):
        return await call_hook(fn, *args, executor=self.executor)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


_uids = itertools.count(1)
# How long the event loop waits, at most, for an instance's thread to take a batch it handed over (a busy machine
# may not run the thread at once; the loop then carries on and the thread waits for the GIL as before).
HANDOVER_WAIT_S = 0.002
# Only an instance whose last batch ran this long is handed the GIL: for a model that runs in microseconds the
# thread's wait for the GIL is no idle worth a forced switch per batch.
HANDOVER_MIN_RUN_NS = 1_000_000
# Only an instance whose last batch ran (and came back) within this long is handed its next full batch while it runs
# one: a batch then waits behind a short run at most, never behind a long one while another instance frees up.
QUEUE_AHEAD_MAX_RUN_NS = 2_000_000


def _run_in_thread(slot: InstanceSlot, requests: list[InferenceRequest], take=None) -> asyncio.Future:
    """Run ``execute`` on the instance's thread and hand it the GIL now: the loop blocks (without the GIL) until the
    thread has started, which then holds the GIL only to assemble the batch before its native run releases it.
    Without this the thread waits for the GIL until the loop's work of the moment ends or the switch interval
    (5 ms) forces it off the loop: measured on ``text_encoder`` (``/v1/embeddings``, 32 clients, a loaded
    2-core machine), the time from the hand-over to the thread's start fell from 2.1 ms median (p90 11.3) to
    0.3 (p90 4.3) per batch of ~12 (docs/performance.md, "the hand-over to ONNX Runtime's threads").

    The future's result is ``(result, follow)``: ``follow`` None, or the next batch the thread took itself at the
    end of the run (``take``: the scheduler's ``take_ready``) as ``(requests, start_ns, concurrent future)``, run
    next on the same thread (its future's result again ``(result, follow)``)."""
    lock = threading.Lock()  # one per batch: a thread that starts after the wait has run out releases only its own
    lock.acquire()
    future = asyncio.get_running_loop().run_in_executor(slot.executor, _started, lock, slot, take, requests)
    lock.acquire(timeout=HANDOVER_WAIT_S)
    return future


def _started(lock: threading.Lock, slot: InstanceSlot, take, requests: list[InferenceRequest]):
    lock.release()
    return _run_and_follow(slot, take, requests)


def _run_and_follow(slot: InstanceSlot, take, requests: list[InferenceRequest]):
    """Run a batch on the instance's thread; then, with ``take``, take the next ready batch and queue it on the
    same thread before returning this one's result to the loop: the thread starts it at once, while the loop
    answers this one."""
    result = slot.instance.execute(requests)
    if take is None:
        return result, None
    try:
        follow = take()
    except Exception:  # never the run's failure: the loop's workers form the next batch as before
        log.exception("instance '%s': taking the next batch on its thread failed", slot.instance.ctx.name)
        follow = None
    if not follow:
        return result, None
    start = time.monotonic_ns()
    try:
        future = slot.executor.submit(_run_and_follow, slot, take, follow)
    except RuntimeError:  # the executor shut down meanwhile (the model unloads): the loop answers them
        future = None
    return result, (follow, start, future)


class ModelRuntime:
    """One version of one model, ready to take requests once :meth:`load` returns."""

    def __init__(self, backend: Backend, ctx: ModelContext, stats: ModelStats) -> None:
        self.backend = backend
        self.ctx = ctx
        self.name = ctx.name
        self.version = ctx.version
        self.stats = stats
        self.rate_limiter = None  # the server's, when --rate-limit execution_count (set by the repository)
        self.uid = next(_uids)  # names this runtime to frontend workers, never reused
        self.on_change = None  # called (from any thread) when the state changes; set by the repository
        self.state = ModelState.LOADING
        self.reason = ""
        # an ensemble's steps as (model, version or ""): it serves only while each of them does
        self.steps: tuple[tuple[str, str], ...] = tuple(dict.fromkeys(
            (step.model_name, str(step.model_version) if step.model_version > 0 else "")
            for step in ctx.config.ensemble_scheduling.step)) if ctx.config is not None else ()
        ctx.on_failure = self._failed
        self.model: Model = backend.create_model(ctx)
        self.slots: list[InstanceSlot] = []
        self.scheduler = None
        self.validator: RequestValidator | None = None
        self.inflight = 0
        self.idle = asyncio.Event()
        self.idle.set()

    @property
    def state(self) -> ModelState:
        return self._state

    @state.setter
    def state(self, value: ModelState) -> None:
        self._state = value
        if self.on_change is not None:
            self.on_change()

    @property
    def config(self) -> mc.ModelConfig:
        return self.ctx.config

    @property
    def decoupled(self) -> bool:
        return self.ctx.decoupled

    @property
    def engine(self) -> EngineInfo | None:
        """What the model's LLM backend tells of its engine (ServedModel.engine)."""
        return self.model.engine_info()

    # -- lifecycle -----------------------------------------------------------------------
    async def load(self) -> None:
        """Auto-complete and check the config, initialise the model and its instances in parallel."""
        try:
            await self._load()
        except BaseException as exc:
            await self.unload()
            self.state, self.reason = ModelState.UNAVAILABLE, str(exc)
            raise

    async def _load(self) -> None:
        from . import config as config_module
        from .schedulers import make_scheduler
        from .warmup import run_warmup

        await call_hook(self.model.auto_complete_config)
        config_module.validate(self.config)
        response_cache.check_config(self.config)
        self.validator = RequestValidator(self.config)
        await call_hook(self.model.initialize)
        response_cache.check_config(self.config)  # again: initialize may make it decoupled (an ensemble's step)
        contexts = self._instance_contexts()
        instances = await asyncio.gather(*(self._make_instance(c) for c in contexts), return_exceptions=True)
        self.slots = [i for i in instances if isinstance(i, InstanceSlot)]
        failures = [i for i in instances if isinstance(i, BaseException)]
        if failures:
            raise failures[0]
        await run_warmup(self)  # model_warmup samples, on every instance, before the model is READY
        if self.rate_limiter is not None:
            self.rate_limiter.add_model(self)
        self.scheduler = make_scheduler(self)
        self.stats.pending_fn = self.scheduler.pending
        await self.scheduler.start()
        self.state = ModelState.READY

    def _instance_contexts(self) -> list[InstanceContext]:
        contexts = []
        for group in self.config.instance_group:
            kind = mc.ModelInstanceGroup.Kind.Name(group.kind)
            devices = list(group.gpus) or [0]
            for slot in range(group.count):
                for device in devices:
                    contexts.append(InstanceContext(
                        name=f"{group.name}_{slot}" + (f"_gpu{device}" if group.gpus else ""),
                        kind=kind, device_id=device, index=len(contexts), group_name=group.name))
        if not contexts:  # e.g. ensembles: the scheduler does the work
            contexts.append(InstanceContext(name=f"{self.name}_0", kind="KIND_CPU", device_id=0, index=0))
        return contexts

    async def _make_instance(self, ctx: InstanceContext) -> InstanceSlot:
        slot = InstanceSlot(self.model.create_instance(ctx))
        try:
            await slot.call(slot.instance.initialize)
        except BaseException:
            slot.shutdown()
            raise
        return slot

    async def drain(self, timeout: float | None) -> None:
        """Wait until no request of this model is in flight (or ``timeout`` passes): those the core scheduled and
        those frontend workers sent straight to its instances (``--frontend-direct``), which take no more."""
        await asyncio.gather(self._drain_own(timeout), *(slot.instance.drain_direct(timeout) for slot in self.slots))

    async def _drain_own(self, timeout: float | None) -> None:
        if self.inflight:
            try:
                await asyncio.wait_for(self.idle.wait(), timeout)
            except asyncio.TimeoutError:
                log.warning("model '%s' version %s: %d request(s) still in flight after %.1fs",
                            self.name, self.version, self.inflight, timeout or 0)

    def _failed(self, reason: str) -> None:
        """The model broke while serving (see ModelContext.report_failure)."""
        if self.state is ModelState.READY:
            self.state, self.reason = ModelState.UNAVAILABLE, reason
            log.error("model '%s' version %s is unavailable: %s", self.name, self.version, reason)

    async def unload(self) -> None:
        self.state = ModelState.UNLOADING
        if self.scheduler is not None:
            await self.scheduler.stop()
        if self.rate_limiter is not None:
            self.rate_limiter.remove_model(self)
        for slot in self.slots:
            try:
                await slot.call(slot.instance.finalize)
            except Exception:
                log.exception("instance '%s' failed to finalize", slot.instance.ctx.name)
            slot.shutdown()
        self.slots = []
        try:
            await call_hook(self.model.finalize)
        except Exception:
            log.exception("model '%s' failed to finalize", self.name)
        self.state = ModelState.UNAVAILABLE
        self.reason = "unloaded"

    # -- requests ------------------------------------------------------------------------
    def request_started(self) -> None:
        self.inflight += 1
        if self.inflight == 1:  # no longer idle (set by request_finished at 0)
            self.idle.clear()

    def request_finished(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self.idle.set()

    def enqueue(self, request: InferenceRequest) -> None:
        if self._state is not ModelState.READY:
            raise Unavailable(f"model '{self.name}' version {self.version} is not ready")
        request.queue_start_ns = time.monotonic_ns()
        self.scheduler.enqueue(request)

    def generate(self, stream) -> None:
        """Start a typed LLM generation (DataPlane.generate; its GenerationStream is the request): the scheduler
        runs the model's generation coroutine at once (the pass-through scheduler), or schedules it as any
        request."""
        if self._state is not ModelState.READY:
            raise Unavailable(f"model '{self.name}' version {self.version} is not ready")
        stream.queue_start_ns = time.monotonic_ns()
        self.scheduler.generate(stream)

    async def execute(self, slot: InstanceSlot, requests: list[InferenceRequest], record: bool = True) -> None:
        """Run one batch on one instance, answer whatever the backend left unanswered.

        The batch's compute time is the time ``execute`` takes: for a backend that answers inline
        (those on the pass-through scheduler), from the request's start to its last response.
        ``record=False`` (warmup) leaves the statistics alone; a request never queued (a sequence
        batch's padding row) records no queue time."""
        start = time.monotonic_ns()
        self._started(requests, start)
        follow = None
        if slot.queues and record:
            offer = self._batcher_hook(slot, "offer")
            if offer is not None:
                await self._execute_ahead(slot, requests, start, offer)
                return
        try:
            if slot.is_async:
                result = await slot.instance.execute(requests)
            elif slot.hands_over and slot.last_run_ns >= HANDOVER_MIN_RUN_NS:
                result, follow = await _run_in_thread(slot, requests, self._batcher_hook(slot, "take_ready") if record else None)
            else:
                result = await asyncio.get_running_loop().run_in_executor(
                    slot.executor, slot.instance.execute, requests)
            error = None
        except Exception as exc:  # a failing model answers with an error and keeps serving
            log.debug("model '%s' execute raised", self.name, exc_info=True)
            result, error = None, as_server_error(exc)
        self._ended(slot, requests, start, result, error, record)
        while follow is not None:  # batches the instance's thread took itself at the end of a run, in order
            requests, start, future = follow
            follow = None
            self._started(requests, start)
            try:
                if future is None:
                    raise Unavailable(f"model '{self.name}' version {self.version} is unloading")
                result, follow = await asyncio.wrap_future(future)
                error = None
            except Exception as exc:
                log.debug("model '%s' execute raised", self.name, exc_info=True)
                result, error = None, as_server_error(exc)
            self._ended(slot, requests, start, result, error, record)

    async def _execute_ahead(self, slot: InstanceSlot, requests: list[InferenceRequest], start: int, offer) -> None:
        """Run batches on an instance that takes the next one while it runs one (``ModelInstance.submit``: a model
        process runs what it is sent in order, its responses reach each request's sender as they come): while a
        batch runs, the scheduler may hand this instance the next full batch (``offer``), which goes out at once, so
        that the instance starts it as soon as the running one ends instead of waiting for the loop to hear of the
        end and send the next. Such a batch's queue time runs until the one before it ends."""
        withdraw = self.scheduler.withdraw
        try:
            done, error = slot.instance.submit(requests), None
        except Exception as exc:  # noqa: BLE001 - the instance cannot take it (its process is gone)
            done, error = None, as_server_error(exc)
        while True:
            taken: list = []

            def send(batch: list[InferenceRequest], taken=taken) -> None:
                try:
                    taken.append((batch, slot.instance.submit(batch)))
                except Exception as exc:  # noqa: BLE001 - the instance cannot take it: answered as its run
                    taken.append((batch, exc))

            if done is not None:
                if slot.last_run_ns < QUEUE_AHEAD_MAX_RUN_NS:
                    offer(send)
                try:
                    await done
                except Exception as exc:
                    log.debug("model '%s' execute raised", self.name, exc_info=True)
                    error = as_server_error(exc)
                finally:
                    if not taken:
                        withdraw(send)
            self._ended(slot, requests, start, None, error, True)
            if not taken:
                return
            (requests, sent), = taken
            start = time.monotonic_ns()
            self._started(requests, start)
            if isinstance(sent, Exception):
                done, error = None, as_server_error(sent)
            else:
                done, error = sent, None

    def _batcher_hook(self, slot: InstanceSlot, name: str):
        """The dynamic batcher's ``name`` method where the instance may be handed its next batch outside the batcher's
        workers — ``take_ready`` (its thread takes the next ready batch itself) or ``offer`` (its next full batch sent
        while it runs one) — as long as nothing else decides when it runs: no rate limiter, no hold (direct
        instances). None otherwise, or for another scheduler."""
        if self.rate_limiter is not None or slot.limits is not None or slot.instance.hold is not None:
            return None
        return getattr(getattr(self, "scheduler", None), name, None)

    def _started(self, requests: list[InferenceRequest], start: int) -> None:
        """Record the queue time of a batch that starts at ``start``, and its traces' compute start."""
        waited = queued = 0
        for request in requests:
            if request.queue_start_ns:
                waited += start - request.queue_start_ns
                queued += 1
            if request.trace is not None:
                request.trace.compute = (start, 0)
        if queued:
            self.stats.record_queue(waited, queued)

    def _ended(self, slot: InstanceSlot, requests: list[InferenceRequest], start: int, result, error, record: bool
               ) -> None:
        """Record a batch's execution and answer whatever the backend left unanswered."""
        end = time.monotonic_ns()
        slot.last_run_ns = end - start
        stats = self.stats
        traced = False
        queued = rows = inferences = 0  # rows never queued (a sequence batch's padding) are no inferences
        for request in requests:
            rows += request.batch_size
            if request.queue_start_ns:
                queued += 1
                inferences += request.batch_size
            if request.trace is not None:
                traced = True
        if traced:
            for request in requests:
                if request.trace is not None:
                    request.trace.compute_done(end)
        if record:
            stats.record_execution(rows, queued, 0, end - start, 0, inferences)
        if error is not None:
            for request in requests:
                request.response_sender.send_error(error)
            return
        if result is not None:
            self._send_returned(requests, result)
        elif not self.decoupled:
            for request in requests:
                if not request.response_sender.is_closed and not slot.is_async:
                    request.response_sender.send_error(
                        InternalError(f"model '{self.name}' returned no response for the request"))

    def _send_returned(self, requests: list[InferenceRequest], result) -> None:
        responses = list(result)
        if len(responses) != len(requests):
            error = InternalError(
                f"model '{self.name}' returned {len(responses)} responses for {len(requests)} requests")
            for request in requests:
                request.response_sender.send_error(error)
            return
        for request, response in zip(requests, responses):
            sender = request.response_sender
            if sender.is_closed:
                continue
            if response is None:
                sender.send_error(InternalError(f"model '{self.name}' returned no response for the request"))
            elif response.error is not None:
                sender.send_error(response.error if isinstance(response.error, ServerError)
                                  else as_server_error(response.error))
            else:
                sender.send(response, final=True)
