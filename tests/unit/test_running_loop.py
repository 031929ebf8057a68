"""``tideserve.loops.running_loop``: asyncio's running loop, kept per thread without a getpid system call per
call, and never a stale one (a stopped loop, another thread's, a forked parent's)."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
import uvloop
from tideserve import loops
from tideserve.loops import running_loop


def _running() -> asyncio.AbstractEventLoop:
    async def ask():
        assert running_loop() is asyncio.get_running_loop()
        return running_loop()

    return ask


@pytest.mark.parametrize("run", [asyncio.run, uvloop.run])
def test_it_is_the_running_loop_and_a_new_loop_replaces_a_stopped_one(run):
    first = run(_running()())
    second = run(_running()())
    assert first is not second  # each run's own loop, not the first one kept
    with pytest.raises(RuntimeError):
        running_loop()  # none runs: as asyncio says


def test_each_thread_gets_its_own_loop():
    seen = {}

    def in_thread(name):
        seen[name] = asyncio.run(_running()())

    threads = [threading.Thread(target=in_thread, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen["a"] is not seen["b"]


def test_a_loop_kept_in_a_parent_is_not_the_forked_child_s():
    async def parent():
        loop = running_loop()
        pid = os.fork()
        if pid == 0:  # the child: the parent's loop is copied and marked running, but it does not run here
            os._exit(0 if loops._pid == os.getpid() and loops._cache.pid != loops._pid else 1)
        assert loop is running_loop()
        return pid

    pid = asyncio.run(parent())
    _, status = os.waitpid(pid, 0)
    assert status == 0
