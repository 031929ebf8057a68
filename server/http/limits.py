"""Limits on what one HTTP connection can take, enforced where uvicorn parses the bytes.

uvicorn's httptools protocol puts no bound on the size or number of request headers and no time
limit on reading them or a body: a client can hold a connection by sending nothing, or a byte at a
time, and can make the server buffer an unterminated header of any size. :class:`LimitedHttpToolsProtocol`
adds those bounds; everything else is uvicorn's own.

- The request line and headers (the head) are at most ``max_header_size`` bytes and
  ``max_header_count`` headers, or the server answers 431 and closes the connection, having buffered
  at most one socket read past the limit. The trailers of a chunked body are held to the same limits.
- The head must be complete ``header_timeout`` seconds after the connection opens (or, on a
  kept-alive connection, after the next request's first byte), or 408 and close; a new connection
  that sent nothing at all is closed without an answer. Idle kept-alive connections are closed after
  uvicorn's keep-alive timeout (5 s), timed by the connection's one timer (uvicorn would make and cancel
  a timer of its own for every answer).
- While a body is expected, at most ``body_timeout`` seconds may pass between two of its chunks, or
  408 and close (only the close once the answer has started). Time during which the server itself
  does not read (flow control: the app has not asked for more) does not count.

The number of connections and requests in flight is uvicorn's own ``limit_concurrency``: past it,
a request is answered 503 and its connection closed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass

import orjson
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from ..asgi import CONNECTION_SOCKET, KERNEL_ARRIVAL, RECEIVED_NS, FastCycle

log = logging.getLogger(__name__)

DEFAULT_MAX_HEADER_SIZE = 64 * 1024
DEFAULT_MAX_HEADER_COUNT = 100
DEFAULT_HEADER_TIMEOUT_SECS = 10.0
DEFAULT_BODY_TIMEOUT_SECS = 30.0
DEFAULT_MAX_CONNECTIONS = 1000

_TASK_NAME = "http-direct"  # the name of a request's task on the direct path (KServe infer)

# What the connection waits for.
_HEAD = 1  # a request line and headers
_BODY = 2  # the rest of a request body
_IDLE = 0  # nothing from the client: the server is answering
_KEPT = 3  # nothing from the client after an answer: the connection is kept alive (uvicorn's keep-alive timeout)


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_header_size: int = DEFAULT_MAX_HEADER_SIZE
    """Most bytes of request line and headers (``--http-max-header-size``)."""
    max_header_count: int = DEFAULT_MAX_HEADER_COUNT
    """Most headers in one request (``--http-max-header-count``)."""
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_SECS
    """Seconds the head may take to arrive (``--http-header-timeout-secs``)."""
    body_timeout: float = DEFAULT_BODY_TIMEOUT_SECS
    """Seconds allowed between two chunks of a body (``--http-body-timeout-secs``)."""
    max_connections: int | None = DEFAULT_MAX_CONNECTIONS
    """Most open connections and requests in flight, None for no limit (``--http-max-connections``)."""

    def uvicorn_settings(self) -> dict:
        """The ``uvicorn.Config`` arguments that apply these limits.

        uvicorn answers 503 once the open connections, the one asking included, reach
        ``limit_concurrency``: one more than ``max_connections`` serves that many. The server has no
        WebSocket routes, so no connection is handed over to a WebSocket protocol, out of these limits.
        """
        concurrency = None if self.max_connections is None else self.max_connections + 1
        return {"http": functools.partial(LimitedHttpToolsProtocol, limits=self), "limit_concurrency": concurrency,
                "ws": "none"}


class _Refusal(Exception):
    """Raised in a parser callback to stop parsing; the protocol then answers 431 and closes."""


class CoalescingTransport:
    """A connection's transport whose writes of one event-loop turn leave as one.

    uvicorn writes a response's head and its body with two ``write`` calls; on uvloop each is a ``send``
    system call, and the client often wakes for two TCP segments. Held here until the end of the turn, they
    cost one of each. A response that streams (SSE) still sends each event as it comes (:meth:`write_event`)."""

    __slots__ = ("_loop", "_pending", "_transport")

    def __init__(self, transport, loop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: bytes | None = None

    def write(self, data: bytes) -> None:
        if self._pending is None:
            self._pending = bytes(data)
            self._loop.call_soon(self.flush)
        else:
            self._pending += data

    def write_now(self, data: bytes) -> None:
        """Write at once (a whole answer in one piece: nothing to wait for), after what is held."""
        if self._pending is not None:
            self._pending += data
            self.flush()
        elif not self._transport.is_closing():
            self._transport.write(data)

    def write_event(self, data: bytes) -> None:
        """An event of a streamed answer (SSE): written at once when nothing is held, after what is held otherwise.
        Each event of a stream is a ``send`` of its own either way (they come an engine step apart); held to the
        turn's end it would also cost a callback per event, and one per stream per engine step adds up."""
        if self._pending is not None:
            self._pending += data
        elif not self._transport.is_closing():
            self._transport.write(data)

    def writelines(self, chunks) -> None:
        for chunk in chunks:
            self.write(chunk)

    def flush(self) -> None:
        data, self._pending = self._pending, None
        if data and not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name, default=None):
        return self._transport.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def abort(self) -> None:
        self._pending = None
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + len(self._pending or b"")

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def set_protocol(self, protocol) -> None:
        self.flush()
        self._transport.set_protocol(protocol)

    def get_protocol(self):
        return self._transport.get_protocol()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with limits on the head's size and header count, and read timeouts; it
    stamps each request's scope with when its parsing began (:data:`RECEIVED_NS`)."""

    def __init__(self, *args, limits: ConnectionLimits, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._waiting = _HEAD
        self._deadline = 0.0
        self._timer = None
        self._timer_at = 0.0
        self._head_received = 0  # bytes read since the head began: a bound on its size
        self._head_count = 0     # headers of the request whose body is being read (more are trailers)
        self._unseen = 0         # bytes read while waiting for a body with none of it seen: trailers
        self._body_began = False  # the head completed in the read being parsed: the body's wait begins
        self._refusal: tuple[int, str] | None = None
        self._shortest = min(limits.header_timeout, limits.body_timeout, self.timeout_keep_alive)
        # the app's direct handlers (KServe infer: tideserve.http.app.HttpApp.infer_handler), None for another app
        self._handler = getattr(self.app, "infer_handler", None) if FastCycle is not None else None
        self._socket = None  # the connection's socket where a deadline may ask the kernel (connection_made)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        scope = self.scope
        scope[RECEIVED_NS] = time.monotonic_ns()
        if self._socket is not None:  # a deadline also asks the kernel when the bytes came (asgi.received_ns)
            scope[CONNECTION_SOCKET] = self._socket

    # -- what the connection waits for, and the one timer that bounds it -------------------
    def _wait_for(self, what: int, timeout: float) -> None:
        """Wait for ``what`` at most ``timeout`` seconds. The timer moves only when it would fire too late: a
        later deadline is left to the timer, which looks again when it fires (no timer made per request)."""
        self._waiting = what
        deadline = self._deadline = self.loop.time() + timeout
        if self._timer is None or self._timer_at > deadline:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self.loop.call_at(deadline, self._on_timer)
            self._timer_at = deadline

    def _on_timer(self) -> None:
        self._timer = None
        waiting = self._waiting
        if waiting == _IDLE or self.transport.is_closing():
            return
        now = self.loop.time()
        if waiting == _KEPT:
            if now >= self._deadline:
                self._waiting = _IDLE
                self.timeout_keep_alive_handler()
                return
        else:
            cycle = self.cycle
            if self.flow.read_paused or (waiting == _HEAD and cycle is not None and not cycle.response_complete):
                # the server is the one not reading, or is answering the previous request: the client is not late
                self._deadline = now + (self.limits.header_timeout if waiting == _HEAD else self.limits.body_timeout)
        if now < self._deadline:
            # by the deadline, and no later than the shortest wait from now: the next, nearer deadline (the
            # keep-alive after an answer) then finds the timer early enough and leaves it where it is
            at = self._timer_at = min(self._deadline, now + self._shortest)
            self._timer = self.loop.call_at(at, self._on_timer)
            return
        if waiting == _BODY:
            self._answer(408, f"no part of the request body arrived for {self.limits.body_timeout:g} s "
                              "(--http-body-timeout-secs)")
        elif self._head_received:
            self._answer(408, f"the request line and headers did not arrive within "
                              f"{self.limits.header_timeout:g} s (--http-header-timeout-secs)")
        else:
            self._close()  # a connection that never sent a byte gets no answer

    def _close(self) -> None:
        self._waiting = _IDLE
        self.transport.close()

    def _answer(self, status: int, message: str) -> None:
        """Answer ``{"error": message}`` with ``status`` where HTTP allows it, and close the connection.

        Waiting for a head, the answer goes out unless the previous request's is still due (it must
        come first); waiting for a body, unless the app's answer has started (the app then sees the
        client gone).
        """
        log.debug("HTTP %d to %s: %s", status, self.client, message)
        cycle = self.cycle
        if self._waiting == _HEAD:
            answerable = cycle is None or cycle.response_complete
        else:
            answerable = cycle is not None and not cycle.response_started
            if answerable:
                cycle.disconnected = True  # the app's receive() and send() now see the client gone
                cycle.message_event.set()
        if answerable:
            body = orjson.dumps({"error": message})
            head = [STATUS_LINE[status]]
            for name, value in self.server_state.default_headers:
                head.extend([name, b": ", value, b"\r\n"])
            head.append(b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
                        % len(body))
            self.transport.write(b"".join(head) + body)
        self._close()

    def _too_large(self, size: int) -> str:
        return (f"the request line and headers take more than {self.limits.max_header_size} bytes "
                f"({size} so far; --http-max-header-size)")

    def _check_head(self) -> None:
        """Refuse (431) a complete head past the limits: raised in a parser callback, it stops the parser."""
        limits = self.limits
        message = None
        if len(self.headers) > limits.max_header_count:
            message = f"the request has more than {limits.max_header_count} headers (--http-max-header-count)"
        elif self._head_received > limits.max_header_size:  # the read also held body bytes: measure the head
            size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
            if size > limits.max_header_size:
                message = self._too_large(size)
        if message is not None:
            self._refusal = (431, message)
            raise _Refusal(message)

    # -- asyncio.Protocol -----------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self._socket = transport.get_extra_info("socket") if KERNEL_ARRIVAL else None
        super().connection_made(CoalescingTransport(transport, self.loop))
        self._wait_for(_HEAD, self.limits.header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._waiting = _IDLE
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        super().connection_lost(exc)
        cycle = self.cycle
        if type(cycle) is FastCycle and cycle.task is not None and not cycle.response_complete:
            cycle.task.cancel()  # nobody is left to answer: the handler's request is cancelled (its model sees it)

    def data_received(self, data: bytes) -> None:
        # A head or a body that begins here is timed from here only if this read does not complete it (the
        # usual request arrives whole in one read: its two waits cost nothing).
        waiting = self._waiting
        head_began = False
        if waiting == _IDLE or waiting == _KEPT:  # the next request's first bytes
            self._head_received = len(data)
            self._waiting = _HEAD
            head_began = True
        elif waiting == _HEAD:
            self._head_received += len(data)
        else:  # more of a body
            self._deadline = self.loop.time() + self.limits.body_timeout
            self._unseen += len(data)
        self._body_began = False
        super().data_received(data)
        waiting = self._waiting
        if waiting == _IDLE or self.transport.is_closing():
            return
        if waiting == _HEAD:
            if head_began:
                self._wait_for(_HEAD, self.limits.header_timeout)
            if self._head_received > self.limits.max_header_size:
                self._answer(431, self._too_large(self._head_received))  # a header that does not end
            return
        if self._body_began:
            self._wait_for(_BODY, self.limits.body_timeout)
        if self._unseen > self.limits.max_header_size or \
                len(self.headers) - self._head_count > self.limits.max_header_count:
            # a chunked body's trailers: held to the limits of a head
            self._answer(431, "the request's trailers take more than the limits of its headers "
                              "(--http-max-header-size, --http-max-header-count)")

    def send_400_response(self, msg: str) -> None:
        if self._refusal is None:
            super().send_400_response(msg)
        else:  # a parser callback refused the request
            self._answer(*self._refusal)

    # -- httptools callbacks (the head's size and header count are checked once it is complete: until
    # then data_received bounds what is buffered) -----------------------------------------
    def on_headers_complete(self) -> None:
        if len(self.headers) > self.limits.max_header_count or self._head_received > self.limits.max_header_size:
            self._check_head()
        self._head_count = len(self.headers)
        self._unseen = 0
        self._waiting = _BODY  # timed once the read that brought the head is parsed (data_received)
        self._body_began = True
        if self._handler is None or not self._start_direct():
            super().on_headers_complete()

    def _start_direct(self) -> bool:
        """A ``POST`` the app answers without an ASGI call (KServe infer): its handler runs as this request's task
        on a :class:`~tideserve.asgi.FastCycle` (uvicorn's path: its URL parsed into a new object, a cycle with its
        own Event, ``run_asgi`` and the app's ``__call__`` around the handler). False, having done nothing, where
        uvicorn's path must serve: any other method or path, a path with a query or escapes, ``Expect:
        100-continue``, an upgrade, a request pipelined behind one not answered yet, the concurrency limit
        reached."""
        url = self.url
        if not url.endswith(b"/infer") or self.expect_100_continue or self.root_path:
            return False
        parser = self.parser
        if parser.get_method() != b"POST" or parser.should_upgrade():
            return False
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            return False  # pipelined: uvicorn queues it
        limit = self.limit_concurrency
        if limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit):
            return False  # uvicorn answers 503
        try:
            path = url.decode("ascii")
        except UnicodeDecodeError:
            return False
        # a query, an escape or a fragment: uvicorn's path (looked for in the str: ``bytes in bytes`` first tries
        # the needle as an int, a TypeError made and dropped each time)
        if "?" in path or "%" in path or "#" in path:
            return False
        found = self._handler(path)
        if found is None:
            return False
        handler, model, version = found
        scope = self.scope
        scope["method"] = "POST"
        http_version = parser.get_http_version()
        if http_version != "1.1":
            scope["http_version"] = http_version
        scope["path"] = path
        scope["raw_path"] = url
        scope["query_string"] = b""
        cycle = self.cycle = FastCycle(scope, self.transport, self.flow, self.logger, self.access_logger,
                                       self.access_log, self.server_state.default_headers,
                                       http_version != "1.0" and parser.should_keep_alive(), self.on_response_complete)
        coro = handler(scope, cycle.receive, cycle.send, model, version)
        loop = self.loop
        if loop.get_task_factory() is None:  # named here: asyncio formats a "Task-<n>" name for every unnamed task
            task = asyncio.Task(coro, loop=loop, name=_TASK_NAME)
        else:
            task = loop.create_task(coro)
        task.add_done_callback(functools.partial(self._direct_done, cycle))
        cycle.task = task
        self.tasks.add(task)
        return True

    def _direct_done(self, cycle: FastCycle, task) -> None:
        """As uvicorn's ``run_asgi`` ends a request whose handler raised (the handlers answer their own errors: a
        cancellation at shutdown, a bug) or returned with no whole answer: 500 where the answer has not started,
        else the connection closed."""
        self.tasks.discard(task)
        if cycle.response_complete or cycle.disconnected:
            return
        if not task.cancelled() and task.exception() is not None:
            log.error("HTTP request to %s failed", cycle.scope.get("path"), exc_info=task.exception())
        if not cycle.response_started and not self.transport.is_closing():
            cycle.keep_alive = False
            body = orjson.dumps({"error": "internal error: the request's handler ended without an answer"})
            head = [STATUS_LINE[500]]
            for name, value in self.server_state.default_headers:
                head.extend([name, b": ", value, b"\r\n"])
            head.append(b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
                        % len(body))
            self.transport.write(b"".join(head) + body)
        cycle.response_complete = True
        self.transport.close()

    def on_body(self, body: bytes) -> None:
        self._unseen = 0
        cycle = self.cycle
        if type(cycle) is not FastCycle:
            super().on_body(body)
            return
        if cycle.response_complete:
            return
        cycle.body += body
        if len(cycle.body) > HIGH_WATER_LIMIT:
            self.flow.pause_reading()
        cycle.wake()

    def on_message_complete(self) -> None:
        self._waiting = _IDLE
        cycle = self.cycle
        if type(cycle) is not FastCycle:
            super().on_message_complete()
            return
        if not cycle.response_complete:
            cycle.more_body = False
            cycle.wake()

    def on_response_complete(self) -> None:
        """uvicorn's, with the keep-alive timeout kept by the connection's timer (uvicorn arms one of its own)."""
        if self._waiting != _IDLE or self.pipeline:  # a request still arriving, or the next one queued: uvicorn's
            super().on_response_complete()
            return
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self._unset_keepalive_if_required()
        self.flow.resume_reading()
        self._wait_for(_KEPT, self.timeout_keep_alive)
