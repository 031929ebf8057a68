"""The ASGI plumbing the HTTP frontends share: KServe v2 (infer and control), generate, and OpenAI.

* Sending a whole answer (:func:`send_response`) and the KServe error answer ``{"error": "<message>"}``
  (:func:`error_body`, :func:`send_error`); OpenAI's error shape is :mod:`tideserve.openai.errors`.
* :class:`ClientGone`: the client left (before its body arrived, or while its request ran); nobody is
  left to answer, so a handler that catches it just returns.
* :class:`cancel_on_disconnect`: ``with cancel_on_disconnect(receive):`` cancels the block when the
  client disconnects and ends it with :class:`ClientGone`; the block's own cleanup (closing an
  InferenceStream, which cancels the request and lets an engine abort it) runs as the cancellation
  passes. The task's cancellation count is kept as :func:`asyncio.timeout` keeps it, so a cancellation
  from elsewhere (server shutdown) stays a ``CancelledError``.

Request bodies are read by one reader, :class:`tideserve.http.body.BodyReader` (size limit, streamed
decompression, JSON depth). This module imports nothing of the frontends, so each of them can use it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import struct
import time

import orjson

from .errors import DeadlinePassed

log = logging.getLogger(__name__)

JSON_HEADER = (b"content-type", b"application/json")


class ClientGone(Exception):
    """The client disconnected: before its request body arrived, or while its request ran (cancelled)."""


def error_body(message: str) -> bytes:
    """A KServe v2 error answer's body."""
    return orjson.dumps({"error": message})


RECEIVED_NS = "tideserve.received_ns"
"""The scope key of when the server began to parse the request (``time.monotonic_ns``, set by the HTTP protocol):
a queue deadline counts from there, not from when a busy event loop got to the request's handler."""

CONNECTION_SOCKET = "tideserve.socket"
"""The scope key of the request's connection socket (set by the HTTP protocol where :data:`KERNEL_ARRIVAL` holds),
for :func:`received_ns` to ask the kernel when the request's bytes arrived; taken out of the scope at that first
question."""


def _tick_ns() -> int:
    """One kernel tick (jiffy) in ns: the resolution of ``CLOCK_MONOTONIC_COARSE``, which the tick advances; 0 where
    not known (not Linux)."""
    try:
        return round(time.clock_getres(6) * 1e9)  # CLOCK_MONOTONIC_COARSE (Linux), not named by the time module
    except (OSError, ValueError):
        return 0


_TCP_INFO = getattr(socket, "TCP_INFO", None)
_LAST_DATA_RECV = 52  # struct tcp_info (Linux): tcpi_last_data_recv, a __u32 of ms since the last data segment
_TICK_NS = _tick_ns()
# what a ms count of whole ticks may exceed the time since the data came by: one tick, as the kernel counts it in
# whole ticks, and one ms more where a tick is no whole number of ms (the count rounded)
_TICK_SLACK_NS = _TICK_NS + (0 if _TICK_NS % 1_000_000 == 0 else 1_000_000)
KERNEL_ARRIVAL = (_TCP_INFO is not None and 0 < _TICK_NS <= 20_000_000
                  and os.environ.get("TIDESERVE_KERNEL_ARRIVAL", "1") != "0")
"""Whether :func:`received_ns` asks the kernel when a request's bytes arrived (Linux TCP; ``TIDESERVE_KERNEL_ARRIVAL=0``:
not, the deadline then counts from the parser's first byte alone)."""


_COARSE = 6  # CLOCK_MONOTONIC_COARSE (Linux): the time of the kernel's last tick, as its timekeeping counted it
_PHASE_DRIFT = 2_000  # a bound on how fast the coarse clock's lag behind its tick moves: 500 ppm (1/2000), the
# kernel's bound on its clock's frequency adjustment (the lag is the phase between the tick's timer, on whole ticks
# of monotonic time, and the timekeeping's whole intervals, whose length that adjustment moves)
_PHASE_MARGIN_NS = 250_000  # a tick that came late (a busy host): taken off the time since the tick
# the least (now - the coarse clock) read, and when: an upper bound on how far the coarse clock's value lies behind
# the moment its tick came, see _tick_phase_ns
_phase_floor = [_TICK_NS, 0]
TICK_PHASE = os.environ.get("TIDESERVE_TICK_PHASE", "1") != "0"
"""Whether :func:`kernel_arrival_ns` adds the time since the kernel's current tick (``TIDESERVE_TICK_PHASE=0``: not,
a whole tick is taken off the kernel's count)."""


def _tick_phase_ns(now: int, coarse: int) -> int:
    """How long ago, at least, the kernel's current tick came (``now`` read after ``coarse``): ``now - coarse``, less
    the least such difference read so far (grown since by the most the lag can have moved, ``_PHASE_DRIFT``), as
    the coarse clock's value may lie a part of a tick behind the tick's own moment (its timekeeping counts whole
    intervals); each reading is at or after its tick, so that least difference is never less than the clock's own
    lag, and the result never more than the time since the tick, but where a tick came late by more than
    ``_PHASE_MARGIN_NS``, which is taken off, or where the reading fell between the tick's jiffy and its clock
    update (microseconds, unless the host stops the virtual CPU there). 0 at a process's first reading; at most a
    tick."""
    phase = now - coarse
    floor = _phase_floor
    least = floor[0] + (now - floor[1]) // _PHASE_DRIFT
    if phase < least:
        least = floor[0] = phase
        floor[1] = now
    return max(0, min(phase - least - _PHASE_MARGIN_NS, _TICK_NS))


def kernel_arrival_ns(sock, received: int) -> int:
    """The earlier of ``received`` and the latest time that is surely after the connection's last data segment
    arrived, by the kernel's count (``TCP_INFO``'s ``tcpi_last_data_recv``: ms since, counted in kernel ticks,
    so that count less a tick and its rounding is the time since the tick after the one the bytes came in,
    counted from the current tick: the time since that, :func:`_tick_phase_ns`, is added; a time never before
    the bytes came is the result). The request's bytes waited in the socket while the event loop ran other
    connections' work (a burst of arrivals): a deadline counted from here does not start that wait late.
    ``received`` where the kernel does not say, or the bytes came within the current tick."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _LAST_DATA_RECV + 4)
        ms = struct.unpack_from("=I", info, _LAST_DATA_RECV)[0]
    except (OSError, struct.error):
        return received
    if ms == 0:
        return received
    if TICK_PHASE:
        coarse = time.clock_gettime_ns(_COARSE)  # after the kernel's count: a tick between them makes a later time
        now = time.monotonic_ns()
        since_ns = ms * 1_000_000 - _TICK_SLACK_NS + _tick_phase_ns(now, coarse)
    else:
        now = time.monotonic_ns()
        since_ns = ms * 1_000_000 - _TICK_SLACK_NS
    if since_ns <= 0:
        return received
    return min(received, now - since_ns)  # now read after the kernel's count: never too early


def received_ns(scope) -> int:
    """When the request reached the server (monotonic ns): when the server began to parse it, or where the
    kernel says that its bytes waited in the socket before (:func:`kernel_arrival_ns`), from when they arrived;
    0 where the protocol did not say. The kernel is asked once per request (the socket leaves the scope then):
    call this only for a request with a deadline (a ``getsockopt``, some microseconds)."""
    received = scope.get(RECEIVED_NS, 0)
    sock = scope.pop(CONNECTION_SOCKET, None)
    if sock is not None and received:
        received = scope[RECEIVED_NS] = kernel_arrival_ns(sock, received)
    return received


DEADLINE_LATE_HEADER = b"tideserve-deadline-late-us"


def deadline_late_header(exc: BaseException) -> tuple[bytes, bytes] | None:
    """On a refusal at a queue deadline, how late the server was, in microseconds after the deadline:
    ``timer=`` when its timer refused the request, ``answer=`` now, as the answer is written (a client on another
    clock can tell the server's lateness from the network's and its own), and where the server measured it
    (``TIDESERVE_DEADLINE_PROBE=1``) ``cpu_wait=``, how long its loop waited for a CPU in between, and ``at=``, the
    answer's time on the host's monotonic clock in ns; None for any other error."""
    deadline = getattr(exc, "deadline_ns", 0)
    if not deadline:
        return None
    now = time.monotonic_ns()
    value = f"timer={(exc.fired_ns - deadline) // 1000}, answer={(now - deadline) // 1000}"
    if (waited := getattr(exc, "cpu_wait_ns", None)) is not None:  # measured: also the host's clock now (ns), so
        value += f", cpu_wait={waited // 1000}, at={now}"  # a client on the same host can tell the way in from back
    return DEADLINE_LATE_HEADER, value.encode()


def send_whole(send, status: int, body: bytes, headers: list) -> bool:
    """:func:`send_response` where it needs no await (uvicorn's httptools cycle, the answer written at once):
    True once sent; False, having sent nothing, where ``send_response`` must be awaited."""
    cycle = getattr(send, "__self__", None)
    kind = type(cycle)
    return (kind is _UvicornCycle or kind is FastCycle) and _write_whole(cycle, status, body, headers)


class RefusalNow:
    """Answers a queue-deadline refusal where the backend refuses it (the deadline's timer, on the loop), in one
    write, not a loop turn later when the handler's task wakes and raises it (the answer is the same).
    ``answer(error)`` gives the protocol's ``(status, body, headers)``; :meth:`watch` arms it on a stream (a frontend
    worker's stream has no ``on_error``: it learns the refusal later, through its handler). ``armed`` is cleared
    once the handler's own answer has started; ``done``: written here (where ``send_whole`` could not, not)."""

    __slots__ = ("answer", "armed", "done", "send")

    def __init__(self, send, answer) -> None:
        self.send = send
        self.answer = answer
        self.armed = True
        self.done = False

    def watch(self, stream) -> None:
        on_error = getattr(stream, "on_error", None)
        if on_error is not None:
            on_error(self)

    def __call__(self, error: BaseException) -> None:
        if self.armed and not self.done and isinstance(error, DeadlinePassed):
            self.done = send_whole(self.send, *self.answer(error))


async def send_response(send, status: int, body: bytes, headers: list) -> None:
    """One complete answer; ``headers`` (a list of byte pairs) gets the Content-Length appended."""
    if send_whole(send, status, body, headers):
        return
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


try:  # uvicorn's httptools protocol (the one the server runs): a whole answer can skip its two ASGI sends
    import uvicorn
    from uvicorn.protocols.http.httptools_impl import HEADER_RE as _HEADER_RE
    from uvicorn.protocols.http.httptools_impl import HEADER_VALUE_RE as _HEADER_VALUE_RE
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE as _STATUS_LINE
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle as _UvicornCycle
except ImportError:  # pragma: no cover - another uvicorn layout: the ASGI sends serve
    _UvicornCycle = None

if _UvicornCycle is not None:
    class FastCycle(_UvicornCycle):
        """uvicorn's request-response cycle for a request the HTTP protocol hands straight to its handler (KServe
        infer: server/http/limits.py), made with less: its ``message_event`` (an ``asyncio.Event``) is made only
        when someone waits on it or it is asked for (a request whose body is in and whose answer is written at once
        never needs one); until then :meth:`wake` and :meth:`calm` keep whether it would be set. Everything else,
        ``receive`` and ``send`` included, is uvicorn's own."""

        def __init__(self, scope, transport, flow, logger, access_logger, access_log: bool, default_headers,
                     keep_alive: bool, on_response) -> None:  # uvicorn's, less its Event and its 100 Continue
            self.scope = scope
            self.transport = transport
            self.flow = flow
            self.logger = logger
            self.access_logger = access_logger
            self.access_log = access_log
            self.default_headers = default_headers
            self.on_response = on_response
            self.disconnected = False
            self.keep_alive = keep_alive
            self.waiting_for_100_continue = False
            self.body = bytearray()
            self.more_body = True
            self.response_started = False
            self.response_complete = False
            self.chunked_encoding = None
            self.expected_content_length = 0
            self._event = None
            self._woken = False
            self.task = None  # the handler's task (the protocol cancels it when the connection is lost)

        @property
        def message_event(self) -> asyncio.Event:
            event = self._event
            if event is None:
                event = self._event = asyncio.Event()
                if self._woken:
                    event.set()
            return event

        def wake(self) -> None:
            """``message_event.set()``, without making the Event."""
            if self._event is None:
                self._woken = True
            else:
                self._event.set()

        def calm(self) -> None:
            """``message_event.clear()``, without making the Event."""
            if self._event is None:
                self._woken = False
            else:
                self._event.clear()
else:  # pragma: no cover - another uvicorn layout
    FastCycle = None

_WHOLE_MAX = 1 << 16  # a body up to this size leaves in the same write as the head (a copy); larger ones after it
_CONNECTION_HEADERS = (b"connection", b"transfer-encoding", b"content-length")
# header pairs already checked as uvicorn checks them, lower-cased: the constant ones (a content type) come again
# with every answer and skip the checks; a few hundred at most, so values that vary are not kept
_CHECKED: dict[tuple[bytes, bytes], tuple[bytes, bytes]] = {}
_CHECKED_MAX = 256
_defaults: list = [None, b""]  # uvicorn's default headers (its server's list of the second) and their bytes


def _write_whole(cycle, status: int, body: bytes, headers: list) -> bool:
    """What uvicorn's ``RequestResponseCycle.send`` does for ``http.response.start`` (``headers`` and a
    Content-Length) then a last ``http.response.body``, as one write and without the ASGI messages (the hot path
    of every unary answer: two coroutine calls, two dicts and a regex check of its default headers per answer
    fewer; a header pair seen before is not checked again). False, having done nothing, where the ASGI sends must
    decide (a response already started, a paused or closed connection, an access log to write, HEAD, a connection,
    transfer-encoding or content-length header, a header uvicorn would refuse)."""
    global _UvicornCycle
    try:
        if (cycle.response_started or cycle.disconnected or cycle.flow.write_paused or cycle.access_log
                or cycle.scope["method"] == "HEAD" or status not in _STATUS_LINE):
            return False
        default_headers, keep_alive, transport = cycle.default_headers, cycle.keep_alive, cycle.transport
        message_event = None if type(cycle) is FastCycle else cycle.message_event
        on_response = cycle.on_response
    except AttributeError:  # a uvicorn whose cycle differs from the one this was written for: its ASGI sends
        log.warning("uvicorn %s: whole answers go through its ASGI sends", getattr(uvicorn, "__version__", "?"))
        _UvicornCycle = None
        return False
    if default_headers is not _defaults[0]:  # uvicorn makes a new list when the date changes (once a second)
        _defaults[1] = b"".join(b"%s: %s\r\n" % (name.lower(), value) for name, value in default_headers)
        _defaults[0] = default_headers
    content = [_STATUS_LINE[status], _defaults[1]]
    for pair in headers:
        try:
            checked = _CHECKED.get(pair)
        except TypeError:  # not a pair of bytes: checked below, not kept
            checked = None
        if checked is None:
            name, value = pair
            name = name.lower()
            if name in _CONNECTION_HEADERS or _HEADER_RE.search(name) or _HEADER_VALUE_RE.search(value):
                return False
            checked = (name, value)
            if len(_CHECKED) < _CHECKED_MAX and type(name) is bytes and type(value) is bytes:
                _CHECKED[tuple(pair)] = checked
        content += (checked[0], b": ", checked[1], b"\r\n")
    content.append(b"content-length: %d\r\n" % len(body))
    cycle.response_started = True
    cycle.waiting_for_100_continue = False
    cycle.chunked_encoding = False
    cycle.expected_content_length = 0
    if not keep_alive:
        content.append(b"connection: close\r\n")
    content.append(b"\r\n")
    write = getattr(transport, "write_now", transport.write)
    if len(body) <= _WHOLE_MAX:
        content.append(body)
        write(b"".join(content))
    else:
        write(b"".join(content))
        write(body)
    cycle.response_complete = True
    if message_event is None:
        cycle.wake()
    else:
        message_event.set()
    if not keep_alive:
        transport.close()
    on_response()
    return True


def uvicorn_cycle(send):
    """uvicorn's httptools request-response cycle behind ``send``, whose attributes a streamed answer may read to
    write its body chunks as ``send`` would (``server/openai/http.py``); None for another server."""
    cycle = getattr(send, "__self__", None)
    kind = type(cycle)
    return cycle if kind is _UvicornCycle or kind is FastCycle else None


def whole_body(receive) -> bytes | None:
    """The request body, taken from uvicorn's httptools cycle behind ``receive`` once all of it has arrived, as its
    ``receive`` would return it but without awaiting it (two coroutines and the ASGI message fewer per request);
    None, having done nothing, where ``receive`` must be awaited (more body to come, a 100 Continue owed, the
    client gone or the answer done, another server)."""
    cycle = getattr(receive, "__self__", None)
    kind = type(cycle)
    if kind is not _UvicornCycle and kind is not FastCycle:
        return None
    try:
        if cycle.more_body or cycle.waiting_for_100_continue or cycle.disconnected or cycle.response_complete:
            return None
        body = bytes(cycle.body)
        cycle.body = bytearray()
        # as receive leaves it: a later receive (the disconnect watch) waits
        if kind is FastCycle:
            cycle.calm()
        else:
            cycle.message_event.clear()
        flow = cycle.flow
        if flow.read_paused:
            flow.resume_reading()
    except AttributeError:  # a uvicorn whose cycle differs from the one this was written for: its receive
        return None
    return body


async def send_error(send, status: int, message: str, retry_after_s: int | None = None,
                     error: BaseException | None = None) -> None:
    """A KServe v2 error answer: ``{"error": message}`` with ``status`` (and ``Retry-After`` when given; the
    deadline header of :func:`deadline_late_header` when ``error`` is a refusal at a deadline)."""
    headers = [JSON_HEADER]
    if retry_after_s is not None:
        headers.append((b"retry-after", str(retry_after_s).encode()))
    if error is not None and (late := deadline_late_header(error)) is not None:
        headers.append(late)
    await send_response(send, status, error_body(message), headers)


class cancel_on_disconnect:  # noqa: N801 - a context manager, named as contextlib.suppress is
    """``with cancel_on_disconnect(receive):`` - the block is cancelled if the client disconnects, and then
    ends with :class:`ClientGone`.

    Enter it once the request body has been read: a watcher task reads ``receive`` from then on, and an
    ``http.disconnect`` while the block runs cancels the task running it (``gone`` turns true). On exit the
    watcher stops and, when its cancellation is what ended the block, the cancellation is taken back
    (``Task.uncancel``) and :class:`ClientGone` raised instead; a cancellation from elsewhere, also one
    that comes with the disconnect, stays a ``CancelledError`` (the count is kept as :func:`asyncio.timeout`
    keeps it). ``delay``: start watching only after this many seconds (up to ``_WATCH_TICK_S`` later: the
    blocks that start watching within one tick share one timer), so a request answered sooner costs no
    watcher task and no timer of its own (the infer hot path). A plain ``with``, as anyio's cancel scopes:
    entering and leaving never wait, and the hot path pays for no coroutines.
    """

    __slots__ = ("cancelling", "delay", "due", "gone", "receive", "task", "waiting", "watcher")

    def __init__(self, receive, delay: float = 0.0) -> None:
        self.receive = receive
        self.delay = delay
        self.due = 0.0
        self.waiting = False  # queued to start watching at ``due`` (its loop's _Watchlist)
        self.watcher: asyncio.Task | None = None
        self.gone = False

    def __enter__(self) -> cancel_on_disconnect:
        task = self.task = asyncio.current_task()
        self.cancelling = task.cancelling()
        if self.delay > 0:
            _watchlist(task.get_loop(), self.delay).add(self)
        else:
            self._start()
        return self

    def __exit__(self, kind, exc, traceback) -> bool:
        if self.waiting:  # not started yet: it never will be (the watchlist drops it when its time comes)
            self.waiting = False
            self.receive = None
        if self.watcher is not None:
            self.watcher.cancel()  # it cannot cancel the task any more
        if self.gone and self.task.uncancel() <= self.cancelling and kind is asyncio.CancelledError:
            raise ClientGone() from None
        return False

    def _start(self) -> None:
        self.waiting = False
        self.watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        try:
            message = await self.receive()
        except Exception:  # the server is closing the connection itself
            log.debug("disconnect watch ended", exc_info=True)
            return
        if message["type"] == "http.disconnect":
            self.gone = True
            self.task.cancel()


_WATCH_TICK_S = 0.05


class _Watchlist:
    """The blocks of one loop and one delay waiting to start watching, oldest first, and one timer for them all
    (firing at most every ``_WATCH_TICK_S``): a block costs an append, and nothing when it ends before its delay."""

    __slots__ = ("blocks", "delay", "loop", "timer")

    def __init__(self, loop, delay: float) -> None:
        self.loop = loop
        self.delay = delay
        self.blocks: collections.deque[cancel_on_disconnect] = collections.deque()
        self.timer = None

    def add(self, block: cancel_on_disconnect) -> None:
        block.due = due = self.loop.time() + self.delay
        block.waiting = True
        self.blocks.append(block)
        if self.timer is None:
            self.timer = self.loop.call_at(due, self.start_due)

    def start_due(self) -> None:
        self.timer = None
        blocks = self.blocks
        now = self.loop.time()
        while blocks and blocks[0].due <= now:
            block = blocks.popleft()
            if block.waiting:
                block._start()
        if blocks:
            self.timer = self.loop.call_at(max(blocks[0].due, now + _WATCH_TICK_S), self.start_due)


_watchlists: dict[tuple[int, float], _Watchlist] = {}  # (id of the loop, delay) -> its watchlist


def _watchlist(loop, delay: float) -> _Watchlist:
    found = _watchlists.get((id(loop), delay))
    if found is None or found.loop is not loop:  # none yet, or that of a closed loop whose id was reused
        if len(_watchlists) > 64:  # loops come and go (tests): forget those closed
            for key in [key for key, value in _watchlists.items() if value.loop.is_closed()]:
                del _watchlists[key]
        found = _watchlists[(id(loop), delay)] = _Watchlist(loop, delay)
    return found
