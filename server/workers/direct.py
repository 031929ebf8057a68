"""``--frontend-direct on``: a frontend worker sends an eligible request straight to an instance process of its
Python model, and reads its responses straight back, so the core's event loop never sees it.

The core publishes, in the snapshot it pushes, the address of a Unix socket that each instance process of an
eligible model listens on (``Snapshot.direct``, by runtime uid; see ``FrontendWorkers.direct_addresses``). A
worker keeps one link per address, opened at first use; each request goes to the instance with the fewest of
this worker's requests in flight (round robin among equals; the requests of one loop turn for a model go to one
instance, so that they leave in one :class:`DirectSubmit` and can run as one batch; with a dynamic batcher, to the
first instance whose batcher holds less than a full batch, as its shared queue word says: see
:meth:`DirectRouter._pick`), its responses come back as
:class:`DirectAnswer`, those of one loop turn there in one :class:`DirectAnswers`; a stream closed early sends
``wire.Cancel``. In the process the requests meet a scheduler of
their own (``general_backends/python/direct.py``). Everything else goes through the core as before: a request
that is not eligible, one the worker's validation refuses (the core answers it, and counts it, exactly as it
always does), one whose link cannot be opened, and one the process hands back (``retry``: it is draining for an
unload).

Eligible: plain inference (no shared-memory inputs or outputs, no sequence parameters, no priority, no timeout,
not a typed generation request) to a model the core publishes addresses for.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import mmap
import os
import struct
import time
from typing import TYPE_CHECKING

import msgspec

from .. import wire
from ..errors import InternalError, ServerError, Unsupported
from ..loops import running_loop
from ..shared_memory import REGION
from ..types import InferenceRequest, InferenceResponse
from ..validation import RequestValidator
from .protocol import PendingResponses

if TYPE_CHECKING:
    from .remote import RemoteDataPlane, RemoteRuntime

log = logging.getLogger(__name__)

SEQUENCE_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end")

# Beside each instance's socket, ``<socket>.queue``: the requests its dynamic batcher holds (queued, not yet in a
# batch), one native 8-byte integer the instance process writes and the workers read when they pick an instance.
DIRECT_QUEUE_SUFFIX = ".queue"
DIRECT_QUEUE_WORD = struct.Struct("q")
DIRECT_EXECUTING = 1 << 32  # added to the word while the instance runs a batch
# added while the instance's batches run short (their running mean under DIRECT_SHORT_RUN_US): a request sent to it
# while it runs one, for no longer than that, waits less for its end than another instance process takes to wake
# up, form a batch and run it
DIRECT_SHORT_RUNS = 1 << 33
DIRECT_QUEUED_MASK = DIRECT_EXECUTING - 1
DIRECT_SHORT_RUN_US = float(os.environ.get("TIDESERVE_DIRECT_SHORT_RUN_US", "500"))
# while it runs a batch, the word's bits from 34 on (29 bits, so that the word stays positive) hold when the run
# started: CLOCK_MONOTONIC in units of 1,024 ns, modulo 2**29 (about 9 minutes), the clock every process shares
DIRECT_RUN_SHIFT = 34
DIRECT_RUN_UNIT_SHIFT = 10
DIRECT_RUN_MASK = (1 << 29) - 1


def direct_run_stamp(now_ns: int) -> int:
    """``now_ns`` as the word holds a run's start."""
    return (now_ns >> DIRECT_RUN_UNIT_SHIFT) & DIRECT_RUN_MASK


_SHORT_RUN_UNITS = int(DIRECT_SHORT_RUN_US * 1000) >> DIRECT_RUN_UNIT_SHIFT


# -- the link's messages (worker <-> instance process) -----------------------------------------------------
class DirectJson(msgspec.Struct, tag=True, array_like=True):
    """A KServe v2 HTTP infer body as it came (``header_length`` -1: no Inference-Header-Content-Length), for the
    instance process to decode within the worker's limits, and answer with the HTTP body."""

    rid: int
    model_name: str
    model_version: str
    body: bytes
    header_length: int
    arrival_ns: int
    max_json_depth: int
    max_rank: int
    max_elements: int


class DirectSubmit(msgspec.Struct, tag=True, array_like=True):
    """Requests to run (tensors inline) and HTTP bodies to decode and run: those a worker's loop turn sends to one
    instance process, in one message."""

    requests: list[wire.Request]
    bodies: list[DirectJson] = []


class DirectAnswer(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """One response of request ``rid``. ``rejected``: refused before it was scheduled (the queue is full: what
    ``DataPlane.infer`` raises); ``retry``: not taken (the instance is draining): send it through the core."""

    rid: int
    response: wire.Response
    rejected: bool = False
    retry: bool = False
    body: bytes | None = None  # a DirectJson's answer: the HTTP body (``response`` then carries nothing)
    json_length: int = -1  # the body's JSON length where binary outputs follow it


class DirectAnswers(msgspec.Struct, tag=True, array_like=True):
    """The responses one loop turn of the instance process sends to a worker (a batch's), in one message."""

    answers: list[DirectAnswer]


DirectToProcess = DirectSubmit | wire.Cancel
DirectToWorker = DirectAnswer | DirectAnswers


def plain_inference(request: InferenceRequest) -> bool:
    """No sequence parameters and no shared-memory input or output: what the direct path takes (with the caller's
    other conditions)."""
    parameters = request.parameters
    if parameters and any(name in parameters for name in SEQUENCE_PARAMETERS):
        return False
    for tensor in request.inputs.values():
        if tensor.parameters and REGION in tensor.parameters:
            return False
    for output in request.outputs:
        if output.parameters and REGION in output.parameters:
            return False
    return True


class BodyDecoder:
    """An instance process's side of :class:`DirectJson`: an HTTP infer body decoded and validated as the worker's
    HTTP frontend would (its codec, the model's validation), and the answer's HTTP body written as it would write it.
    A body it does not take whole (an error the frontend words and the core counts, a parameter the direct path
    leaves to the core, shared memory, classification, a model whose inputs reshape) is left to the worker."""

    def __init__(self, config) -> None:
        reshapes = any(t.HasField("reshape") for t in config.input)
        self.validator = None if reshapes else RequestValidator(config)
        self._limits: dict[tuple[int, int], object] = {}

    def request(self, message: DirectJson):
        """(the request, how its answer is written), or None: left to the worker."""
        from ..http import codec
        from ..limits import TensorLimits

        if self.validator is None:
            return None
        key = (message.max_rank, message.max_elements)
        limits = self._limits.get(key)
        if limits is None:
            limits = self._limits[key] = TensorLimits(*key)
        try:
            decoded = codec.decode_request(message.model_name, message.model_version, message.body,
                                           None if message.header_length < 0 else message.header_length, limits,
                                           message.max_json_depth)
        except Exception:  # noqa: BLE001 - the worker decodes it again and answers in its words
            return None
        request = decoded.request
        if decoded.classify or request.priority or request.timeout_us or not plain_inference(request):
            return None
        try:
            self.validator.validate(request)
        except ServerError:
            return None
        request.arrival_ns = message.arrival_ns
        request.streaming = False
        return request, codec.DecodedRequest(None, decoded.binary_output, decoded.outputs, False)

    @staticmethod
    def answer(rid: int, response: InferenceResponse, encoding, model_name: str) -> DirectAnswer:
        """The answer to a body: the HTTP body the frontend would write for ``response`` (its model's version set),
        or the error it would answer (the model sent no response; an output it cannot write)."""
        from ..http import codec

        if response.error is not None:
            return DirectAnswer(rid, wire.response_message(response))
        if response.empty:
            error = Unsupported(f"model '{model_name}' sent no response to the request")
            return DirectAnswer(rid, wire.Response(error=wire.error_data(error)))
        try:
            body, json_length = codec.encode_response(response, encoding, None)
        except ServerError as exc:
            return DirectAnswer(rid, wire.Response(error=wire.error_data(exc)))
        except Exception as exc:  # noqa: BLE001 - as the frontend answers a bug: an internal error
            log.exception("model '%s': an HTTP answer could not be written", model_name)
            error = InternalError(f"internal error: {type(exc).__name__}: {exc}")
            return DirectAnswer(rid, wire.Response(error=wire.error_data(error)))
        return DirectAnswer(rid, wire.Response(final=True), body=body,
                            json_length=-1 if json_length is None else json_length)


_RETRY = object()


# -- the worker's side ---------------------------------------------------------------------------------------
class DirectStream(PendingResponses):
    """The responses of one request sent straight to an instance process; closing it early cancels it there.
    Before its first response it may turn into a stream through the core (``_fallback``)."""

    def __init__(self, router: DirectRouter, link: DirectLink, rid: int, request: InferenceRequest,
                 runtime: RemoteRuntime, unary: bool) -> None:
        self._router = router
        self._link = link
        self.rid = rid
        self.request = request
        self.runtime = runtime
        self._unary = unary
        self._pending: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._done = False
        self._fallback = None  # a RemoteInferenceStream through the core

    def __aiter__(self) -> DirectStream:
        return self

    async def __anext__(self) -> InferenceResponse:
        if self._fallback is not None:
            return await self._fallback.__anext__()
        if self._done:
            raise StopAsyncIteration
        if not self._pending:
            await self._wait()
        item = self._pending.popleft()
        if item is _RETRY:  # the process did not take it: the core does
            self._finish()
            self._fallback = self._router.plane._submit(self.request, self._unary)
            return await self._fallback.__anext__()
        if isinstance(item, BaseException):  # refused before it was scheduled
            self._finish()
            raise item
        item.model_version = str(self.runtime.version)
        if item.final:
            self._finish()
        return item

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._link.forget(self.rid)

    def cancel(self) -> None:
        if self._fallback is not None:
            self._fallback.cancel()
            return
        if self._done:
            return
        self._finish()
        self.request.cancellation.cancel()
        self._link.send(wire.Cancel(self.rid))

    async def aclose(self) -> None:
        self.cancel()


class DirectJsonStream(PendingResponses):
    """The answer to one HTTP body sent straight to an instance process (:class:`DirectJson`)."""

    def __init__(self, link: DirectLink, rid: int) -> None:
        self._link = link
        self.rid = rid
        self._pending: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._done = False

    async def result(self) -> tuple[bytes, int | None] | None:
        if not self._pending:
            await self._wait()
        item = self._pending.popleft()
        self._finish()
        if type(item) is tuple:
            return item
        if item is _RETRY:  # not taken there: decoded here
            return None
        if isinstance(item, BaseException):  # refused before it was scheduled
            raise item
        if item.error is not None:  # the model's error, or the process's end
            raise item.error
        raise InternalError(f"the model's process answered request {self.rid} without a body")

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._link.forget(self.rid)

    def cancel(self) -> None:
        if self._done:
            return
        self._finish()
        self._link.send(wire.Cancel(self.rid))


class DirectLink(asyncio.Protocol):
    """The worker's link to one instance process."""

    def __init__(self, router: DirectRouter, address: str) -> None:
        self.router = router
        self.address = address
        self.transport: asyncio.Transport | None = None
        self.reader = wire.FrameReader(DirectToWorker)
        self.streams: dict[int, DirectStream | DirectJsonStream] = {}
        self.submits: list[wire.Request] = []  # requests to send (at the end of this loop turn, or once connected)
        self.bodies: list[DirectJson] = []  # HTTP bodies to send with them
        self.waiting: list[bytes] = []  # other frames to write after them (cancellations)
        self.state = "new"  # new -> connecting -> up -> down
        self._flush_scheduled = False
        self.queue = _open_queue(address)  # the instance's queued requests (None: it does not say)

    def queued(self) -> int:
        """The requests the instance's batcher holds now (as of its last write), plus :data:`DIRECT_EXECUTING` while
        it runs a batch (with the run's start, :data:`DIRECT_RUN_SHIFT`) and :data:`DIRECT_SHORT_RUNS` while its
        batches run short; -1 where it does not say."""
        queue = self.queue
        return DIRECT_QUEUE_WORD.unpack_from(queue)[0] if queue is not None else -1

    def connect(self) -> None:
        self.state = "connecting"
        loop = asyncio.get_running_loop()
        task = loop.create_task(loop.create_unix_connection(lambda: self, self.address))
        task.add_done_callback(self._connected)

    def _connected(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is not None:
            if not task.cancelled():
                log.debug("direct link to %s: %s", self.address, task.exception())
            self.state = "down"
            self.router.links.pop(self.address, None)
            for stream in list(self.streams.values()):  # never sent: the core takes them
                stream._put(_RETRY)
            self.streams.clear()
            self.submits.clear()
            self.bodies.clear()
            self.waiting.clear()

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.state = "up"
        self._flush()

    def connection_lost(self, exc) -> None:
        self.state = "down"
        self.transport = None
        if self.router.links.get(self.address) is self:
            del self.router.links[self.address]
        streams = list(self.streams.values())
        self.streams.clear()
        if streams:
            asyncio.get_running_loop().create_task(self.router.fail(self.address, streams))

    def data_received(self, data: bytes) -> None:
        streams = self.streams
        for message in self.reader.feed(data):
            for answer in message.answers if type(message) is DirectAnswers else (message,):
                stream = streams.get(answer.rid)
                if stream is None:
                    continue
                if answer.body is not None:
                    stream._put((answer.body, None if answer.json_length < 0 else answer.json_length))
                elif answer.retry:
                    stream._put(_RETRY)
                elif answer.rejected:
                    stream._put(wire.server_error(answer.response.error))
                else:
                    stream._put(wire.core_response(answer.response))

    def submit(self, request: wire.Request) -> None:
        """Queue ``request``: the requests of one turn of the event loop leave in one message."""
        self.submits.append(request)
        self._schedule()

    def submit_body(self, body: DirectJson) -> None:
        """Queue an HTTP body: it leaves with the turn's requests."""
        self.bodies.append(body)
        self._schedule()

    def send(self, message) -> None:
        """Queue ``message`` (a cancellation): it leaves with this turn's write."""
        if self.state == "down":
            return
        self.waiting.append(wire.frame(message))
        self._schedule()

    def _schedule(self) -> None:
        if self.state == "up" and not self._flush_scheduled:
            self._flush_scheduled = True
            running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self.state != "up":
            return
        submits, bodies, waiting = self.submits, self.bodies, self.waiting
        if submits or bodies:  # before the cancellations: a request cancelled in the turn it was sent arrives first
            waiting.insert(0, wire.frame(DirectSubmit(submits, bodies) if bodies else DirectSubmit(submits)))
            self.submits = []
            if bodies:
                self.bodies = []
        if waiting:
            self.transport.write(waiting[0] if len(waiting) == 1 else b"".join(waiting))
            waiting.clear()

    def forget(self, rid: int) -> None:
        self.streams.pop(rid, None)


def _open_queue(address: str) -> mmap.mmap | None:
    try:
        fd = os.open(address + DIRECT_QUEUE_SUFFIX, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return mmap.mmap(fd, DIRECT_QUEUE_WORD.size, prot=mmap.PROT_READ)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


class DirectRouter:
    """Picks, per request, whether it goes straight to an instance process, and which."""

    def __init__(self, plane: RemoteDataPlane, workers: int = 1) -> None:
        self.plane = plane
        self.workers = max(1, workers)  # the frontend workers that share the instances (each routes on its own)
        self.links: dict[str, DirectLink] = {}
        self._ids = itertools.count(1)
        self._turn = 0
        self._turns: dict[int, tuple[DirectLink, int]] = {}  # this loop turn's pick per runtime uid, and its count
        self._validators: dict[int, RequestValidator | None] = {}  # by runtime uid (None: reshapes, not taken)

    def _validator(self, runtime: RemoteRuntime) -> RequestValidator | None:
        uid = runtime.uid
        try:
            return self._validators[uid]
        except KeyError:
            pass
        if len(self._validators) > 256:
            self._validators.clear()
        config = runtime.config
        # validation reshapes such inputs in place: the request could no longer go through the core as it came
        reshapes = any(t.HasField("reshape") for t in config.input)
        validator = self._validators[uid] = None if reshapes else RequestValidator(config)
        return validator

    def route(self, request: InferenceRequest, unary: bool) -> DirectStream | None:
        """A stream straight to an instance process, or None: the request goes through the core."""
        snapshot = self.plane.link.snapshot
        if not snapshot.direct or request.generation is not None or request.priority or request.timeout_us:
            return None
        try:
            runtime = self.plane.model(request.model_name, request.model_version)
        except ServerError:
            return None  # the core answers it
        addresses = snapshot.direct.get(runtime.uid)
        if not addresses:
            return None
        if not plain_inference(request):
            return None
        validator = self._validator(runtime)
        if validator is None:
            return None
        try:
            validator.validate(request)
        except ServerError:
            return None  # the core refuses it with the same error, and counts it
        link = self._pick(addresses, runtime)
        rid = next(self._ids)
        stream = DirectStream(self, link, rid, request, runtime, unary)
        link.streams[rid] = stream
        link.submit(wire.request_message(rid, request))
        return stream

    def route_json(self, model_name: str, model_version: str, body: bytes, header_length: int | None, limits,
                   max_json_depth: int) -> DirectJsonStream | None:
        """An HTTP infer body straight to an instance process of its model, to decode and run there, or None (the
        frontend decodes it): a model the core publishes no addresses for, a decoupled one, one whose inputs
        reshape, or one that needs the frontend's own steps (classification labels are the frontend's; the
        process hands such a body back)."""
        snapshot = self.plane.link.snapshot
        if not snapshot.direct:
            return None
        try:
            runtime = self.plane.model(model_name, model_version)
        except ServerError:
            return None
        addresses = snapshot.direct.get(runtime.uid)
        if not addresses or runtime.config.model_transaction_policy.decoupled or self._validator(runtime) is None:
            return None
        link = self._pick(addresses, runtime)
        rid = next(self._ids)
        stream = DirectJsonStream(link, rid)
        link.streams[rid] = stream
        link.submit_body(DirectJson(rid, model_name, model_version, body, -1 if header_length is None else header_length,
                                    time.monotonic_ns(), max_json_depth, limits.max_rank, limits.max_elements))
        return stream

    def _pick(self, addresses: list[str], runtime: RemoteRuntime) -> DirectLink:
        """The link for one request. The requests of one loop turn for a model go to one instance process, up to
        its ``max_batch_size`` (what a turn sends leaves in one write and can run as one batch there, as the
        requests one queue holds would). For a model with a dynamic batcher, the next turn's go to the first
        instance, in the snapshot's order (the same in every worker), that runs no batch, or runs short ones
        (:data:`DIRECT_SHORT_RUNS`), and whose batcher holds fewer queued requests than a full batch (its queue word,
        :meth:`DirectLink.queued`; an instance that does not say: where this worker has fewer requests in flight
        than its share of a full batch, ``max_batch_size`` / the workers): the requests of all workers meet there
        and run as one batch, as they would in one queue, instead of as one small batch per worker and instance;
        an instance that is free takes the next batch while another runs a long one, as from one queue, and one
        whose batches run short collects the next batch behind the run, until a full one waits or the run has gone
        on for longer than short (the wait is shorter than another process's wake-up and batch). Where every
        instance runs a batch, to the first that holds less than a full one behind it. Otherwise, and once every
        instance holds a full batch, to the instance with the fewest of this worker's requests in flight (round
        robin among equals)."""
        limit = self._batch_limit(runtime)
        turn = self._turns.get(runtime.uid)
        if turn is not None:
            link, count = turn
            if count < limit and link.state != "down":
                self._turns[runtime.uid] = (link, count + 1)
                return link
        links = self.links
        best = None
        if limit > 1 and runtime.config.HasField("dynamic_batching"):
            share = -(-limit // self.workers)
            busy = None  # the first instance that runs a batch and holds less than a full one behind it
            for address in addresses:
                link = links.get(address)
                if link is None:
                    best = address
                    break
                word = link.queued()
                if word < 0:
                    if len(link.streams) < share:
                        best = address
                        break
                elif word & DIRECT_QUEUED_MASK < limit:
                    if not word & DIRECT_EXECUTING or (
                            word & DIRECT_SHORT_RUNS
                            and (direct_run_stamp(time.monotonic_ns()) - (word >> DIRECT_RUN_SHIFT)) & DIRECT_RUN_MASK
                            < _SHORT_RUN_UNITS):
                        best = address
                        break
                    if busy is None:
                        busy = address
            else:
                best = busy
        if best is None:
            best_load = None
            count = len(addresses)
            start = self._turn = (self._turn + 1) % count
            for i in range(count):
                address = addresses[(start + i) % count]
                link = links.get(address)
                load = len(link.streams) if link is not None else 0
                if best_load is None or load < best_load:
                    best, best_load = address, load
                    if load == 0:
                        break
        link = links.get(best)
        if link is None:
            link = links[best] = DirectLink(self, best)
            link.connect()
        if not self._turns:
            running_loop().call_soon(self._turns.clear)
        self._turns[runtime.uid] = (link, 1)
        return link

    @staticmethod
    def _batch_limit(runtime: RemoteRuntime) -> int:
        size = runtime.config.max_batch_size
        return size if size > 0 else 1

    def abort_all(self, error: ServerError) -> None:
        """Answer every request in flight in a model's process with ``error`` (the server is stopping and its exit
        timeout ran out); the processes hear that they are cancelled."""
        for link in list(self.links.values()):
            for stream in list(link.streams.values()):
                request = getattr(stream, "request", None)  # (an HTTP body's stream has none here)
                if request is not None:
                    request.cancellation.cancel()
                link.send(wire.Cancel(stream.rid))
                stream._put(InferenceResponse(error=error, final=True))

    async def fail(self, address: str, streams: list[DirectStream]) -> None:
        """The process at ``address`` went away with ``streams`` in flight: each ends with the error the core
        gives requests in flight in a process that died (it counts them)."""
        from . import protocol as p

        try:
            text = await self.plane.link.call(p.DirectFailure(0, address, len(streams)))
        except Exception:  # noqa: BLE001 - the core is gone too
            text = "the model's process exited"
        error = InternalError(text)
        for stream in streams:
            stream._put(InferenceResponse(error=error, final=True))
