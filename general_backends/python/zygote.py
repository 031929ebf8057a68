"""The zygote: a small process that forks model processes, so each starts in milliseconds.

The server never forks itself (its threads and event loop would be copied half-way). Once, on first
use, it starts the zygote as a fresh interpreter (running :func:`.zygote_main.main`, in a session of its own so a
terminal's Ctrl-C reaches only the server); the zygote imports the whole
model-process stack (numpy, the ``pb_utils`` API, :mod:`.stub`) and then, single-threaded, forks one
child per request. A child gets its socket and its two arenas' files from the request (``SCM_RIGHTS``),
imports its ``model.py`` and serves (:func:`.stub.run`). The zygote reaps its children and tells the
server each exit status, which is how a crash is named ("killed by signal SIGSEGV").

Nothing outlives the server: when the server's end of the zygote's socket closes (the server exited,
however it died), the zygote kills the children still running and exits; each child also exits by
itself when its own socket to the server closes.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable

import msgspec

from tideserve.backend_api import wire

from . import loader, protocol

log = logging.getLogger(__name__)

FDS_PER_PROCESS = 3  # the process's socket, the request arena, the response arena


class Spawn(msgspec.Struct, tag=True, array_like=True):
    request: int
    spec: protocol.ProcessSpec


class Started(msgspec.Struct, tag=True, array_like=True):
    request: int
    pid: int
    error: str = ""


class Exited(msgspec.Struct, tag=True, array_like=True):
    pid: int
    returncode: int


# -- the server's side ---------------------------------------------------------------------------------
class Zygote:
    """The server's handle on its zygote: ``spawn`` asks for a model process. Thread-safe; one per server
    process (``Zygote.get()``), started on first use and again if it ever dies."""

    _current: Zygote | None = None
    _current_lock = threading.Lock()

    @classmethod
    def get(cls) -> Zygote:
        with cls._current_lock:
            if cls._current is None or not cls._current.alive:
                cls._current = cls()
            return cls._current

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(_import_path())}
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", f"from {__package__}.zygote_main import main; main({theirs.fileno()})"],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        finally:
            theirs.close()
        self.sock = ours
        self.alive = True
        self._lock = threading.Lock()
        self._requests = itertools.count(1)
        self._pending: dict[int, tuple[concurrent.futures.Future, Callable[[int], None]]] = {}
        self._watchers: dict[int, Callable[[int], None]] = {}
        threading.Thread(target=self._read, name="tideserve-zygote", daemon=True).start()

    def spawn(self, spec: protocol.ProcessSpec, fds: list[int], on_exit: Callable[[int], None]) -> concurrent.futures.Future:
        """Fork a model process with ``fds`` (duplicated: the caller closes its own). The future gives its
        pid; ``on_exit(returncode)`` is called, from another thread, when it exits (negative: a signal)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if not self.alive:
                future.set_exception(RuntimeError("the zygote process is gone"))
                return future
            request = next(self._requests)
            self._pending[request] = (future, on_exit)
            try:
                data = wire.frame(Spawn(request, spec))
                sent = socket.send_fds(self.sock, [data], fds)
                if sent < len(data):
                    self.sock.sendall(data[sent:])
            except OSError as exc:
                self._pending.pop(request, None)
                future.set_exception(RuntimeError(f"the zygote process is gone: {exc}"))
        return future

    def _read(self) -> None:
        reader = wire.FrameReader(Started | Exited)
        while True:
            try:
                messages = reader.receive(self.sock)
            except OSError:
                messages = None
            if messages is None:
                break
            for message in messages:
                self._handle(message)
        with self._lock:
            self.alive = False
            pending, self._pending = self._pending, {}
        for future, _ in pending.values():
            future.set_exception(RuntimeError("the zygote process exited"))
        # Its children live on, orphaned; each still exits when its own socket to the server closes.
        self.sock.close()
        log.warning("the zygote process (pid %d) exited with code %s; the next model process starts a new one",
                    self.process.pid, self.process.wait())

    def _handle(self, message: Started | Exited) -> None:
        match message:
            case Started(request=request, pid=pid, error=error):
                with self._lock:
                    future, on_exit = self._pending.pop(request)
                    if not error:
                        self._watchers[pid] = on_exit
                if error:
                    future.set_exception(RuntimeError(error))
                else:
                    future.set_result(pid)
            case Exited(pid=pid, returncode=returncode):
                with self._lock:
                    on_exit = self._watchers.pop(pid, None)
                if on_exit is not None:
                    on_exit(returncode)


def _import_path() -> list[str]:
    """This process's module search path, for the zygote (without the directories of in-process models)."""
    own = set(loader.model_paths())
    return [os.path.abspath(p) if p else os.getcwd() for p in sys.path if p not in own]
