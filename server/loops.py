"""The running event loop, found without a system call.

On CPython 3.11 ``asyncio.get_running_loop()`` (and everything that looks the loop up: ``asyncio.Future()``,
``asyncio.sleep(d)``, ``asyncio.current_task()``) asks the kernel for the process id each time, a check that a
forked child does not run its parent's loop: a ``getpid`` system call, about a microsecond on a VM, on every
request of the hot paths. :func:`running_loop` keeps the loop per thread and checks it cheaply instead.

For the server's own code that runs as a loop's callback or task; model code (which may run a loop of its own
on an instance's thread while the instance's loop is marked not running) asks asyncio.
"""

from __future__ import annotations

import asyncio
import os
import threading

_pid = os.getpid()


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


class _Cache(threading.local):
    loop: asyncio.AbstractEventLoop | None = None
    pid = 0


_cache = _Cache()


def running_loop() -> asyncio.AbstractEventLoop:
    """``asyncio.get_running_loop()``: the loop this thread last found running, while it still runs (a thread runs
    one loop at a time) in this process (not a forked copy); else asyncio's answer (RuntimeError if none runs)."""
    cache = _cache
    loop = cache.loop
    if loop is not None and cache.pid == _pid and loop.is_running():
        return loop
    loop = asyncio.get_running_loop()
    cache.loop = loop
    cache.pid = _pid
    return loop
