"""A test double of TensorRT's Python runtime and of the device-buffer layer, and the engines ("plans") the
TensorRT tests use: tests/unit/test_tensorrt_binding.py (the binding logic) and tests/e2e/test_tensorrt.py (a
real server). See tests/e2e/test_tensorrt.py for what the double covers and what it does not."""

from __future__ import annotations

import enum
import itertools
import json
import weakref
from dataclasses import dataclass, field

import numpy as np

from tideserve.general_backends.tensorrt.cuda import DeviceBuffer

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


# == the engines of the tests ======================================================================
def io_tensor(name, mode, dtype, shape, profiles=None, **extra) -> dict:
    doc = {"name": name, "mode": mode, "dtype": dtype, "shape": shape, **extra}
    if profiles is not None:
        doc["profiles"] = profiles
    return doc


AFFINE_IO = [io_tensor("x", "INPUT", "FLOAT", [-1, 16], [[[1, 16], [4, 16], [8, 16]]]),
             io_tensor("y", "OUTPUT", "FLOAT", [-1, 4]), io_tensor("score", "OUTPUT", "FLOAT", [-1])]
AFFINE = fake_plan(AFFINE_IO, "affine")
AFFINE_BATCHED = fake_plan(AFFINE_IO, "affine", tag="affine_batched")
ADD_SUB = fake_plan([io_tensor("a", "INPUT", "INT32", [-1, -1], [[[1, 1], [2, 2], [4, 4]], [[1, 5], [2, 8], [4, 16]]]),
                     io_tensor("b", "INPUT", "INT32", [-1, -1], [[[1, 1], [2, 2], [4, 4]], [[1, 5], [2, 8], [4, 16]]]),
                     io_tensor("sum", "OUTPUT", "INT32", [-1, -1]), io_tensor("diff", "OUTPUT", "INT32", [-1, -1])],
                    "add_sub", num_profiles=2)
DOUBLE = fake_plan([io_tensor("in", "INPUT", "HALF", [2, 3], [[[2, 3], [2, 3], [2, 3]]]),
                    io_tensor("out", "OUTPUT", "HALF", [2, 3])], "double")
TWO_OUTPUTS = fake_plan([io_tensor("x", "INPUT", "INT64", [-1, 2], [[[1, 2], [2, 2], [2, 2]]]),
                         io_tensor("kept", "OUTPUT", "INT64", [-1, 2]),
                         io_tensor("dropped", "OUTPUT", "INT64", [-1, 2])], "two_outputs")
FAIL = fake_plan([io_tensor("x", "INPUT", "FLOAT", [-1, 2], [[[1, 2], [1, 2], [4, 2]]]),
                  io_tensor("y", "OUTPUT", "FLOAT", [-1, 2])], "fail")
FP8 = fake_plan([io_tensor("x", "INPUT", "FP8", [-1, 2], [[[1, 2], [1, 2], [4, 2]]]),
                 io_tensor("y", "OUTPUT", "FLOAT", [-1, 2])], "fail")
