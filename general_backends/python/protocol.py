"""The messages between the server and a model process: the envelopes of this link around the structs every
process link shares (:mod:`tideserve.wire`: requests, responses, tensors, errors, framing).

A message's tensors lie in shared memory (:mod:`tideserve.arena`) from ``SHARED_MEMORY_MIN_BYTES`` in all, each
described by its offset in the message's block and the message's ``Payload``; smaller ones travel inline. A file
descriptor that travels with a message (a block of its own, a metrics page) rides on the first byte of its frame
(``SCM_RIGHTS``).
"""

from __future__ import annotations

import msgspec
from tideserve.backend_api import wire


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
    requests: list[wire.Request]
    payload: wire.Payload | None


class CallResponse(msgspec.Struct, tag=True, array_like=True):
    """A response to a BLS call of the model."""

    call: int
    response: wire.Response
    payload: wire.Payload | None


class ControlResult(msgspec.Struct, tag=True, array_like=True):
    call: int
    ready: bool = False
    error: wire.Error | None = None


class Finalize(msgspec.Struct, tag=True, array_like=True):
    call: int


# --frontend-direct (general_backends/python/direct.py): each answered by a Reply; DirectStats and DirectDrain carry
# the process's counters of direct requests in ``config`` (msgpack of ``ModelStats.export()``)
class OpenDirect(msgspec.Struct, tag=True, array_like=True):
    """Listen for frontend workers' direct links on the Unix socket ``path``."""

    call: int
    path: str


class DirectStats(msgspec.Struct, tag=True, array_like=True):
    call: int


class DirectDrain(msgspec.Struct, tag=True, array_like=True):
    """Take no new direct request; answer once those in flight are done (or ``timeout_s`` passed)."""

    call: int
    timeout_s: float


# -- model process -> server ------------------------------------------------------------------------------
class Reply(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """The end of AutoComplete (with the completed configuration), CreateInstance or Finalize."""

    call: int
    error: wire.Error | None = None
    config: bytes = b""


class Answer(msgspec.Struct, array_like=True):
    rid: int
    response: wire.Response


class Respond(msgspec.Struct, tag=True, array_like=True):
    """Responses to requests of the process: one, or all that a batch's execute returned (their tensors
    in one block)."""

    answers: list[Answer]
    payload: wire.Payload | None


class Executed(msgspec.Struct, tag=True, array_like=True):
    """The end of a batch; ``rescheduled``: the requests (by id) the model released to run again."""

    batch: int
    rescheduled: list[int] = []


class Call(msgspec.Struct, tag=True, array_like=True):
    """A BLS call: ``unary`` for ``exec()`` / ``async_exec()``, a stream for ``decoupled=True``."""

    call: int
    request: wire.Request
    payload: wire.Payload | None
    unary: bool
    # The instance's thread waits on the call in a batch that frontend workers sent straight to it: the core, which
    # did not send that batch, holds back its own work for the instance until the call ends (a recursive BLS
    # would otherwise wait behind the very batch that waits for it)
    holds: bool = False


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


ToProcess = (AutoComplete | CreateInstance | Execute | wire.Cancel | CallResponse | ControlResult | Finalize
             | wire.Release | OpenDirect | DirectStats | DirectDrain)
ToServer = (Reply | Respond | Executed | Call | CancelCall | LoadModel | UnloadModel | ModelReady | Log | Series
            | Exiting | wire.Release)

