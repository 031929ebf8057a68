"""The messages between the core process and its frontend workers: this link's envelopes around the structs every
process link shares (:mod:`tideserve.wire`: requests, responses, tensors, errors, framing).

A message's tensors cross inline, or, from :data:`tideserve.arena.SHARED_MEMORY_MIN_BYTES` bytes on, in a block of
the sender's arena (one per direction and worker, made by the core when it starts the worker); a message that finds
no room there goes inline (this link passes no descriptors).
"""

from __future__ import annotations

import asyncio
import collections
import threading
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from .. import arena, wire
from ..generation import EngineInfo
from ..loops import running_loop
from ..types import InferenceRequest, InferenceResponse

if TYPE_CHECKING:
    from ..serving import ServingInterface

ARENA_BYTES = 64 * 1024 * 1024  # each direction's arena, per worker (virtual: pages are backed as they are written)


# -- worker -> core -----------------------------------------------------------------------------------------
class Infer(msgspec.Struct, tag=True, array_like=True):
    """A request to run: ``unary`` asks for exactly one response (``DataPlane.infer_unary``); ``payload``: where its
    input tensors lie in the worker's arena, when they do."""

    request: wire.Request
    unary: bool
    payload: wire.Payload | None = None


# The serving interface's methods that the core answers (tideserve.serving.ServingInterface), one message
# each; ``run`` makes the call on the core's side, a Result answers it. ``changes_repository``: the workers get
# a fresh snapshot before the answer (what snapshots hold may have changed).
class _Call(msgspec.Struct, array_like=True):
    cid: int
    changes_repository: ClassVar[bool] = False

    async def run(self, plane: "ServingInterface") -> Any:
        raise NotImplementedError


class Statistics(_Call, tag=True):
    name: str
    version: str

    async def run(self, plane):
        return await plane.statistics(self.name, self.version)


class MetricsText(_Call, tag=True):
    async def run(self, plane):
        return await plane.metrics_text()


class Index(_Call, tag=True):
    ready_only: bool

    async def run(self, plane):
        return await plane.index(self.ready_only)


class LoadModel(_Call, tag=True):
    name: str
    config_json: str | None
    changes_repository: ClassVar[bool] = True

    async def run(self, plane):
        return await plane.load_model(self.name, self.config_json)


class UnloadModel(_Call, tag=True):
    name: str
    unload_dependents: bool
    changes_repository: ClassVar[bool] = True

    async def run(self, plane):
        return await plane.unload_model(self.name, self.unload_dependents)


class RegisterSystemSharedMemory(_Call, tag=True):
    name: str
    key: str
    offset: int
    byte_size: int

    async def run(self, plane):
        return await plane.register_system_shared_memory(self.name, self.key, self.offset, self.byte_size)


class UnregisterSystemSharedMemory(_Call, tag=True):
    name: str

    async def run(self, plane):
        return await plane.unregister_system_shared_memory(self.name)


class SystemSharedMemoryStatus(_Call, tag=True):
    name: str

    async def run(self, plane):
        return await plane.system_shared_memory_status(self.name)


class RegisterCudaSharedMemory(_Call, tag=True):
    name: str
    raw_handle: bytes
    device_id: int
    byte_size: int

    async def run(self, plane):
        return await plane.register_cuda_shared_memory(self.name, self.raw_handle, self.device_id, self.byte_size)


class UnregisterCudaSharedMemory(_Call, tag=True):
    name: str

    async def run(self, plane):
        return await plane.unregister_cuda_shared_memory(self.name)


class CudaSharedMemoryStatus(_Call, tag=True):
    name: str

    async def run(self, plane):
        return await plane.cuda_shared_memory_status(self.name)


class TraceSetting(_Call, tag=True):
    model_name: str
    updates: dict[str, Any] | None

    async def run(self, plane):
        return await plane.trace_setting(self.model_name, self.updates)


class LoadAdapter(_Call, tag=True):
    model_name: str
    adapter_name: str
    path: str
    load_inplace: bool
    changes_repository: ClassVar[bool] = True

    async def run(self, plane):
        return await plane.load_adapter(self.model_name, self.adapter_name, self.path, self.load_inplace)


class UnloadAdapter(_Call, tag=True):
    model_name: str
    adapter_name: str
    changes_repository: ClassVar[bool] = True

    async def run(self, plane):
        return await plane.unload_adapter(self.model_name, self.adapter_name)


class LoadReport(_Call, tag=True):
    model_name: str

    async def run(self, plane):
        return await plane.load_report(self.model_name)


class ResetPrefixCache(_Call, tag=True):
    model_name: str
    reset_running_requests: bool

    async def run(self, plane):
        return await plane.reset_prefix_cache(self.model_name, self.reset_running_requests)


class DirectFailure(_Call, tag=True):
    """``--frontend-direct``: the instance process at ``address`` went away with ``count`` of this worker's
    requests in flight; the answer is the error text the core gives requests in flight in a process that died
    (the core counts them as failed)."""

    address: str
    count: int

    async def run(self, plane):
        endpoint = getattr(plane, "direct_endpoints", {}).get(self.address)
        if endpoint is None:
            return "Failed to process the request(s): the model's process exited"
        return await endpoint.direct_failure(self.count)


Call = (Statistics | MetricsText | Index | LoadModel | UnloadModel | RegisterSystemSharedMemory
        | UnregisterSystemSharedMemory | SystemSharedMemoryStatus | RegisterCudaSharedMemory
        | UnregisterCudaSharedMemory | CudaSharedMemoryStatus | TraceSetting | LoadAdapter | UnloadAdapter
        | LoadReport | ResetPrefixCache)
CALLS: tuple[type[_Call], ...] = Call.__args__  # every call message, for the conformance test


class Ready(msgspec.Struct, tag=True, array_like=True):
    """The worker's ports are serving."""

    pid: int


# -- core -> worker -----------------------------------------------------------------------------------------
class Start(msgspec.Struct, tag=True, array_like=True):
    options: bytes  # the pickled ServerOptions
    index: int


class Respond(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """One response of request ``rid``; ``rejected``: the request was refused before it was scheduled
    (what ``DataPlane.infer`` raises); ``runtime``: the uid of the model version that served it."""

    rid: int
    response: wire.Response
    runtime: int = 0
    rejected: bool = False
    payload: wire.Payload | None = None  # where its output tensors lie in the core's arena, when they do


class Result(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """The answer to a call message (its ``cid``): the value returned, or the error raised."""

    cid: int
    value: Any = None
    error: wire.Error | None = None


class RuntimeInfo(msgspec.Struct, array_like=True):
    """What frontends read of a loaded model version."""

    uid: int
    name: str
    version: int
    config: bytes  # a serialized ModelConfig
    model_path: str
    allowed_roots: list[str]
    versions: list[int]  # every loaded version of the model (model metadata lists them)
    engine: EngineInfo | None = None  # ServedModel.engine


class Snapshot(msgspec.Struct, tag=True, array_like=True):
    """The core's repository as frontends see it, pushed on every change.

    ``lookups`` maps a model name to what ``DataPlane.model(name, version)`` gives for version "" and
    each loaded version: a runtime uid, or the error it raises."""

    accepting: bool
    ready: bool
    healthy: bool
    index: list[dict[str, Any]]
    lookups: dict[str, dict[str, int | wire.Error]]
    runtimes: list[RuntimeInfo]  # those the worker has not been sent yet
    adapters: list[dict[str, str]]
    # --frontend-direct: by runtime uid, the addresses of the instance processes that take its requests straight
    direct: dict[int, list[str]] = {}


class Stop(msgspec.Struct, tag=True, array_like=True):
    """Close the ports and exit; ``message``: first answer the requests still in flight straight to the models'
    processes (``--frontend-direct``) with UNAVAILABLE and this text (the exit timeout ran out)."""

    message: str = ""


class WorkerGenerations(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """Typed generations a worker ran on its own engine client (workers/engines.py) for runtime ``uid`` since its
    last such message: ``started`` and ``finished`` (the core counts them as the version's requests in flight, so
    that a drain or an unload waits for them), and the worker's statistics counters for it (``ModelStats.export``)."""

    uid: int
    started: int = 0
    finished: int = 0
    counters: dict[str, Any] | None = None
    llm: dict[str, list[float]] | None = None  # the LLM metrics' increments since the last message (engines.py)
    state: list[float] | None = None  # the engine's last scheduler state this worker's client saw: running, waiting, kv, at
    # the engine's vllm:* families (workers/engines.py engine_values): counter and histogram increments since the
    # last message, gauges as set by the last scheduler stats this worker's client saw; [family, label values, values]
    engine: list[tuple[str, list[str], list[float]]] | None = None


ToCore = Infer | wire.Cancel | wire.Release | Ready | Call | DirectFailure | WorkerGenerations
ToWorker = Start | Respond | Result | Snapshot | Stop | wire.Release

# -- the link ---------------------------------------------------------------------------------------------------
class FramedLink(asyncio.Protocol):
    """One end of a core-worker socket: splits what arrives into ``kind`` messages (``data_received`` of the
    subclass reads ``self.splitter``); ``send`` queues a message and what one turn of the event loop sends
    leaves in one write (fewer system calls and wake-ups of the other side when many requests are in flight).

    With its arenas (``attach``), ``outbox`` puts the large tensors of what this end sends in shared memory and
    ``inbox`` reads those of the other end; the blocks read go back (``Release``) with the next write, or
    ``RELEASE_DELAY_S`` later when nothing goes out."""

    def __init__(self, kind: Any) -> None:
        self.transport: asyncio.Transport | None = None
        self.splitter = wire.FrameReader(kind)
        self.loop = asyncio.get_running_loop()
        self.outbox: arena.Outbox | None = None
        self.inbox: arena.Inbox | None = None
        self._outbox: list[bytes] = []
        self._flush_scheduled = False
        self._releases: collections.deque[int] = collections.deque()
        self._release_scheduled = False
        self._loop_thread = threading.get_ident()

    def attach(self, send_fd: int, receive_fd: int, size: int, min_bytes: int = arena.SHARED_MEMORY_MIN_BYTES) -> None:
        """Use the arena file ``send_fd`` for what this end sends and map ``receive_fd``, the other end's (both of
        ``size`` bytes; the descriptors stay the caller's)."""
        self.outbox = arena.Outbox(arena.Arena(size, "", fd=send_fd), min_bytes, own_files=False)
        self.outbox.arena.fd = -1  # the caller's to close
        self.inbox = arena.Inbox(receive_fd, size, self._released)

    def connection_made(self, transport) -> None:
        self.transport = transport

    def send(self, message: msgspec.Struct) -> None:
        self._outbox.append(wire.frame(message))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        outbox, transport = self._outbox, self.transport
        if self._releases:
            outbox.insert(0, wire.frame(wire.Release(_drain(self._releases))))
        if outbox and transport is not None and not transport.is_closing():
            transport.write(outbox[0] if len(outbox) == 1 else b"".join(outbox))
        outbox.clear()

    def release(self, message: wire.Release) -> None:
        """The other end no longer reads these blocks of ours."""
        if self.outbox is not None:
            for offset in message.offsets:
                self.outbox.arena.release(offset)

    def _released(self, offset: int) -> None:
        """A block of the other end's arena is no longer read here (from whatever thread dropped its last array)."""
        self._releases.append(offset)
        if self._release_scheduled:
            return
        self._release_scheduled = True
        try:
            if threading.get_ident() == self._loop_thread:
                self.loop.call_later(arena.RELEASE_DELAY_S, self._send_releases)
            else:
                self.loop.call_soon_threadsafe(self.loop.call_later, arena.RELEASE_DELAY_S, self._send_releases)
        except RuntimeError:  # the loop is closed: the process is exiting
            pass

    def _send_releases(self) -> None:
        self._release_scheduled = False
        if self._releases and not self._flush_scheduled:
            self._flush()


class PendingResponses:
    """What arrived for one request and is not yet taken (``_pending``), and the wait for more: the arrival side
    calls ``_put``, ``__anext__`` awaits ``_wait`` only when nothing is pending. A cancelled wait cancels the
    request (the subclass's ``cancel``)."""

    __slots__ = ()

    def _put(self, item) -> None:
        self._pending.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        pending = self._pending
        while not pending:
            self._waiter = running_loop().create_future()
            try:
                await self._waiter
            except asyncio.CancelledError:
                self.cancel()
                raise
            finally:
                self._waiter = None


def _drain(queue: collections.deque[int]) -> list[int]:
    items = []
    while True:
        try:
            items.append(queue.popleft())
        except IndexError:
            return items


# -- requests and responses ---------------------------------------------------------------------------------------
def infer_message(rid: int, request: InferenceRequest, unary: bool, outbox: arena.Outbox | None = None) -> Infer:
    """``request`` to send (its inputs in ``outbox``'s arena when they are large enough and fit)."""
    if outbox is None:
        return Infer(wire.request_message(rid, request), unary)
    inputs, payload, _ = outbox.put(list(request.inputs.values()))
    return Infer(wire.request_message(rid, request, inputs), unary, payload)


def request_of(message: Infer, inbox: arena.Inbox | None = None) -> InferenceRequest:
    block = inbox.block(message.payload) if message.payload is not None else None
    return wire.core_request(message.request, block)


def respond_message(rid: int, response: InferenceResponse, runtime: int = 0,
                    outbox: arena.Outbox | None = None) -> Respond:
    """One response of request ``rid`` to send (its outputs in ``outbox``'s arena when large enough and they fit)."""
    if outbox is None or not response.outputs:
        return Respond(rid, wire.response_message(response), runtime)
    outputs, payload, _ = outbox.put(response.outputs)
    return Respond(rid, wire.response_message(response, outputs), runtime, False, payload)


def error_respond(rid: int, error: BaseException, runtime: int = 0, rejected: bool = False) -> Respond:
    """The final answer to request ``rid``: ``error`` (``rejected``: refused before it was scheduled)."""
    return Respond(rid, wire.Response(error=wire.error_data(error)), runtime, rejected)


def response_of(message: Respond, inbox: arena.Inbox | None = None) -> InferenceResponse:
    block = inbox.block(message.payload) if message.payload is not None else None
    return wire.core_response(message.response, block)

