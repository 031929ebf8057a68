"""The TensorRT backend (``general_backends/tensorrt``) against a TEST DOUBLE of TensorRT's Python runtime.

TensorRT needs an NVIDIA GPU, so nothing here runs TensorRT. ``FakeTensorRT`` is a test double of the
handful of runtime calls the backend makes: ``Logger``, ``Runtime.deserialize_cuda_engine``, the engine's
``num_io_tensors`` / ``get_tensor_name`` / ``get_tensor_mode`` / ``get_tensor_dtype`` / ``get_tensor_shape`` /
``get_tensor_profile_shape`` / ``num_optimization_profiles`` / ``is_shape_inference_io`` /
``get_tensor_format`` / ``create_execution_context``, and the context's ``set_optimization_profile_async`` /
``set_input_shape`` / ``get_tensor_shape`` / ``set_tensor_address`` / ``execute_async_v3``. Its "plans" are
JSON documents naming the I/O tensors, their optimisation profiles and a numpy program standing in for
the network; like TensorRT it refuses shapes outside the selected profile, and it refuses to run unless
every I/O tensor has an address of the right size and type. ``FakeCudaDevice`` is the matching double
of the device-buffer layer: "device memory" is numpy arrays found by address. Both are plugged in with
``TensorRTBackend.using(fake, fake.device)`` — no globals patched. The doubles and the test engines are in
``tests/tensorrt_double.py``; the binding logic on its own is tested in ``tests/unit/test_tensorrt_binding.py``.

What this proves: the binding logic (config vs engine names, datatypes, dims, batch dimension,
auto-complete, profile choice, dynamic shapes) and the data path through a real tideserve server with
real tritonclient HTTP / gRPC clients. What it does not: that real TensorRT, CUDA streams and PyTorch
CUDA buffers behave like the doubles (see docs/tensorrt.md).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tensorrt_double import (
    ADD_SUB,
    AFFINE,
    AFFINE_BATCHED,
    B,
    DOUBLE,
    FAIL,
    FP8,
    TWO_OUTPUTS,
    W,
    ExecutionContextAllocationStrategy,
)
from support import free_port
from in_process import InProcessServer
from tritonclient.utils import InferenceServerException

from tideserve.general_backends.tensorrt import TensorRTBackend
from tideserve.app import ServerOptions
from tideserve.backend import Backend, BackendRegistry, Model, ModelInstance
from tideserve.types import InferenceResponse, Tensor

pytestmark = pytest.mark.timeout(60)

ADD_SUB_IO = "".join(f'{k} {{ name: "{n}" data_type: TYPE_INT32 dims: [ -1 ] }}\n'
                     for k, n in (("input", "a"), ("input", "b"), ("output", "sum"), ("output", "diff")))

# name -> (plan bytes, config body); configs leave out what auto-complete fills
REPOSITORY = {
    "affine": (AFFINE, 'platform: "tensorrt_plan"\n'),
    "affine_batched": (AFFINE_BATCHED, ('backend: "tensorrt"\nmax_batch_size: 8\n'
                                        "dynamic_batching { max_queue_delay_microseconds: 200000 }\n")),
    "add_sub": (ADD_SUB, 'backend: "tensorrt"\nmax_batch_size: 4\n' + ADD_SUB_IO
                + 'instance_group [ { kind: KIND_GPU profile: [ "0", "1" ] } ]\n'
                + 'parameters { key: "execution_context_allocation_strategy" '
                  'value: { string_value: "ON_PROFILE_CHANGE" } }\n'),
    "double": (DOUBLE, 'backend: "tensorrt"\ninput [ { name: "in" data_type: TYPE_FP16 dims: [ 2, 3 ] } ]\n'),
    "two_outputs": (TWO_OUTPUTS, ('backend: "tensorrt"\nmax_batch_size: 2\n'
                                  'output [ { name: "kept" data_type: TYPE_INT64 dims: [ 2 ] } ]\n')),
    "fail": (FAIL, 'backend: "tensorrt"\n'),
    # models that must not load
    "bad_plan": (b"not a plan", 'backend: "tensorrt"\n'),
    "wrong_type": (AFFINE, 'backend: "tensorrt"\ninput [ { name: "x" data_type: TYPE_FP16 dims: [ 16 ] } ]\n'),
    "too_big": (AFFINE, 'backend: "tensorrt"\nmax_batch_size: 32\n'),
    "fp8": (FP8, 'backend: "tensorrt"\n'),
}
UNLOADABLE = {"bad_plan", "wrong_type", "too_big", "fp8"}


def write_repository(root: Path, models: dict) -> Path:
    for name, (plan, body) in models.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.plan").write_bytes(plan)
        (root / name / "config.pbtxt").write_text(f'name: "{name}"\n' + body)
    return root


@pytest.fixture(scope="module")
def tideserve(tmp_path_factory, fake_tensorrt):
    root = write_repository(tmp_path_factory.mktemp("trt_repo"), REPOSITORY)
    registry = BackendRegistry()
    registry.register("tensorrt", TensorRTBackend.using(fake_tensorrt, fake_tensorrt.device))
    options = ServerOptions(model_repositories=[root], http_port=free_port(), grpc_port=free_port(),
                            allow_metrics=False, strict_readiness=False, exit_timeout_secs=2)
    running = InProcessServer(options, registry)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def http(tideserve):
    with httpclient.InferenceServerClient(tideserve.http_url, concurrency=8) as client:
        yield client


@pytest.fixture(scope="module")
def grpc(tideserve):
    with grpcclient.InferenceServerClient(tideserve.grpc_url) as client:
        yield client


def infer_input(module, name: str, array: np.ndarray):
    datatype = {np.float32: "FP32", np.float16: "FP16", np.int32: "INT32", np.int64: "INT64"}[array.dtype.type]
    tensor = module.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


# == through the server ============================================================================
def test_auto_completed_config(grpc):
    config = grpc.get_model_config("affine", as_json=True)["config"]
    assert config["max_batch_size"] == 8  # the profile's largest first dimension
    assert "dynamic_batching" in config
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [("x", "TYPE_FP32", ["16"])]
    outputs = {t["name"]: t for t in config["output"]}
    assert outputs["y"]["dims"] == ["4"] and outputs["y"]["data_type"] == "TYPE_FP32"
    assert outputs["score"]["dims"] == ["1"] and outputs["score"]["reshape"] == {}  # a scalar per row
    assert {g["kind"] for g in config["instance_group"]} == {"KIND_GPU"}  # TensorRT runs on GPUs only


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_outputs_come_back_from_the_engine_buffers(protocol, http, grpc):
    client, module = (http, httpclient) if protocol == "http" else (grpc, grpcclient)
    x = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
    result = client.infer("affine", [infer_input(module, "x", x)])
    np.testing.assert_array_equal(result.as_numpy("y"), x @ W + B)
    assert result.as_numpy("score").shape == (3, 1)  # the engine's [3] seen through dims [1]
    np.testing.assert_array_equal(result.as_numpy("score")[:, 0], (x @ W + B).sum(axis=1))


def test_dynamic_shapes_choose_the_profile_and_set_input_shapes(grpc, fake_tensorrt):
    def run(rows: int, length: int):
        a = np.arange(rows * length, dtype=np.int32).reshape(rows, length)
        b = np.full((rows, length), 3, np.int32)
        result = grpc.infer("add_sub", [infer_input(grpcclient, "a", a), infer_input(grpcclient, "b", b)])
        np.testing.assert_array_equal(result.as_numpy("sum"), a + b)
        np.testing.assert_array_equal(result.as_numpy("diff"), a - b)

    run(2, 3)   # sequence length 3: profile 0 (1..4)
    run(1, 12)  # length 12: profile 1 (5..16)
    engine = fake_tensorrt.engine_of("add_sub")
    by_profile = {c.profile: c for c in engine.contexts[-2:]}
    assert set(by_profile) == {0, 1}
    assert by_profile[0].runs[-1] == {"a": (2, 3), "b": (2, 3)}
    assert by_profile[1].runs[-1] == {"a": (1, 12), "b": (1, 12)}
    assert by_profile[1].strategy is ExecutionContextAllocationStrategy.ON_PROFILE_CHANGE
    with pytest.raises(InferenceServerException) as info:
        run(1, 20)
    message = str(info.value)
    assert "no optimization profile of the engine accepts the input shapes (a [1,20], b [1,20])" in message
    assert "profile 1: a [1,5]..[4,16]" in message


def test_dynamic_batching_concatenates_requests_and_splits_outputs(http, fake_tensorrt):
    before = http.get_inference_statistics("affine_batched")["model_stats"][0]
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal((rows, 16)).astype(np.float32) for rows in (1, 2, 1, 3, 1)]
    pending = [http.async_infer("affine_batched", [infer_input(httpclient, "x", x)]) for x in xs]
    for x, request in zip(xs, pending):
        result = request.get_result(timeout=30)
        # a batched matmul may round differently from one of the request's rows alone (BLAS blocking)
        np.testing.assert_allclose(result.as_numpy("y"), x @ W + B, rtol=1e-5, atol=1e-6)
    after = http.get_inference_statistics("affine_batched")["model_stats"][0]
    assert after["inference_count"] - before["inference_count"] == 8
    assert after["execution_count"] - before["execution_count"] < len(xs)
    rows = [run["x"][0] for c in fake_tensorrt.engine_of("affine_batched").contexts for run in c.runs]
    assert max(rows) > 3  # one engine run took several requests' rows


def test_static_fp16_engine_without_batching(grpc):
    config = grpc.get_model_config("double", as_json=True)["config"]
    assert config.get("max_batch_size", 0) == 0  # dims [2, 3] have the engine's rank: no batch dimension
    x = np.arange(6, dtype=np.float16).reshape(2, 3)
    result = grpc.infer("double", [infer_input(grpcclient, "in", x)])
    assert result.as_numpy("out").dtype == np.float16
    np.testing.assert_array_equal(result.as_numpy("out"), x * np.float16(2))


def test_engine_outputs_the_config_leaves_out_are_bound_and_dropped(grpc):
    x = np.array([[1, 2], [3, 4]], np.int64)
    result = grpc.infer("two_outputs", [infer_input(grpcclient, "x", x)])
    np.testing.assert_array_equal(result.as_numpy("kept"), x + 1)
    assert result.as_numpy("dropped") is None


def test_a_failing_execution_is_a_request_error_and_the_model_keeps_serving(grpc):
    x = np.zeros((1, 2), np.float32)
    with pytest.raises(InferenceServerException, match="execute_async_v3 returned false"):
        grpc.infer("fail", [infer_input(grpcclient, "x", x)])
    assert grpc.is_model_ready("fail")


def test_models_that_cannot_load_are_unavailable_with_reasons_and_others_serve(grpc):
    index = {m["name"]: m for m in grpc.get_model_repository_index(as_json=True)["models"]}
    for name in UNLOADABLE:
        assert index[name]["state"] == "UNAVAILABLE", name
    assert "TensorRT could not deserialize" in index["bad_plan"]["reason"]
    assert "unexpected datatype TYPE_FP32 for input 'x', expecting TYPE_FP16" in index["wrong_type"]["reason"]
    assert "configuration specified max-batch 32 but TensorRT engine only supports max-batch 8" \
        in index["too_big"]["reason"]
    assert "is of TensorRT type FP8, which has no tensor datatype here" in index["fp8"]["reason"]
    assert grpc.is_model_ready("affine")


# == without the double ============================================================================
class _EchoInstance(ModelInstance):
    def execute(self, requests):
        return [InferenceResponse(outputs=[Tensor.from_numpy("OUT", r.inputs["IN"].data)]) for r in requests]


class _EchoModel(Model):
    instance_class = _EchoInstance


class _EchoBackend(Backend):
    model_class = _EchoModel


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None,
                    reason="TensorRT is installed here: the not-installed path cannot be seen")
def test_without_tensorrt_the_model_is_unavailable_and_others_serve(tmp_path):
    write_repository(tmp_path, {"plan": (AFFINE, 'platform: "tensorrt_plan"\n')})
    (tmp_path / "echo" / "1").mkdir(parents=True)
    (tmp_path / "echo" / "config.pbtxt").write_text(
        'name: "echo"\nbackend: "echo"\ninput [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        'output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]\n')
    registry = BackendRegistry()  # "tensorrt" comes from the package entry point: the real backend
    registry.register("echo", _EchoBackend)
    running = InProcessServer(ServerOptions(model_repositories=[tmp_path], grpc_port=free_port(), allow_http=False,
                                            allow_metrics=False, strict_readiness=False), registry)
    try:
        with grpcclient.InferenceServerClient(running.grpc_url) as client:
            index = {m["name"]: m for m in client.get_model_repository_index(as_json=True)["models"]}
            assert index["plan"]["state"] == "UNAVAILABLE"
            assert "TensorRT is not installed: it needs an NVIDIA GPU" in index["plan"]["reason"]
            assert "pip install tensorrt" in index["plan"]["reason"]
            assert not client.is_model_ready("plan")
            result = client.infer("echo", [infer_input(grpcclient, "IN", np.array([7], np.int32))])
            assert result.as_numpy("OUT").tolist() == [7]
    finally:
        running.stop()
