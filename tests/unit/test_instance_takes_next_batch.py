"""An instance whose batches run on its own thread (``releases_gil``, as ONNX Runtime's) takes its next ready batch
itself at the end of a run (``DynamicBatcher.take_ready``), never one an idle instance waits for."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
from toy_backends import BATCHES, SumInstance, collect, instance_backend, start_core, sum_request, wait_for, write_model


class ThreadedSum(SumInstance):
    """The toy sum, run as a native run that lets the GIL go: each batch takes ``delay_ms``."""

    releases_gil = True


async def start(tmp_path, instances: int = 1, extra: str = "dynamic_batching { }"):
    from tideserve.backend import BackendRegistry

    write_model(tmp_path, "m", instances=instances, extra=extra, params={"delay_ms": "40", "kind": "threaded"})
    registry = BackendRegistry()
    registry.register("toy", instance_backend({"threaded": ThreadedSum}))
    dataplane = await start_core(tmp_path, registry=registry)
    return dataplane, dataplane.repository


def spy_take(repository) -> list:
    """Record what the batcher's ``take_ready`` gives the instance threads."""
    scheduler = repository.get("m").scheduler
    taken, take = [], scheduler.take_ready

    def recording():
        batch = take()
        taken.append((threading.current_thread().name, [int(r.id) for r in batch] if batch else None))
        return batch

    scheduler.take_ready = recording
    return taken


async def test_the_thread_goes_on_to_the_batch_queued_during_its_run(tmp_path):
    BATCHES.clear()
    dataplane, repository = await start(tmp_path)
    try:
        await collect(dataplane, sum_request("m", 100))  # a first run: the instance's runs last long enough
        taken = spy_take(repository)
        BATCHES["m"].clear()
        first = asyncio.create_task(collect(dataplane, sum_request("m", 0, value=0)))
        await wait_for(lambda: len(BATCHES["m"]) == 1)
        queued = [asyncio.create_task(collect(dataplane, sum_request("m", i, value=i))) for i in range(1, 4)]
        results = await asyncio.gather(first, *queued)
        assert BATCHES["m"] == [[0], [1, 2, 3]]
        # the thread took [1, 2, 3] itself when [0] ended, then found nothing more
        assert [batch for _, batch in taken] == [[1, 2, 3], None]
        assert all(name.startswith("m_0") for name, _ in taken)
        for i, responses in enumerate(results):
            (response,) = responses
            assert response.error is None and response.final
            np.testing.assert_array_equal(response.output("OUTPUT0").data, np.full((1, 4), float(i)) + np.arange(4))
        stats = (await dataplane.statistics("m"))[0]
        assert stats["inference_count"] == 5 and stats["execution_count"] == 3
    finally:
        await repository.shutdown(5)


async def test_an_idle_instance_takes_the_batch_not_the_busy_ones_thread(tmp_path):
    BATCHES.clear()
    # a long window: the idle instance's worker waits in the batcher while the requests gather
    dataplane, repository = await start(tmp_path, instances=2,
                                        extra="dynamic_batching { max_queue_delay_microseconds: 100000 }")
    try:
        for i in range(2):  # one run on each instance (their workers take turns at the batcher)
            await collect(dataplane, sum_request("m", 100 + i))
        taken = spy_take(repository)
        BATCHES["m"].clear()
        first = asyncio.create_task(collect(dataplane, sum_request("m", 0)))
        await wait_for(lambda: len(BATCHES["m"]) == 1)
        second = asyncio.create_task(collect(dataplane, sum_request("m", 1)))
        await asyncio.gather(first, second)
        assert sorted(BATCHES["m"]) == [[0], [1]]
        # each run ended while the other instance's worker waited in the batcher: neither thread took a batch
        assert taken and all(batch is None for _, batch in taken)
    finally:
        await repository.shutdown(5)
