"""The per-request pieces of the infer path that were made cheaper (issue 21) still behave as before: request
validation and its errors, a request's response stream and sender, the unary collection of a stream, the success
statistics, gRPC parameter maps."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as pb

from tideserve.dataplane import DataPlane
from tideserve.errors import InvalidArgument, ServerError, Unsupported
from tideserve.grpc.codec import decode_request as grpc_decode, params_to_dict
from tideserve.responses import ResponseSender, ResponseStream
from tideserve.stats import ModelStats
from tideserve.types import InferenceRequest, InferenceResponse, RequestedOutput, Tensor
from tideserve.validation import RequestValidator


def _config() -> mc.ModelConfig:
    config = mc.ModelConfig(name="add_sub", max_batch_size=8)
    for name in ("INPUT0", "INPUT1"):
        config.input.add(name=name, data_type=mc.TYPE_FP32, dims=[4])
    for name in ("OUTPUT0", "OUTPUT1"):
        config.output.add(name=name, data_type=mc.TYPE_FP32, dims=[4])
    return config


def _tensor(name: str, shape=(1, 4), datatype: str = "FP32") -> Tensor:
    return Tensor(name, datatype, shape, np.zeros(shape, np.float32))


def _request(*names: str, **shapes) -> InferenceRequest:
    return InferenceRequest("add_sub", {n: _tensor(n, shapes.get(n, (1, 4))) for n in names})


def test_validation_accepts_and_sets_the_batch_size():
    validator = RequestValidator(_config())
    request = _request("INPUT0", "INPUT1", INPUT0=(3, 4), INPUT1=(3, 4))
    validator.validate(request)
    assert request.batch_size == 3
    # a shape given as a list (as some frontends build it) is judged as the tuple would be
    listed = InferenceRequest("add_sub", {n: Tensor(n, "FP32", [2, 4], np.zeros((2, 4), np.float32))
                                          for n in ("INPUT0", "INPUT1")})
    validator.validate(listed)
    assert listed.batch_size == 2


@pytest.mark.parametrize("names, message", [
    (("INPUT0", "INPUT1", "INPUT2"), "unexpected inference input 'INPUT2' for model 'add_sub'"),
    (("INPUT0",), "expected 2 inputs but got 1 inputs for model 'add_sub'. Got input(s) ['INPUT0'], but missing "
                  "required input(s) ['INPUT1']. Please provide all required input(s)."),
])
def test_validation_names_unknown_and_missing_inputs(names, message):
    with pytest.raises(InvalidArgument) as caught:
        RequestValidator(_config()).validate(_request(*names))
    assert caught.value.message == message


def test_validation_errors_on_shape_datatype_and_data():
    validator = RequestValidator(_config())
    with pytest.raises(InvalidArgument, match=r"unexpected shape for input 'INPUT1' for model 'add_sub'. "
                                              r"Expected \[-1, 4\], got \[1, 5\]"):
        validator.validate(_request("INPUT0", "INPUT1", INPUT1=(1, 5)))
    request = _request("INPUT0", "INPUT1")
    request.inputs["INPUT0"].datatype = "INT32"
    with pytest.raises(InvalidArgument, match="data-type is 'INT32', but model 'add_sub' expects 'FP32'"):
        validator.validate(request)
    request = _request("INPUT0", "INPUT1")
    request.inputs["INPUT0"].shape = (2, 4)
    with pytest.raises(InvalidArgument, match=r"input 'INPUT0': data holds 4 elements, shape \[2, 4\] needs 8"):
        validator.validate(request)
    with pytest.raises(InvalidArgument, match="batch size 2 does not match the batch size 1"):
        validator.validate(_request("INPUT0", "INPUT1", INPUT1=(2, 4)))


def test_response_stream_wait_cancelled_then_put():
    async def main():
        stream = ResponseStream(asyncio.get_running_loop())
        waiter = stream.wait()
        waiter.cancel()  # a reader that gave up
        stream.put(InferenceResponse(id="a", final=False))
        stream.put(InferenceResponse(id="b"))
        assert (await stream.get()).id == "a"
        getter = asyncio.ensure_future(stream.get())
        assert (await getter).id == "b"
        later = asyncio.ensure_future(stream.get())
        await asyncio.sleep(0)
        stream.put(InferenceResponse(id="c"))
        assert (await later).id == "c"

    asyncio.run(main())


def test_sender_keeps_only_the_requested_outputs():
    outputs = [_tensor("OUTPUT0"), _tensor("OUTPUT1")]
    for requested, expected in (([], ["OUTPUT0", "OUTPUT1"]), (["OUTPUT1"], ["OUTPUT1"]),
                                (["OUTPUT0", "OUTPUT1"], ["OUTPUT0", "OUTPUT1"]),
                                (["OUTPUT1", "OUTPUT9"], ["OUTPUT1"])):
        request = _request("INPUT0")
        request.outputs = [RequestedOutput(name) for name in requested]
        got = []
        ResponseSender(request, got.append).send(InferenceResponse(outputs=list(outputs)), final=True)
        assert [t.name for t in got[0].outputs] == expected
        assert got[0].model_name == "add_sub" and got[0].final


class _Stream:
    """A response stream as the serving interface describes it."""

    def __init__(self, responses):
        self.request = _request("INPUT0")
        self._responses = list(responses)
        self.cancelled = 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self._responses:
            raise StopAsyncIteration
        return self._responses.pop(0)

    def cancel(self):
        self.cancelled += 1

    async def aclose(self):
        self.cancel()


def test_collect_unary():
    collect = DataPlane.collect_unary
    one = InferenceResponse(id="x", final=False)
    stream = _Stream([one, InferenceResponse(final=True, empty=True), InferenceResponse(id="never")])
    assert asyncio.run(collect(None, stream)) is one
    assert stream.cancelled == 1 and len(stream._responses) == 1  # nothing read past the final response
    with pytest.raises(Unsupported, match="sent no response"):
        asyncio.run(collect(None, _Stream([InferenceResponse(final=True, empty=True)])))
    with pytest.raises(Unsupported, match="sent 2 responses"):
        asyncio.run(collect(None, _Stream([InferenceResponse(final=False), InferenceResponse(final=True)])))
    failing = _Stream([InferenceResponse(error=InvalidArgument("bad"), final=True)])
    with pytest.raises(ServerError, match="bad"):
        asyncio.run(collect(None, failing))
    assert failing.cancelled == 1


def test_success_statistics_with_and_without_a_first_response():
    stats = ModelStats("add_sub", "1", metrics=object())
    stats.record_success(2_000_000, True)
    stats.record_first_response(1_000_000)
    stats.record_success(3_000_000)
    assert (stats.success.count, stats.success.ns) == (2, 5_000_000)
    assert sum(stats.latency.counts) == 2 and stats.latency.sum == 5.0
    assert sum(stats.first_response.counts) == 2 and stats.first_response.sum == 3.0
    bare = ModelStats("add_sub", "1")  # no metrics: no histograms
    bare.record_success(1, True)
    assert bare.success.count == 1


def test_grpc_parameters():
    msg = pb.ModelInferRequest(model_name="add_sub")
    msg.parameters["priority"].uint64_param = 2
    msg.parameters["custom"].string_param = "x"
    msg.parameters["flag"].bool_param = True
    tensor = msg.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4])
    tensor.parameters["note"].int64_param = 7
    msg.raw_input_contents.append(np.arange(4, dtype=np.float32).tobytes())
    request = grpc_decode(msg)
    assert request.priority == 2
    assert request.parameters == {"custom": "x", "flag": True}
    assert request.inputs["INPUT0"].parameters == {"note": 7}
    assert params_to_dict(pb.ModelInferRequest().parameters) == {}


def test_grpc_raw_inputs():
    msg = pb.ModelInferRequest(model_name="add_sub")
    msg.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4])
    msg.inputs.add(name="TEXT", datatype="BYTES", shape=[1])
    msg.inputs.add(name="EMPTY", datatype="INT32", shape=[0, 4])
    msg.raw_input_contents.append(np.arange(4, dtype=np.float32).tobytes())
    msg.raw_input_contents.append(len(b"hi").to_bytes(4, "little") + b"hi")
    msg.raw_input_contents.append(b"")
    inputs = grpc_decode(msg).inputs
    assert inputs["INPUT0"].data.tolist() == [[0.0, 1.0, 2.0, 3.0]] and inputs["INPUT0"].shape == (1, 4)
    assert inputs["TEXT"].data.tolist() == [b"hi"]
    assert inputs["EMPTY"].data.shape == (0, 4) and inputs["EMPTY"].data.dtype == np.int32
    short = pb.ModelInferRequest(model_name="add_sub")
    short.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4])
    short.raw_input_contents.append(b"\0" * 12)
    with pytest.raises(InvalidArgument, match=r"input 'INPUT0': unexpected byte size 12, expecting 16 for FP32 "
                                              r"tensor of shape \[1, 4\]"):
        grpc_decode(short)
