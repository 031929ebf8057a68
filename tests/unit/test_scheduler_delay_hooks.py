"""Triton's scheduler test hooks (TRITONSERVER_DELAY_SCHEDULER, TRITONSERVER_BACKLOG_DELAY_SCHEDULER) and how the
direct sequence batcher pads and counts its batches, on the toy backend without a server."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from toy_backends import BATCHES, collect, sum_request, write_model

from tideserve.batching import concat_inputs
from tideserve.errors import InternalError
from tideserve.types import InferenceRequest, Tensor

SEQUENCE = """
sequence_batching {
  direct { }
  max_sequence_idle_microseconds: 5000000
  control_input [ { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
                  { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] } ]
}
"""


@pytest.fixture(autouse=True)
def _fresh_records():
    BATCHES.clear()
    yield
    BATCHES.clear()


def step(model: str, rid: int, sequence: int, *, start=False, end=False, width=4) -> InferenceRequest:
    return sum_request(model, rid, width=width, parameters={"sequence_id": sequence, "sequence_start": start,
                                                           "sequence_end": end})


def send(dataplane, request) -> asyncio.Task:
    return asyncio.create_task(collect(dataplane, request))


async def test_dynamic_batcher_holds_its_first_batch_until_the_count_is_queued(tmp_path, start_core, monkeypatch):
    monkeypatch.setenv("TRITONSERVER_DELAY_SCHEDULER", "3")
    write_model(tmp_path, "m", extra="dynamic_batching { }")
    dataplane = await start_core(tmp_path)
    first = [send(dataplane, sum_request("m", i)) for i in (1, 2)]
    await asyncio.sleep(0.2)
    assert BATCHES["m"] == []  # two queued, three asked for: nothing runs
    first.append(send(dataplane, sum_request("m", 3)))
    for responses in await asyncio.gather(*first):
        assert responses[0].error is None
    assert BATCHES["m"] == [[1, 2, 3]]
    await collect(dataplane, sum_request("m", 4))  # the hook holds the first batch only
    assert BATCHES["m"][-1] == [4]
    stats = (await dataplane.statistics("m"))[0]
    assert {b["batch_size"]: b["compute_infer"]["count"] for b in stats["batch_stats"]} == {3: 1, 1: 1}


async def test_sequence_batcher_waits_for_slots_and_backlog_then_pads_as_triton(tmp_path, start_core, monkeypatch):
    monkeypatch.setenv("TRITONSERVER_DELAY_SCHEDULER", "3")
    monkeypatch.setenv("TRITONSERVER_BACKLOG_DELAY_SCHEDULER", "1")
    write_model(tmp_path, "seq", max_batch_size=2, extra=SEQUENCE)
    dataplane = await start_core(tmp_path)
    tasks = [send(dataplane, step("seq", 1, 101, start=True)), send(dataplane, step("seq", 2, 102, start=True))]
    await asyncio.sleep(0.05)
    tasks.append(send(dataplane, step("seq", 3, 101, end=True)))
    await asyncio.sleep(0.2)
    assert BATCHES["seq"] == []  # three requests in the slots, but none in the backlog yet
    tasks.append(send(dataplane, step("seq", 4, 103, start=True, end=True)))  # both slots taken: backlogged
    for responses in await asyncio.gather(*tasks):
        assert responses[0].error is None, responses[0].error
    # slot 0 then slot 1; 103 takes slot 0 once 101 ended, and slot 1 (102, nothing queued) is padding
    assert BATCHES["seq"] == [[1, 2], [3], [4]]
    stats = (await dataplane.statistics("seq"))[0]
    assert stats["execution_count"] == 3 and stats["inference_count"] == 4


async def test_direct_rows_run_up_to_the_highest_ready_slot_and_padding_is_not_an_inference(tmp_path, start_core):
    write_model(tmp_path, "seq", max_batch_size=4, dims="-1", extra=SEQUENCE)
    dataplane = await start_core(tmp_path)
    for rid, sequence in ((1, 201), (2, 202), (3, 203)):  # slots 0, 1, 2
        (response,) = await collect(dataplane, step("seq", rid, sequence, start=True))
        assert response.error is None
    # 201 waits with nothing queued; 202 and 203 send inputs of different shapes: never one batch
    tasks = [send(dataplane, step("seq", 4, 202, width=2)), send(dataplane, step("seq", 5, 203, width=3))]
    for responses in await asyncio.gather(*tasks):
        assert responses[0].error is None, responses[0].error
        assert responses[0].output("OUTPUT0").data.shape[1] in (2, 3)
    assert BATCHES["seq"][:3] == [[1], [-1, 2], [-1, -1, 3]]  # rows below a sequence's slot are padding
    later = {tuple(batch) for batch in BATCHES["seq"][3:]}
    assert later in ({(-1, 4, -1), (-1, -1, 5)}, {(-1, 4), (-1, -1, 5)})  # 203's row is padding beside 202
    stats = (await dataplane.statistics("seq"))[0]
    assert stats["inference_count"] == 5 and stats["execution_count"] == 5


def test_requests_of_different_shapes_are_refused_in_words():
    def request(width):
        data = np.array([[b"x"] * width], dtype=np.object_)
        return InferenceRequest("m", {"IN": Tensor("IN", "BYTES", data.shape, data)})

    with pytest.raises(InternalError, match=r"input 'IN' .* shapes \[1, 2\] and \[1, 1\].*allow_ragged_batch"):
        concat_inputs([request(2), request(1)])
    assert concat_inputs([request(2), request(1)], frozenset({"IN"}))["IN"].shape == (3,)
