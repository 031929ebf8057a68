"""A queue-deadline refusal is answered where the backend makes it: ``ResponseStream.on_error`` calls its hook
once, on the loop, as the error response is put (after the reader's wake-up, which still takes the response),
and never for a response without an error."""

from __future__ import annotations

import asyncio

from tideserve.errors import DeadlinePassed
from tideserve.responses import ResponseStream
from tideserve.types import InferenceResponse


def test_on_error_runs_once_as_the_error_is_put_and_the_reader_still_takes_it():
    async def main():
        stream = ResponseStream(asyncio.get_running_loop())
        seen: list = []
        stream.on_error = seen.append
        stream.put(InferenceResponse(final=False))  # a response with no error: no call
        assert seen == []
        reader = asyncio.ensure_future(stream.get())
        await asyncio.sleep(0)
        assert (await reader).error is None
        waiter = asyncio.ensure_future(stream.get())
        await asyncio.sleep(0)
        refusal = DeadlinePassed("no place by the deadline", 1, 2)
        stream.put(InferenceResponse(error=refusal, final=True))
        assert seen == [refusal]  # at once, before the reader ran
        assert not waiter.done()
        assert (await waiter).error is refusal
        stream.put(InferenceResponse(error=DeadlinePassed("again"), final=True))
        assert seen == [refusal]  # once

    asyncio.run(main())


def _slice_ns(tid: int) -> int | None:
    """The thread's time slice as the kernel reports it (``se.slice`` of ``/proc/self/task/<tid>/sched``)."""
    try:
        with open(f"/proc/self/task/{tid}/sched") as sched:
            for line in sched:
                if line.startswith("se.slice"):
                    return int(line.split(":")[1])
    except OSError:
        pass
    return None


def test_the_loop_thread_asks_for_a_short_slice_and_its_children_do_not_inherit_it():
    import threading

    pytest = __import__("pytest")
    generation = pytest.importorskip("tideserve.llm_backends.vllm.generation")
    seen: dict = {}

    def loop_thread() -> None:
        tid = threading.get_native_id()
        seen["default"] = _slice_ns(tid)
        seen["zero"] = generation.ask_for_short_slice(0)  # 0: left as it is
        seen["took"] = generation.ask_for_short_slice(200)
        seen["again"] = generation.ask_for_short_slice(200)  # once per thread
        seen["slice"] = _slice_ns(tid)
        child = threading.Thread(target=lambda: seen.__setitem__("child", _slice_ns(threading.get_native_id())))
        child.start()
        child.join()

    thread = threading.Thread(target=loop_thread)
    thread.start()
    thread.join()
    assert seen["zero"] is False and seen["again"] is False
    if not seen["took"]:  # another OS or an older kernel: nothing changed
        assert seen["slice"] == seen["default"]
        return
    if seen["slice"] is not None:  # the kernel shows slices (EEVDF)
        assert seen["slice"] == 200_000
        assert seen["child"] == seen["default"] != 200_000  # a thread it starts has the default again
