"""The DataPlane as a frontend worker sees it: inference and calls go to the core over the link; the
repository's state (readiness, lookups, configurations) is a copy the core pushes on every change, so
that the frontends' synchronous questions (``model``, ``model_config``, ``ready``...) need no round trip.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from pathlib import Path
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from .. import wire
from ..backend import ModelContext
from ..dataplane import DataPlane, model_metadata, server_metadata
from ..errors import InvalidArgument, NotFound, ServerError, Unavailable, as_server_error
from ..generation import GenerationDelta, GenerationRequest
from ..serving import ServingInterface
from ..types import InferenceRequest, InferenceResponse
from . import protocol as p

log = logging.getLogger(__name__)


class RemoteRuntime:
    """A loaded model version as frontends read it (``name``, ``version``, ``config``, ``ctx``)."""

    __slots__ = ("uid", "name", "version", "config", "ctx", "versions", "engine", "__weakref__")

    def __init__(self, info: p.RuntimeInfo) -> None:
        config = mc.ModelConfig()
        config.ParseFromString(info.config)
        self.uid = info.uid
        self.name = info.name
        self.version = info.version
        self.config = config
        self.versions = list(info.versions)
        self.engine = info.engine
        self.ctx = ModelContext(info.name, info.version, config, Path(info.model_path),
                                allowed_roots=tuple(Path(r) for r in info.allowed_roots))

    @property
    def decoupled(self) -> bool:
        return self.config.model_transaction_policy.decoupled


class RemoteInferenceStream(p.PendingResponses):
    """The responses of one request, coming from the core. Closing it early cancels the request."""

    __slots__ = ("_link", "rid", "request", "runtime", "_pending", "_waiter", "_done")

    def __init__(self, link: "CoreLink", rid: int, request: InferenceRequest) -> None:
        self._link = link
        self.rid = rid
        self.request = request
        self.runtime: RemoteRuntime | None = None
        self._pending: deque[p.Respond] = deque()  # arrived, not yet taken
        self._waiter: asyncio.Future | None = None
        self._done = False

    def __aiter__(self) -> "RemoteInferenceStream":
        return self

    async def __anext__(self) -> InferenceResponse:
        if self._done:
            raise StopAsyncIteration
        if not self._pending:
            await self._wait()
        message = self._pending.popleft()
        if message.runtime:
            self.runtime = self._link.runtimes.get(message.runtime, self.runtime)
        if message.rejected:
            self._finish()
            raise wire.server_error(message.response.error)
        if message.response.final:
            self._finish()
        return p.response_of(message, self._link.inbox)

    def _finish(self) -> None:
        self._done = True
        self._link.streams.pop(self.rid, None)

    def cancel(self) -> None:
        if self._done:
            return
        self._finish()
        self.request.cancellation.cancel()
        try:
            self._link.send(wire.Cancel(self.rid))
        except ServerError:  # the core is gone: nothing left to cancel
            pass

    async def aclose(self) -> None:
        self.cancel()


class RemoteGenerationStream:
    """A typed generation through the core (:meth:`RemoteDataPlane.generate`): the deltas its responses carry, a
    model's error raised. Closing it early cancels the request."""

    __slots__ = ("_done", "_stream", "model_name")

    def __init__(self, stream: RemoteInferenceStream) -> None:
        self._stream = stream
        self.model_name = stream.request.model_name
        self._done = False

    def __aiter__(self) -> "RemoteGenerationStream":
        return self

    async def __anext__(self) -> GenerationDelta:
        while not self._done:
            response = await self._stream.__anext__()
            if response.final:
                self._done = True
            if response.error is not None:
                self._done = True
                raise as_server_error(response.error)
            if response.generation is not None:
                return response.generation
        raise StopAsyncIteration

    def cancel(self) -> None:
        self._done = True
        self._stream.cancel()

    async def aclose(self) -> None:
        self.cancel()


class CoreLink(p.FramedLink):
    """The worker's connection to the core."""

    def __init__(self) -> None:
        super().__init__(p.ToWorker)
        self.streams: dict[int, RemoteInferenceStream] = {}
        self.calls: dict[int, asyncio.Future] = {}
        self.runtimes: dict[int, RemoteRuntime] = {}
        self.snapshot: p.Snapshot | None = None
        self.started: asyncio.Future = asyncio.get_running_loop().create_future()
        self.first_snapshot: asyncio.Future = asyncio.get_running_loop().create_future()
        self.stopped: asyncio.Future = asyncio.get_running_loop().create_future()
        self.stop_message = ""  # Stop's: the requests still in flight are answered with it
        self._ids = itertools.count(1)
        self.engines = None  # the worker's engine clients (workers/engines.py), when it has them

    def connection_lost(self, exc) -> None:
        if not self.stopped.done():
            self.stopped.set_result("lost")

    def send(self, message) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            raise Unavailable("the server's core process is gone")
        super().send(message)

    def data_received(self, data: bytes) -> None:
        for message in self.splitter.feed(data):
            kind = type(message)
            if kind is p.Respond:
                stream = self.streams.get(message.rid)
                if stream is not None:
                    stream._put(message)
            elif kind is p.Result:
                future = self.calls.pop(message.cid, None)
                if future is not None and not future.done():
                    if message.error is not None:
                        future.set_exception(wire.server_error(message.error))
                    else:
                        future.set_result(message.value)
            elif kind is wire.Release:
                self.release(message)
            elif kind is p.Snapshot:
                self._apply(message)
            elif kind is p.Start:
                if not self.started.done():
                    self.started.set_result(message)
            elif kind is p.Stop:
                if not self.stopped.done():
                    self.stop_message = message.message
                    self.stopped.set_result("stop")

    def _apply(self, snapshot: p.Snapshot) -> None:
        for info in snapshot.runtimes:
            self.runtimes[info.uid] = RemoteRuntime(info)
        live = {uid for table in snapshot.lookups.values() for uid in table.values() if isinstance(uid, int)}
        for uid in [uid for uid in self.runtimes if uid not in live]:
            del self.runtimes[uid]
        self.snapshot = snapshot
        if self.engines is not None:
            self.engines.snapshot_applied(live)
        if not self.first_snapshot.done():
            self.first_snapshot.set_result(None)

    def next_id(self) -> int:
        return next(self._ids)

    async def call(self, message: "p.Call") -> Any:
        """Send one of the interface's call messages; its Result's value (or its error, raised)."""
        message.cid = cid = self.next_id()
        future = asyncio.get_running_loop().create_future()
        self.calls[cid] = future
        try:
            self.send(message)
            return await future
        finally:
            self.calls.pop(cid, None)


class RemoteDataPlane(ServingInterface):
    """The serving interface in a frontend worker process: synchronous questions are answered from the
    snapshot the core pushes, the rest are messages to the core (one per method, workers/protocol.py)."""

    def __init__(self, link: CoreLink) -> None:
        self.link = link
        self.direct = None  # a DirectRouter (workers/direct.py) with --frontend-direct on
        self.engines = None  # an EngineClients (workers/engines.py): engine clients (--frontend-direct on), counters

    # -- health and metadata (from the pushed snapshot) ----------------------------------------------------
    @property
    def accepting(self) -> bool:
        return self.link.snapshot.accepting and not self.link.stopped.done()

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        return self.accepting and self.link.snapshot.ready

    def healthy(self) -> bool:
        return self.accepting and self.link.snapshot.healthy

    async def metrics_text(self) -> bytes:
        return await self.link.call(p.MetricsText(0))

    def server_metadata(self) -> dict[str, Any]:
        return server_metadata()

    def _abort_own(self, message: str) -> None:
        """(The worker's wiring, not the interface's.) Answer every request this process runs without the core (straight to a model's process, or on its own
        engine client) with UNAVAILABLE ``message``: the server's exit timeout ran out (the core answers its own)."""
        error = Unavailable(message)
        if self.direct is not None:
            self.direct.abort_all(error)
        if self.engines is not None:
            self.engines.abort_all(error)

    def model(self, name: str, version: str = "") -> RemoteRuntime:
        table = self.link.snapshot.lookups.get(name)
        if table is None:
            raise NotFound(f"unknown model: '{name}'")
        found = table.get(version)
        if found is None:
            first = table.get("")
            if len(table) == 1 and isinstance(first, wire.Error):  # no version loaded: that error for any
                raise wire.server_error(first)
            try:
                int(version)
            except ValueError:
                raise InvalidArgument(f"invalid model version '{version}': versions are integers") from None
            raise NotFound(f"unknown version {version} of model '{name}'")
        if isinstance(found, wire.Error):
            raise wire.server_error(found)
        runtime = self.link.runtimes.get(found)
        if runtime is None:  # pushed in the same snapshot: cannot happen; say so plainly if it does
            raise Unavailable(f"model '{name}' is changing; try again")
        return runtime

    def model_ready(self, name: str, version: str = "") -> bool:
        try:
            self.model(name, version)
        except ServerError:
            return False
        return True

    def model_metadata(self, name: str, version: str = "") -> dict[str, Any]:
        runtime = self.model(name, version)
        return model_metadata(name, runtime.versions, runtime.config)

    def model_config(self, name: str, version: str = "") -> mc.ModelConfig:
        return self.model(name, version).config

    async def statistics(self, name: str = "", version: str = "") -> list[dict]:
        return await self.link.call(p.Statistics(0, name, version))

    # -- repository ------------------------------------------------------------------------------------------
    def repository_index(self, ready_only: bool = False) -> list[dict]:
        rows = self.link.snapshot.index
        return [row for row in rows if row.get("state") == "READY"] if ready_only else list(rows)

    async def index(self, ready_only: bool = False) -> list[dict]:
        return await self.link.call(p.Index(0, ready_only))

    async def load_model(self, name: str, config_json: str | None = None) -> None:
        await self.link.call(p.LoadModel(0, name, config_json))

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        await self.link.call(p.UnloadModel(0, name, unload_dependents))

    # -- inference ---------------------------------------------------------------------------------------------
    def infer(self, request: InferenceRequest) -> RemoteInferenceStream:
        """Send ``request`` to the core; a refusal is raised by the stream's first step."""
        if not self.accepting:
            raise Unavailable("the server is shutting down and accepts no new requests")
        if self.direct is not None:
            stream = self.direct.route(request, False)
            if stream is not None:
                return stream
        return self._submit(request, False)

    def infer_json(self, model_name: str, model_version: str, body: bytes, header_length: int | None,
                   limits, max_json_depth: int):
        """Straight to an instance process of the model where the direct path takes it (workers/direct.py)."""
        if not self.accepting or self.direct is None:
            return None
        return self.direct.route_json(model_name, model_version, body, header_length, limits, max_json_depth)

    def _submit(self, request: InferenceRequest, unary: bool) -> RemoteInferenceStream:
        link = self.link
        rid = link.next_id()
        stream = RemoteInferenceStream(link, rid, request)
        link.streams[rid] = stream
        try:
            link.send(p.infer_message(rid, request, unary, link.outbox))
        except BaseException:
            link.streams.pop(rid, None)
            raise
        return stream

    def generate(self, model_name: str, generation: GenerationRequest, *, model_version: str = "", id: str = "",
                 priority: int = 0, timeout_us: int = 0, arrival_ns: int = 0, trace_context: Any = None):
        """A typed LLM generation on this worker's own engine client, where the model's engine takes one, else
        through the core (whose DataPlane runs it; a refusal is raised by the stream's first step)."""
        if not self.accepting:
            raise Unavailable("the server is shutting down and accepts no new requests")
        if self.direct is not None and self.engines is not None:  # (engines take workers' clients only then)
            stream = self.engines.generate(model_name, generation, model_version=model_version, id=id,
                                           priority=priority, timeout_us=timeout_us, arrival_ns=arrival_ns,
                                           trace_context=trace_context)
            if stream is not None:
                return stream
        request = InferenceRequest(model_name, {}, model_version=model_version, id=id, priority=priority,
                                   timeout_us=timeout_us, generation=generation)  # (as it crosses to the core)
        if arrival_ns:
            request.arrival_ns = arrival_ns
        request.trace_context = trace_context
        return RemoteGenerationStream(self._submit(request, False))

    def record_frontend_runs(self, model, count: int, elapsed_ns: int) -> None:
        if self.engines is not None and isinstance(model, RemoteRuntime):
            self.engines.record_runs(model, count, elapsed_ns)

    async def infer_unary(self, request: InferenceRequest) -> InferenceResponse:
        if not self.accepting:
            raise Unavailable("the server is shutting down and accepts no new requests")
        request.streaming = False
        if self.direct is not None:
            stream = self.direct.route(request, True)
            if stream is not None:
                return await DataPlane.collect_unary(self, stream)
        stream = self._submit(request, True)
        try:
            response = await stream.__anext__()
        finally:
            await stream.aclose()
        if response.error is not None:
            raise response.error
        return response

    # -- shared memory -----------------------------------------------------------------------------------------
    async def register_system_shared_memory(self, name: str, key: str, offset: int, byte_size: int) -> None:
        await self.link.call(p.RegisterSystemSharedMemory(0, name, key, offset, byte_size))

    async def unregister_system_shared_memory(self, name: str = "") -> None:
        await self.link.call(p.UnregisterSystemSharedMemory(0, name))

    async def system_shared_memory_status(self, name: str = "") -> list[dict]:
        return await self.link.call(p.SystemSharedMemoryStatus(0, name))

    async def register_cuda_shared_memory(self, name: str, raw_handle: bytes, device_id: int,
                                          byte_size: int) -> None:
        await self.link.call(p.RegisterCudaSharedMemory(0, name, raw_handle, device_id, byte_size))

    async def unregister_cuda_shared_memory(self, name: str = "") -> None:
        await self.link.call(p.UnregisterCudaSharedMemory(0, name))

    async def cuda_shared_memory_status(self, name: str = "") -> list[dict]:
        return await self.link.call(p.CudaSharedMemoryStatus(0, name))

    # -- trace settings ------------------------------------------------------------------------------------------
    async def trace_setting(self, model_name: str = "", updates: dict | None = None) -> dict[str, Any]:
        return await self.link.call(p.TraceSetting(0, model_name, updates))

    # -- load and caches ------------------------------------------------------------------------------------------
    async def load_report(self, model_name: str = "") -> dict[str, Any]:
        return await self.link.call(p.LoadReport(0, model_name))

    async def reset_prefix_cache(self, model_name: str = "", reset_running_requests: bool = False) -> dict[str, Any]:
        return await self.link.call(p.ResetPrefixCache(0, model_name, reset_running_requests))

    # -- adapters (LoRA) ----------------------------------------------------------------------------------------
    def adapters(self) -> list[dict[str, str]]:
        return self.link.snapshot.adapters

    async def load_adapter(self, model_name: str, adapter_name: str, path: str, load_inplace: bool = False) -> None:
        await self.link.call(p.LoadAdapter(0, model_name, adapter_name, path, load_inplace))

    async def unload_adapter(self, model_name: str, adapter_name: str) -> None:
        await self.link.call(p.UnloadAdapter(0, model_name, adapter_name))


__all__ = ["CoreLink", "RemoteDataPlane", "RemoteInferenceStream", "RemoteRuntime"]


async def open_frontend(link: CoreLink):
    """A frontend process's side once its link is attached: the core's start message and options (the log level
    set from them), then, after the first snapshot, the frontends' access policy and the worker-side interface
    (with the direct path to the models' processes where the server runs with ``--frontend-direct on``).
    Returns ``(start, options, dataplane, access)``."""
    import logging
    import pickle

    from ..access import AccessPolicy

    start = await link.started
    options = pickle.loads(start.options)
    logging.getLogger().setLevel(logging.DEBUG if options.log_verbose > 0 else logging.INFO)
    await link.first_snapshot
    access = AccessPolicy(options.http_restricted_apis, options.grpc_restricted_protocols, options.api_key,
                          options.api_key_scope)
    dataplane = RemoteDataPlane(link)
    if getattr(options, "frontend_direct", False):
        from .direct import DirectRouter

        dataplane.direct = DirectRouter(dataplane, options.frontend_workers)
    from .engines import EngineClients

    # (engine clients only where the core gave the engines clients for the workers: --frontend-direct on)
    dataplane.engines = link.engines = EngineClients(dataplane, start.index + 1)
    return start, options, dataplane, access
