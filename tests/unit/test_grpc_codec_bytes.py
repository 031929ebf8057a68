"""gRPC ModelInfer's response built as bytes (``encode_response_bytes``) parses to the very message that
``encode_response`` makes, and leaves the responses it cannot carry to the message."""

from __future__ import annotations

import numpy as np
import pytest
from tideserve.grpc.codec import encode_response, encode_response_bytes
from tideserve.types import InferenceResponse, Tensor
from tritonclient.grpc import service_pb2 as pb


def _response(*outputs: Tensor, **fields) -> InferenceResponse:
    return InferenceResponse(model_name=fields.pop("model_name", "add_sub"), outputs=list(outputs), **fields)


CASES = {
    "add_sub": _response(Tensor("OUTPUT0", "FP32", (1, 4), np.arange(4, dtype=np.float32).reshape(1, 4)),
                         Tensor("OUTPUT1", "FP32", (1, 4), -np.arange(4, dtype=np.float32).reshape(1, 4)),
                         model_version="1", id="req-7"),
    "no id, no version": _response(Tensor("OUT", "INT64", (3,), np.array([1, 2, 300], np.int64))),
    "bytes and unicode names": _response(Tensor("テキスト", "BYTES", (2,), np.array([b"a", b"\x00bc"], object)),
                                         model_name="модель", model_version="12", id="ü"),
    "empty and scalar shapes": _response(Tensor("E", "FP64", (0, 5), np.zeros((0, 5))),
                                         Tensor("S", "INT32", (), np.array(7, np.int32))),
    "big dims and data": _response(Tensor("B", "UINT8", (300, 1000), np.ones((300, 1000), np.uint8))),
    "data cast to its datatype": _response(Tensor("F", "FP32", (2,), np.array([1.5, 2.5]))),
    "a list as data": _response(Tensor("L", "INT32", (2,), [1, 2])),
    "no outputs": _response(model_version="3", id="x"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bytes_parse_to_the_message(name):
    response = CASES[name]
    encoded = encode_response_bytes(response)
    assert encoded is not None
    assert pb.ModelInferResponse.FromString(encoded) == encode_response(response)
    assert encode_response_bytes(response) == encoded  # the cached headers give the same bytes


@pytest.mark.parametrize("response", [
    _response(Tensor("O", "FP32", (1,), np.zeros(1, np.float32)), parameters={"sequence_id": 3}),
    _response(Tensor("O", "FP32", (1,), np.zeros(1, np.float32), {"note": "x"})),
    _response(Tensor("O", "FP32", (1,), None, {"shared_memory_region": "r"})),
])
def test_responses_that_need_the_message(response):
    assert encode_response_bytes(response) is None
