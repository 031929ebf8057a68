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
``TensorRTBackend.using(fake, fake.device)`` — no globals patched.

What this proves: the binding logic (config vs engine names, datatypes, dims, batch dimension,
auto-complete, profile choice, dynamic shapes) and the data path through a real tideserve server with
real tritonclient HTTP / gRPC clients. What it does not: that real TensorRT, CUDA streams and PyTorch
CUDA buffers behave like the doubles (see docs/tensorrt.md).
"""

from __future__ import annotations

import enum
import importlib.util
import itertools
import json
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from support import free_port
from in_process import InProcessServer
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from tideserve.general_backends.tensorrt import TensorRTBackend
from tideserve.general_backends.tensorrt.binding import (
    auto_complete,
    bind,
    choose_profile,
    config_profiles,
    engine_max_batch_size,
)
from tideserve.general_backends.tensorrt.cuda import DeviceBuffer
from tideserve.general_backends.tensorrt.engine import describe_engine
from tideserve.app import ServerOptions
from tideserve.backend import Backend, BackendRegistry, Model, ModelInstance
from tideserve.config import parse_text
from tideserve.errors import InvalidArgument, Unsupported
from tideserve.types import InferenceResponse, Tensor

pytestmark = pytest.mark.timeout(60)

W = np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32)
B = np.linspace(-1, 1, 4, dtype=np.float32)

# the numpy programs the fake plans stand for: engine input arrays -> engine output arrays
PROGRAMS = {
    "affine": lambda x: {"y": x["x"] @ W + B, "score": (x["x"] @ W + B).sum(axis=1)},
    "add_sub": lambda x: {"sum": x["a"] + x["b"], "diff": x["a"] - x["b"]},
    "double": lambda x: {"out": x["in"] * np.float16(2)},
    "two_outputs": lambda x: {"kept": x["x"] + 1, "dropped": x["x"] * 0},
    "fail": lambda x: {"y": x["x"]},
}


# == the test double =================================================================================
class DataType(enum.Enum):
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    FP8 = 6
    BF16 = 7
    INT64 = 8
    INT4 = 9


NUMPY_OF = {DataType.FLOAT: np.float32, DataType.HALF: np.float16, DataType.INT8: np.int8,
            DataType.INT32: np.int32, DataType.BOOL: np.bool_, DataType.UINT8: np.uint8, DataType.INT64: np.int64}


class TensorIOMode(enum.Enum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


class TensorFormat(enum.Enum):
    LINEAR = 0
    CHW32 = 1


class ExecutionContextAllocationStrategy(enum.Enum):
    STATIC = 0
    ON_PROFILE_CHANGE = 1


class Logger:
    WARNING = 2

    def __init__(self, severity: int) -> None:
        self.severity = severity


MAGIC = b"FAKE-TENSORRT-PLAN\n"


def fake_plan(tensors: list[dict], program: str, num_profiles: int = 1, tag: str = "") -> bytes:
    """A plan the double deserializes: tensors as {name, mode, dtype, shape, profiles=[[min, opt, max]...]}."""
    doc = {"tensors": tensors, "program": program, "num_profiles": num_profiles, "tag": tag or program}
    return MAGIC + json.dumps(doc).encode()


class FakeEngine:
    """Test double of ``tensorrt.ICudaEngine``."""

    def __init__(self, doc: dict, fake: FakeTensorRT, device_id: int) -> None:
        self.fake, self.device_id = fake, device_id
        self.tensors = {t["name"]: t for t in doc["tensors"]}
        self.names = [t["name"] for t in doc["tensors"]]
        self.program, self.tag = doc["program"], doc["tag"]
        self.num_optimization_profiles = doc["num_profiles"]
        self.contexts: list[FakeContext] = []

    @property
    def num_io_tensors(self) -> int:
        return len(self.names)

    def get_tensor_name(self, index: int) -> str:
        return self.names[index]

    def get_tensor_mode(self, name: str) -> TensorIOMode:
        return TensorIOMode[self.tensors[name]["mode"]]

    def get_tensor_dtype(self, name: str) -> DataType:
        return DataType[self.tensors[name]["dtype"]]

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name]["shape"])

    def get_tensor_profile_shape(self, name: str, profile: int) -> list[tuple[int, ...]]:
        if self.get_tensor_mode(name) != TensorIOMode.INPUT:
            raise RuntimeError(f"{name} is not an input")
        return [tuple(s) for s in self.tensors[name]["profiles"][profile]]

    def is_shape_inference_io(self, name: str) -> bool:
        return self.tensors[name].get("shape_tensor", False)

    def get_tensor_format(self, name: str) -> TensorFormat:
        return TensorFormat[self.tensors[name].get("format", "LINEAR")]

    def create_execution_context(self, strategy: ExecutionContextAllocationStrategy | None = None) -> FakeContext:
        context = FakeContext(self, strategy)
        self.contexts.append(context)
        return context


class FakeContext:
    """Test double of ``tensorrt.IExecutionContext``: checks what TensorRT checks, runs the numpy program."""

    def __init__(self, engine: FakeEngine, strategy) -> None:
        self.engine, self.strategy = engine, strategy
        self.profile = 0
        self.shapes = {n: e["shape"] for n, e in engine.tensors.items() if e["mode"] == "INPUT" and -1 not in e["shape"]}
        self.addresses: dict[str, int] = {}
        self.runs: list[dict[str, tuple[int, ...]]] = []  # input shapes of each execution

    def set_optimization_profile_async(self, profile: int, stream: int) -> bool:
        if not 0 <= profile < self.engine.num_optimization_profiles:
            return False
        self.profile = profile
        return True

    def set_input_shape(self, name: str, shape) -> bool:
        spec = self.engine.tensors[name]
        low, _, high = spec["profiles"][self.profile]
        shape = tuple(int(d) for d in shape)
        if len(shape) != len(spec["shape"]) or not all(lo <= s <= hi for s, lo, hi in zip(shape, low, high)):
            return False
        self.shapes[name] = shape
        return True

    def _inputs(self, fill: bool) -> dict[str, np.ndarray]:
        arrays = {}
        for name, spec in self.engine.tensors.items():
            if spec["mode"] == "INPUT":
                dtype, shape = NUMPY_OF[DataType[spec["dtype"]]], tuple(self.shapes[name])
                arrays[name] = self._memory(name, shape, dtype) if fill else np.zeros(shape, dtype)
        return arrays

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        spec = self.engine.tensors[name]
        if spec["mode"] == "INPUT":
            return tuple(self.shapes.get(name, spec["shape"]))
        return PROGRAMS[self.engine.program](self._inputs(fill=False))[name].shape  # shape inference

    def set_tensor_address(self, name: str, address: int) -> bool:
        if name not in self.engine.tensors:
            return False
        self.addresses[name] = address
        return True

    def _memory(self, name: str, shape, dtype) -> np.ndarray:
        array = self.engine.fake.memory.get(self.addresses.get(name, -1))
        if array is None:
            raise AssertionError(f"tensor '{name}' has no device address")
        if array.shape != tuple(shape) or array.dtype != dtype:
            raise AssertionError(f"tensor '{name}': buffer {array.dtype}{list(array.shape)} for {dtype}{list(shape)}")
        return array

    def execute_async_v3(self, stream: int) -> bool:
        if self.engine.program == "fail":
            return False
        assert stream == self.engine.fake.stream_of(self.engine.device_id)
        inputs = self._inputs(fill=True)
        self.runs.append({n: a.shape for n, a in inputs.items()})
        for name, value in PROGRAMS[self.engine.program](inputs).items():
            spec = self.engine.tensors[name]
            np.copyto(self._memory(name, value.shape, NUMPY_OF[DataType[spec["dtype"]]]), value)
        return True


class Runtime:
    def __init__(self, logger: Logger, fake: FakeTensorRT) -> None:
        self.logger, self.fake = logger, fake

    def deserialize_cuda_engine(self, plan: bytes) -> FakeEngine | None:
        if not plan.startswith(MAGIC):
            return None  # TensorRT logs an error and returns None
        engine = FakeEngine(json.loads(plan[len(MAGIC):]), self.fake, self.fake.current_device)
        self.fake.engines.append(engine)
        return engine


class FakeTensorRT:
    """Test double of the ``tensorrt`` module (the names the backend uses), plus its device memory."""

    DataType, TensorIOMode, TensorFormat, Logger = DataType, TensorIOMode, TensorFormat, Logger
    ExecutionContextAllocationStrategy = ExecutionContextAllocationStrategy

    def __init__(self) -> None:
        self.memory: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()
        self.engines: list[FakeEngine] = []
        self.current_device = 0
        self._addresses = itertools.count(0x7F0000000000, 0x1000)

    def Runtime(self, logger: Logger) -> Runtime:  # a class in the real module
        return Runtime(logger, self)

    def stream_of(self, device_id: int) -> int:
        return 0xC0DE + device_id

    def device(self, device_id: int) -> FakeCudaDevice:
        return FakeCudaDevice(device_id, self)

    def allocate(self, array: np.ndarray) -> DeviceBuffer:
        address = next(self._addresses)
        self.memory[address] = array
        return DeviceBuffer(address, array)

    def engine_of(self, tag: str) -> FakeEngine:
        return [e for e in self.engines if e.tag == tag][-1]


@dataclass
class FakeCudaDevice:
    """Test double of ``general_backends.tensorrt.cuda.CudaDevice``: 'device memory' is numpy arrays."""

    device_id: int
    fake: FakeTensorRT
    uploads: list[tuple[int, ...]] = field(default_factory=list)

    def activate(self):
        fake, device_id = self.fake, self.device_id

        class _Current:
            def __enter__(self):
                fake.current_device = device_id

            def __exit__(self, *exc):
                return False

        return _Current()

    @property
    def stream_handle(self) -> int:
        return self.fake.stream_of(self.device_id)

    def upload(self, array: np.ndarray) -> DeviceBuffer:
        self.uploads.append(array.shape)
        return self.fake.allocate(np.array(array))

    def empty(self, shape, dtype) -> DeviceBuffer:
        return self.fake.allocate(np.full(shape, 99, dtype))  # garbage until the engine writes it

    def download(self, buffer: DeviceBuffer) -> np.ndarray:
        return np.array(buffer.owner)

    def synchronize(self) -> None:
        pass


# == engines and configs of the test repository ======================================================
def _t(name, mode, dtype, shape, profiles=None, **extra) -> dict:
    doc = {"name": name, "mode": mode, "dtype": dtype, "shape": shape, **extra}
    if profiles is not None:
        doc["profiles"] = profiles
    return doc


AFFINE_IO = [_t("x", "INPUT", "FLOAT", [-1, 16], [[[1, 16], [4, 16], [8, 16]]]),
             _t("y", "OUTPUT", "FLOAT", [-1, 4]), _t("score", "OUTPUT", "FLOAT", [-1])]
AFFINE = fake_plan(AFFINE_IO, "affine")
AFFINE_BATCHED = fake_plan(AFFINE_IO, "affine", tag="affine_batched")
ADD_SUB = fake_plan([_t("a", "INPUT", "INT32", [-1, -1], [[[1, 1], [2, 2], [4, 4]], [[1, 5], [2, 8], [4, 16]]]),
                     _t("b", "INPUT", "INT32", [-1, -1], [[[1, 1], [2, 2], [4, 4]], [[1, 5], [2, 8], [4, 16]]]),
                     _t("sum", "OUTPUT", "INT32", [-1, -1]), _t("diff", "OUTPUT", "INT32", [-1, -1])],
                    "add_sub", num_profiles=2)
DOUBLE = fake_plan([_t("in", "INPUT", "HALF", [2, 3], [[[2, 3], [2, 3], [2, 3]]]),
                    _t("out", "OUTPUT", "HALF", [2, 3])], "double")
TWO_OUTPUTS = fake_plan([_t("x", "INPUT", "INT64", [-1, 2], [[[1, 2], [2, 2], [2, 2]]]),
                         _t("kept", "OUTPUT", "INT64", [-1, 2]), _t("dropped", "OUTPUT", "INT64", [-1, 2])],
                        "two_outputs")
FAIL = fake_plan([_t("x", "INPUT", "FLOAT", [-1, 2], [[[1, 2], [1, 2], [4, 2]]]),
                  _t("y", "OUTPUT", "FLOAT", [-1, 2])], "fail")
FP8 = fake_plan([_t("x", "INPUT", "FP8", [-1, 2], [[[1, 2], [1, 2], [4, 2]]]), _t("y", "OUTPUT", "FLOAT", [-1, 2])],
                "fail")

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
def fake():
    return FakeTensorRT()


@pytest.fixture(scope="module")
def tideserve(tmp_path_factory, fake):
    root = write_repository(tmp_path_factory.mktemp("trt_repo"), REPOSITORY)
    registry = BackendRegistry()
    registry.register("tensorrt", TensorRTBackend.using(fake, fake.device))
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


def test_dynamic_shapes_choose_the_profile_and_set_input_shapes(grpc, fake):
    def run(rows: int, length: int):
        a = np.arange(rows * length, dtype=np.int32).reshape(rows, length)
        b = np.full((rows, length), 3, np.int32)
        result = grpc.infer("add_sub", [infer_input(grpcclient, "a", a), infer_input(grpcclient, "b", b)])
        np.testing.assert_array_equal(result.as_numpy("sum"), a + b)
        np.testing.assert_array_equal(result.as_numpy("diff"), a - b)

    run(2, 3)   # sequence length 3: profile 0 (1..4)
    run(1, 12)  # length 12: profile 1 (5..16)
    engine = fake.engine_of("add_sub")
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


def test_dynamic_batching_concatenates_requests_and_splits_outputs(http, fake):
    before = http.get_inference_statistics("affine_batched")["model_stats"][0]
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal((rows, 16)).astype(np.float32) for rows in (1, 2, 1, 3, 1)]
    pending = [http.async_infer("affine_batched", [infer_input(httpclient, "x", x)]) for x in xs]
    for x, request in zip(xs, pending):
        result = request.get_result(timeout=30)
        np.testing.assert_array_equal(result.as_numpy("y"), x @ W + B)
    after = http.get_inference_statistics("affine_batched")["model_stats"][0]
    assert after["inference_count"] - before["inference_count"] == 8
    assert after["execution_count"] - before["execution_count"] < len(xs)
    rows = [run["x"][0] for c in fake.engine_of("affine_batched").contexts for run in c.runs]
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


# == binding logic, without a server ===============================================================
def _engine(plan: bytes, fake: FakeTensorRT):
    return describe_engine(Runtime(Logger(Logger.WARNING), fake).deserialize_cuda_engine(plan), fake)


def _config(text: str) -> mc.ModelConfig:
    config = parse_text('name: "m"\nbackend: "tensorrt"\n' + text)
    if not config.instance_group:
        config.instance_group.add(name="m_0", count=1, kind=mc.ModelInstanceGroup.KIND_GPU)
    return config


def test_describe_engine_maps_datatypes_and_profiles(fake):
    info = _engine(ADD_SUB, fake)
    assert [(t.name, t.is_input, t.datatype, t.shape) for t in info.tensors] == [
        ("a", True, "INT32", (-1, -1)), ("b", True, "INT32", (-1, -1)),
        ("sum", False, "INT32", (-1, -1)), ("diff", False, "INT32", (-1, -1))]
    assert info.num_profiles == 2
    assert info.inputs[0].profiles[1] == ((1, 5), (2, 8), (4, 16))
    static = _engine(DOUBLE, fake).inputs[0]
    assert (static.datatype, static.profiles, static.dynamic) == ("FP16", (((2, 3), (2, 3), (2, 3)),), False)
    assert _engine(FP8, fake).inputs[0].datatype is None


def test_auto_complete_from_the_engine_alone(fake):
    config = _config("")
    auto_complete(config, _engine(ADD_SUB, fake))
    assert config.max_batch_size == 4 and config.HasField("dynamic_batching")
    assert [(t.name, mc.DataType.Name(t.data_type), list(t.dims)) for t in config.input] == [
        ("a", "TYPE_INT32", [-1]), ("b", "TYPE_INT32", [-1])]
    assert [t.name for t in config.output] == ["sum", "diff"]


def test_auto_complete_follows_the_configs_dims(fake):
    full_rank = _config('input [ { name: "x" data_type: TYPE_FP32 dims: [ -1, 16 ] } ]\n')
    auto_complete(full_rank, _engine(AFFINE, fake))
    assert full_rank.max_batch_size == 0 and not full_rank.HasField("dynamic_batching")
    assert list(full_rank.output[0].dims) == [-1, 4]  # outputs keep the engine's batch dimension as a dim
    with pytest.raises(InvalidArgument, match="contradict each other"):
        auto_complete(_config('input [ { name: "x" data_type: TYPE_FP32 dims: [ 16 ] } ]\n'
                              'output [ { name: "y" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]\n'),
                      _engine(AFFINE, fake))
    with pytest.raises(InvalidArgument, match="specified max-batch 9 but TensorRT engine only supports max-batch 8"):
        auto_complete(_config("max_batch_size: 9\n"), _engine(AFFINE, fake))


def test_max_batch_size_follows_the_profiles_instances_use(fake):
    info = _engine(ADD_SUB, fake)
    assert engine_max_batch_size(info, [0]) == 4
    config = _config('instance_group [ { kind: KIND_GPU profile: [ "1" ] } ]\n')
    assert config_profiles(config, info) == [1]
    with pytest.raises(InvalidArgument, match="optimization profile 5 does not exist; the engine has 2"):
        config_profiles(_config('instance_group [ { kind: KIND_GPU profile: [ "5" ] } ]\n'), info)


@pytest.mark.parametrize("text, error, message", [
    ('input [ { name: "z" data_type: TYPE_FP32 dims: [ 16 ] } ]', InvalidArgument,
     "unexpected input 'z'; the engine's inputs are: x"),
    ('input [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]', InvalidArgument, "unexpected input 'y'"),
    ('input [ { name: "x" data_type: TYPE_FP32 dims: [ 4, 4 ] } ]', InvalidArgument,
     "the model expects 2 dimensions (shape [-1,16]) but the model configuration specifies 3 dimensions"),
    ('input [ { name: "x" data_type: TYPE_FP32 dims: [ 15 ] } ]', InvalidArgument, "making complete shape [-1,15]"),
    (('input [ { name: "x" data_type: TYPE_FP32 dims: [ 16 ] } ]\n'
     'output [ { name: "y" data_type: TYPE_INT32 dims: [ 4 ] } ]'), InvalidArgument,
     "unexpected datatype TYPE_FP32 for output 'y', expecting TYPE_INT32"),
])
def test_binding_errors(fake, text, error, message):
    config = _config("max_batch_size: 8\n" + text)
    with pytest.raises(error) as info:
        bind(config, _engine(AFFINE, fake))
    assert message in str(info.value)


def test_every_engine_input_must_be_fed_and_shape_tensors_are_refused(fake):
    config = _config('max_batch_size: 4\ninput [ { name: "a" data_type: TYPE_INT32 dims: [ -1 ] } ]\n')
    with pytest.raises(InvalidArgument, match="engine input 'b' is not in the model configuration"):
        bind(config, _engine(ADD_SUB, fake))
    shaped = fake_plan([_t("n", "INPUT", "INT32", [1], [[[1], [1], [1]]], shape_tensor=True),
                        _t("y", "OUTPUT", "FLOAT", [-1])], "fail")
    with pytest.raises(Unsupported, match="'n' is a shape tensor"):
        auto_complete(_config(""), _engine(shaped, fake))


def test_engine_names_with_a_space_bind_by_their_first_word(fake):
    plan = fake_plan([_t("x (input)", "INPUT", "FLOAT", [-1, 2], [[[1, 2], [1, 2], [2, 2]]]),
                      _t("y", "OUTPUT", "FLOAT", [-1, 2])], "fail")
    config = _config("")
    auto_complete(config, _engine(plan, fake))
    bindings = bind(config, _engine(plan, fake))
    assert [(b.name, b.engine_name) for b in bindings.inputs] == [("x", "x (input)")]


def test_choose_profile_takes_the_closest_profile_that_fits(fake):
    info = _engine(ADD_SUB, fake)
    assert choose_profile(info, [0, 1], {"a": (2, 2), "b": (2, 2)}) == 0
    assert choose_profile(info, [0, 1], {"a": (4, 9), "b": (4, 9)}) == 1
    with pytest.raises(InvalidArgument, match="no optimization profile"):
        choose_profile(info, [0], {"a": (1, 9), "b": (1, 9)})  # this instance may only use profile 0


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
