"""decode_request's direct path for flat JSON tensors and its shared output options: the same arrays and the same
errors as the general path."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tideserve.errors import InvalidArgument
from tideserve.http import codec


def decode(inputs, outputs=None):
    doc = {"inputs": inputs}
    if outputs is not None:
        doc["outputs"] = outputs
    return codec.decode_request("m", "", json.dumps(doc).encode(), None)


def one(datatype, shape, data):
    return decode([{"name": "X", "datatype": datatype, "shape": shape, "data": data}]).request.inputs["X"]


@pytest.mark.parametrize(("datatype", "shape", "data", "expected"), [
    ("FP32", [1, 4], [1.5, 2, 3, 4], np.array([[1.5, 2, 3, 4]], np.float32)),
    ("FP32", [4], [1, 2, 3, 4], np.array([1, 2, 3, 4], np.float32)),
    ("INT64", [2, 2], [[1, 2], [3, 4]], np.array([[1, 2], [3, 4]], np.int64)),  # nested: the general path
    ("BOOL", [1, 2], [True, False], np.array([[True, False]])),
    ("UINT8", [0, 3], [], np.zeros((0, 3), np.uint8)),
])
def test_json_tensors_decode_to_their_arrays(datatype, shape, data, expected):
    tensor = one(datatype, shape, data)
    assert tensor.shape == tuple(shape)
    assert tensor.data.dtype == expected.dtype
    np.testing.assert_array_equal(tensor.data, expected)
    assert tensor.data.shape == tuple(shape)


@pytest.mark.parametrize(("datatype", "shape", "data", "message"), [
    ("FP32", [2], [True, 1.0], "FP32 'data' must hold numbers, got boolean true"),
    ("INT32", [2], [1, 2.5], "INT32 'data' must hold integers, got number 2.5"),
    ("INT8", [1], [300], "'data' does not fit INT8"),
    ("FP32", [1, 4], [1, 2, 3], "shape [1, 4] needs 4 elements, 'data' holds 3"),
    ("FP32", [1], "nope", "'data' must be an array, got string"),
])
def test_json_tensor_errors_name_the_input(datatype, shape, data, message):
    with pytest.raises(InvalidArgument, match="input 'X'") as caught:
        one(datatype, shape, data)
    assert message in str(caught.value)


def test_output_options_are_not_shared_state_between_requests():
    tensor = {"name": "X", "datatype": "FP32", "shape": [1], "data": [1]}
    first = decode([tensor], [{"name": "A", "parameters": {"binary_data": True}}, {"name": "B"},
                              {"name": "C", "parameters": {"binary_data": False, "classification": 2}}])
    second = decode([tensor], [{"name": "A", "parameters": {"binary_data": False}},
                               {"name": "B", "parameters": {"classification": 3}}])
    assert (first.outputs["A"].binary, first.outputs["A"].class_count) == (True, 0)
    assert (first.outputs["B"].binary, first.outputs["B"].class_count) == (None, 0)
    assert (first.outputs["C"].binary, first.outputs["C"].class_count) == (False, 2)
    assert first.classify
    assert (second.outputs["A"].binary, second.outputs["A"].class_count) == (False, 0)
    assert (second.outputs["B"].binary, second.outputs["B"].class_count) == (None, 3)
    unclassified = decode([tensor], [{"name": "A", "parameters": {"classification": 0}}])
    assert not unclassified.classify and unclassified.outputs["A"].class_count == 0
