"""The zygote process itself (see :mod:`.zygote` for what it is and how the server talks to it).

Kept apart from :mod:`.zygote`, the server's side, because it imports the whole model-process stack
(:mod:`.stub`, which hosts the Python backend's model classes): the server's side must not.
"""

from __future__ import annotations

import errno
import gc
import os
import select
import signal
import socket
import traceback

from tideserve.backend_api import wire

from .zygote import FDS_PER_PROCESS, Exited, Spawn, Started


# -- the zygote process --------------------------------------------------------------------------------
def main(fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import triton_python_backend_utils  # noqa: F401 - imported once here, inherited by every model process

    from . import stub
    gc.collect()
    gc.freeze()  # what the children inherit stays shared: no reference counting writes to those pages
    sock = socket.socket(fileno=fd)
    wake_r, wake_w = os.pipe()
    for end in (wake_r, wake_w):
        os.set_blocking(end, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd hears of each exit
    reader = wire.FrameReader(Spawn)
    children: set[int] = set()
    try:
        while True:
            readable, _, _ = select.select([sock, wake_r], [], [])
            if wake_r in readable:
                while True:
                    try:
                        os.read(wake_r, 512)
                    except BlockingIOError:
                        break
                _reap(sock, children)
            if sock in readable:
                messages = reader.receive(sock)
                if messages is None:
                    break
                for message in messages:
                    fds = [reader.take_fd() for _ in range(FDS_PER_PROCESS)]
                    _fork(message, fds, stub, sock, (wake_r, wake_w), children)
    except OSError as exc:
        if exc.errno not in (errno.EPIPE, errno.ECONNRESET):
            raise
    finally:
        for pid in children:  # the server is gone: so are its model processes
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _fork(message: Spawn, fds: list[int], stub, sock: socket.socket, wake: tuple[int, int],
          children: set[int]) -> None:
    try:
        pid = os.fork()
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        sock.sendall(wire.frame(Started(message.request, 0, f"fork failed: {exc}")))
        return
    if pid == 0:
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            sock.close()
            for end in wake:
                os.close(end)
            code = stub.run(message.spec, *fds)
        except BaseException:  # noqa: BLE001 - the child must never return into the zygote's loop
            traceback.print_exc()
        finally:
            os._exit(code)
    for fd in fds:
        os.close(fd)
    children.add(pid)
    sock.sendall(wire.frame(Started(message.request, pid)))


def _reap(sock: socket.socket, children: set[int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        sock.sendall(wire.frame(Exited(pid, os.waitstatus_to_exitcode(status))))

