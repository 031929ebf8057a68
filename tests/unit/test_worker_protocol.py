"""The messages between the core and its frontend workers (server/workers/protocol.py, on the shared wire of
server/wire.py): what crosses comes out as it went in, inline or through the link's shared-memory arenas."""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2 as mc

from tideserve import wire
from tideserve.errors import InvalidArgument, NotFound, QueueFull, Unavailable, UnsupportedMediaType
from tideserve.types import InferenceRequest, InferenceResponse, RequestedOutput, Tensor
from tideserve.workers import protocol as p


def roundtrip(message, kind):
    splitter = wire.FrameReader(kind)
    data = wire.frame(message) + wire.frame(message)
    first = splitter.feed(data[:7])  # a frame split anywhere is reassembled
    rest = splitter.feed(data[7:])
    assert first == [] and len(rest) == 2
    return rest[0]


@pytest.mark.parametrize("array", [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2],  # not contiguous
    np.zeros((0, 4), np.float16),
    np.array(7, np.int32),  # no dimensions
    np.array([True, False]),
    np.array([[b"a", b""], ["\u00e9", b"\x00\xff"]], dtype=np.object_),
])
def test_tensors_cross_unchanged(array):
    datatype = "BYTES" if array.dtype == np.object_ else None
    request = InferenceRequest("m", {"x": Tensor.from_numpy("x", array, datatype)}, model_version="2", id="r1",
                               outputs=[RequestedOutput("y", {"binary_data": True})],
                               parameters={"p": 1, "q": "s", "b": True}, priority=3, timeout_us=50)
    request.streaming = False
    got = p.request_of(roundtrip(p.infer_message(9, request, unary=True), p.ToCore))
    x = got.inputs["x"]
    expected = np.array([v.encode() if isinstance(v, str) else v for v in array.ravel()],
                        dtype=np.object_).reshape(array.shape) if datatype else array
    assert x.shape == array.shape and x.datatype == request.inputs["x"].datatype
    assert x.data.dtype == expected.dtype and (x.data == expected).all()
    assert (got.model_name, got.model_version, got.id, got.priority, got.timeout_us, got.streaming) == \
        ("m", "2", "r1", 3, 50, False)
    assert got.parameters == {"p": 1, "q": "s", "b": True}
    assert [(o.name, o.parameters) for o in got.outputs] == [("y", {"binary_data": True})]
    assert got.arrival_ns == request.arrival_ns


@pytest.mark.parametrize("error", [InvalidArgument("bad"), NotFound("gone"), UnsupportedMediaType("zstd"),
                                   QueueFull("queue full")])
def test_errors_keep_class_status_http_code_and_retry_advice(error):
    response = InferenceResponse("m", "1", "r", error=error)
    message = roundtrip(p.respond_message(4, response, 17), p.ToWorker)
    got = p.response_of(message).error
    assert isinstance(got, {QueueFull: Unavailable, UnsupportedMediaType: InvalidArgument}.get(type(error), type(error)))
    assert (got.status, got.message, got.http_code, got.retry_after_s) == \
        (error.status, error.message, error.http_code, error.retry_after_s)


def test_results_carry_protobuf_messages():
    config = mc.ModelConfig(name="m", max_batch_size=8)
    got = roundtrip(p.Result(3, config), p.ToWorker)
    assert isinstance(got.value, mc.ModelConfig) and got.value == config


def test_a_typed_generation_request_and_its_deltas_cross_as_they_are():
    from tideserve.generation import GenerationDelta, GenerationRequest

    generation = GenerationRequest("Once upon", {"max_tokens": 8, "temperature": 0.0, "n": 2}, stream=True,
                                   add_special_tokens=False, lora_name="a", logprobs=True, cached_tokens=True)
    request = InferenceRequest("llm", {}, id="c1", generation=generation)
    got = p.request_of(roundtrip(p.infer_message(4, request, unary=False), p.ToCore))
    assert got.generation == generation and got.inputs == {}
    delta = GenerationDelta(["a", "b"], [None, "length"], [1, 1], 3,
                            [[{"7": {"logprob": -0.5, "rank": 1, "decoded_token": "a"}}], None], None, 2)
    response = p.response_of(roundtrip(p.respond_message(4, InferenceResponse(generation=delta)), p.ToWorker))
    assert response.generation == delta and response.outputs == []
