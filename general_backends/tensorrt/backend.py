"""The ``tensorrt`` backend: serialized TensorRT engines (``<version>/model.plan``) on NVIDIA GPUs.

``tensorrt`` is imported only when a model of this backend loads; without it (always the case on a
machine with no NVIDIA GPU) the model is UNAVAILABLE with the reason and every other model serves.

Loading: the plan is deserialized with ``tensorrt.Runtime.deserialize_cuda_engine`` (once per GPU the
instances use), its I/O read into an :class:`~.engine.EngineInfo`, the config auto-completed and
bound to it (:mod:`.binding`). Each instance makes one execution context per optimisation profile it
may use (the instance group's ``profile`` list, else profile 0) on its own CUDA stream.

Running a batch (requests concatenated along dimension 0 by
:class:`~tideserve.batching.TensorModelInstance`): pick the profile that takes the batch's input shapes,
``set_input_shape`` for dynamic inputs, copy inputs to device buffers, ``set_tensor_address`` for
every input and output (outputs sized by ``get_tensor_shape`` after the inputs are set),
``execute_async_v3`` on the instance's stream, copy the outputs back.

Device buffers and the stream come from a :class:`~.cuda.CudaDevice` (PyTorch CUDA tensors by
default); tests swap both it and the ``tensorrt`` module for test doubles with :meth:`TensorRTBackend.using`.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from tideserve.backend_api import (
    Backend,
    InternalError,
    InvalidArgument,
    Model,
    TensorModelInstance,
    Unavailable,
    Unsupported,
    numpy_dtype,
)

from .binding import Bindings, auto_complete, bind, choose_profile, client_shape, parse_profiles
from .cuda import CudaDevice, DeviceBuffer, TorchCudaDevice
from .engine import EngineInfo, describe_engine

log = logging.getLogger(__name__)

NOT_INSTALLED = ("TensorRT is not installed: it needs an NVIDIA GPU (CUDA, Linux or Windows) and the tensorrt "
                 "package; pip install tensorrt (see https://docs.nvidia.com/deeplearning/tensorrt/latest/"
                 "installing-tensorrt/installing.html), then load the model again")

ALLOCATION_STRATEGIES = ("STATIC", "ON_PROFILE_CHANGE")


def import_tensorrt() -> Any:
    """The real ``tensorrt`` package, or Unavailable saying why not."""
    try:
        return importlib.import_module("tensorrt")
    except ImportError as exc:
        raise Unavailable(f"{NOT_INSTALLED} ({type(exc).__name__}: {exc})") from exc
    except Exception as exc:  # installed but broken: missing CUDA libraries, no driver...
        raise Unavailable(f"TensorRT failed to import: {type(exc).__name__}: {exc}") from exc


class TensorRTInstance(TensorModelInstance):
    """One CUDA stream on one GPU, with an execution context per optimisation profile it may use."""

    model: TensorRTModel

    def initialize(self) -> None:
        model = self.model
        group = next((g for g in model.config.instance_group if g.name == self.ctx.group_name), None)
        self.profiles = parse_profiles(model.config.name, group.profile if group else [], model.info)
        self.device: CudaDevice = model.backend.make_device(self.ctx.device_id)
        engine = model.engine_for(self.device)
        self.contexts: dict[int, Any] = {}
        with self.device.activate():
            for profile in self.profiles:
                self.contexts[profile] = self._make_context(engine, profile)
            self.device.synchronize()

    def _make_context(self, engine: Any, profile: int) -> Any:
        strategy = self.model.allocation_strategy
        context = engine.create_execution_context(strategy) if strategy is not None \
            else engine.create_execution_context()
        if context is None:
            raise Unavailable(f"instance '{self.ctx.name}': unable to create a TensorRT execution context "
                              f"(see the server log for TensorRT's message)")
        if profile != 0 and not context.set_optimization_profile_async(profile, self.device.stream_handle):
            raise Unavailable(f"instance '{self.ctx.name}': cannot set optimization profile {profile}; the engine "
                              f"has {self.model.info.num_profiles}")
        return context

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        model = self.model
        bindings, info = model.bindings, model.info
        missing = [b.name for b in bindings.inputs if b.name not in inputs]
        if missing:
            raise InvalidArgument(f"input '{missing[0]}' is required: every engine input must be fed")
        shapes = {b.engine_name: tuple(inputs[b.name].shape) for b in bindings.inputs}
        context = self.contexts[choose_profile(info, self.profiles, shapes)]
        held: list[DeviceBuffer] = []  # device memory stays alive until the engine is done with it
        with self.device.activate():
            for binding in bindings.inputs:
                array = np.ascontiguousarray(inputs[binding.name], dtype=binding.dtype)
                if model.dynamic[binding.engine_name] and not context.set_input_shape(binding.engine_name,
                                                                                      array.shape):
                    raise InvalidArgument(f"TensorRT refused shape {list(array.shape)} for input '{binding.name}'")
                held.append(self._bind(context, binding.engine_name, self.device.upload(array)))
            outputs = {}
            for name, engine_name, dtype in model.output_buffers:
                shape = tuple(int(d) for d in context.get_tensor_shape(engine_name))
                if any(d < 0 for d in shape):
                    raise Unsupported(f"output '{engine_name}' has a data-dependent shape {list(shape)}; engines "
                                      f"whose output shapes depend on input values are not supported")
                buffer = self._bind(context, engine_name, self.device.empty(shape, dtype))
                held.append(buffer)
                if name is not None:
                    outputs[name] = buffer
            if not context.execute_async_v3(self.device.stream_handle):
                raise InternalError("TensorRT failed to run the engine: execute_async_v3 returned false "
                                    "(see the server log for TensorRT's message)")
            result = {name: self.device.download(buffer) for name, buffer in outputs.items()}
            self.device.synchronize()
        return {b.name: client_shape(result[b.name], b, bindings.batching) for b in bindings.outputs}

    @staticmethod
    def _bind(context: Any, engine_name: str, buffer: DeviceBuffer) -> DeviceBuffer:
        if not context.set_tensor_address(engine_name, buffer.ptr):
            raise InternalError(f"TensorRT refused the device address of tensor '{engine_name}'")
        return buffer

    def finalize(self) -> None:
        self.contexts = {}


class TensorRTModel(Model):
    """A plan file, the engine deserialized on each GPU used, and the config bound to it."""

    instance_class = TensorRTInstance

    def __init__(self, backend: TensorRTBackend, ctx) -> None:
        super().__init__(backend, ctx)
        self.backend: TensorRTBackend = backend
        self.info: EngineInfo | None = None
        self.plan: bytes = b""
        self._engines: dict[int, Any] = {}  # device id -> ICudaEngine
        self._lock = threading.Lock()

    def auto_complete_config(self) -> None:
        self.backend.load_tensorrt()
        config = self.config
        use_gpu_instances(config)
        self.plan = read_plan(self.ctx)
        first_gpu = next((g.gpus[0] for g in config.instance_group if g.gpus), 0)
        engine = self.engine_for(self.backend.make_device(first_gpu))
        self.info = describe_engine(engine, self.backend.load_tensorrt())
        auto_complete(config, self.info)

    def initialize(self) -> None:
        self.bindings: Bindings = bind(self.config, self.info)
        self.dynamic = {t.name: t.dynamic for t in self.info.inputs}
        # (config name or None, engine name, numpy dtype) of every engine output: TensorRT wants them all bound
        self.output_buffers = [(b.name, b.engine_name, b.dtype) for b in self.bindings.outputs] + [
            (None, t.name, numpy_dtype(t.datatype)) for t in self.bindings.unbound_outputs]
        self.allocation_strategy = self._allocation_strategy()

    def _allocation_strategy(self) -> Any:
        value = self.ctx.parameter("execution_context_allocation_strategy")
        if not value:
            return None
        name = value.strip().upper()
        if name not in ALLOCATION_STRATEGIES:
            raise InvalidArgument(f"model '{self.config.name}': execution_context_allocation_strategy must be one "
                                  f"of {', '.join(ALLOCATION_STRATEGIES)}, got '{value}'")
        return getattr(self.backend.load_tensorrt().ExecutionContextAllocationStrategy, name)

    def engine_for(self, device: CudaDevice) -> Any:
        """The engine deserialized on ``device``'s GPU (once per GPU)."""
        with self._lock:
            engine = self._engines.get(device.device_id)
            if engine is None:
                with device.activate():
                    engine = self.backend.runtime().deserialize_cuda_engine(self.plan)
                if engine is None:
                    raise Unavailable(f"TensorRT could not deserialize {self.plan_path}: a plan runs only with the "
                                      f"TensorRT version and GPU kind that built it (see the server log for "
                                      f"TensorRT's message)")
                self._engines[device.device_id] = engine
            return engine

    @property
    def plan_path(self) -> Path:
        return self.ctx.version_path / (self.config.default_model_filename or "model.plan")

    def finalize(self) -> None:
        self._engines.clear()


def read_plan(ctx) -> bytes:
    path = ctx.version_path / (ctx.config.default_model_filename or "model.plan")
    if not path.is_file():
        raise Unavailable(f"model '{ctx.name}' version {ctx.version}: TensorRT plan {path} not found")
    return path.read_bytes()


def use_gpu_instances(config: mc.ModelConfig) -> None:
    """TensorRT runs on GPUs only: KIND_CPU groups (the default when a config names none) become KIND_GPU."""
    for group in config.instance_group:
        if group.kind == mc.ModelInstanceGroup.KIND_MODEL:
            raise Unsupported(f"model '{config.name}': instance group '{group.name}' is KIND_MODEL; multi-device "
                              f"TensorRT engines are not supported")
        if group.kind != mc.ModelInstanceGroup.KIND_GPU:
            log.info("model '%s': instance group '%s' runs on GPU (TensorRT has no CPU execution)",
                     config.name, group.name)
            group.kind = mc.ModelInstanceGroup.KIND_GPU


class TensorRTBackend(Backend):
    """``backend: "tensorrt"`` / ``platform: "tensorrt_plan"``."""

    model_class = TensorRTModel
    tensorrt_module: Any = None  # None: import the real ``tensorrt`` when a model loads
    device_class: Callable[[int], CudaDevice] = TorchCudaDevice

    def __init__(self) -> None:
        self._runtime = None
        self._lock = threading.Lock()

    @classmethod
    def using(cls, tensorrt_module: Any, device_class: Callable[[int], CudaDevice]) -> type[TensorRTBackend]:
        """This backend over another TensorRT module and device (test doubles): register the returned class
        with ``BackendRegistry.register("tensorrt", ...)``."""
        return type(f"{cls.__name__}Using{type(tensorrt_module).__name__}", (cls,),
                    {"tensorrt_module": tensorrt_module, "device_class": staticmethod(device_class)})

    def load_tensorrt(self) -> Any:
        return self.tensorrt_module if self.tensorrt_module is not None else import_tensorrt()

    def runtime(self) -> Any:
        """One ``tensorrt.Runtime`` (and logger) for every model of the backend."""
        with self._lock:
            if self._runtime is None:
                trt = self.load_tensorrt()
                self._logger = trt.Logger(trt.Logger.WARNING)
                self._runtime = trt.Runtime(self._logger)
            return self._runtime

    def make_device(self, device_id: int) -> CudaDevice:
        return self.device_class(device_id)
