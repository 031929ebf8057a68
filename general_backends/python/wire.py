"""The messages between the server and a model process, and their framing on the socket.

Messages are msgspec structs encoded as MessagePack, each frame a 4-byte little-endian length and the
body. They carry metadata only: tensor bytes lie in shared memory (:mod:`.shm`), described by
``TensorRef`` entries and the message's ``Payload``. A file descriptor that travels with a message
(a block of its own, a metrics page) rides on the first byte of its frame (``SCM_RIGHTS``).
"""

from __future__ import annotations

import array
import os
import socket
import struct
from collections import deque
from typing import Any

import msgspec

from tideserve.backend_api import ServerError, Status, as_server_error, error_of_status

MAX_FDS = 8  # descriptors one frame may carry


# -- parts ------------------------------------------------------------------------------------------------
class TensorRef(msgspec.Struct, array_like=True, omit_defaults=True):
    name: str
    datatype: str  # the tensor's datatype (FP32, BYTES...)
    dtype: str  # numpy's dtype string; "|O" for BYTES: uint32 lengths, then the elements
    shape: tuple[int, ...]
    offset: int  # in the message's block
    nbytes: int
    parameters: dict[str, Any] = {}


class Payload(msgspec.Struct, array_like=True):
    """Where a message's tensors lie: a block of the sender's arena, or (offset -1) a file of its own."""

    offset: int
    size: int


class Error(msgspec.Struct, array_like=True):
    status: str  # tideserve.errors.Status value
    message: str




def error_of(error: BaseException | None) -> Error | None:
    if error is None:
        return None
    error = as_server_error(error)
    return Error(error.status.value, error.message)


def server_error(error: Error) -> ServerError:
    """The server error an ``Error`` describes, of the class its status has (ALREADY_EXISTS: the base class)."""
    status = Status(error.status)
    return error_of_status(status, error.message)


class OutputRef(msgspec.Struct, array_like=True, omit_defaults=True):
    name: str
    parameters: dict[str, Any] = {}


class Request(msgspec.Struct, array_like=True, omit_defaults=True):
    """An inference request: one of an execute batch, or a BLS call of the model."""

    rid: int
    model_name: str
    model_version: str
    id: str
    inputs: list[TensorRef]
    outputs: list[OutputRef]
    parameters: dict[str, Any]
    priority: int = 0
    timeout_us: int = 0
    streaming: bool = True


class Response(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[TensorRef] = []
    parameters: dict[str, Any] = {}
    error: Error | None = None
    final: bool = True
    empty: bool = False


class ModelSpec(msgspec.Struct, array_like=True):
    name: str
    version: int
    model_path: str
    config: bytes  # a serialized ModelConfig


class InstanceSpec(msgspec.Struct, array_like=True):
    name: str
    kind: str
    device_id: int
    index: int
    group_name: str


class ProcessSpec(msgspec.Struct, array_like=True):
    """What a new model process is told when it starts (with its socket and both arenas' files)."""

    label: str  # for its threads and files: <model>_<version> or the instance name
    request_arena: int  # bytes of the arena the server writes requests into
    response_arena: int  # bytes of the arena the process writes responses into
    log_level: int


# -- server -> model process ------------------------------------------------------------------------------
class AutoComplete(msgspec.Struct, tag=True, array_like=True):
    call: int
    model: ModelSpec


class CreateInstance(msgspec.Struct, tag=True, array_like=True):
    call: int
    model: ModelSpec  # with the final configuration
    instance: InstanceSpec


class Execute(msgspec.Struct, tag=True, array_like=True):
    batch: int
    requests: list[Request]
    payload: Payload | None


class Cancel(msgspec.Struct, tag=True, array_like=True):
    rid: int


class CallResponse(msgspec.Struct, tag=True, array_like=True):
    """A response to a BLS call of the model."""

    call: int
    response: Response
    payload: Payload | None


class ControlResult(msgspec.Struct, tag=True, array_like=True):
    call: int
    ready: bool = False
    error: Error | None = None


class Finalize(msgspec.Struct, tag=True, array_like=True):
    call: int


class Release(msgspec.Struct, tag=True, array_like=True):
    """Blocks of the receiver's arena that the sender no longer reads (both directions)."""

    offsets: list[int]


# -- model process -> server ------------------------------------------------------------------------------
class Reply(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """The end of AutoComplete (with the completed configuration), CreateInstance or Finalize."""

    call: int
    error: Error | None = None
    config: bytes = b""


class Answer(msgspec.Struct, array_like=True):
    rid: int
    response: Response


class Respond(msgspec.Struct, tag=True, array_like=True):
    """Responses to requests of the process: one, or all that a batch's execute returned (their tensors
    in one block)."""

    answers: list[Answer]
    payload: Payload | None


class Executed(msgspec.Struct, tag=True, array_like=True):
    """The end of a batch; ``rescheduled``: the requests (by id) the model released to run again."""

    batch: int
    rescheduled: list[int] = []


class Call(msgspec.Struct, tag=True, array_like=True):
    """A BLS call: ``unary`` for ``exec()`` / ``async_exec()``, a stream for ``decoupled=True``."""

    call: int
    request: Request
    payload: Payload | None
    unary: bool


class CancelCall(msgspec.Struct, tag=True, array_like=True):
    call: int
    # True: only flag the called model's request as cancelled (a BLS iterator's cancel()); its responses
    # keep coming until its final one. False: drop the call (a timeout, the model's end)
    request_only: bool = False


class LoadModel(msgspec.Struct, tag=True, array_like=True):
    call: int
    name: str
    config: str


class UnloadModel(msgspec.Struct, tag=True, array_like=True):
    call: int
    name: str
    unload_dependents: bool


class ModelReady(msgspec.Struct, tag=True, array_like=True):
    call: int
    name: str
    version: str


class Log(msgspec.Struct, tag=True, array_like=True):
    """One log record of the model process, for the server's log."""

    name: str
    level: int
    message: str
    pathname: str
    lineno: int
    func: str
    created: float
    thread_name: str
    exc_text: str


class Series(msgspec.Struct, tag=True, array_like=True):
    """A custom metric series whose values the process keeps in a shared page (``cells`` doubles at
    ``offset``); a page the server has not seen yet comes with the message."""

    family: str
    description: str
    kind: int
    labels: dict[str, str]
    buckets: list[float] | None
    page: int
    page_size: int
    offset: int
    cells: int


class Exiting(msgspec.Struct, tag=True, array_like=True):
    """The process is about to exit on its own (the model called ``sys.exit``); why."""

    reason: str


ToProcess = AutoComplete | CreateInstance | Execute | Cancel | CallResponse | ControlResult | Finalize | Release
ToServer = (Reply | Respond | Executed | Call | CancelCall | LoadModel | UnloadModel | ModelReady | Log | Series
            | Exiting | Release)

_HEADER = struct.Struct("<I")
_FDS_SPACE = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
_encoder = msgspec.msgpack.Encoder()


def frame(message: msgspec.Struct) -> bytes:
    body = _encoder.encode(message)
    return _HEADER.pack(len(body)) + body


class FrameReader:
    """Splits what a socket delivers into messages, pairing each descriptor with its frame's message.

    Reads into one buffer kept for the reader's life: a fresh buffer per read (what ``socket.recv`` makes)
    of this size would cost an allocation, and page faults, on every message."""

    def __init__(self, kind: Any, size: int = 1 << 18) -> None:
        self._decoder = msgspec.msgpack.Decoder(kind)
        self._input = bytearray(size)
        self._buffer = bytearray()  # the start of a frame that has not fully arrived
        self.fds: deque[int] = deque()  # received, not yet taken by a message

    def receive(self, sock: socket.socket) -> list | None:
        """Read once from ``sock``: the complete messages now available, or None at the end of the stream."""
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
