"""A queue deadline's notion of "started" for a vLLM model (``EngineOrder`` in
``llm_backends/vllm/generation.py``): at its deadline, a request with a place in the engine (fewer than ``max_num_seqs`` sequences unfinished ahead of it,
first come first served) runs on; one without is refused and leaves the order."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import uvloop
from tideserve.llm_backends.vllm.generation import KV_NEARLY_FULL, EngineOrder


def test_a_request_has_a_place_while_fewer_than_max_num_seqs_sequences_are_ahead():
    order = EngineOrder(max_num_seqs=3)
    for key in "abcd":
        order.add(key, 1)
    assert [order.placed(k) for k in "abcd"] == [True, True, True, False]
    order.remove("b")  # finished (or refused): the next one moves up
    assert order.placed("d")
    assert not order.placed("gone")  # not in the engine (still rendering, or already left): no place


def test_parallel_sampling_takes_n_places():
    order = EngineOrder(max_num_seqs=4)
    order.add("a", 3)
    order.add("b", 2)  # 3 + 2 > 4: not all of b's sequences fit
    order.add("c", 0)  # n counts at least one
    assert order.placed("a") and not order.placed("b") and not order.placed("c")
    order.remove("a")
    assert order.placed("b") and order.placed("c")


def test_no_place_under_priority_scheduling_or_a_nearly_full_kv_cache():
    order = EngineOrder(max_num_seqs=8, enabled=False)  # the engine's order is not the arrival order
    order.add("a", 1)
    assert not order.placed("a")
    usage = [0.0]
    order = EngineOrder(max_num_seqs=8, kv_usage=lambda: usage[0])
    order.add("a", 1)
    assert order.placed("a")
    usage[0] = KV_NEARLY_FULL  # the engine may hold requests back for want of blocks
    assert not order.placed("a")


def test_deadline_lets_a_placed_request_run_on_and_refuses_one_without_a_place():
    from tideserve.errors import DeadlinePassed
    from tideserve.llm_backends.vllm.generation import _Abort, _Deadline

    answers: dict = {}
    aborted: list = []

    class Engine:
        async def abort(self, request_ids):  # vLLM's AsyncLLM.abort: the ids of one loop turn together
            aborted.extend(request_ids)

    class Sender:
        def __init__(self, key):
            self.key = key

        def send_error(self, error):
            answers[self.key] = error

    order = EngineOrder(max_num_seqs=2)

    async def run():
        loop = asyncio.get_running_loop()
        deadlines = {}
        for key in ("running", "next", "waiting"):
            order.add(key, 1)
            request = SimpleNamespace(response_sender=Sender(key), is_cancelled=lambda: False)
            deadline = _Deadline(request, request.response_sender, time.monotonic_ns() + 2_000_000, 2.0,
                                 _Abort(Engine(), key, loop), "llm")
            deadline.order, deadline.engine_id = order, key
            deadlines[key] = deadline
        rendering = SimpleNamespace(response_sender=Sender("rendering"), is_cancelled=lambda: False)
        deadlines["rendering"] = _Deadline(rendering, rendering.response_sender, time.monotonic_ns() + 2_000_000, 2.0,
                                           _Abort(Engine(), "rendering", loop), "llm")  # not in the engine yet
        await asyncio.sleep(0.05)
        return deadlines

    deadlines = uvloop.run(run())
    assert deadlines["running"].started and deadlines["next"].started  # places in the engine: they run on
    assert not deadlines["running"].expired and not deadlines["next"].expired
    assert sorted(answers) == ["rendering", "waiting"]  # the third in line and the one never added: refused
    assert all(isinstance(error, DeadlinePassed) for error in answers.values())
    assert sorted(aborted) == ["rendering", "waiting"]
    assert list(order.entries) == ["running", "next"]  # the refused one left the order at once


def test_the_deadline_refusals_of_one_loop_turn_go_to_the_engine_as_one_abort():
    """Deadlines that fire in the same loop turn (a retry burst's) abort their requests with one engine call; a
    later turn's refusal with another; each request is aborted once, after its answer."""
    from tideserve.llm_backends.vllm.generation import _Abort, _AbortBatch, _Deadline

    calls: list = []
    events: list = []

    class Engine:
        async def abort(self, request_ids):
            calls.append(list(request_ids))
            events.extend(("abort", key) for key in request_ids)

    class Sender:
        def __init__(self, key):
            self.key = key

        def send_error(self, error):
            events.append(("answer", self.key))

    async def run():
        loop = asyncio.get_running_loop()
        batch = _AbortBatch(Engine(), loop)
        now = time.monotonic_ns()
        for key, due_ms in (("a", 2), ("b", 2), ("c", 2), ("late", 30)):
            request = SimpleNamespace(response_sender=Sender(key), is_cancelled=lambda: False)
            _Deadline(request, request.response_sender, now + due_ms * 1_000_000, float(due_ms),
                      _Abort(batch.engine, key, loop, batch), "llm")
        busy = time.perf_counter() + 0.005  # the loop busy past the first three deadlines: they fire in one turn
        while time.perf_counter() < busy:
            pass
        await asyncio.sleep(0.1)
        # a cancellation from another thread joins the batch of its turn too
        cancelled = _Abort(batch.engine, "cancelled", loop, batch)
        await loop.run_in_executor(None, cancelled.on_cancel)
        await asyncio.sleep(0.02)
        cancelled.on_cancel()  # once only
        await asyncio.sleep(0.02)

    uvloop.run(run())
    assert calls == [["a", "b", "c"], ["late"], ["cancelled"]]
    for key in ("a", "b", "c", "late"):
        assert events.index(("answer", key)) < events.index(("abort", key))
