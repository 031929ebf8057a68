"""``pad_batch_inputs`` (a model config parameter): the inputs it names batch across lengths, each request's
rows zero-padded to the batch's largest shape when the batch is concatenated."""

from __future__ import annotations

import asyncio
import re
import threading

import numpy as np
import pytest
from google.protobuf import text_format
from toy_backends import BATCHES, GATES, collect, sum_request, wait_for, write_model
from tritonclient.grpc import model_config_pb2 as mc

from tideserve.batching import concat_inputs, padded_inputs
from tideserve.errors import InvalidArgument
from tideserve.types import InferenceRequest, Tensor


def _config(text: str) -> mc.ModelConfig:
    return text_format.Parse('name: "m" max_batch_size: 8\n' + text, mc.ModelConfig())


IDS = ('input [ { name: "ids" data_type: TYPE_INT64 dims: [ -1 ] },\n'
       '        { name: "mask" data_type: TYPE_INT64 dims: [ -1 ] } ]\n')


def _request(ids: list[list[int]]) -> InferenceRequest:
    array = np.array(ids, dtype=np.int64)
    return InferenceRequest("m", {"ids": Tensor.from_numpy("ids", array),
                                  "mask": Tensor.from_numpy("mask", np.ones_like(array))})


def test_padded_inputs_read_the_parameter():
    assert padded_inputs(_config(IDS)) == frozenset()
    config = _config(IDS + 'parameters { key: "pad_batch_inputs" value { string_value: " ids, mask " } }')
    assert padded_inputs(config) == {"ids", "mask"}


@pytest.mark.parametrize("extra, reason", [
    ('parameters { key: "pad_batch_inputs" value { string_value: "ids,nope" } }',
     "names 'nope', which is not an input"),
    (('input [ { name: "fixed" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
      'parameters { key: "pad_batch_inputs" value { string_value: "fixed" } }'), "must have a variable (-1) dimension"),
    (('input [ { name: "r" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true } ]\n'
      'parameters { key: "pad_batch_inputs" value { string_value: "r" } }'), "no allow_ragged_batch"),
])
def test_padded_inputs_refuse_what_cannot_be_padded(extra, reason):
    with pytest.raises(InvalidArgument, match=re.escape(reason)):
        padded_inputs(_config(IDS + extra))


def test_concat_pads_each_request_to_the_longest():
    requests = [_request([[1, 2]]), _request([[3, 4, 5, 6], [7, 8, 9, 10]]), _request([[11]])]
    merged = concat_inputs(requests, padded=frozenset({"ids", "mask"}))
    assert merged["ids"].tolist() == [[1, 2, 0, 0], [3, 4, 5, 6], [7, 8, 9, 10], [11, 0, 0, 0]]
    assert merged["mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert merged["ids"].dtype == np.int64
    same = concat_inputs([_request([[1, 2]]), _request([[3, 4]])], padded=frozenset({"ids"}))
    assert same["ids"].tolist() == [[1, 2], [3, 4]]


def test_concat_without_the_parameter_still_refuses_different_shapes():
    from tideserve.errors import InternalError

    with pytest.raises(InternalError, match="requests of different shapes cannot be batched"):
        concat_inputs([_request([[1, 2]]), _request([[3, 4, 5]])])


async def test_the_dynamic_batcher_batches_padded_inputs_across_lengths(tmp_path, start_core):
    """As ragged inputs do, requests of other widths join the batch (the toy model's rows are not split)."""
    write_model(tmp_path, "padded", dims="-1", extra="dynamic_batching { max_queue_delay_microseconds: 100000 }",
                params={"gate": "shapes-p", "pad_batch_inputs": "INPUT0,INPUT1"})
    dataplane = await start_core(tmp_path)
    release = GATES["shapes-p"] = threading.Event()
    BATCHES["padded"].clear()
    first = asyncio.create_task(collect(dataplane, sum_request("padded", 0, width=2)))
    await wait_for(lambda: len(BATCHES["padded"]) == 1)
    tasks = [asyncio.create_task(collect(dataplane, sum_request("padded", i, width=w)))
             for i, w in ((1, 2), (2, 3), (3, 2))]
    await asyncio.sleep(0.05)
    release.set()
    try:
        await asyncio.gather(first, *tasks, return_exceptions=True)
    finally:
        GATES.pop("shapes-p").set()
    assert [len(b) for b in BATCHES["padded"]] == [1, 3]
