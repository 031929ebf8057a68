"""The DataPlane: the one place every protocol goes through to reach a model.

It finds the model, checks readiness, validates and times the request, records success and
failure, and hands back an async iterator of responses. Frontends only translate wire formats.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from . import __version__, load_report
from .backend import ServerHandles
from .datatypes import config_to_datatype
from .errors import (InternalError, InvalidArgument, NotFound, QueueFull, ServerError, Status, Unavailable,
                     Unsupported)
from .generation import GenerationDelta, GenerationRequest
from .loops import running_loop
from .repository import ModelRepository
from .response_cache import ResponseCache, request_key
from .responses import ResponseSender, ResponseStream
from .runtime import ModelRuntime, ModelState
from .serving import ServingInterface
from .shared_memory import REGION, SharedMemoryRegistry, cuda_unsupported
from .stats import GENERATIONS_KEPT, Metrics
from .tracing import Tracer
from .types import InferenceRequest, InferenceResponse, request_ids

# Triton protocol extensions this server implements (listed in the server metadata).
EXTENSIONS = ["classification", "model_repository", "model_repository(unload_dependents)", "schedule_policy",
              "model_configuration",
              "binary_tensor_data", "parameters", "statistics", "generate", "system_shared_memory", "trace"]

_FAILURE_REASON = {Status.CANCELLED: "CANCELED", Status.UNAVAILABLE: "REJECTED"}

log = logging.getLogger(__name__)


def _request_started(runtime: ModelRuntime) -> None:
    """``ModelRuntime.request_started`` on the typed path (no call into the runtime per request)."""
    runtime.inflight += 1
    if runtime.inflight == 1:  # no longer idle (the repository's drain waits for ``idle``)
        runtime.idle.clear()


def _request_finished(runtime: ModelRuntime) -> None:
    runtime.inflight -= 1
    if runtime.inflight == 0:
        runtime.idle.set()


def server_metadata() -> dict[str, Any]:
    return {"name": "tideserve", "version": __version__, "extensions": list(EXTENSIONS)}


def model_metadata(name: str, versions: list[int], config: mc.ModelConfig) -> dict[str, Any]:
    """KServe v2 model metadata of ``config``, serving ``versions``."""
    batch = [-1] if config.max_batch_size > 0 else []

    def tensors(items):
        return [{"name": t.name, "datatype": config_to_datatype(mc.DataType.Name(t.data_type)),
                 "shape": batch + list(t.dims)} for t in items]

    return {"name": name, "versions": [str(v) for v in sorted(versions)],
            "platform": config.platform or config.backend,
            "inputs": tensors(config.input), "outputs": tensors(config.output)}


class InferenceStream:
    """The responses of one request. Closing it early cancels the request."""

    __slots__ = ("_dataplane", "runtime", "request", "_stream", "_done", "_first", "_cache_key", "_lookup_ns",
                 "_shm_outputs", "_shm_held")

    def __init__(self, dataplane: "DataPlane", runtime: ModelRuntime, request: InferenceRequest,
                 stream: ResponseStream, cache_key: bytes | None = None, lookup_ns: int = 0,
                 shm_outputs: dict | None = None, shm_held: list | None = None) -> None:
        self._dataplane = dataplane
        self.runtime = runtime
        self.request = request
        self._stream = stream
        self._done = False
        self._first = True
        self._cache_key = cache_key      # a response cache miss: store the answer under this key
        self._lookup_ns = lookup_ns
        self._shm_outputs = shm_outputs  # outputs to write into shared memory regions
        self._shm_held = shm_held        # the shared memory regions the request uses, until it is done

    def __aiter__(self) -> "InferenceStream":
        return self

    async def __anext__(self) -> InferenceResponse:
        if self._done:
            raise StopAsyncIteration
        items = self._stream._items
        if not items:  # the stream's own wait, awaited here: one coroutine fewer per response
            try:
                while not items:
                    await self._stream.wait()
            except asyncio.CancelledError:
                self.cancel()
                raise
        response = items.popleft()
        runtime = self.runtime
        response.model_version = str(runtime.version)
        if response.error is None and (self._cache_key is not None or self._shm_outputs is not None):
            response = self._store(response)
        stats = runtime.stats
        request = self.request
        elapsed = time.monotonic_ns() - request.arrival_ns
        first = self._first
        if first:
            self._first = False
            if request.trace is not None:
                request.trace.first_response(time.monotonic_ns())
        if response.final:
            self._done = True
            if self._shm_held:
                self._release_regions()
            if request.trace is not None:
                self._dataplane.tracer.finish(request.trace, request, time.monotonic_ns(), response.outputs)
            self._dataplane.active.discard(self)
            runtime.request_finished()
            if response.error is None:
                stats.record_success(elapsed, first)
            else:
                if first:
                    stats.record_first_response(elapsed)
                stats.record_failure(elapsed, _FAILURE_REASON.get(response.error.status, "BACKEND"))
        elif first:
            stats.record_first_response(elapsed)
        return response

    def _store(self, response: InferenceResponse) -> InferenceResponse:
        """Cache a final answer (a cache miss); write the outputs asked for in shared memory."""
        if self._cache_key is not None and response.final and not response.empty:
            start = time.monotonic_ns()
            self._dataplane.cache.insert(self._cache_key, response)
            self.runtime.stats.record_cache_miss(self._lookup_ns + time.monotonic_ns() - start)
        if self._shm_outputs is not None and response.outputs:
            try:
                response = SharedMemoryRegistry.write_outputs(response, self._shm_outputs)
            except ServerError as exc:
                response = InferenceResponse(response.model_name, response.model_version, response.id,
                                             error=exc, final=response.final)
        return response

    def cancel(self) -> None:
        """The client went away: flag the request so its backend can stop working on it."""
        if self._done:
            return
        self._done = True
        self._release_regions()
        self._dataplane.active.discard(self)
        self.request.cancellation.cancel()
        self.runtime.request_finished()
        self.runtime.stats.record_failure(time.monotonic_ns() - self.request.arrival_ns, "CANCELED")
        if self.request.trace is not None:
            self._dataplane.tracer.finish(self.request.trace, self.request, time.monotonic_ns())

    def _release_regions(self) -> None:
        if self._shm_held:
            self._dataplane.shared_memory.release(self._shm_held)

    async def aclose(self) -> None:
        self.cancel()

    def on_error(self, hook) -> None:
        """``hook(error)`` once, on the loop, when the backend ends the request with an error, before the reader
        takes that response (which it still does): a handler writes a refusal in the turn the backend refused
        in. Streams of other kinds (a frontend worker's) have no such method."""
        self._stream.on_error = hook

    def abort(self, error: ServerError) -> None:
        """End the stream with ``error`` now (server shutdown) and cancel the backend's work."""
        self.request.cancellation.cancel()
        self._stream.put(InferenceResponse(error=error, final=True))


class DeltaStream:
    """One typed LLM generation: the request (what the frontend asked: ``model_name``, ``generation``, ``id``,
    ``priority``, ``timeout_us``, ``arrival_ns``, ``trace_context``; the engine's request id ``internal_id``; the
    ``trace``) and its deltas, handed by the backend's generation task (the sender) straight to the reader: no request
    or response objects, sender, scheduler queue or per-response bookkeeping between them. The backend takes the
    stream as its request. The sender's half is :meth:`send_delta` per engine step (from any thread: another one's
    call is passed to the reader's loop), :meth:`send` for a whole answer and :meth:`send_error`; deltas the reader
    has not taken yet join into one (one chunk and one write for them, as vLLM's output collector merges the outputs
    of a slow reader); :meth:`is_cancelled` and :meth:`on_cancel` (the backend's abort) are the request's
    cancellation. The reader's is the async iteration; closing it early cancels the request. What is recorded at the
    end is each kind's own: :meth:`_end` (the backend ended the request and the reader has taken everything) and
    :meth:`cancel` (the reader went away first). :class:`GenerationStream` is the DataPlane's; a frontend worker's
    engine client has its own (``server/workers/engines.py``). A subclass gives the model's ``runtime`` (its
    ``name``)."""

    __slots__ = ("model_name", "model_version", "id", "generation", "priority", "timeout_us", "arrival_ns",
                 "queue_start_ns", "internal_id", "trace_context", "trace", "_cancelled", "_on_cancel",
                 "_items", "_waiter", "_loop", "_loop_thread", "_closed", "_done", "_first_ns", "_error", "_on_error",
                 "_direct")

    def __init__(self, loop: asyncio.AbstractEventLoop, model_name: str, generation: GenerationRequest, *,
                 model_version: str = "", id: str = "", priority: int = 0, timeout_us: int = 0, arrival_ns: int = 0,
                 trace_context: Any = None) -> None:
        self.model_name = model_name
        self.model_version = model_version
        self.id = id
        self.generation = generation
        self.priority = priority
        self.timeout_us = timeout_us  # the request's deadline to start generating (0: the model's own)
        self.arrival_ns = arrival_ns or time.monotonic_ns()  # (a deadline counts from when the server read it)
        self.queue_start_ns = 0
        self.internal_id = next(request_ids)  # (shared with InferenceRequest: the engine's request ids are unique)
        # a client's W3C traceparent (str), or the traced request of an ensemble step (its RequestTrace); None: none
        self.trace_context = trace_context
        self.trace = None  # the request's RequestTrace when it is traced (set by the DataPlane)
        self._cancelled = False
        self._on_cancel = None  # the backend's abort (on_cancel)
        self._items: collections.deque[GenerationDelta] = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._closed = False  # the backend has sent its last delta or its error
        self._done = False  # the reader has seen the end (or closed the stream)
        self._first_ns = 0  # when the reader took the first delta (recorded at the end, with the rest)
        self._error: ServerError | None = None
        self._on_error = None
        self._direct = None  # the reader's own taker of a delta while it waits (write_through)

    # -- the request's cancellation (on the loop's thread) -----------------------------------------------------
    def is_cancelled(self) -> bool:
        return self._cancelled

    def on_cancel(self, abort) -> None:
        """``abort()`` once when the request is cancelled (the client went away, the server shuts down), at once if
        it is already: the backend's abort of its engine request."""
        if self._cancelled:
            abort()
        else:
            self._on_cancel = abort

    def _cancel_request(self) -> None:
        if self._cancelled:
            return
        self._cancelled = True
        abort, self._on_cancel = self._on_cancel, None
        if abort is not None:
            abort()

    # -- the backend's side -------------------------------------------------------------------------------------
    @property
    def is_closed(self) -> bool:
        return self._closed

    def send_delta(self, delta: GenerationDelta | None, final: bool = False) -> None:
        """What one engine step added (``final``: the last); ignored once the request has ended."""
        if threading.get_ident() != self._loop_thread:
            self._loop.call_soon_threadsafe(self.send_delta, delta, final)
            return
        if self._closed:
            return
        if final:
            self._closed = True
        items = self._items
        if delta is not None:
            if items:  # not taken yet: the new delta joins it
                items[-1].extend(delta)
                if not final:
                    return
            else:
                waiter = self._waiter
                if (not final and waiter is not None and self._direct is not None and not waiter.done()
                        and self._direct(delta)):
                    return  # taken where it came: the reader waits on
                items.append(delta)
        waiter = self._waiter  # _wake, inline: once per engine step
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def send(self, response=None, final: bool = False) -> None:
        """A sender's ``send``: an InferenceResponse carrying ``generation`` (a whole answer)."""
        if response is not None and response.error is not None:
            self.send_error(response.error)
            return
        if response is not None and response.generation is None and not final:
            raise InternalError(f"model '{self.runtime.name}' answered a typed generation request with tensors")
        self.send_delta(response.generation if response is not None else None, final)

    def send_error(self, error: ServerError) -> None:
        """End the request with ``error`` (ignored once it has ended)."""
        if threading.get_ident() != self._loop_thread:
            self._loop.call_soon_threadsafe(self.send_error, error)
            return
        if self._closed:
            return
        self._closed = True
        self._error = error
        self._wake()
        if self._on_error is not None:
            hook, self._on_error = self._on_error, None
            hook(error)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    # -- the reader's side --------------------------------------------------------------------------------------
    def write_through(self, take) -> None:
        """``take(delta)`` for each delta that is not the last and comes while the reader waits for the next with
        nothing left to take (so it has read everything before): True when it took it (an OpenAI stream's chunk
        written to its connection where the delta came, ``openai/chat_completion/serving.py``), with no wake-up
        of the reader's task per engine step; False leaves the delta to the reader, as it is when none is set (the
        connection paused for flow control: the reader writes and waits for it to drain, deltas join meanwhile).
        ``take`` runs in the sender's turn (the engine's output handler): it must not raise. None removes it."""
        self._direct = take

    def __aiter__(self) -> "DeltaStream":
        return self

    async def __anext__(self) -> GenerationDelta:
        items = self._items
        while not items:
            if self._closed:
                if self._done:
                    raise StopAsyncIteration
                self._end()
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            if self._done:  # cancelled by the reader
                raise StopAsyncIteration
            waiter = self._waiter = self._loop.create_future()
            try:
                await waiter
            except asyncio.CancelledError:
                self.cancel()
                raise
        if not self._first_ns:
            self._first_ns = now = time.monotonic_ns()
            if self.trace is not None:
                self.trace.first_response(now)
        return items.popleft()

    def _end(self) -> None:
        """The backend has ended the request and the reader has taken everything: record it."""
        raise NotImplementedError

    def cancel(self) -> None:
        """The client went away: the backend aborts the engine request (and the stream records it)."""
        raise NotImplementedError

    async def aclose(self) -> None:
        self.cancel()

    def on_error(self, hook) -> None:
        """As :meth:`InferenceStream.on_error`: ``hook(error)`` once, when the backend ends the request with an
        error, before the reader takes it."""
        self._on_error = hook

    def abort(self, error: ServerError) -> None:
        """End the stream with ``error`` now (server shutdown) and cancel the backend's work."""
        self._cancel_request()
        self.send_error(error)


class GenerationStream(DeltaStream):
    """One typed LLM generation in the core (:meth:`DataPlane.generate`): what :class:`InferenceStream` records is
    recorded here once, at the end (statistics, tracing, the model's requests in flight), in one call."""

    __slots__ = ("_dataplane", "runtime", "_running", "_compute_ns")

    def __init__(self, dataplane: "DataPlane", runtime: ModelRuntime, loop: asyncio.AbstractEventLoop,
                 model_name: str, generation: GenerationRequest, **identity) -> None:
        super().__init__(loop, model_name, generation, **identity)
        self._dataplane = dataplane
        self.runtime = runtime
        self._running: dict | None = None  # the scheduler's running tasks, where the generation task is one
        self._compute_ns = -1  # the generation task's time, start to end (-1: still running)

    def _end(self) -> None:
        """The backend has ended the request and the reader has taken everything: record it (one call)."""
        self._done = True
        runtime = self.runtime
        now = time.monotonic_ns()
        arrival = self.arrival_ns
        dataplane = self._dataplane
        dataplane.active.discard(self)
        _request_finished(runtime)
        error = self._error
        first = self._first_ns - arrival if self._first_ns else now - arrival  # (no delta: the end is the first)
        _count(runtime.stats, (now - arrival, first, self._compute_ns,
                               None if error is None else _FAILURE_REASON.get(error.status, "BACKEND"), now))
        self._compute_ns = -1  # recorded
        if self.trace is not None:
            dataplane.tracer.finish(self.trace, self, now)

    def cancel(self) -> None:
        """The client went away: the backend aborts the engine request."""
        if self._done:
            return
        self._done = True
        now = time.monotonic_ns()
        self._dataplane.active.discard(self)
        self._cancel_request()
        _request_finished(self.runtime)
        arrival = self.arrival_ns
        first = self._first_ns - arrival if self._first_ns else -1
        _count(self.runtime.stats, (now - arrival, first, self._compute_ns, "CANCELED", now))
        self._compute_ns = -1  # recorded (a task still running records its execution when it ends)
        if self.trace is not None:
            self._dataplane.tracer.finish(self.trace, self, now)

    def _generated(self, task: asyncio.Task) -> None:
        """The generation task ended (the pass-through scheduler's bookkeeping, done here for the typed path):
        its compute time is recorded with the rest at the stream's end, or now when the reader has gone; a task
        that failed or was cancelled (the model unloaded) answers the request."""
        if self._running is None or self._running.pop(task, None) is None:
            return
        end = time.monotonic_ns()
        compute = end - self.queue_start_ns
        if self.trace is not None:
            self.trace.compute_done(end)
        if self._done:  # the reader went away first: its statistics are in, the execution's come now
            _count(self.runtime.stats, (-1, -1, compute, None, end))
        else:
            self._compute_ns = compute
        if task.cancelled():
            runtime = self.runtime
            self.send_error(Unavailable(f"model '{runtime.name}' version {runtime.version} was unloaded "
                                        "before the request finished"))
        elif (exc := task.exception()) is not None:
            log.error("model '%s': request generation failed", self.runtime.name, exc_info=exc)
            self.send_error(InternalError(f"model '{self.runtime.name}' failed to run the request"))


def _count(stats, end: tuple) -> None:
    """Keep a typed generation's end for its model's statistics (:meth:`ModelStats.count_generations` counts it when
    they are read, or here once ``GENERATIONS_KEPT`` wait)."""
    ends = stats.generations
    ends.append(end)
    if len(ends) >= GENERATIONS_KEPT:
        stats.count_generations()


class _Generating:
    """A ready model's typed generation, resolved once (DataPlane.generate): its runtime, the backend's generation
    coroutine (``Model.generation_entry``), the pass-through scheduler's running tasks (where unloading finds
    them) and its ``max_queue_size``."""

    __slots__ = ("runtime", "run", "running", "max_queue_size")

    def __init__(self, runtime: ModelRuntime, run, running: dict, max_queue_size: int) -> None:
        self.runtime = runtime
        self.run = run
        self.running = running
        self.max_queue_size = max_queue_size


class _Infer:
    """The ``infer`` handle of backends: requests go through the DataPlane as a client's do."""

    __slots__ = ("_dataplane",)

    def __init__(self, dataplane: "DataPlane") -> None:
        self._dataplane = dataplane

    def __call__(self, request: InferenceRequest) -> InferenceStream:
        return self._dataplane.infer(request)

    async def unary(self, request: InferenceRequest) -> InferenceResponse:
        return await self._dataplane.infer_unary(request)


class _Control:
    """The model-control handle of backends (BLS ``load_model`` / ``unload_model`` / ``is_model_ready``)."""

    __slots__ = ("_dataplane",)

    def __init__(self, dataplane: "DataPlane") -> None:
        self._dataplane = dataplane

    async def load(self, name: str, config_json: str | None = None) -> None:
        await self._dataplane.load_model(name, config_json)

    async def unload(self, name: str, unload_dependents: bool = False) -> None:
        await self._dataplane.unload_model(name, unload_dependents=unload_dependents)

    def ready(self, name: str, version: str = "") -> bool:
        return self._dataplane.model_ready(name, version)


class DataPlane(ServingInterface):
    """The serving interface in the core process, over the repository's models; also what the server wires
    (the handles models get, aborting every request at shutdown, the tracer)."""

    def __init__(self, repository: ModelRepository, metrics: Metrics, *, strict_readiness: bool = True,
                 cache_size: int | None = None, tracer: Tracer | None = None,
                 lora_runtime_updates: bool = False) -> None:
        self.repository = repository
        self.metrics = metrics
        self.strict_readiness = strict_readiness
        self._accepting = True  # false once shutdown begins
        self.active: set[InferenceStream] = set()
        # the response cache (--cache-config local,size=N), for models whose config enables it
        self.cache = ResponseCache(cache_size) if cache_size else None
        self.shared_memory = SharedMemoryRegistry()  # system shared memory regions clients registered
        self.tracer = tracer or Tracer()  # --trace-config
        # --enable-lora-runtime-updates: adapters may be loaded from disk (inside the allowed roots) at run time
        self.lora_runtime_updates = lora_runtime_updates
        # model name -> its typed generation entry (generate), dropped whenever the repository changes
        self._generating: dict[str, _Generating] = {}
        listeners = getattr(repository, "listeners", None)
        self._keep_generating = listeners is not None  # (kept only where the repository says when it changes)
        if listeners is not None:
            listeners.append(self._generating.clear)

    def server_handles(self) -> ServerHandles:
        """What the repository hands the models it builds: calls into this DataPlane (``infer``, model
        control) and the repository's model lookup. The server wires them (``repository.handles``)."""
        return ServerHandles(infer=_Infer(self), models=self.repository.model_config, control=_Control(self))

    # -- health and metadata -------------------------------------------------------------
    @property
    def accepting(self) -> bool:
        return self._accepting

    @accepting.setter
    def accepting(self, value: bool) -> None:
        self._accepting = value

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        if not self.accepting:
            return False
        return self.repository.all_ready() if self.strict_readiness else True

    def healthy(self) -> bool:
        """Liveness as vLLM's ``GET /health`` reports it: false once shutdown begins or when a loaded model
        broke while serving (its engine died: the version turned UNAVAILABLE)."""
        if not self.accepting:
            return False
        return not any(r.state is ModelState.UNAVAILABLE for r in self.repository.runtimes())

    async def metrics_text(self) -> bytes:
        """The Prometheus text exposition of the server's registry (``GET /metrics`` on either port; in a
        frontend worker, a call to the core)."""
        await self._refresh_direct(self.repository.runtimes())
        return self.metrics.render()

    def server_metadata(self) -> dict[str, Any]:
        return server_metadata()

    def model(self, name: str, version: str = "") -> ModelRuntime:
        return self.repository.get(name, version)

    def model_ready(self, name: str, version: str = "") -> bool:
        try:
            self.repository.get(name, version)
        except ServerError:
            return False
        return True

    def model_metadata(self, name: str, version: str = "") -> dict[str, Any]:
        runtime = self.repository.get(name, version)
        return model_metadata(name, sorted(self.repository.entries[name].versions), runtime.config)

    def model_config(self, name: str, version: str = "") -> mc.ModelConfig:
        return self.repository.get(name, version).config

    async def statistics(self, name: str = "", version: str = "") -> list[dict]:
        if not name:
            runtimes = [r for r in self.repository.runtimes()]
        elif version:
            runtimes = [self.repository.get(name, version)]
        else:
            entry = self.repository.entries.get(name)
            if entry is None or not entry.versions:
                raise NotFound(f"requested model '{name}' is not available")
            runtimes = list(entry.versions.values())
        await self._refresh_direct(runtimes)
        return [r.stats.as_dict() for r in runtimes]

    @staticmethod
    async def _refresh_direct(runtimes) -> None:
        """--frontend-direct: add what models' processes counted for requests they took straight from the frontend
        workers (asked now, so that a client reading statistics right after its response sees it counted)."""
        refresh = [r.model.refresh_direct_statistics() for r in runtimes
                   if getattr(r.model, "direct_processes", None)]
        if refresh:
            await asyncio.gather(*refresh, return_exceptions=True)

    # -- repository ----------------------------------------------------------------------
    def repository_index(self, ready_only: bool = False) -> list[dict]:
        return self.repository.index(ready_only)

    async def index(self, ready_only: bool = False) -> list[dict]:
        return self.repository.index(ready_only)

    async def load_model(self, name: str, config_json: str | None = None) -> None:
        await self.repository.load(name, config_json)

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        await self.repository.unload(name, unload_dependents=unload_dependents)

    # -- shared memory (Triton's shared-memory extension; async so a frontend worker's proxy reads alike) ----
    async def register_system_shared_memory(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self.shared_memory.register(name, key, offset, byte_size)

    async def unregister_system_shared_memory(self, name: str = "") -> None:
        """Unregister region ``name``, or every region when ``name`` is empty."""
        self.shared_memory.unregister(name)

    async def system_shared_memory_status(self, name: str = "") -> list[dict]:
        """``[{"name", "key", "offset", "byte_size"}]`` of region ``name``, or of every region."""
        return self.shared_memory.status(name)

    async def register_cuda_shared_memory(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        raise cuda_unsupported()

    async def unregister_cuda_shared_memory(self, name: str = "") -> None:
        """No CUDA region is ever registered here: nothing to do, as for an unknown name."""

    async def cuda_shared_memory_status(self, name: str = "") -> list[dict]:
        if name:
            raise NotFound(f"Unable to find cuda shared memory region: '{name}'")
        return []

    # -- trace settings (Triton's trace extension: /v2/trace/setting, gRPC TraceSetting) ---------------
    async def trace_setting(self, model_name: str = "", updates: dict | None = None) -> dict[str, Any]:
        """The trace settings, global or of ``model_name`` (a ready model), after applying ``updates``
        (``{setting: value or None}``; None clears it)."""
        if model_name and not self.model_ready(model_name):
            raise InvalidArgument(f"Request for unknown model : {model_name}")
        if updates:
            return self.tracer.update(model_name, updates)
        return self.tracer.settings(model_name)

    # -- load and caches (GET /load, the ORCA header, POST /reset_prefix_cache) ------------------
    async def load_report(self, model_name: str = "") -> dict[str, Any]:
        runtimes = [self.repository.get(model_name)] if model_name else self._ready_runtimes()
        await self._refresh_direct(runtimes)
        return load_report.report(runtimes)

    async def reset_prefix_cache(self, model_name: str = "", reset_running_requests: bool = False) -> dict[str, Any]:
        runtimes = [self.repository.get(model_name)] if model_name else self._ready_runtimes()
        results = [await r.model.reset_prefix_cache(reset_running_requests) for r in runtimes]
        done = [result for result in results if result is not None]
        if model_name and not done:
            raise InvalidArgument(f"model '{model_name}' has no prefix cache to reset")
        return {"success": all(done)}

    def _ready_runtimes(self) -> list[ModelRuntime]:
        return [r for r in self.repository.runtimes() if r.state is ModelState.READY]

    # -- adapters (LoRA) of the models that take them ---------------------------------------------
    def adapters(self) -> list[dict[str, str]]:
        """The adapters of the ready models that take them: ``{"name", "path", "model"}`` (``model``: the base)."""
        return [{**adapter, "model": runtime.name}
                for runtime in self._adapter_models() for adapter in runtime.model.lora_adapters()]

    async def load_adapter(self, model_name: str, adapter_name: str, path: str, load_inplace: bool = False) -> None:
        """Load an adapter from ``path`` into ready model ``model_name`` (the model checks the name and the files)."""
        await self._adapter_model(model_name).model.load_lora_adapter(adapter_name, path, load_inplace)

    async def unload_adapter(self, model_name: str, adapter_name: str) -> None:
        await self._adapter_model(model_name).model.unload_lora_adapter(adapter_name)

    def _adapter_model(self, model_name: str) -> ModelRuntime:
        if not self.lora_runtime_updates:
            raise NotFound("loading and unloading LoRA adapters at run time is off; start the server with "
                           "--enable-lora-runtime-updates")
        runtime = self.repository.get(model_name)
        if runtime.model.lora_adapters() is None:
            raise InvalidArgument(f"model '{model_name}' takes no LoRA adapters (its engine arguments do "
                                  "not set 'enable_lora': true)")
        return runtime

    def _adapter_models(self) -> list[ModelRuntime]:
        """The ready model versions (the one each name serves) that take adapters."""
        found = []
        for name in dict.fromkeys(row["name"] for row in self.repository.index(ready_only=True)):
            try:
                runtime = self.repository.get(name)
            except ServerError:
                continue
            if runtime.model.lora_adapters() is not None:
                found.append(runtime)
        return found

    # -- inference -----------------------------------------------------------------------
    def infer_json(self, model_name: str, model_version: str, body: bytes, header_length: int | None,
                   limits, max_json_depth: int) -> None:
        """None: in the core process the HTTP frontend decodes the body itself (its models' processes take
        requests only through the core's schedulers)."""
        return None

    def infer(self, request: InferenceRequest) -> InferenceStream:
        """Validate and schedule ``request``; raise a ServerError if it cannot be accepted.

        Inputs given in shared memory are read from their regions first; a request the response cache
        can answer is answered from it without being scheduled."""
        if not self.accepting:
            raise Unavailable("the server is shutting down and accepts no new requests")
        runtime = self.repository.get(request.model_name, request.model_version)
        shm_outputs = None
        shm_held: list = []  # regions the request uses: unregistering them is refused until it is done
        try:
            for tensor in request.inputs.values():
                if tensor.parameters and REGION in tensor.parameters:
                    self.shared_memory.resolve_inputs(request, shm_held)
                    break
            if request.generation is None:
                runtime.validator.validate(request)
            elif request.inputs or runtime.engine is None or not runtime.engine.typed_requests:
                raise InvalidArgument("a typed generation request carries no input tensors" if request.inputs else
                                      f"model '{runtime.name}' takes no typed generation requests; send its input "
                                      "tensors")
            if request.outputs:
                shm_outputs = self.shared_memory.output_targets(request, shm_held)
        except ServerError:
            self.shared_memory.release(shm_held)
            runtime.stats.record_failure(time.monotonic_ns() - request.arrival_ns, "OTHER")
            raise
        stream = ResponseStream(running_loop())
        request.response_sender = ResponseSender(request, stream.put)
        if self.tracer.active:
            request.trace = self.tracer.begin(request, runtime)
        cache_key, lookup_ns, cached = None, 0, None
        if (self.cache is not None and runtime.config.response_cache.enable and not runtime.decoupled
                and request.generation is None):
            start = time.monotonic_ns()
            cache_key = request_key(request, str(runtime.version))
            cached = self.cache.lookup(cache_key, request)
            lookup_ns = time.monotonic_ns() - start
            runtime.stats.cache_enabled = True
        if cached is not None:
            runtime.stats.record_cache_hit(lookup_ns)
            stream.put(cached)
            cache_key = None
        else:
            try:
                runtime.enqueue(request)
            except ServerError as exc:
                self.shared_memory.release(shm_held)
                runtime.stats.record_failure(time.monotonic_ns() - request.arrival_ns,
                                             _FAILURE_REASON.get(exc.status, "OTHER"))
                raise
        runtime.request_started()
        inference = InferenceStream(self, runtime, request, stream, cache_key, lookup_ns, shm_outputs, shm_held or None)
        self.active.add(inference)
        return inference

    def generate(self, model_name: str, generation: GenerationRequest, *, model_version: str = "", id: str = "",
                 priority: int = 0, timeout_us: int = 0, arrival_ns: int = 0,
                 trace_context: Any = None) -> GenerationStream:
        """A typed LLM generation: the model's backend runs it as a task of its own and hands its deltas to the
        returned stream, which is the request the backend takes (no InferenceRequest, no validation of tensors, no
        response cache, no shared memory: a typed request has no tensors). Raises a ServerError if it cannot be
        accepted.

        A ready model's generation entry (:class:`_Generating`: its runtime, the backend's generation coroutine,
        the pass-through scheduler's running tasks and ``max_queue_size``) is resolved once and kept until the
        repository changes (any model's state: a load, an unload, a failure), as vLLM's API server holds its
        engine client: a request then runs no repository, runtime or scheduler code, and this method does what
        the pass-through scheduler does for it (admission, the task, the model's requests in flight)."""
        if not self._accepting:
            raise Unavailable("the server is shutting down and accepts no new requests")
        entry = None if model_version else self._generating.get(model_name)
        loop = asyncio.get_running_loop()
        if entry is None:
            runtime = self.repository.get(model_name, model_version)
            entry = self._generation_entry(model_name, model_version, runtime)
            stream = GenerationStream(self, runtime, loop, model_name, generation, model_version=model_version, id=id,
                                      priority=priority, timeout_us=timeout_us, arrival_ns=arrival_ns,
                                      trace_context=trace_context)
            if entry is None:
                return self._generate_scheduled(stream, runtime)
        else:
            runtime = entry.runtime
            stream = GenerationStream(self, runtime, loop, model_name, generation, id=id, priority=priority,
                                      timeout_us=timeout_us, arrival_ns=arrival_ns, trace_context=trace_context)
        running = entry.running
        if entry.max_queue_size:
            capacity = runtime.model.engine_capacity() or 0
            waiting = len(running) - capacity
            if waiting >= entry.max_queue_size:
                runtime.stats.record_failure(time.monotonic_ns() - stream.arrival_ns, "REJECTED")
                raise QueueFull(f"model '{runtime.name}' is busy: {waiting} requests wait for its engine "
                                f"(max_queue_size {entry.max_queue_size}); retry later or on another replica")
        if self.tracer.active:
            stream.trace = self.tracer.begin(stream, runtime)
        stream.queue_start_ns = now = time.monotonic_ns()
        if stream.trace is not None:
            stream.trace.compute = (now, 0)
        task = loop.create_task(entry.run(stream))
        running[task] = stream
        stream._running = running
        task.add_done_callback(stream._generated)
        _request_started(runtime)
        self.active.add(stream)
        return stream

    def _generation_entry(self, model_name: str, model_version: str, runtime: ModelRuntime) -> "_Generating | None":
        """The model's generation entry, kept for the next requests; None when its typed requests go through its
        scheduler (not the pass-through one, no generation coroutine, a version named, an ensemble)."""
        if model_version or runtime.steps:
            return None
        engine = runtime.engine
        run = runtime.model.generation_entry() if engine is not None and engine.typed_requests else None
        from .schedulers.passthrough import PassThroughScheduler

        scheduler = runtime.scheduler
        if run is None or not isinstance(scheduler, PassThroughScheduler):
            return None
        entry = _Generating(runtime, run, scheduler.running, scheduler.max_queue_size)
        if self._keep_generating:
            self._generating[model_name] = entry
        return entry

    def _generate_scheduled(self, stream: GenerationStream, runtime: ModelRuntime) -> GenerationStream:
        """A typed generation through the model's scheduler (``ModelRuntime.generate``)."""
        engine = runtime.engine
        if engine is None or not engine.typed_requests:
            runtime.stats.record_failure(time.monotonic_ns() - stream.arrival_ns, "OTHER")
            raise InvalidArgument(f"model '{runtime.name}' takes no typed generation requests; send its input "
                                  "tensors")
        if self.tracer.active:
            stream.trace = self.tracer.begin(stream, runtime)
        try:
            runtime.generate(stream)
        except ServerError as exc:
            runtime.stats.record_failure(time.monotonic_ns() - stream.arrival_ns,
                                         _FAILURE_REASON.get(exc.status, "OTHER"))
            raise
        _request_started(runtime)
        self.active.add(stream)
        return stream

    def abort_all(self, message: str) -> None:
        """Answer every unfinished request with UNAVAILABLE (used when the exit timeout runs out)."""
        for inference in list(self.active):
            inference.abort(Unavailable(message))

    def record_frontend_runs(self, model, count: int, elapsed_ns: int) -> None:
        stats = getattr(model, "stats", None)
        if stats is not None:
            stats.record_runs(count, elapsed_ns)

    async def infer_unary(self, request: InferenceRequest) -> InferenceResponse:
        """One request, one response: for protocols without streaming."""
        request.streaming = False
        return await self.collect_unary(self.infer(request))

    async def collect_unary(self, stream: InferenceStream) -> InferenceResponse:
        """The one response of ``stream`` (its model's error raised); Unsupported for a decoupled model
        that sends none or several."""
        request = stream.request
        responses = []
        try:  # content_responses, inlined: the unary protocols' hot path
            async for response in stream:
                if response.error is not None:
                    raise response.error
                if not response.empty:
                    responses.append(response)
                if response.final:
                    break
        finally:
            stream.cancel()  # nothing once the final response is in
        if len(responses) == 1:
            return responses[0]
        if not responses:
            raise Unsupported(f"model '{request.model_name}' sent no response; use the streaming API")
        raise Unsupported(f"model '{request.model_name}' is decoupled and sent {len(responses)} responses; "
                          "use the streaming API (gRPC ModelStreamInfer or generate_stream)")
