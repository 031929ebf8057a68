"""``InstanceThread.serve``: the instance's thread runs an event loop (a model process's direct links) and the work
posted to the thread meanwhile runs between the loop's callbacks, in order, with no running loop in sight."""

from __future__ import annotations

import asyncio
import threading

from tideserve.general_backends.python.backend import InstanceThread
from tideserve.general_backends.python.scope import ModelScope


def _thread() -> InstanceThread:
    return InstanceThread("serve-test", ModelScope(None, "m", 1, None, None))


def _running_loop():
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def test_posts_before_during_and_after_the_loop_run_in_order_on_the_thread():
    thread = _thread()
    seen: list = []
    thread.post(seen.append, "before")  # queued
    assert thread.submit(lambda: None).result(10) is None
    loop = asyncio.new_event_loop()
    started = threading.Event()
    thread.post(lambda: (loop.call_soon(started.set), thread.serve(loop)))
    assert started.wait(10)
    ident = thread.submit(threading.get_ident).result(10)
    assert ident == thread._thread.ident
    assert thread.submit(_running_loop).result(10) is None  # model code sees no running loop
    for i in range(50):
        thread.post(seen.append, i)
    assert thread.submit(lambda: list(seen)).result(10) == ["before", *range(50)]
    assert asyncio.run_coroutine_threadsafe(asyncio.sleep(0, "on the loop"), loop).result(10) == "on the loop"
    thread.stop()
    thread._thread.join(10)
    assert not thread._thread.is_alive()
    loop.close()


def test_a_failing_post_is_logged_and_a_submit_carries_its_error_while_serving(caplog):
    thread = _thread()
    loop = asyncio.new_event_loop()
    started = threading.Event()
    thread.post(lambda: (loop.call_soon(started.set), thread.serve(loop)))
    assert started.wait(10)
    thread.post(lambda: 1 / 0)
    future = thread.submit(lambda: {}["missing"])
    try:
        future.result(10)
    except KeyError:
        pass
    else:
        raise AssertionError("the submit's error was lost")
    assert thread.submit(lambda: "alive").result(10) == "alive"
    assert not thread.busy
    thread.stop()
    thread._thread.join(10)
    assert "failed" in caplog.text
    loop.close()
