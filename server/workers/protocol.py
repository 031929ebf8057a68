"""The messages between the core process and its frontend workers, and their framing.

Each frame is a 4-byte little-endian length and a MessagePack body (msgspec structs, tagged). Tensor
bytes travel in the message itself: for the tensors of an HTTP or gRPC request (already in memory,
read from a socket) one copy into the frame and one out of it cost less than a shared-memory block's
allocation and hand-back (measured in docs/performance.md).
"""

from __future__ import annotations

import asyncio
import struct
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec
import numpy as np

from ..errors import ServerError, Status, as_server_error, error_of_status
from ..generation import EngineInfo, GenerationDelta, GenerationRequest
from ..types import InferenceRequest, InferenceResponse, RequestedOutput, Tensor

if TYPE_CHECKING:
    from ..serving import ServingInterface


# -- parts ----------------------------------------------------------------------------------------------------
class TensorData(msgspec.Struct, array_like=True, omit_defaults=True):
    name: str
    datatype: str
    dtype: str  # numpy's dtype string; "|O" for BYTES (then ``data`` is a list of the elements)
    shape: tuple[int, ...]
    data: Any  # bytes (raw, C order) or list[bytes]
    parameters: dict[str, Any] = {}


class Error(msgspec.Struct, array_like=True, omit_defaults=True):
    status: str  # a tideserve.errors.Status value
    message: str
    retry_after_s: int | None = None  # ServerError.retry_after_s (a queue at its bound: Retry-After)
    http_code: int = 0  # where the error's class answers another HTTP status than its status's (e.g. 415)


class OutputSpec(msgspec.Struct, array_like=True, omit_defaults=True):
    name: str
    parameters: dict[str, Any] = {}


class ResponseData(msgspec.Struct, array_like=True, omit_defaults=True):
    model_name: str = ""
    model_version: str = ""
    id: str = ""
    outputs: list[TensorData] = []
    parameters: dict[str, Any] = {}
    error: Error | None = None
    final: bool = True
    empty: bool = False
    generation: GenerationDelta | None = None


# -- worker -> core -----------------------------------------------------------------------------------------
class Infer(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """A request to run: ``unary`` asks for exactly one response (``DataPlane.infer_unary``)."""

    rid: int
    unary: bool
    model_name: str
    model_version: str
    id: str
    inputs: list[TensorData]
    outputs: list[OutputSpec]
    parameters: dict[str, Any]
    arrival_ns: int
    priority: int = 0
    timeout_us: int = 0
    streaming: bool = True
    trace_context: str = ""  # a client's W3C traceparent (tracing)
    generation: GenerationRequest | None = None  # a typed LLM request (then no inputs)


class Cancel(msgspec.Struct, tag=True, array_like=True):
    rid: int


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


class LoadLoraAdapter(_Call, tag=True):
    lora_name: str
    lora_path: str
    load_inplace: bool
    base_model_name: str
    changes_repository: ClassVar[bool] = True

    async def run(self, plane):
        return await plane.load_lora_adapter(self.lora_name, self.lora_path, self.load_inplace,
                                             self.base_model_name)


class UnloadLoraAdapter(_Call, tag=True):
    lora_name: str
    changes_repository: ClassVar[bool] = True

    async def run(self, plane):
        return await plane.unload_lora_adapter(self.lora_name)


Call = (Statistics | MetricsText | Index | LoadModel | UnloadModel | RegisterSystemSharedMemory
        | UnregisterSystemSharedMemory | SystemSharedMemoryStatus | RegisterCudaSharedMemory
        | UnregisterCudaSharedMemory | CudaSharedMemoryStatus | TraceSetting | LoadLoraAdapter | UnloadLoraAdapter)
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
    response: ResponseData
    runtime: int = 0
    rejected: bool = False


class Result(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """The answer to a call message (its ``cid``): the value returned, or the error raised."""

    cid: int
    value: Any = None
    error: Error | None = None


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
    lookups: dict[str, dict[str, int | Error]]
    runtimes: list[RuntimeInfo]  # those the worker has not been sent yet
    lora_adapters: list[dict[str, str]]


class Stop(msgspec.Struct, tag=True, array_like=True):
    pass


ToCore = Infer | Cancel | Ready | Call
ToWorker = Start | Respond | Result | Snapshot | Stop

# -- framing --------------------------------------------------------------------------------------------------
_HEADER = struct.Struct("<I")
_PB_EXT = 1  # a protobuf message in a Result: its full name, NUL, its bytes


def _enc_hook(value: Any) -> Any:
    serialize = getattr(value, "SerializeToString", None)
    if serialize is not None:
        return msgspec.msgpack.Ext(_PB_EXT, value.DESCRIPTOR.full_name.encode() + b"\0" + serialize())
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"cannot send a {type(value).__name__} between processes")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code == _PB_EXT:
        from google.protobuf import symbol_database

        name, _, body = bytes(data).partition(b"\0")
        message = symbol_database.Default().GetSymbol(name.decode())()
        message.ParseFromString(body)
        return message
    raise TypeError(f"unknown extension type {code}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def frame(message: msgspec.Struct) -> bytes:
    body = _encoder.encode(message)
    return _HEADER.pack(len(body)) + body


class FrameSplitter:
    """Turns the bytes a stream delivers into messages of type ``kind``."""

    def __init__(self, kind: Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(kind, ext_hook=_ext_hook)
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list:
        buffer = self._buffer
        if buffer:
            buffer += data
            data = buffer
        messages, position, total = [], 0, len(data)
        with memoryview(data) as view:
            while total - position >= 4:
                (length,) = _HEADER.unpack_from(view, position)
                end = position + 4 + length
                if end > total:
                    break
                messages.append(self._decoder.decode(view[position + 4:end]))
                position = end
        if buffer:
            del buffer[:position]
        elif position < total:
            buffer += data[position:]
        return messages


class FramedLink(asyncio.Protocol):
    """One end of a core-worker socket: splits what arrives into ``kind`` messages (``data_received`` of the
    subclass reads ``self.splitter``); ``send`` queues a message and what one turn of the event loop sends
    leaves in one write (fewer system calls and wake-ups of the other side when many requests are in flight)."""

    def __init__(self, kind: Any) -> None:
        self.transport: asyncio.Transport | None = None
        self.splitter = FrameSplitter(kind)
        self.loop = asyncio.get_running_loop()
        self._outbox: list[bytes] = []
        self._flush_scheduled = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def send(self, message: msgspec.Struct) -> None:
        self._outbox.append(frame(message))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        outbox, transport = self._outbox, self.transport
        if outbox and transport is not None and not transport.is_closing():
            transport.write(outbox[0] if len(outbox) == 1 else b"".join(outbox))
        outbox.clear()


# -- tensors, requests, responses, errors -------------------------------------------------------------------


def error_data(error: BaseException) -> Error:
    error = as_server_error(error)
    code = error.http_code
    return Error(error.status.value, error.message, error.retry_after_s,
                 0 if code == error.status.http_code else code)


_KINDS: dict[tuple[type, int], type] = {}


def server_error(error: Error) -> ServerError:
    status = Status(error.status)
    found = error_of_status(status, error.message)
    if error.http_code:  # a class of its own that answers that HTTP status, as the core's error did
        kind = type(found)
        kind = _KINDS.get((kind, error.http_code)) or _KINDS.setdefault(
            (kind, error.http_code), type(kind.__name__, (kind,), {"http_code": error.http_code}))
        found = kind(error.message, status)
    found.retry_after_s = error.retry_after_s
    return found


def _element(item: Any) -> bytes:
    if type(item) is bytes:
        return item
    if isinstance(item, str):
        return item.encode("utf-8")
    return bytes(item)


def tensor_data(tensor: Tensor) -> TensorData:
    if tensor.data is None:  # data in a shared memory region (an input to read, an output written): none here
        return TensorData(tensor.name, tensor.datatype, "", tuple(tensor.shape), None, tensor.parameters or {})
    array = np.asarray(tensor.data)
    if array.dtype == np.object_ or tensor.datatype == "BYTES":
        return TensorData(tensor.name, tensor.datatype, "|O", tuple(array.shape),
                          [_element(x) for x in array.reshape(-1)], tensor.parameters or {})
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    data = memoryview(array).cast("B") if array.ndim and array.size else array.tobytes()
    return TensorData(tensor.name, tensor.datatype, array.dtype.str, tuple(array.shape), data,
                      tensor.parameters or {})


_DTYPES: dict[str, np.dtype] = {}


def tensor_of(data: TensorData) -> Tensor:
    if not data.dtype:
        return Tensor(data.name, data.datatype, tuple(data.shape), None, dict(data.parameters))
    if data.dtype == "|O":
        array = np.empty(len(data.data), np.object_)
        array[:] = data.data
        array = array.reshape(data.shape)
    else:
        dtype = _DTYPES.get(data.dtype)
        if dtype is None:
            dtype = _DTYPES[data.dtype] = np.dtype(data.dtype)
        array = np.frombuffer(data.data, dtype).reshape(data.shape)
    return Tensor(data.name, data.datatype, tuple(data.shape), array, dict(data.parameters))


def infer_message(rid: int, request: InferenceRequest, unary: bool) -> Infer:
    return Infer(rid, unary, request.model_name, request.model_version, request.id,
                 [tensor_data(t) for t in request.inputs.values()],
                 [OutputSpec(o.name, o.parameters or {}) for o in request.outputs],
                 request.parameters or {}, request.arrival_ns, request.priority, request.timeout_us,
                 request.streaming, request.trace_context if type(request.trace_context) is str else "",
                 request.generation)


def request_of(message: Infer) -> InferenceRequest:
    request = InferenceRequest(message.model_name, {t.name: tensor_of(t) for t in message.inputs},
                               model_version=message.model_version, id=message.id,
                               outputs=[RequestedOutput(o.name, dict(o.parameters)) for o in message.outputs],
                               parameters=dict(message.parameters), priority=message.priority,
                               timeout_us=message.timeout_us, generation=message.generation)
    request.arrival_ns = message.arrival_ns  # CLOCK_MONOTONIC: the same clock in every process
    request.streaming = message.streaming
    if message.trace_context:
        request.trace_context = message.trace_context
    return request


def response_data(response: InferenceResponse) -> ResponseData:
    return ResponseData(response.model_name, response.model_version, response.id,
                        [tensor_data(t) for t in response.outputs], response.parameters or {},
                        error_data(response.error) if response.error is not None else None,
                        response.final, response.empty, response.generation)


def response_of(data: ResponseData) -> InferenceResponse:
    return InferenceResponse(data.model_name, data.model_version, data.id, [tensor_of(t) for t in data.outputs],
                             dict(data.parameters), server_error(data.error) if data.error is not None else None,
                             data.final, data.empty, data.generation)
