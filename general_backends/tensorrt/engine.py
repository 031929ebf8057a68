"""What a deserialized TensorRT engine says about its I/O tensors, as plain data.

:func:`describe_engine` is the only place that reads an engine's I/O through TensorRT's Python API
(``num_io_tensors``, ``get_tensor_name``, ``get_tensor_mode``, ``get_tensor_dtype``,
``get_tensor_shape``, ``get_tensor_profile_shape``, ``is_shape_inference_io``, ``get_tensor_format``);
everything after it (:mod:`.binding`) works on the :class:`EngineInfo` it returns.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

Shape = tuple[int, ...]

# TensorRT DataType member name -> Triton datatype. BF16, FP8, INT4 and FP4 tensors have no numpy
# dtype, so no request could carry them: they map to None and a model using them does not load.
TRT_DATATYPES: dict[str, str | None] = {
    "FLOAT": "FP32", "HALF": "FP16", "INT8": "INT8", "INT32": "INT32", "INT64": "INT64",
    "BOOL": "BOOL", "UINT8": "UINT8", "BF16": None, "FP8": None, "INT4": None, "FP4": None,
}


def triton_datatype(trt_type_name: str) -> str | None:
    """``FLOAT`` -> ``FP32``...; None for a TensorRT type that cannot cross the wire."""
    return TRT_DATATYPES.get(trt_type_name)


@dataclass(frozen=True)
class EngineTensor:
    """One I/O tensor of the engine."""

    name: str
    is_input: bool
    trt_type: str  # TensorRT's DataType name, e.g. "FLOAT"
    shape: Shape  # -1 where the engine takes any size (within its optimisation profiles)
    profiles: tuple[tuple[Shape, Shape, Shape], ...] = ()  # inputs: (min, opt, max) per optimisation profile
    is_shape_tensor: bool = False
    linear: bool = True

    @property
    def datatype(self) -> str | None:
        return triton_datatype(self.trt_type)

    @property
    def config_name(self) -> str:
        """The name a model config uses: the engine name up to its first space, as Triton reads it."""
        return self.name.split(" ", 1)[0]

    @property
    def dynamic(self) -> bool:
        return -1 in self.shape


@dataclass(frozen=True)
class EngineInfo:
    tensors: tuple[EngineTensor, ...]
    num_profiles: int

    @property
    def inputs(self) -> list[EngineTensor]:
        return [t for t in self.tensors if t.is_input]

    @property
    def outputs(self) -> list[EngineTensor]:
        return [t for t in self.tensors if not t.is_input]

    def find(self, config_name: str) -> EngineTensor | None:
        for tensor in self.tensors:
            if tensor.config_name == config_name:
                return tensor
        return None


def _enum_name(value: Any) -> str:
    name = getattr(value, "name", None)
    return name if isinstance(name, str) else str(value).rsplit(".", 1)[-1]


def _profile_shapes(engine: Any, name: str, shape: Shape, num_profiles: int) -> tuple[tuple[Shape, Shape, Shape], ...]:
    if -1 not in shape:  # a static input: every profile takes exactly its shape
        return tuple((shape, shape, shape) for _ in range(max(num_profiles, 1)))
    profiles = []
    for index in range(num_profiles):
        low, opt, high = engine.get_tensor_profile_shape(name, index)
        profiles.append((tuple(int(d) for d in low), tuple(int(d) for d in opt), tuple(int(d) for d in high)))
    return tuple(profiles)


def describe_engine(engine: Any, trt: Any) -> EngineInfo:
    """Read an ``ICudaEngine``'s I/O tensors (names, modes, types, shapes, profile ranges)."""
    num_profiles = int(engine.num_optimization_profiles)
    tensors = []
    for index in range(int(engine.num_io_tensors)):
        name = engine.get_tensor_name(index)
        is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
        shape = tuple(int(d) for d in engine.get_tensor_shape(name))
        is_shape_tensor = bool(engine.is_shape_inference_io(name))
        linear = engine.get_tensor_format(name) == trt.TensorFormat.LINEAR
        profiles = _profile_shapes(engine, name, shape, num_profiles) if is_input and not is_shape_tensor else ()
        tensors.append(EngineTensor(name, is_input, _enum_name(engine.get_tensor_dtype(name)), shape, profiles,
                                    is_shape_tensor, linear))
    return EngineInfo(tuple(tensors), num_profiles)
