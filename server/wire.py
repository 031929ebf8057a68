"""One wire for every process link: the frontend-worker link (``tideserve.workers.protocol``) and the link to a
Python model process (``general_backends/python/protocol.py``) frame the same structs the same way.

Framing
    Each frame is a 4-byte little-endian length and a MessagePack body (a msgspec struct). A link may pass file
    descriptors with a frame (``SCM_RIGHTS`` on its first byte): :class:`FrameReader` ``receive`` collects them
    beside the messages, :func:`send_frames` sends one. Protobuf messages and numpy scalars inside a value are
    carried too (an extension type; ``.item()``).

Structs
    :class:`Tensor` (inline bytes, or a reference into the message's shared-memory block), :class:`Request`,
    :class:`Response`, :class:`Error` (status, message, Retry-After, HTTP code: a ``ServerError`` comes out of a link
    as the class, codes and advice it went in with), :class:`Payload` (where a message's block lies),
    :class:`Cancel` and :class:`Release`. Each link wraps them in envelope messages of its own (a batch, a BLS
    call, a worker's request with its ``unary`` flag...).

Tensors
    Inline: a numeric tensor's bytes in C order, a BYTES tensor's elements as a list. In shared memory: all tensors
    of one message lie in one block (:func:`layout`, :func:`copy_into`; a BYTES tensor as its uint32 element
    lengths, then the elements), each :class:`Tensor` naming its ``offset`` and ``nbytes`` in the block; the
    receiver reads them in place (:func:`core_tensor`). :mod:`tideserve.arena` allocates the blocks; which tensors
    go where is each link's choice (:data:`tideserve.arena.SHARED_MEMORY_MIN_BYTES`).
"""

from __future__ import annotations

import array
import os
import socket
import struct
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from .errors import DeadlinePassed, ServerError, Status, as_server_error, error_of_status
from .generation import GenerationDelta, GenerationRequest
from .types import InferenceRequest, InferenceResponse, RequestedOutput
from .types import Tensor as CoreTensor

ALIGN = 64  # every tensor in a block starts on a cache line
INLINE = -1  # Tensor.offset of a tensor whose data is in the message itself
MAX_FDS = 8  # descriptors one frame may carry


# -- structs ------------------------------------------------------------------------------------------------
class Tensor(msgspec.Struct, array_like=True, omit_defaults=True):
    """A tensor: its bytes inline (``data``) or at ``offset`` of the message's shared-memory block (``nbytes``)."""

    name: str
    datatype: str  # the tensor's datatype (FP32, BYTES...)
    dtype: str  # numpy's dtype string; "|O" for BYTES; "" for no data (a client's shared-memory region holds it)
    shape: tuple[int, ...]
    data: Any = None  # inline: bytes (C order), or for BYTES a list of the elements; None in a block
    offset: int = INLINE  # in the message's block
    nbytes: int = 0  # in the block (BYTES: the lengths, then the elements)
    parameters: dict[str, Any] = {}


class Error(msgspec.Struct, array_like=True, omit_defaults=True):
    status: str  # a tideserve.errors.Status value
    message: str
    retry_after_s: int | None = None  # ServerError.retry_after_s (a queue at its bound: Retry-After)
    http_code: int = 0  # where the error's class answers another HTTP status than its status's (e.g. 415)
    # a refusal at a queue deadline (DeadlinePassed): the deadline, when the server refused, and the loop's wait for
    # a CPU meanwhile where measured (time.monotonic_ns: one clock for every process of the host)
    deadline_ns: int = 0
    fired_ns: int = 0
    cpu_wait_ns: int | None = None


class Output(msgspec.Struct, array_like=True, omit_defaults=True):
    """A requested output."""

    name: str
    parameters: dict[str, Any] = {}


class Request(msgspec.Struct, array_like=True, omit_defaults=True):
    """An inference request: ``rid`` names it on its link (its responses, its cancellation)."""

    rid: int
    model_name: str
    model_version: str
    id: str
    inputs: list[Tensor]
    outputs: list[Output]
    parameters: dict[str, Any]
    priority: int = 0
    timeout_us: int = 0
    streaming: bool = True
    arrival_ns: int = 0  # CLOCK_MONOTONIC: the same clock in every process of the server (0: on arrival)
    trace_context: str = ""  # a client's W3C traceparent (tracing)
    generation: GenerationRequest | None = None  # a typed LLM request (then no inputs)


class Response(msgspec.Struct, array_like=True, omit_defaults=True):
    """One response of a request's stream; ``final`` marks the last, ``empty`` a bare FINAL flag."""

    outputs: list[Tensor] = []
    parameters: dict[str, Any] = {}
    error: Error | None = None
    final: bool = True
    empty: bool = False
    model_name: str = ""
    model_version: str = ""
    id: str = ""
    generation: GenerationDelta | None = None  # the answer to a typed LLM request


class Payload(msgspec.Struct, array_like=True):
    """Where a message's tensors lie: a block of the sender's arena, or (``offset`` -1) a file of its own that
    travels with the message."""

    offset: int
    size: int


class Cancel(msgspec.Struct, tag=True, array_like=True):
    """Cancel request ``rid`` (its responses may still come until its final one)."""

    rid: int


class Release(msgspec.Struct, tag=True, array_like=True):
    """Blocks of the receiver's arena that the sender no longer reads."""

    offsets: list[int]


# -- errors -------------------------------------------------------------------------------------------------
def error_data(error: BaseException) -> Error:
    """What crosses for ``error``: its status, message, Retry-After and (where its class has one of its own) its
    HTTP code."""
    error = as_server_error(error)
    code = error.http_code
    if isinstance(error, DeadlinePassed):
        return Error(error.status.value, error.message, error.retry_after_s,
                     0 if code == error.status.http_code else code, error.deadline_ns, error.fired_ns,
                     error.cpu_wait_ns)
    return Error(error.status.value, error.message, error.retry_after_s,
                 0 if code == error.status.http_code else code)


_KINDS: dict[tuple[type, int], type] = {}


def server_error(error: Error) -> ServerError:
    """The ServerError ``error`` describes: of its status's class (ALREADY_EXISTS: the base class), answering the
    HTTP code and Retry-After the original did."""
    status = Status(error.status)
    if error.deadline_ns:  # a refusal at a queue deadline: its answer says how late the server was
        found = DeadlinePassed(error.message, error.deadline_ns, error.fired_ns)
        found.cpu_wait_ns = error.cpu_wait_ns
        if error.retry_after_s is not None:
            found.retry_after_s = error.retry_after_s
        return found
    found = error_of_status(status, error.message)
    if error.http_code:  # a class of its own that answers that HTTP status, as the original's did
        kind = type(found)
        kind = _KINDS.get((kind, error.http_code)) or _KINDS.setdefault(
            (kind, error.http_code), type(kind.__name__, (kind,), {"http_code": error.http_code}))
        found = kind(error.message, status)
    if error.retry_after_s is not None:
        found.retry_after_s = error.retry_after_s
    return found


# -- tensors ------------------------------------------------------------------------------------------------
def _element(item: Any) -> bytes:
    if type(item) is bytes:
        return item
    if isinstance(item, str):
        return item.encode("utf-8")
    return bytes(item)


def _is_bytes(tensor: CoreTensor, data: np.ndarray) -> bool:
    return tensor.datatype == "BYTES" or data.dtype.kind == "O"


_COPY_MAX = 4096  # inline data up to this size is copied out at once (cheaper than a memoryview of it)


def inline_tensor(tensor: CoreTensor) -> Tensor:
    """``tensor`` with its data in the message."""
    if tensor.data is None:  # data in a client's shared memory region (an input to read, an output written)
        return Tensor(tensor.name, tensor.datatype, "", tuple(tensor.shape), parameters=tensor.parameters or {})
    data = np.asarray(tensor.data)
    if _is_bytes(tensor, data):
        return Tensor(tensor.name, tensor.datatype, "|O", tuple(data.shape), [_element(x) for x in data.reshape(-1)],
                      parameters=tensor.parameters or {})
    if data.nbytes <= _COPY_MAX:
        body = data.tobytes()  # C order whatever the array's
    else:
        if not data.flags.c_contiguous:
            data = np.ascontiguousarray(data)
        body = memoryview(data).cast("B") if data.ndim and data.size else data.tobytes()
    dtype = data.dtype
    return Tensor(tensor.name, tensor.datatype, _DTYPE_STR.get(dtype) or _dtype_str(dtype), tuple(data.shape), body,
                  parameters=tensor.parameters or {})


# numpy makes a new string for every ``dtype.str`` (a printf-style format): the few dtypes tensors have, kept
_DTYPE_STR: dict[np.dtype, str] = {}
_DTYPE_STR_MAX = 64


def _dtype_str(dtype: np.dtype) -> str:
    text = dtype.str
    if len(_DTYPE_STR) < _DTYPE_STR_MAX:
        _DTYPE_STR[dtype] = text
    return text


def data_bytes(tensors: list[CoreTensor]) -> int:
    """The bytes of the tensors' data (BYTES: the elements' lengths and bytes)."""
    total = 0
    for tensor in tensors:
        data = tensor.data
        if data is None:
            continue
        data = np.asarray(data)
        if _is_bytes(tensor, data):
            total += 4 * data.size + sum(len(_element(x)) for x in data.reshape(-1))
        else:
            total += data.nbytes
    return total


@dataclass
class Layout:
    """The tensors of one message placed in a block: their descriptions, what to copy where, the block's size."""

    tensors: list[Tensor]
    parts: list[tuple[int, np.ndarray | bytes]]  # (offset in the block, what to copy there)
    size: int


def aligned(size: int) -> int:
    return (size + ALIGN - 1) & ~(ALIGN - 1)


def layout(tensors: list[CoreTensor]) -> Layout:
    """Place ``tensors`` one after the other in a block. A BYTES tensor becomes its elements' lengths (uint32), then
    the elements."""
    described, parts, offset = [], [], 0
    for tensor in tensors:
        if tensor.data is None:
            described.append(inline_tensor(tensor))
            continue
        data = np.asarray(tensor.data)
        if _is_bytes(tensor, data):
            items = [_element(x) for x in data.reshape(-1)]
            lengths = np.fromiter(map(len, items), np.uint32, len(items))
            body = b"".join(items)
            nbytes = lengths.nbytes + len(body)
            parts.append((offset, lengths))
            parts.append((offset + lengths.nbytes, body))
            dtype = "|O"
        else:
            nbytes = data.nbytes
            parts.append((offset, data))
            dtype = _DTYPE_STR.get(data.dtype) or _dtype_str(data.dtype)
        described.append(Tensor(tensor.name, tensor.datatype, dtype, tuple(data.shape), None, offset, nbytes,
                                tensor.parameters or {}))
        offset += aligned(nbytes)
    return Layout(described, parts, offset)


def copy_into(block: memoryview, placed: Layout) -> None:
    """Copy the tensors of ``placed`` into ``block`` (a view of shared memory)."""
    for offset, part in placed.parts:
        if isinstance(part, bytes):
            block[offset:offset + len(part)] = part
        elif part.nbytes:
            if part.flags.c_contiguous:
                block[offset:offset + part.nbytes] = memoryview(part).cast("B")
            else:
                target = np.frombuffer(block, np.uint8, part.nbytes, offset)
                np.copyto(target.view(part.dtype).reshape(part.shape), part)


_DTYPES: dict[str, np.dtype] = {}


def _dtype(text: str) -> np.dtype:
    dtype = _DTYPES.get(text)
    if dtype is None:
        dtype = _DTYPES[text] = np.dtype(text)
    return dtype


def core_tensor(tensor: Tensor, block: np.ndarray | None = None) -> CoreTensor:
    """The core tensor ``tensor`` describes: an array over its inline bytes, or over ``block`` (the message's block,
    a uint8 array) where it lies there; BYTES elements are copied out."""
    shape = tuple(tensor.shape)
    dtype = tensor.dtype
    if not dtype:
        data = None
    elif tensor.offset == INLINE:
        if dtype == "|O":
            data = np.empty(len(tensor.data), np.object_)
            data[:] = tensor.data
            data = data.reshape(shape)
        else:
            # the array made with its shape over the message's bytes (which this module's encoder wrote from an
            # array of that shape): ~0.8k instructions fewer than frombuffer then setting the shape
            data = np.ndarray(shape, _DTYPES.get(dtype) or _dtype(dtype), tensor.data)
    elif tensor.dtype == "|O":
        count = int(np.prod(shape)) if shape else 1
        if not count:  # no elements: nothing in the block (there may be no block)
            return CoreTensor(tensor.name, tensor.datatype, shape, np.empty(shape, np.object_), dict(tensor.parameters))
        start = tensor.offset
        lengths = block[start:start + 4 * count].view(np.uint32)
        body = block[start + 4 * count:start + tensor.nbytes].tobytes()
        data = np.empty(count, np.object_)
        position = 0
        for index, length in enumerate(lengths.tolist()):
            data[index] = body[position:position + length]
            position += length
        data = data.reshape(shape)
    elif tensor.nbytes:
        data = block[tensor.offset:tensor.offset + tensor.nbytes].view(_dtype(tensor.dtype)).reshape(shape)
    else:
        data = np.empty(shape, _dtype(tensor.dtype))
    return CoreTensor(tensor.name, tensor.datatype, shape, data, dict(tensor.parameters) if tensor.parameters else {})


# -- requests and responses -----------------------------------------------------------------------------------
def request_message(rid: int, request: InferenceRequest, inputs: list[Tensor] | None = None) -> Request:
    """``request`` as it crosses, with ``inputs`` (the inputs already described; by default inline)."""
    if inputs is None:
        inputs = [inline_tensor(t) for t in request.inputs.values()]
    trace_context = request.trace_context
    return Request(rid, request.model_name, request.model_version, request.id, inputs,
                   [Output(o.name, o.parameters or {}) for o in request.outputs], request.parameters or {},
                   request.priority, request.timeout_us, request.streaming, request.arrival_ns,
                   trace_context if type(trace_context) is str else "", request.generation)


def core_request(message: Request, block: np.ndarray | None = None) -> InferenceRequest:
    """The core request ``message`` describes (its inputs read from ``block`` where they lie there)."""
    request = InferenceRequest(message.model_name, {t.name: core_tensor(t, block) for t in message.inputs},
                               model_version=message.model_version, id=message.id,
                               outputs=[RequestedOutput(o.name, dict(o.parameters)) for o in message.outputs],
                               parameters=dict(message.parameters), priority=message.priority,
                               timeout_us=message.timeout_us, generation=message.generation)
    if message.arrival_ns:
        request.arrival_ns = message.arrival_ns
    request.streaming = message.streaming
    if message.trace_context:
        request.trace_context = message.trace_context
    return request


def response_message(response: InferenceResponse, outputs: list[Tensor] | None = None) -> Response:
    """``response`` as it crosses, with ``outputs`` (the outputs already described; by default inline)."""
    if outputs is None:
        outputs = [inline_tensor(t) for t in response.outputs]
    return Response(outputs, response.parameters or {},
                    error_data(response.error) if response.error is not None else None, response.final,
                    response.empty, response.model_name, response.model_version, response.id, response.generation)


def core_response(message: Response, block: np.ndarray | None = None) -> InferenceResponse:
    return InferenceResponse(message.model_name, message.model_version, message.id,
                             [core_tensor(t, block) for t in message.outputs], dict(message.parameters),
                             server_error(message.error) if message.error is not None else None,
                             message.final, message.empty, message.generation)


# -- framing ------------------------------------------------------------------------------------------------
_HEADER = struct.Struct("<I")
_FDS_SPACE = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
_PB_EXT = 1  # a protobuf message: its full name, NUL, its bytes


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
    """``message`` framed: its length, then its MessagePack body."""
    body = _encoder.encode(message)
    return _HEADER.pack(len(body)) + body


def send_frames(sock: socket.socket, data: bytes | memoryview, fd: int) -> int:
    """Send ``data`` (whole frames) with ``fd`` riding on its first byte; the bytes sent (the rest is the caller's
    to send, without the descriptor)."""
    return socket.send_fds(sock, [data], [fd])


class FrameReader:
    """Splits what a stream delivers into messages of type ``kind``; ``receive`` also keeps the descriptors that
    arrive with them (each message that has one takes it, in order, with ``take_fd``).

    ``receive`` reads into one buffer kept for the reader's life: a fresh buffer per read (what ``socket.recv``
    makes) of this size would cost an allocation, and page faults, on every message."""

    def __init__(self, kind: Any, size: int = 1 << 18) -> None:
        self._decoder = msgspec.msgpack.Decoder(kind, ext_hook=_ext_hook)
        self._size = size
        self._input: bytearray | None = None
        self._buffer = bytearray()  # the start of a frame that has not fully arrived
        self.fds: deque[int] = deque()  # received, not yet taken by a message

    def receive(self, sock: socket.socket) -> list | None:
        """Read once from ``sock``: the complete messages now available, or None at the end of the stream."""
        if self._input is None:
            self._input = bytearray(self._size)
        with memoryview(self._input) as view:
            count, ancillary, _flags, _address = sock.recvmsg_into([view], _FDS_SPACE)
            for level, kind, data in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
                    self.fds.extend(fds)
            if not count:
                return None
            return self.feed(view[:count])

    def feed(self, data: bytes | memoryview) -> list:
        """The messages completed by ``data`` (the bytes that follow those fed before)."""
        buffer = self._buffer
        if not buffer:  # the usual case: whole frames, nothing left over
            messages, used = self._split(data)
            if used < len(data):
                buffer += data[used:]
            return messages
        buffer += data
        messages, used = self._split(buffer)
        del buffer[:used]
        return messages

    def _split(self, data: bytes | bytearray | memoryview) -> tuple[list, int]:
        messages, position, total = [], 0, len(data)
        with memoryview(data) as view:
            while total - position >= 4:
                (length,) = _HEADER.unpack_from(view, position)
                end = position + 4 + length
                if end > total:
                    break
                messages.append(self._decoder.decode(view[position + 4:end]))
                position = end
        return messages, position

    def take_fd(self) -> int:
        return self.fds.popleft()

    def close(self) -> None:
        while self.fds:
            os.close(self.fds.popleft())


__all__ = [
    "ALIGN",
    "INLINE",
    "MAX_FDS",
    "Cancel",
    "Error",
    "FrameReader",
    "Layout",
    "Output",
    "Payload",
    "Release",
    "Request",
    "Response",
    "Tensor",
    "aligned",
    "copy_into",
    "core_request",
    "core_response",
    "core_tensor",
    "data_bytes",
    "error_data",
    "frame",
    "inline_tensor",
    "layout",
    "request_message",
    "response_message",
    "send_frames",
    "server_error",
]
