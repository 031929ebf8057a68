"""The HTTP port's connections spread over the frontend workers: evenly, or first over a few where cores are few.

Every worker serves the one listening socket the core made. Left to the event loop, a worker that wakes first
accepts every connection waiting (libuv accepts until the backlog is empty), so the few long-lived connections of a
load generator or a proxy land mostly on one worker: 8 connections opened together went 8 / 0 or 6 / 2 over two
workers, which then run at the speed of one. Here each worker accepts the connections itself, one per wake-up, and
only while it holds no more open connections than the worker holding the fewest; the counts are a small table of
shared memory the core makes (one slot per worker, written by its owner only). A worker that holds more steps aside
for ``DEFER_S`` and looks again; after ``MAX_DEFER_S`` of stepping aside for the same backlog (the others busy or
gone) it accepts anyway, so a connection never waits on a worker that does not come. A worker not started yet,
stopping, or dead (the core marks one that exits) counts as holding :data:`GONE`: no other steps aside for it.

Where the workers cannot all run at once beside their model processes (as many workers as cores, or more: two
workers on 2 cores), spreading costs more than it gives: each worker's loop turn serves fewer requests, so every
turn's poll, link write and read, and every batch's wake-up are paid for fewer requests, and the workers compete for
the cores with the instance processes and the client. There only the first :func:`takers` workers (one per two
cores, as ``--frontend-workers auto`` counts them; one on 2 cores) take connections, evenly among them, until each
holds ``fill`` (:func:`fill_limit`: unbounded unless ``TIDESERVE_HTTP_FILL_CONNECTIONS`` says; 0 spreads over every
worker from the first connection); beyond, every worker takes them evenly. The others step aside for a taker up to
``MAX_TAKER_WAIT_S`` (a taker whose loop does not come). With fewer workers than cores every worker takes its share from the
first connection, as before.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import select
import socket
import struct
import time

log = logging.getLogger(__name__)

DEFER_S = 0.0005
MAX_DEFER_S = 0.02
MAX_TAKER_WAIT_S = 0.1  # a worker that is not a taker steps aside this long for a taker (a loaded machine's taker
# can take longer than MAX_DEFER_S to come, and one connection on another worker costs every request of it more)
ACCEPTS_PER_WAKE = 16  # where some workers take before others: the most connections one wake-up accepts
FILL_CONNECTIONS = 1 << 20  # what each of those takes before the others take any (all, in effect)
GONE = 1 << 62  # the count of a worker that accepts none: never the fewest, never a taker with room
_SLOT = struct.Struct("q")


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def takers(workers: int, cores: int) -> int:
    """How many of ``workers`` take the HTTP connections first: all of them where there are fewer workers than
    cores; else the workers the cores can run beside their model processes, one per two cores (at least one)."""
    return workers if workers < cores else max(1, min(workers, cores // 2))


def fill_limit(override: str | None = None) -> int:
    """How many connections each of the first :func:`takers` workers takes before the others take any:
    :data:`FILL_CONNECTIONS`, or ``override`` (``TIDESERVE_HTTP_FILL_CONNECTIONS``) where given (0: none, every
    worker takes its share from the first connection)."""
    if override in (None, ""):
        return FILL_CONNECTIONS
    try:
        return max(0, int(override))
    except ValueError:  # a worker that cannot start over a setting's typo would take the server's start with it
        log.warning("TIDESERVE_HTTP_FILL_CONNECTIONS=%r is not an integer: ignored", override)
        return FILL_CONNECTIONS


def create_table(count: int) -> int:
    """A file descriptor (inheritable) of a table of ``count`` connection counts, every worker :data:`GONE` until
    its acceptor starts."""
    fd = os.memfd_create("tideserve-http-connections", 0) if hasattr(os, "memfd_create") else _temp_fd()
    os.ftruncate(fd, _SLOT.size * count)
    os.set_inheritable(fd, True)
    for index in range(count):
        mark_gone(fd, index, count)
    return fd


def mark_gone(fd: int, index: int, count: int) -> None:
    """Worker ``index`` accepts no connections (not started, stopping, or dead: the core marks a worker that
    exits), so that no other worker steps aside for it."""
    with mmap.mmap(fd, _SLOT.size * count) as table:
        _SLOT.pack_into(table, index * _SLOT.size, GONE)


def _temp_fd() -> int:  # pragma: no cover - systems without memfd_create
    import tempfile
    fd, path = tempfile.mkstemp(prefix="tideserve-connections-")
    os.unlink(path)
    return fd


class ConnectionTable:
    """The open HTTP connections of each worker, in shared memory."""

    def __init__(self, fd: int, index: int, count: int) -> None:
        self.map = mmap.mmap(fd, _SLOT.size * count)
        self.index = index
        self.count = count
        self.offset = index * _SLOT.size

    def set(self, value: int) -> None:
        _SLOT.pack_into(self.map, self.offset, value)

    def held(self, index: int) -> int:
        return _SLOT.unpack_from(self.map, index * _SLOT.size)[0]

    def others_fewest(self, among: int | None = None) -> int:
        """The fewest connections any other worker holds, of the first ``among`` workers (all where None; a large
        number when there is no other)."""
        fewest = 1 << 62
        for index in range(self.count if among is None else among):
            if index != self.index:
                fewest = min(fewest, self.held(index))
        return fewest

    def fewest(self, among: int, own: int) -> int:
        """The fewest connections any of the first ``among`` workers holds, this one counted as ``own``."""
        return min(own if index == self.index else self.held(index) for index in range(among))


class BalancedAcceptor:
    """Accepts ``sock``'s connections for ``factory``'s protocols (uvicorn's) in this worker, one per wake-up,
    while this worker holds no more connections than the fewest of the others; with ``takers`` fewer than the
    workers, only the first ``takers`` workers (evenly among them) while one of them holds fewer than ``fill``."""

    def __init__(self, sock: socket.socket, table: ConnectionTable, factory, takers: int | None = None,
                 fill: int = FILL_CONNECTIONS) -> None:
        self.sock = sock
        self.table = table
        self.factory = factory
        self.takers = table.count if takers is None or not fill else min(takers, table.count)
        self.fill = fill
        self.loop = asyncio.get_running_loop()
        self.open = 0
        self.deferring_since = 0.0
        self.reading = False
        self.closed = False
        self.resume_handle = None
        self.tasks: set[asyncio.Task] = set()
        self.pending = select.poll()  # whether a connection waits, while stepping aside
        self.pending.register(sock.fileno(), select.POLLIN)

    def start(self) -> None:
        self.sock.setblocking(False)
        self._publish()  # from here on this worker takes connections (a restarted one begins with none)
        self._read()

    def _read(self) -> None:
        self.resume_handle = None
        if not self.closed and not self.reading:
            self.loop.add_reader(self.sock.fileno(), self._ready)
            self.reading = True

    def _pause(self, delay: float, then=None) -> None:
        if self.reading:
            self.loop.remove_reader(self.sock.fileno())
            self.reading = False
        if self.resume_handle is None:
            self.resume_handle = self.loop.call_later(delay, then or self._read)

    def _look_again(self) -> None:
        """After stepping aside: where the backlog it stepped aside for is gone (another worker took it), the next
        connection's wait counts from its own arrival, not from this one's."""
        if self.deferring_since and not self.pending.poll(0):
            self.deferring_since = 0.0
        self._read()

    def _others_turn(self) -> float:
        """How long this worker steps aside for the others at most (0: it takes the connection now)."""
        if self.takers < self.table.count and self.table.fewest(self.takers, self.open) < self.fill:
            if self.table.index >= self.takers:
                return MAX_TAKER_WAIT_S
            return MAX_DEFER_S if self.open > self.table.others_fewest(self.takers) else 0.0
        return MAX_DEFER_S if self.open > self.table.others_fewest() else 0.0

    def _ready(self) -> None:
        # Every worker taking, one connection per wake-up (the others look too); the first few taking, a taker
        # accepts what waits, so that a client's connections opened together reach it before another gives up
        # waiting for it (MAX_TAKER_WAIT_S).
        for _ in range(ACCEPTS_PER_WAKE if self.takers < self.table.count else 1):
            wait = self._others_turn()
            if wait:
                now = time.monotonic()
                if not self.deferring_since:
                    self.deferring_since = now
                if now - self.deferring_since < wait:
                    self._pause(DEFER_S, self._look_again)  # another worker takes it (or this one, looking again)
                    return
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):  # another worker took it, or none waits
                self.deferring_since = 0.0
                return
            except OSError as exc:  # out of descriptors, or the like: look again a little later
                log.warning("HTTP accept failed: %s", exc)
                self._pause(0.1)
                return
            self.deferring_since = 0.0
            self._opened()
            conn.setblocking(False)
            task = self.loop.create_task(self.loop.connect_accepted_socket(self._protocol, conn))
            self.tasks.add(task)
            task.add_done_callback(self._connected)

    def _connected(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:  # the connection never began
            log.debug("HTTP connection setup failed", exc_info=task.exception())
            self._closed()

    def _protocol(self):
        protocol = self.factory()
        lost = protocol.connection_lost

        def connection_lost(exc) -> None:
            self._closed()
            lost(exc)

        protocol.connection_lost = connection_lost
        return protocol

    def _opened(self) -> None:
        self.open += 1
        self._publish()

    def _closed(self) -> None:
        self.open -= 1
        self._publish()

    def _publish(self) -> None:
        self.table.set(GONE if self.closed else self.open)

    def close(self) -> None:
        """Accept no more (the open connections are uvicorn's to close)."""
        self.closed = True
        self._publish()
        if self.reading:
            self.loop.remove_reader(self.sock.fileno())
            self.reading = False
        if self.resume_handle is not None:
            self.resume_handle.cancel()
            self.resume_handle = None


def acceptor_for(table: ConnectionTable):
    """``Frontends.http_acceptor`` for a worker: a :class:`BalancedAcceptor` of the shared socket for a started
    uvicorn server, making uvicorn's protocols as its own listening server would (the first :func:`takers`
    workers for this machine's cores taking the connections first)."""
    first = takers(table.count, cores())
    fill = fill_limit(os.environ.get("TIDESERVE_HTTP_FILL_CONNECTIONS"))

    def attach(sock: socket.socket, server) -> BalancedAcceptor:
        config = server.config

        def factory():
            return config.http_protocol_class(config=config, server_state=server.server_state,
                                              app_state=server.lifespan.state)

        acceptor = BalancedAcceptor(sock, table, factory, first, fill)
        acceptor.start()
        return acceptor

    return attach
