"""The dynamic batcher built in-process over toy models: formation, priorities, timeouts, splitting."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tideserve.errors import ServerError, Status
from toy_backends import BATCHES, GATES, collect, sum_request, wait_for, write_model


@pytest.fixture(autouse=True)
def _fresh_records():
    BATCHES.clear()
    yield
    for event in GATES.values():  # never leave an instance thread blocked
        event.set()
    GATES.clear()


def gate(name: str):
    import threading
    GATES[name] = threading.Event()
    return GATES[name]


async def test_batches_fill_up_and_outputs_split_back(tmp_path, start_core):
    write_model(tmp_path, "m", extra="dynamic_batching { max_queue_delay_microseconds: 200000 }",
                params={"gate": "batch-fill"})
    release = gate("batch-fill")
    dataplane = await start_core(tmp_path)
    BATCHES["m"].clear()
    # the first request occupies the only instance; the next 10 queue and form [8] then [2]
    first = asyncio.create_task(collect(dataplane, sum_request("m", 0, value=0)))
    await wait_for(lambda: len(BATCHES["m"]) == 1)
    tasks = [asyncio.create_task(collect(dataplane, sum_request("m", i, value=i))) for i in range(1, 11)]
    await asyncio.sleep(0.05)
    release.set()
    results = await asyncio.gather(first, *tasks)
    assert [len(b) for b in BATCHES["m"]] == [1, 8, 2]
    for i, responses in enumerate(results):
        (response,) = responses
        assert response.error is None and response.final
        out = response.output("OUTPUT0").data
        assert out.shape == (1, 4)
        np.testing.assert_array_equal(out, np.full((1, 4), float(i)) + np.arange(4))
    stats = (await dataplane.statistics("m"))[0]
    assert stats["inference_count"] == 11 and stats["execution_count"] == 3
    assert {b["batch_size"] for b in stats["batch_stats"]} == {1, 8, 2}


async def test_multi_row_requests_count_rows_against_max_batch_size(tmp_path, start_core):
    write_model(tmp_path, "m", extra="dynamic_batching { max_queue_delay_microseconds: 200000 }",
                params={"gate": "rows"})
    release = gate("rows")
    dataplane = await start_core(tmp_path)
    BATCHES["m"].clear()
    first = asyncio.create_task(collect(dataplane, sum_request("m", 0)))
    await wait_for(lambda: len(BATCHES["m"]) == 1)
    tasks = [asyncio.create_task(collect(dataplane, sum_request("m", i, rows=3))) for i in range(1, 5)]
    await asyncio.sleep(0.05)
    release.set()
    results = await asyncio.gather(first, *tasks)
    assert [len(b) for b in BATCHES["m"]] == [1, 2, 2]  # 3+3 rows fit in 8, a third would not
    assert all(r[0].output("OUTPUT1").data.shape == (3, 4) for r in results[1:])


async def test_preferred_batch_size_runs_without_waiting_for_the_delay(tmp_path, start_core):
    write_model(tmp_path, "m", extra="dynamic_batching { preferred_batch_size: [ 4 ] "
                                     "max_queue_delay_microseconds: 30000000 }")
    dataplane = await start_core(tmp_path)
    BATCHES["m"].clear()
    results = await asyncio.wait_for(
        asyncio.gather(*(collect(dataplane, sum_request("m", i)) for i in range(4))), timeout=10)
    assert [len(b) for b in BATCHES["m"]] == [4]
    assert all(r[0].error is None for r in results)


async def test_zero_delay_sends_what_is_queued(tmp_path, start_core):
    write_model(tmp_path, "m", extra="dynamic_batching { }")
    dataplane = await start_core(tmp_path)
    results = await asyncio.wait_for(
        asyncio.gather(*(collect(dataplane, sum_request("m", i)) for i in range(20))), timeout=10)
    assert all(r[0].error is None for r in results)
    assert sum(len(b) for b in BATCHES["m"]) == 20


async def test_different_shapes_are_not_merged_unless_ragged(tmp_path, start_core):
    extra = "dynamic_batching { max_queue_delay_microseconds: 100000 }"
    write_model(tmp_path, "fixed", dims="-1", extra=extra, params={"gate": "shapes"})
    write_model(tmp_path, "ragged", dims="-1", extra=extra, ragged=True, params={"gate": "shapes-r"})
    dataplane = await start_core(tmp_path)
    for name, gate_name in (("fixed", "shapes"), ("ragged", "shapes-r")):
        release = gate(gate_name)
        BATCHES[name].clear()
        first = asyncio.create_task(collect(dataplane, sum_request(name, 0, width=2)))
        await wait_for(lambda: len(BATCHES[name]) == 1)
        tasks = [asyncio.create_task(collect(dataplane, sum_request(name, i, width=w)))
                 for i, w in ((1, 2), (2, 3), (3, 2))]
        await asyncio.sleep(0.05)
        release.set()
        results = await asyncio.gather(first, *tasks, return_exceptions=True)
        if name == "fixed":
            # the width-3 request blocks the batch: [1], then [2], then [3]
            assert [len(b) for b in BATCHES[name]] == [1, 1, 1, 1]
            assert all(r[0].error is None for r in results)
        else:
            assert [len(b) for b in BATCHES[name]] == [1, 3]
            # ragged inputs arrive flattened and concatenated: outputs cannot be split back by rows,
            # so a ragged model must produce per-request rows itself; here we only check batching.


async def test_priority_levels_run_higher_priority_first(tmp_path, start_core):
    write_model(tmp_path, "m", extra="""dynamic_batching { max_queue_delay_microseconds: 0
        priority_levels: 2 default_priority_level: 2 }""", max_batch_size=1, params={"gate": "prio"})
    release = gate("prio")
    dataplane = await start_core(tmp_path)
    BATCHES["m"].clear()
    first = asyncio.create_task(collect(dataplane, sum_request("m", 0)))
    await wait_for(lambda: len(BATCHES["m"]) == 1)
    low = [asyncio.create_task(collect(dataplane, sum_request("m", i))) for i in (1, 2)]
    await asyncio.sleep(0.01)
    high = [asyncio.create_task(collect(dataplane, sum_request("m", i, priority=1))) for i in (3, 4)]
    await asyncio.sleep(0.05)
    release.set()
    await asyncio.gather(first, *low, *high)
    assert [b[0] for b in BATCHES["m"]] == [0, 3, 4, 1, 2]


async def test_queue_timeout_reject_and_delay(tmp_path, start_core):
    write_model(tmp_path, "reject", max_batch_size=1, params={"gate": "to-r"}, extra="""dynamic_batching {
        default_queue_policy { timeout_action: REJECT default_timeout_microseconds: 50000 } }""")
    write_model(tmp_path, "delay", max_batch_size=1, params={"gate": "to-d"}, extra="""dynamic_batching {
        priority_levels: 2 default_priority_level: 2
        priority_queue_policy { key: 1 value: { timeout_action: DELAY default_timeout_microseconds: 50000 } } }""")
    dataplane = await start_core(tmp_path)

    release = gate("to-r")
    first = asyncio.create_task(collect(dataplane, sum_request("reject", 0)))
    await wait_for(lambda: len(BATCHES["reject"]) == 1)
    queued = asyncio.create_task(collect(dataplane, sum_request("reject", 1)))
    (timed_out,) = await asyncio.wait_for(queued, timeout=5)  # answered while the instance is still busy
    assert timed_out.error is not None and "timeout" in timed_out.error.message
    assert timed_out.error.status is Status.UNAVAILABLE
    release.set()
    await first

    release = gate("to-d")
    BATCHES["delay"].clear()
    first = asyncio.create_task(collect(dataplane, sum_request("delay", 0)))
    await wait_for(lambda: len(BATCHES["delay"]) == 1)
    delayed = asyncio.create_task(collect(dataplane, sum_request("delay", 1, priority=1)))
    await asyncio.sleep(0.1)  # request 1 times out: demoted behind everything else
    normal = asyncio.create_task(collect(dataplane, sum_request("delay", 2, priority=2)))
    await asyncio.sleep(0.02)
    release.set()
    results = await asyncio.gather(first, delayed, normal)
    assert all(r[0].error is None for r in results)
    assert [b[0] for b in BATCHES["delay"]] == [0, 2, 1]


async def test_timeout_override_and_max_queue_size(tmp_path, start_core):
    write_model(tmp_path, "m", max_batch_size=1, params={"gate": "qs"}, extra="""dynamic_batching {
        default_queue_policy { max_queue_size: 2 allow_timeout_override: true } }""")
    release = gate("qs")
    dataplane = await start_core(tmp_path)
    first = asyncio.create_task(collect(dataplane, sum_request("m", 0)))
    await wait_for(lambda: len(BATCHES["m"]) >= 1)
    a = asyncio.create_task(collect(dataplane, sum_request("m", 1, timeout_us=30000)))
    b = asyncio.create_task(collect(dataplane, sum_request("m", 2)))
    await asyncio.sleep(0)
    with pytest.raises(ServerError, match="maximum queue size"):
        dataplane.infer(sum_request("m", 3))
    (timed_out,) = await asyncio.wait_for(a, timeout=5)
    assert "timeout" in timed_out.error.message
    release.set()
    await asyncio.gather(first, b)


async def test_preserve_ordering_across_instances(tmp_path, start_core):
    write_model(tmp_path, "m", max_batch_size=1, instances=2, params={"gate": "order"},
                extra="dynamic_batching { preserve_ordering: true }")
    release = gate("order")
    dataplane = await start_core(tmp_path)
    order = []

    async def run(i):
        responses = await collect(dataplane, sum_request("m", i))
        order.append(i)
        return responses

    first = asyncio.create_task(run(0))          # instance 1 blocks on the gate
    await asyncio.sleep(0.05)
    release_second = asyncio.create_task(run(1))  # instance 2 blocks on the gate too
    await asyncio.sleep(0.05)
    release.set()
    await asyncio.gather(first, release_second)
    assert order == [0, 1]


async def test_cancelled_while_queued_is_never_executed(tmp_path, start_core):
    write_model(tmp_path, "m", max_batch_size=1, params={"gate": "cancel"}, extra="dynamic_batching { }")
    release = gate("cancel")
    dataplane = await start_core(tmp_path)
    BATCHES["m"].clear()
    first = asyncio.create_task(collect(dataplane, sum_request("m", 0)))
    await wait_for(lambda: len(BATCHES["m"]) == 1)
    stream = dataplane.infer(sum_request("m", 1))
    await stream.aclose()
    release.set()
    await first
    await asyncio.sleep(0.05)
    assert BATCHES["m"] == [[0]]
    stats = (await dataplane.statistics("m"))[0]
    assert stats["inference_stats"]["fail"]["count"] == 1


async def test_failing_execute_answers_the_batch_and_keeps_serving(tmp_path, start_core):
    write_model(tmp_path, "bad", params={"fail": "boom"}, extra="dynamic_batching { }")
    write_model(tmp_path, "good", extra="dynamic_batching { }")
    dataplane = await start_core(tmp_path)
    results = await asyncio.gather(*(collect(dataplane, sum_request("bad", i)) for i in range(5)))
    for (response,) in results:
        assert response.error is not None and "boom" in response.error.message
    (ok,) = await collect(dataplane, sum_request("good", 1))
    assert ok.error is None
    assert (await dataplane.statistics("bad"))[0]["inference_stats"]["fail"]["count"] == 5
