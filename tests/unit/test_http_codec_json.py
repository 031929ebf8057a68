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


def _general(monkeypatch, body: bytes, header_length=None, **kwargs):
    with monkeypatch.context() as patched:
        patched.setattr(codec, "_decode_typed", lambda *args: None)
        return codec.decode_request("m", "2", body, header_length, **kwargs)


def _outcome(call):
    try:
        decoded = call()
    except InvalidArgument as exc:
        return ("error", str(exc))
    request = decoded.request
    return ("ok", request.model_name, request.model_version, request.id, request.parameters, request.priority,
            request.timeout_us, [(o.name, o.parameters) for o in request.outputs or []] if request.outputs is not None
            else None, decoded.binary_output, decoded.outputs, decoded.classify,
            [(t.name, t.datatype, t.shape, t.data.dtype.str, t.data.shape, t.data.tolist(), t.parameters)
             for t in request.inputs.values()])


_X = {"name": "X", "datatype": "FP32", "shape": [1, 2], "data": [1.5, 2]}


@pytest.mark.parametrize("doc", [
    {"inputs": [_X, {"name": "Y", "datatype": "INT32", "shape": [2], "data": [1, -2]}],
     "outputs": [{"name": "A", "parameters": {"binary_data": False}}, {"name": "B"}, {"name": "C", "parameters": {}}]},
    {"id": "7", "inputs": [_X], "parameters": {"priority": 2, "timeout": 5, "binary_data_output": True, "k": "v",
                                               "sequence_id": 3, "sequence_start": True}},
    {"inputs": [{"name": "B", "datatype": "BOOL", "shape": [], "data": [True]}], "outputs": None},
    {"inputs": []},
    # what the typed path leaves to the general one (taken there, or refused with its words)
    {"inputs": [_X], "outputs": [{"name": "A", "parameters": {"binary_data": True, "classification": 2}}]},
    {"inputs": [_X], "outputs": [{"name": "A", "parameters": {"binary_data": 1}}]},
    {"inputs": [{**_X, "parameters": {"p": 1}}]},
    {"inputs": [{**_X, "extra": [[[1]]]}]},
    {"inputs": [_X], "extra": 1},
    {"inputs": [_X, _X]},
    {"inputs": [{**_X, "name": ""}]},
    {"inputs": [{**_X, "shape": [1, -2]}]},
    {"inputs": [{**_X, "shape": [1, True]}]},
    {"inputs": [{**_X, "shape": [1, 3]}]},
    {"inputs": [{**_X, "shape": [0, 2], "data": []}]},
    {"inputs": [{**_X, "data": [[1.5, 2]]}]},
    {"inputs": [{**_X, "data": [1.5, "2"]}]},
    {"inputs": [{**_X, "data": None}]},
    {"inputs": [{**_X, "datatype": "BYTES", "data": ["a", "b"]}]},
    {"inputs": [{**_X, "datatype": "INT8", "data": [1, 300]}]},
    {"inputs": [{**_X, "datatype": "INT64", "data": [1, 2.0]}]},
    {"inputs": [{**_X, "datatype": "UINT64", "data": [1, 2 ** 70]}]},
    {"inputs": [{**_X, "datatype": "FP64", "data": [1, 2 ** 70]}]},
    {"inputs": [{**_X, "datatype": "FP99"}]},
    {"inputs": [_X], "parameters": {"priority": -1}},
    {"inputs": [_X], "parameters": {"triton_x": 1}},
    {"inputs": [_X], "parameters": {"nested": {"a": 1}}},
    {"inputs": [_X], "outputs": [{"name": "A"}, {"name": "A"}]},
    {"id": 3, "inputs": [_X]},
    {"inputs": {"name": "X"}},
    [_X],
])
@pytest.mark.parametrize("whole", [False, True], ids=["no-header-length", "header-length-of-the-body"])
def test_the_typed_path_decodes_as_the_general_one(monkeypatch, doc, whole):
    """With no Inference-Header-Content-Length, and with one that names the whole body (perf_analyzer sends it with
    JSON tensors too): the same request or the same error either way."""
    body = json.dumps(doc).encode()
    header_length = len(body) if whole else None
    typed = _outcome(lambda: codec.decode_request("m", "2", body, header_length))
    assert typed == _outcome(lambda: _general(monkeypatch, body, header_length))


@pytest.mark.parametrize("body", [
    b'{"inputs": [], "x": "\xff"}', b'{"inputs": [], "x": 1E400}', b'{"inputs": [], "x": "\\ud800"}',
    b'{"inputs": [{"name": "\xff", "datatype": "FP32", "shape": [1], "data": [1]}]}',
    b'{"inputs": [{"name": "X", "datatype": "FP32", "shape": [1], "data": [1E400]}]}',
    (b'{"inputs": [{"name": "X", "datatype": "FP32", "shape": [1], "data": [1]}], "outputs": [{"name": "A",'
     b' "parameters": {"binary_data": false}}]}'),
    b'{"inputs": [{"name": "X", "datatype": "FP32", "shape": [1], "data": [1]}]} trailing',
])
def test_the_typed_path_takes_no_document_the_general_one_refuses(monkeypatch, body):
    assert _outcome(lambda: codec.decode_request("m", "2", body, None)) == _outcome(lambda: _general(monkeypatch, body))


def test_the_typed_path_keeps_a_small_nesting_limit(monkeypatch):
    body = json.dumps({"inputs": [_X]}).encode()
    for depth in (3, 4):
        typed = _outcome(lambda depth=depth: codec.decode_request("m", "2", body, None, max_json_depth=depth))
        assert typed == _outcome(lambda depth=depth: _general(monkeypatch, body, max_json_depth=depth))


def test_a_json_body_with_its_own_length_as_header_length_takes_the_typed_path(monkeypatch):
    body = json.dumps({"inputs": [_X], "outputs": [{"name": "A", "parameters": {"binary_data": False}}]}).encode()
    taken = []
    typed = codec._decode_typed
    monkeypatch.setattr(codec, "_decode_typed", lambda *args: taken.append(typed(*args)) or taken[-1])
    decoded = codec.decode_request("m", "", body, len(body))
    assert taken and taken[0] is decoded
    # binary data after the JSON part: the general path, which reads it
    data = np.array([1.5, 2], np.float32).tobytes()
    doc = json.dumps({"inputs": [{**{k: v for k, v in _X.items() if k != "data"},
                                  "parameters": {"binary_data_size": len(data)}}]}).encode()
    decoded = codec.decode_request("m", "", doc + data, len(doc))
    assert decoded.request.inputs["X"].data.tolist() == [[1.5, 2.0]]


def test_the_usual_request_takes_the_typed_path():
    body = json.dumps({"inputs": [_X], "outputs": [{"name": "A", "parameters": {"binary_data": False}}],
                       "parameters": {"priority": 1}}).encode()
    decoded = codec._decode_typed("m", "", body, codec.DEFAULT_TENSOR_LIMITS, codec.MAX_JSON_DEPTH)
    assert decoded is not None and decoded.request.priority == 1 and decoded.outputs["A"].binary is False


@pytest.mark.parametrize("where", ['"data": %s', '"data": [1], "parameters": {"x": %s}'])
def test_a_document_nested_past_the_decoders_own_depth_is_refused_as_the_general_path_refuses_it(monkeypatch, where):
    """Nested deeper than msgspec or orjson parse (over 1,000 levels, with --http-max-json-depth set above that): the
    typed decoder's RecursionError leaves the document to the general path, which answers it as a bad request."""
    deep = "[" * 1100 + "]" * 1100
    body = ('{"inputs": [{"name": "X", "datatype": "FP32", "shape": [1], ' + where % deep + "}]}").encode()
    typed = _outcome(lambda: codec.decode_request("m", "2", body, None, max_json_depth=2000))
    assert typed == _outcome(lambda: _general(monkeypatch, body, max_json_depth=2000))
    assert typed[0] == "error", typed
