"""An instance that runs what it is sent in order (``ModelInstance.submit``, as a model process does) is sent its next
batch while it runs one when that batch is full (``DynamicBatcher.offer``): never a batch that could still grow,
never one an idle instance waits for."""

from __future__ import annotations

import asyncio

import numpy as np
from toy_backends import BATCHES, SumInstance, collect, instance_backend, start_core, sum_request, wait_for, write_model

LOG: list[tuple] = []  # ("submit", ids, busy when sent) / ("start", ids, instance)


class QueuedSum(SumInstance):
    """The toy sum run as a model process runs its batches: sent at once, run in order on a task of its own, each
    taking ``run_ms``, the responses sent through the requests' senders."""

    def __init__(self, model, ctx) -> None:
        super().__init__(model, ctx)
        self.queue: asyncio.Queue | None = None
        self.busy = False

    def submit(self, requests):
        loop = asyncio.get_running_loop()
        if self.queue is None:
            self.queue = asyncio.Queue()
            self.runner = loop.create_task(self._run())
        done = loop.create_future()
        LOG.append(("submit", [int(r.id) for r in requests], self.busy or not self.queue.empty()))
        self.queue.put_nowait((requests, done))
        return done

    async def execute(self, requests):
        await self.submit(requests)

    async def _run(self) -> None:
        while True:
            requests, done = await self.queue.get()
            self.busy = True
            LOG.append(("start", [int(r.id) for r in requests], self.ctx.name))
            await asyncio.sleep(float(self.model.ctx.parameter("run_ms")) / 1000)
            for request, response in zip(requests, SumInstance.execute(self, requests)):
                request.response_sender.send(response, final=True)
            self.busy = False
            done.set_result(None)


async def start(tmp_path, instances: int, delay_us: int):
    from tideserve.backend import BackendRegistry

    write_model(tmp_path, "m", max_batch_size=4, instances=instances,
                extra=f"dynamic_batching {{ max_queue_delay_microseconds: {delay_us} }}", params={"run_ms": "100"})
    registry = BackendRegistry()
    registry.register("toy", instance_backend(QueuedSum))
    dataplane = await start_core(tmp_path, registry=registry)
    return dataplane, dataplane.repository


async def first_running(dataplane) -> asyncio.Task:
    """Request 0 sent, once its batch has started on an instance."""
    first = asyncio.create_task(collect(dataplane, sum_request("m", 0, value=0)))
    await wait_for(lambda: any(e[0] == "start" for e in LOG))
    return first


def check(results, ids) -> None:
    for i, responses in zip(ids, results):
        (response,) = responses
        assert response.error is None and response.final
        np.testing.assert_array_equal(response.output("OUTPUT0").data, np.full((1, 4), float(i)) + np.arange(4))


async def test_a_full_batch_goes_to_the_busy_instance_and_one_that_can_grow_waits(tmp_path):
    BATCHES.clear()
    LOG.clear()
    dataplane, repository = await start(tmp_path, instances=1, delay_us=0)
    try:
        first = await first_running(dataplane)
        full = [asyncio.create_task(collect(dataplane, sum_request("m", i, value=i))) for i in range(1, 5)]
        await wait_for(lambda: len([e for e in LOG if e[0] == "submit"]) == 2)
        more = [asyncio.create_task(collect(dataplane, sum_request("m", i, value=i))) for i in range(5, 7)]
        results = await asyncio.gather(first, *full, *more)
        check(results, range(7))
        assert BATCHES["m"] == [[0], [1, 2, 3, 4], [5, 6]]
        # [1..4] was full: sent while [0] ran; [5, 6] could grow: formed once the instance was free
        assert [e for e in LOG if e[0] == "submit"] == [
            ("submit", [0], False), ("submit", [1, 2, 3, 4], True), ("submit", [5, 6], False)]
        stats = (await dataplane.statistics("m"))[0]
        assert stats["inference_count"] == 7 and stats["execution_count"] == 3
        assert not repository.get("m").scheduler._ahead  # the last offer withdrawn when its run ended
    finally:
        await repository.shutdown(5)


async def test_an_idle_instance_takes_a_full_batch_not_the_busy_one(tmp_path):
    BATCHES.clear()
    LOG.clear()
    # a long window: the idle instance's worker waits in the batcher while the requests gather
    dataplane, repository = await start(tmp_path, instances=2, delay_us=100_000)
    try:
        first = await first_running(dataplane)
        busy = next(e[2] for e in LOG if e[0] == "start")
        full = [asyncio.create_task(collect(dataplane, sum_request("m", i, value=i))) for i in range(1, 5)]
        results = await asyncio.gather(first, *full)
        check(results, range(5))
        assert sorted(BATCHES["m"]) == [[0], [1, 2, 3, 4]]
        assert all(not e[2] for e in LOG if e[0] == "submit")
        assert [e[2] for e in LOG if e[0] == "start" and e[1] == [1, 2, 3, 4]] != [busy]
    finally:
        await repository.shutdown(5)
