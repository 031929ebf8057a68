"""triton_python_backend_utils on its own (no model process): tensors, BYTES serialization, errors and
responses, the model-config helpers, the response sender, the logger."""

from __future__ import annotations

import json

import numpy as np
import pytest
import triton_python_backend_utils as pb_utils

from tideserve.errors import Status
from tideserve.responses import ResponseSender
from tideserve.types import InferenceRequest


def test_tensor_datatypes_strings_and_dlpack():
    floats = pb_utils.Tensor("F", np.arange(6, dtype=np.float32).reshape(2, 3))
    assert floats.name() == "F" and floats.shape() == [2, 3] and floats.is_cpu()
    assert floats.triton_dtype() == 11 == pb_utils.numpy_to_triton_type(np.float32)
    strings = pb_utils.Tensor("S", np.array(["a", "ü"]))
    assert strings.triton_dtype() == 13 and strings.as_numpy().tolist() == [b"a", "ü".encode()]
    objects = pb_utils.Tensor("O", np.array([b"x", "y", 3], dtype=np.object_))
    assert objects.as_numpy().tolist() == [b"x", b"y", b"3"]
    copy = pb_utils.Tensor.from_dlpack("G", floats.to_dlpack())
    np.testing.assert_array_equal(copy.as_numpy(), floats.as_numpy())
    np.testing.assert_array_equal(np.from_dlpack(floats), floats.as_numpy())
    assert pb_utils.triton_string_to_numpy("TYPE_STRING") is np.object_
    assert pb_utils.triton_to_numpy_type(8) is np.int32
    with pytest.raises(pb_utils.TritonModelException):
        pb_utils.Tensor("C", np.ones(2, np.complex64))


def test_byte_tensor_serialization_round_trip():
    array = np.array([b"ab", b"", "ç".encode()], dtype=np.object_)
    encoded = pb_utils.serialize_byte_tensor(array)
    assert encoded[:6] == b"\x02\x00\x00\x00ab"
    assert pb_utils.deserialize_bytes_tensor(encoded).tolist() == array.tolist()
    assert pb_utils.serialize_byte_tensor(np.array([], dtype=np.object_)) == ()


def test_errors_and_responses():
    error = pb_utils.TritonError("gone", pb_utils.TritonError.NOT_FOUND)
    assert error.message() == "gone" and error.code() == pb_utils.TritonError.NOT_FOUND
    assert pb_utils.TritonError("x").code() == pb_utils.TritonError.INTERNAL
    response = pb_utils.InferenceResponse(error=error)
    assert response.has_error() and response.output_tensors() == [] and response.error() is error
    with_params = pb_utils.InferenceResponse([pb_utils.Tensor("A", np.ones(1))], parameters={"k": 1, "b": True})
    assert json.loads(with_params.parameters()) == {"k": 1, "b": True}
    assert pb_utils.get_output_tensor_by_name(with_params, "A").as_numpy().tolist() == [1.0]
    assert pb_utils.get_output_tensor_by_name(with_params, "B") is None
    with pytest.raises(pb_utils.TritonModelException, match="bool/int/str"):
        pb_utils.InferenceResponse(parameters={"k": [1]})
    with pytest.raises(TypeError):
        pb_utils.InferenceRequest(model_name="m", inputs=[])  # requested_output_names is required


def test_model_config_helpers():
    config = pb_utils.ModelConfig(json.dumps({"name": "m", "max_batch_size": 2, "input": [
        {"name": "A", "data_type": "TYPE_FP32", "dims": [4]}], "output": []}))
    config.add_input({"name": "A", "data_type": "TYPE_FP32", "dims": [4]})
    config.add_input({"name": "B", "data_type": "TYPE_INT32", "dims": [-1], "optional": True})
    config.add_output({"name": "C", "data_type": "TYPE_FP32", "dims": [4]})
    config.set_max_batch_size(8)
    config.set_dynamic_batching()
    config.set_model_transaction_policy({"decoupled": True})
    data = config.as_dict()
    assert [t["name"] for t in data["input"]] == ["A", "B"] and data["max_batch_size"] == 8
    assert data["dynamic_batching"] == {} and pb_utils.using_decoupled_model_transaction_policy(data)
    assert pb_utils.get_input_config_by_name(data, "B")["optional"] is True
    assert pb_utils.get_output_config_by_name(data, "C")["dims"] == [4]
    with pytest.raises(ValueError, match="configuration expects datatype TYPE_FP32"):
        config.add_input({"name": "A", "data_type": "TYPE_INT8", "dims": [4]})
    with pytest.raises(ValueError, match="the model expects dims"):
        config.add_output({"name": "C", "data_type": "TYPE_FP32", "dims": [5]})
    with pytest.raises(ValueError, match="contains property other than"):
        config.add_output({"name": "D", "data_type": "TYPE_FP32", "dims": [5], "optional": True})
    with pytest.raises(ValueError, match="max_batch_size"):
        config.set_max_batch_size(1)


def test_response_sender_in_decoupled_mode():
    sent = []
    request = InferenceRequest("m", {})
    request.response_sender = ResponseSender(request, sent.append)
    sender = pb_utils.InferenceRequest._wrap(request, decoupled=True).get_response_sender()
    sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("A", np.ones(1))]))
    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("bad item", pb_utils.TritonError.INVALID_ARG)))
    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    assert [r.final for r in sent] == [False, False, True] and sent[2].empty
    assert sent[1].error.status is Status.INVALID_ARG and sent[1].error.message == "bad item"
    with pytest.raises(pb_utils.TritonModelException, match="closed"):
        sender.send(pb_utils.InferenceResponse([]))
    with pytest.raises(pb_utils.TritonModelException, match="must be provided"):
        pb_utils.InferenceRequest._wrap(request, decoupled=True).get_response_sender().send()


def test_logger_maps_to_python_logging(caplog):
    with caplog.at_level("DEBUG", logger="tideserve.python_model"):
        pb_utils.Logger.log_info("info message")
        pb_utils.Logger.log_warn("warn message")
        pb_utils.Logger.log_error("error message")
        pb_utils.Logger.log_verbose("verbose message")
        pb_utils.Logger.log("explicit", pb_utils.Logger.WARNING)
    levels = {r.getMessage(): r.levelname for r in caplog.records}
    assert levels == {"info message": "INFO", "warn message": "WARNING", "error message": "ERROR",
                      "verbose message": "DEBUG", "explicit": "WARNING"}
    assert all(r.filename == "test_python_backend_utils.py" for r in caplog.records)
