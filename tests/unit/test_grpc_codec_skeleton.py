"""gRPC ModelInfer requests read from their bytes (``decode_request_bytes``) once a request of the same skeleton
was decoded (``learn_skeleton``): the same request as ``decode_request`` makes, and None (the full path) for
anything else."""

from __future__ import annotations

import numpy as np
import pytest
from tideserve.grpc import codec
from tideserve.grpc.codec import StreamOptions, decode_request, decode_request_bytes, learn_skeleton
from tideserve.limits import TensorLimits
from tritonclient.grpc import service_pb2 as pb


@pytest.fixture(autouse=True)
def _no_skeletons():
    codec._SKELETONS.clear()
    yield
    codec._SKELETONS.clear()


def _request(model="add_sub", version="", request_id="", shape=(1, 4), datatype="FP32", dtype=np.float32,
             outputs=("OUTPUT0", "OUTPUT1"), inputs=("INPUT0", "INPUT1"), seed=0) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    count = int(np.prod(shape))
    for index, name in enumerate(inputs):
        message.inputs.add(name=name, datatype=datatype, shape=list(shape))
        message.raw_input_contents.append((np.arange(count) + seed + index).astype(dtype).tobytes())
    for name in outputs:
        message.outputs.add(name=name)
    return message


def _learn(message: pb.ModelInferRequest, limits=codec.DEFAULT_TENSOR_LIMITS) -> bytes:
    data = message.SerializeToString()
    parsed = pb.ModelInferRequest.FromString(data)
    options = StreamOptions()
    learn_skeleton(data, parsed, decode_request(parsed, options, limits), limits, options)
    return data


def _same(fast, slow) -> None:
    assert (fast.model_name, fast.model_version, fast.id) == (slow.model_name, slow.model_version, slow.id)
    assert list(fast.inputs) == list(slow.inputs)
    for name, tensor in slow.inputs.items():
        other = fast.inputs[name]
        assert (other.name, other.datatype, other.shape, other.parameters) == (tensor.name, tensor.datatype,
                                                                              tensor.shape, tensor.parameters)
        assert other.data.dtype == tensor.data.dtype and other.data.shape == tensor.data.shape
        assert np.array_equal(other.data, tensor.data)
    assert fast.outputs == slow.outputs
    assert (fast.parameters, fast.priority, fast.timeout_us) == (slow.parameters, slow.priority, slow.timeout_us)


def _check(message: pb.ModelInferRequest) -> None:
    data = message.SerializeToString()
    fast_options, slow_options = StreamOptions(), StreamOptions()
    fast = decode_request_bytes(data, options=fast_options)
    assert fast is not None
    _same(fast, decode_request(pb.ModelInferRequest.FromString(data), slow_options))
    assert fast_options.enable_empty_final == slow_options.enable_empty_final


def test_unknown_skeleton_takes_the_full_path():
    assert decode_request_bytes(_request().SerializeToString()) is None


@pytest.mark.parametrize("request_id", ["", "req-1", "ü" * 200])
def test_same_skeleton_any_id_and_data(request_id):
    _learn(_request(request_id="learned"))
    _check(_request(request_id=request_id, seed=5))


@pytest.mark.parametrize("kind", [dict(version="3"), dict(outputs=()), dict(datatype="INT64", dtype=np.int64),
                                  dict(datatype="BOOL", dtype=np.bool_), dict(shape=(0, 4)), dict(shape=()),
                                  dict(shape=(300, 1000), datatype="UINT8", dtype=np.uint8)])
def test_shapes_and_kinds(kind):
    _learn(_request(**kind))
    _check(_request(request_id="x", seed=3, **kind))


def _with_parameters(message: pb.ModelInferRequest) -> pb.ModelInferRequest:
    message.parameters["triton_enable_empty_final_response"].bool_param = True  # as perf_analyzer sends
    message.parameters["priority"].int64_param = 2
    message.parameters["timeout"].int64_param = 5000
    message.parameters["custom"].string_param = "x"
    return message


def test_request_parameters_decode_as_the_first_ones_did():
    _learn(_with_parameters(_request()))
    _check(_with_parameters(_request(request_id="p", seed=9)))
    request = decode_request_bytes(_with_parameters(_request()).SerializeToString())
    assert (request.parameters, request.priority, request.timeout_us) == ({"custom": "x"}, 2, 5000)
    request.parameters["custom"] = "changed"  # each request has its own parameters
    assert decode_request_bytes(_with_parameters(_request()).SerializeToString()).parameters == {"custom": "x"}
    assert decode_request_bytes(_request().SerializeToString()) is None  # other parameters: another skeleton
    other = _with_parameters(_request())
    other.parameters["priority"].int64_param = 3
    assert decode_request_bytes(other.SerializeToString()) is None


def test_sequence_requests_are_not_learned():
    message = _request()
    message.parameters["sequence_id"].int64_param = 7
    message.parameters["sequence_start"].bool_param = True
    _learn(message)
    assert codec._SKELETONS == []


def test_other_models_and_shapes_miss():
    _learn(_request())
    assert decode_request_bytes(_request(model="add_sub2").SerializeToString()) is None
    assert decode_request_bytes(_request(model="add").SerializeToString()) is None
    assert decode_request_bytes(_request(shape=(2, 4)).SerializeToString()) is None
    assert decode_request_bytes(_request(version="1").SerializeToString()) is None
    assert decode_request_bytes(_request(outputs=("OUTPUT0",)).SerializeToString()) is None


def test_wrong_data_size_and_trailing_bytes_miss():
    _learn(_request())
    message = _request()
    message.raw_input_contents[1] = b"\0" * 12  # decode_request names the problem
    assert decode_request_bytes(message.SerializeToString()) is None
    data = _request().SerializeToString()
    assert decode_request_bytes(data + b"\x3a\x00") is None  # a third raw content
    assert decode_request_bytes(data[:-1]) is None
    assert decode_request_bytes(memoryview(data)) is None


def test_invalid_id_utf8_misses():
    _learn(_request(request_id="a"))
    data = _request(request_id="a").SerializeToString()
    broken = data.replace(b"\x1a\x01a", b"\x1a\x01\xff")
    assert broken != data
    assert decode_request_bytes(broken) is None


@pytest.mark.parametrize("change", ["input parameter", "output parameter", "typed contents", "FP16", "BYTES"])
def test_uncommon_requests_are_not_learned(change):
    message = _request()
    if change == "input parameter":
        message.inputs[0].parameters["x"].bool_param = True
    elif change == "output parameter":
        message.outputs[0].parameters["classification"].int64_param = 2
    elif change == "typed contents":
        message = _request(inputs=())
        message.inputs.add(name="INPUT0", datatype="INT32", shape=[2]).contents.int_contents.extend([1, 2])
    elif change == "FP16":
        message = _request(datatype="FP16", dtype=np.float16)
    elif change == "BYTES":
        message = _request(inputs=())
        message.inputs.add(name="T", datatype="BYTES", shape=[1])
        message.raw_input_contents.append(b"\x01\x00\x00\x00a")
    _learn(message)
    assert codec._SKELETONS == []
    assert decode_request_bytes(message.SerializeToString()) is None


def test_fields_out_of_order_are_not_learned():
    message = _request()
    # the model name after the inputs: still a valid message, not of the skeleton's form
    data = message.SerializeToString()
    name = pb.ModelInferRequest(model_name="add_sub").SerializeToString()
    reordered = data[len(name):] + name
    parsed = pb.ModelInferRequest.FromString(reordered)
    learn_skeleton(reordered, parsed, decode_request(parsed))
    assert codec._SKELETONS == []


def test_skeletons_are_per_limits():
    limits = TensorLimits(4, 1 << 20)
    _learn(_request(), limits)
    data = _request().SerializeToString()
    assert decode_request_bytes(data) is None
    assert decode_request_bytes(data, limits) is not None


def test_skeletons_are_bounded_and_not_repeated():
    _learn(_request())
    _learn(_request(request_id="other"))
    assert len(codec._SKELETONS) == 1
    for size in range(1, codec._SKELETONS_MAX + 5):
        _learn(_request(shape=(size,)))
    assert len(codec._SKELETONS) == codec._SKELETONS_MAX
    _check(_request(shape=(codec._SKELETONS_MAX + 4,)))
