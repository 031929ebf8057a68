"""The HTTP port's connections spread evenly over the frontend workers.

Every worker serves the one listening socket the core made. Left to the event loop, a worker that wakes first
accepts every connection waiting (libuv accepts until the backlog is empty), so the few long-lived connections of a
load generator or a proxy land mostly on one worker: 8 connections opened together went 8 / 0 or 6 / 2 over two
workers, which then run at the speed of one. Here each worker accepts the connections itself, one per wake-up, and
only while it holds no more open connections than the worker holding the fewest; the counts are a small table of
shared memory the core makes (one slot per worker, written by its owner only). A worker that holds more steps aside
for ``DEFER_S`` and looks again; after ``MAX_DEFER_S`` of stepping aside for the same backlog (the others busy or
gone) it accepts anyway, so a connection never waits on a worker that does not come.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import socket
import struct
import time

log = logging.getLogger(__name__)

DEFER_S = 0.0005
MAX_DEFER_S = 0.02
_SLOT = struct.Struct("q")


def create_table(count: int) -> int:
    """A file descriptor (inheritable) of a zeroed table of ``count`` connection counts."""
    fd = os.memfd_create("tideserve-http-connections", 0) if hasattr(os, "memfd_create") else _temp_fd()
    os.ftruncate(fd, _SLOT.size * count)
    os.set_inheritable(fd, True)
    return fd


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
        self.set(0)  # a restarted worker begins with none

    def set(self, value: int) -> None:
        _SLOT.pack_into(self.map, self.offset, value)

    def others_fewest(self) -> int:
        """The fewest connections any other worker holds (a large number when there is no other)."""
        fewest = 1 << 62
        for index in range(self.count):
            if index != self.index:
                fewest = min(fewest, _SLOT.unpack_from(self.map, index * _SLOT.size)[0])
        return fewest


class BalancedAcceptor:
    """Accepts ``sock``'s connections for ``factory``'s protocols (uvicorn's) in this worker, one per wake-up,
    while this worker holds no more connections than the fewest of the others."""

    def __init__(self, sock: socket.socket, table: ConnectionTable, factory) -> None:
        self.sock = sock
        self.table = table
        self.factory = factory
        self.loop = asyncio.get_running_loop()
        self.open = 0
        self.deferring_since = 0.0
        self.reading = False
        self.closed = False
        self.resume_handle = None
        self.tasks: set[asyncio.Task] = set()

    def start(self) -> None:
        self.sock.setblocking(False)
        self._read()

    def _read(self) -> None:
        self.resume_handle = None
        if not self.closed and not self.reading:
            self.loop.add_reader(self.sock.fileno(), self._ready)
            self.reading = True

    def _pause(self, delay: float) -> None:
        if self.reading:
            self.loop.remove_reader(self.sock.fileno())
            self.reading = False
        if self.resume_handle is None:
            self.resume_handle = self.loop.call_later(delay, self._read)

    def _ready(self) -> None:
        if self.open > self.table.others_fewest():
            now = time.monotonic()
            if not self.deferring_since:
                self.deferring_since = now
            if now - self.deferring_since < MAX_DEFER_S:
                self._pause(DEFER_S)  # another worker takes it (or this one, when it looks again)
                return
        try:
            conn, _ = self.sock.accept()
        except (BlockingIOError, InterruptedError):  # another worker took it
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
        self.table.set(self.open)

    def _closed(self) -> None:
        self.open -= 1
        self.table.set(self.open)

    def close(self) -> None:
        """Accept no more (the open connections are uvicorn's to close)."""
        self.closed = True
        if self.reading:
            self.loop.remove_reader(self.sock.fileno())
            self.reading = False
        if self.resume_handle is not None:
            self.resume_handle.cancel()
            self.resume_handle = None


def acceptor_for(table: ConnectionTable):
    """``Frontends.http_acceptor`` for a worker: a :class:`BalancedAcceptor` of the shared socket for a started
    uvicorn server, making uvicorn's protocols as its own listening server would."""

    def attach(sock: socket.socket, server) -> BalancedAcceptor:
        config = server.config

        def factory():
            return config.http_protocol_class(config=config, server_state=server.server_state,
                                              app_state=server.lifespan.state)

        acceptor = BalancedAcceptor(sock, table, factory)
        acceptor.start()
        return acceptor

    return attach
