"""--frontend-direct's data path, without a server: a worker's requests of one loop turn for a model go to one
instance process (up to its max_batch_size) and leave in one message, and with a dynamic batcher every worker's
requests go to the first instance that runs no batch until it holds a full batch (they meet in one batch there; the
instances say in a shared word what their batchers hold and whether they run a batch); an instance process answers a loop turn's
responses in one message; its batcher waits sub-millisecond delays on a timerfd (the loop's own timers would fire
at once, round after round, for the whole delay)."""

from __future__ import annotations

import asyncio
import time
import types

import pytest
from tideserve import wire
from tideserve.general_backends.python.direct import SHORT_RUN_NS as _SHORT_RUN_NS
from tideserve.general_backends.python.direct import _FineTimer, _QueueWord
from tideserve.workers.direct import DirectAnswer, DirectAnswers, DirectLink, DirectRouter, DirectSubmit
from tritonclient.grpc import model_config_pb2 as mc


def _runtime(uid: int, max_batch_size: int):
    return types.SimpleNamespace(uid=uid, config=mc.ModelConfig(max_batch_size=max_batch_size))


class _Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))


def _router(addresses: list[str]) -> DirectRouter:
    router = DirectRouter(plane=None)
    for address in addresses:
        link = router.links[address] = DirectLink(router, address)
        link.connection_made(_Transport())
    return router


async def _pick(router: DirectRouter, addresses: list[str], runtime) -> DirectLink:
    link = router._pick(addresses, runtime)
    link.streams[len(link.streams) + 1000 * id(link)] = object()  # in flight, as route() records it
    return link


def test_one_turns_requests_go_to_one_instance_up_to_its_batch_size_then_the_least_loaded():
    async def main():
        addresses = ["a", "b"]
        router = _router(addresses)
        model = _runtime(1, max_batch_size=3)
        first = [await _pick(router, addresses, model) for _ in range(3)]
        assert first[0] is first[1] is first[2]
        fourth = await _pick(router, addresses, model)
        assert fourth is not first[0]  # the first one is full for this turn
        other = await _pick(router, addresses, _runtime(2, max_batch_size=3))  # another model picks for itself
        assert other in (first[0], fourth)
        await asyncio.sleep(0)  # the next turn: the least loaded instance
        assert await _pick(router, addresses, model) is fourth

    asyncio.run(main())


def _batched(uid: int, max_batch_size: int):
    config = mc.ModelConfig(max_batch_size=max_batch_size)
    config.dynamic_batching.max_queue_delay_microseconds = 100
    return types.SimpleNamespace(uid=uid, config=config)


def test_with_a_dynamic_batcher_every_workers_requests_meet_at_the_first_instance_up_to_a_full_batch():
    async def main():
        addresses = ["a", "b"]
        workers = [_router(addresses), _router(addresses)]
        for router in workers:
            router.workers = 2  # each worker's share of a batch of 8: 4
        model = _batched(1, max_batch_size=8)
        for _ in range(4):  # one request a turn from each worker: all to the first instance, where they batch
            for router in workers:
                assert (await _pick(router, addresses, model)).address == "a"
            await asyncio.sleep(0)
        for router in workers:  # each worker has its share there: the next instance
            assert (await _pick(router, addresses, model)).address == "b"
        await asyncio.sleep(0)
        first = workers[0]
        first.links["a"].streams.clear()  # that batch answered: the first instance again
        assert (await _pick(first, addresses, model)).address == "a"

    asyncio.run(main())


def test_once_every_instance_holds_a_share_the_least_loaded_takes_the_next_turn():
    async def main():
        addresses = ["a", "b"]
        router = _router(addresses)  # one worker: its share is the whole batch
        model = _batched(1, max_batch_size=2)
        picked = []
        for _ in range(6):
            picked.append((await _pick(router, addresses, model)).address)
            await asyncio.sleep(0)
        assert picked[:4] == ["a", "a", "b", "b"]
        assert sorted(picked[4:]) == ["a", "b"]

    asyncio.run(main())


def _queue_words(tmp_path, names: list[str]) -> tuple[list[str], dict]:
    """Instances that say how many requests their batchers hold, as an instance process writes it."""
    addresses = [str(tmp_path / f"{name}.sock") for name in names]
    return addresses, {name: _QueueWord(address) for name, address in zip(names, addresses, strict=True)}


def _two_workers_two_instances(tmp_path):
    """Two instances' queue words (a, b), two workers' routers over them, and a model with a dynamic batcher and
    ``max_batch_size`` 8."""
    addresses, words = _queue_words(tmp_path, ["a", "b"])
    workers = [_router(addresses), _router(addresses)]
    for router in workers:
        router.workers = 2
    return addresses, words, workers, _batched(1, max_batch_size=8)


def test_with_queue_words_requests_meet_at_the_first_free_instance_as_in_one_queue(tmp_path):
    """Every worker sends to the first instance that runs no batch and holds less than a full one (its requests meet
    in one batch there); while it runs a batch, to the next free one (as one queue hands its next batch to a free
    instance); where all run one, to the first with room behind its batch."""
    async def main():
        addresses, words, workers, model = _two_workers_two_instances(tmp_path)
        a, b = addresses
        for queued in range(6):  # a collects its batch, short of a full one: every worker's requests go there
            words["a"].set(queued)
            for router in workers:
                assert (await _pick(router, addresses, model)).address == a
            await asyncio.sleep(0)
        words["a"].set(8)  # a full batch waits at a: the next one forms at b
        for router in workers:
            assert (await _pick(router, addresses, model)).address == b
        await asyncio.sleep(0)
        words["a"].set(0)
        words["a"].executing(True)  # a runs its batch: b, free, takes the next
        for router in workers:
            assert (await _pick(router, addresses, model)).address == b
        await asyncio.sleep(0)
        words["b"].executing(True)  # both run a batch: the first with room behind its batch
        assert (await _pick(workers[0], addresses, model)).address == a
        await asyncio.sleep(0)
        words["a"].set(8)  # a holds a full batch behind its run: b
        assert (await _pick(workers[0], addresses, model)).address == b
        await asyncio.sleep(0)
        words["b"].set(8)  # both hold a full batch: the least loaded of this worker's
        assert (await _pick(workers[0], addresses, model)).address in (a, b)
        await asyncio.sleep(0)
        words["a"].executing(False)
        words["a"].set(3)  # a finished its run and collects again: a
        assert (await _pick(workers[1], addresses, model)).address == a
        for word in words.values():
            word.close()
        assert not list(tmp_path.iterdir())

    asyncio.run(main())


def test_an_instance_whose_batches_run_short_collects_the_next_batch_behind_its_run(tmp_path):
    """Where an instance's batches run short (their running mean), the workers' requests wait behind the batch it
    runs, until a full one waits there, rather than wake the free instance; where the run has gone on for longer,
    or its batches run long, the free instance takes the next batch."""
    async def main():
        addresses, words, workers, model = _two_workers_two_instances(tmp_path)
        a, b = addresses
        short = int(_SHORT_RUN_NS // 4)
        words["a"].ran(short)
        words["a"].executing(True, time.monotonic_ns())
        for queued in range(8):  # a runs a short batch: the next one collects behind it
            words["a"].set(queued)
            for router in workers:
                assert (await _pick(router, addresses, model)).address == a
            await asyncio.sleep(0)
        words["a"].set(8)  # a full batch waits behind a's run: b takes the next
        assert (await _pick(workers[0], addresses, model)).address == b
        await asyncio.sleep(0)
        words["a"].set(0)
        words["a"].executing(True, time.monotonic_ns() - int(_SHORT_RUN_NS * 2))  # this run has gone on for long: b
        assert (await _pick(workers[1], addresses, model)).address == b
        await asyncio.sleep(0)
        for _ in range(40):  # its batches now run long: b, free, takes the next, as from one queue
            words["a"].ran(int(_SHORT_RUN_NS * 4))
        words["a"].executing(True, time.monotonic_ns())
        assert (await _pick(workers[0], addresses, model)).address == b
        for word in words.values():
            word.close()

    asyncio.run(main())


def test_a_model_without_batching_spreads_its_requests():
    async def main():
        addresses = ["a", "b"]
        router = _router(addresses)
        model = _runtime(1, max_batch_size=0)
        picked = [await _pick(router, addresses, model) for _ in range(4)]
        assert picked[0] is not picked[1] and picked[0] is picked[2] and picked[1] is picked[3]

    asyncio.run(main())


def test_a_turns_submissions_leave_in_one_message_before_its_cancellations():
    async def main():
        router = _router(["a"])
        link = router.links["a"]
        for rid in (1, 2, 3):
            link.submit(wire.Request(rid, "m", "", "", [], [], {}))
        link.send(wire.Cancel(2))
        await asyncio.sleep(0)
        (data,) = link.transport.writes
        reader = wire.FrameReader(DirectSubmit | wire.Cancel)
        submit, cancel = reader.feed(data)
        assert [r.rid for r in submit.requests] == [1, 2, 3]
        assert cancel == wire.Cancel(2)

    asyncio.run(main())


def test_a_batch_of_answers_reaches_each_stream():
    async def main():
        router = _router(["a"])
        link = router.links["a"]
        got = {}
        for rid in (7, 8):
            link.streams[rid] = types.SimpleNamespace(_put=lambda item, rid=rid: got.setdefault(rid, item))
        answers = DirectAnswers([DirectAnswer(7, wire.Response(id="seven")), DirectAnswer(9, wire.Response()),
                                 DirectAnswer(8, wire.Response(id="eight"))])
        link.data_received(wire.frame(answers) + wire.frame(DirectAnswer(8, wire.Response(id="late"))))
        assert got[7].id == "seven" and got[8].id == "eight"  # 9 is gone: dropped

    asyncio.run(main())


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_the_fine_timer_wakes_its_waiter_and_a_disarmed_one_stays_asleep(loop):
    async def main():
        running = asyncio.get_running_loop()
        timer = _FineTimer.create(running)
        assert timer is not None  # Linux
        try:
            woken = running.create_future()
            timer.arm(0.0002, woken)
            await asyncio.wait_for(woken, 10)
            disarmed = running.create_future()
            timer.arm(0.0002, disarmed)
            timer.disarm(disarmed)
            again = running.create_future()
            timer.arm(0.0005, again)  # re-armed for another waiter: only that one wakes
            await asyncio.wait_for(again, 10)
            await asyncio.sleep(0.01)
            assert not disarmed.done()
        finally:
            timer.close()

    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        uvloop.run(main())
    else:
        asyncio.run(main())


def test_a_lone_request_waits_out_a_short_delay_through_loop_turns_more_queued_on_the_timer():
    from tideserve.general_backends.python import direct

    class FakeTimer:
        def __init__(self, loop) -> None:
            self.loop = loop
            self.armed: list[float] = []

        def arm(self, timeout, waiter) -> None:
            self.armed.append(timeout)
            waiter.set_result(None)

        def disarm(self, waiter) -> None:
            pass

    async def main():
        batcher = direct._DirectBatcher.__new__(direct._DirectBatcher)
        batcher._fine = FakeTimer(asyncio.get_running_loop())
        batcher._waiter = None
        queued = [1]
        batcher.pending = lambda: queued[0]
        await batcher._sleep(direct.SPIN_MAX_S / 2)  # one loop turn, no timer
        assert batcher._fine.armed == []
        queued[0] = 3
        await batcher._sleep(direct.SPIN_MAX_S / 2)  # more queued: the timerfd
        assert batcher._fine.armed == [direct.SPIN_MAX_S / 2]
        queued[0] = 1
        await batcher._sleep(direct.LOOP_TIMER_RESOLUTION_S / 2 + direct.SPIN_MAX_S)  # too long to spin
        assert len(batcher._fine.armed) == 2

    asyncio.run(main())
