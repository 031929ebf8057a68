"""A model config against a TensorRT engine: auto-completion, binding checks, per-batch shapes.

Plain functions over :class:`~.engine.EngineInfo` and Triton's ``ModelConfig`` — no GPU, no
``tensorrt`` import — following Triton's TensorRT backend:

- **Auto-complete** (:func:`auto_complete`): ``max_batch_size`` from the engine's optimisation
  profiles (the largest first-dimension maximum every input accepts) unless the config's tensor
  dims say the model does not batch; inputs and outputs the config leaves out, from the engine (the
  batch dimension dropped, a scalar becoming ``dims: [1]`` with ``reshape: { shape: [] }``); a
  ``dynamic_batching`` section when the model batches and the config names no scheduler.
- **Binding** (:func:`bind`): each config tensor must be an engine tensor of the same direction and
  datatype, with as many dimensions (plus the batch dimension when ``max_batch_size > 0``) and the
  same size wherever both fix one; every engine input must be fed.
- **Per batch** (:func:`choose_profile`): the input shapes of a batch pick the optimisation profile
  whose min/max range holds them, closest to its optimum; none → a clear request error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from tideserve.backend_api import InvalidArgument, Unsupported, config_to_datatype, datatype_to_config, numpy_dtype

from .engine import EngineInfo, EngineTensor, Shape

log = logging.getLogger(__name__)


# -- profiles and batch size ---------------------------------------------------------------------
def parse_profiles(model: str, names, info: EngineInfo) -> list[int]:
    """The profile indices an instance group lists (``profile: ["0", "1"]``); none listed: profile 0."""
    indices = []
    for name in names:
        try:
            index = int(name)
        except ValueError:
            raise InvalidArgument(f"model '{model}': optimization profile '{name}' is not an index") from None
        if not 0 <= index < max(info.num_profiles, 1):
            raise InvalidArgument(f"model '{model}': optimization profile {index} does not exist; the engine has "
                                  f"{info.num_profiles} (0-{info.num_profiles - 1})")
        if index not in indices:
            indices.append(index)
    return indices or [0]


def config_profiles(config: mc.ModelConfig, info: EngineInfo) -> list[int]:
    """Every profile some instance group of the config uses."""
    indices: set[int] = set()
    for group in config.instance_group:
        indices.update(parse_profiles(config.name, group.profile, info))
    return sorted(indices) or [0]


def engine_max_batch_size(info: EngineInfo, profiles: list[int]) -> int:
    """The largest batch the engine takes through ``profiles``: per profile, the smallest first-dimension
    maximum over the inputs; over profiles, the largest. 0 when an input has no dimension to batch on."""
    best = 0
    for profile in profiles:
        limit = None
        for tensor in info.inputs:
            if not tensor.shape:
                return 0
            high = tensor.profiles[profile][2][0] if profile < len(tensor.profiles) else tensor.shape[0]
            limit = high if limit is None else min(limit, high)
        best = max(best, limit or 0)
    return best


# -- auto-complete -------------------------------------------------------------------------------
def _config_shape(entry) -> list[int]:
    return list(entry.reshape.shape) if entry.HasField("reshape") else list(entry.dims)


def batching_hint(config: mc.ModelConfig, info: EngineInfo) -> bool | None:
    """What the config's tensor dims say: True (one dimension fewer than the engine's: the model batches),
    False (as many: it does not), None (no dims given)."""
    hint = None
    for entry in list(config.input) + list(config.output):
        if getattr(entry, "allow_ragged_batch", False):
            says = True
        else:
            shape, tensor = _config_shape(entry), info.find(entry.name)
            if not shape or tensor is None:
                continue
            says = len(tensor.shape) == len(shape) + 1
        if hint is None:
            hint = says
        elif hint != says:
            raise InvalidArgument(f"unable to autofill for '{config.name}': the tensor dims of the configuration "
                                  f"contradict each other on whether the model batches (see '{entry.name}')")
    return hint


def check_engine_supported(model: str, info: EngineInfo) -> None:
    """Refuse engines this backend cannot run: shape tensors, non-linear formats, types with no numpy dtype."""
    for tensor in info.tensors:
        kind = "input" if tensor.is_input else "output"
        if tensor.is_shape_tensor:
            raise Unsupported(f"model '{model}': engine {kind} '{tensor.name}' is a shape tensor; shape tensors "
                              f"are not supported by this backend")
        if not tensor.linear:
            raise Unsupported(f"model '{model}': engine {kind} '{tensor.name}' uses a non-linear I/O format; "
                              f"only linear formats are supported")
        if tensor.datatype is None:
            raise Unsupported(f"model '{model}': engine {kind} '{tensor.name}' is of TensorRT type "
                              f"{tensor.trt_type}, which has no tensor datatype here")


def auto_complete(config: mc.ModelConfig, info: EngineInfo) -> None:
    """Fill what the config leaves out from the engine (in place), as Triton's TensorRT backend does."""
    check_engine_supported(config.name, info)
    hint = batching_hint(config, info)
    engine_max = engine_max_batch_size(info, config_profiles(config, info))
    if hint is True and engine_max == 0:
        raise InvalidArgument(f"autofill failed for model '{config.name}': the configuration's tensor dims say "
                              f"the model batches, but the engine's inputs have no batch dimension")
    if hint is False:
        engine_max = 0
    if config.max_batch_size == 0:
        config.max_batch_size = engine_max
    elif config.max_batch_size > engine_max:
        raise InvalidArgument(f"autofill failed for model '{config.name}': configuration specified max-batch "
                              f"{config.max_batch_size} but TensorRT engine only supports max-batch {engine_max}")
    if config.max_batch_size > 1 and not config.HasField("dynamic_batching") \
            and not config.HasField("sequence_batching"):
        config.dynamic_batching.SetInParent()
    batching = config.max_batch_size > 0
    _fill(config.input, info.inputs, batching)
    _fill(config.output, info.outputs, batching)


def _fill(entries, tensors: list[EngineTensor], batching: bool) -> None:
    if len(entries) == 0:
        for tensor in tensors:
            entry = entries.add()
            entry.name = tensor.config_name
            _complete(entry, tensor, batching)
        return
    by_name = {t.config_name: t for t in tensors}
    for entry in entries:
        if entry.name in by_name:
            _complete(entry, by_name[entry.name], batching)


def _complete(entry, tensor: EngineTensor, batching: bool) -> None:
    if entry.data_type == mc.TYPE_INVALID and tensor.datatype:
        entry.data_type = mc.DataType.Value(datatype_to_config(tensor.datatype))
    if len(entry.dims) == 0 and not getattr(entry, "allow_ragged_batch", False):
        dims = tensor.shape[1:] if batching else tensor.shape
        if dims:
            entry.dims.extend(dims)
        else:  # a scalar (per batch row): Triton's dims cannot be empty
            entry.dims.append(1)
            entry.reshape.SetInParent()


# -- binding -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorBinding:
    """One config tensor and the engine tensor it is."""

    name: str  # as the config (and clients) name it
    engine_name: str
    datatype: str  # Triton datatype
    dims: Shape  # config dims, without the batch dimension
    reshape: Shape | None = None  # the engine-side shape, when the config has a reshape
    ragged: bool = False

    @property
    def dtype(self) -> np.dtype:
        return numpy_dtype(self.datatype)


@dataclass(frozen=True)
class Bindings:
    inputs: tuple[TensorBinding, ...]
    outputs: tuple[TensorBinding, ...]
    unbound_outputs: tuple[EngineTensor, ...]  # engine outputs the config leaves out: still need buffers
    batching: bool


def _shape_text(shape) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def check_dims(model: str, tensor: EngineTensor, config_shape: list[int], batching: bool) -> None:
    """Rank must match (the batch dimension added when batching); sizes must agree where both are fixed."""
    full = ([-1] if batching else []) + list(config_shape)
    if batching and not tensor.shape:
        raise InvalidArgument(f"model '{model}', tensor '{tensor.name}': for the model to support batching the "
                              f"shape should have at least 1 dimension; but shape expected by the model is []")
    agree = len(tensor.shape) == len(full) and all(
        e == c or e == -1 or c == -1 for e, c in zip(tensor.shape, full))
    if not agree:
        extra = (" (an initial batch dimension because max_batch_size > 0 followed by the explicit tensor shape)"
                 if batching else "")
        raise InvalidArgument(
            f"model '{model}', tensor '{tensor.name}': the model expects {len(tensor.shape)} dimensions (shape "
            f"{_shape_text(tensor.shape)}) but the model configuration specifies {len(full)} dimensions{extra}, "
            f"making complete shape {_shape_text(full)}")


def _bind_one(model: str, entry, kind: str, info: EngineInfo, batching: bool) -> TensorBinding:
    tensor = info.find(entry.name)
    pool = info.inputs if kind == "input" else info.outputs
    if tensor is None or tensor not in pool:
        allowed = ", ".join(t.config_name for t in pool)
        raise InvalidArgument(f"model '{model}': unexpected {kind} '{entry.name}'; the engine's {kind}s are: "
                              f"{allowed}")
    config_datatype = config_to_datatype(mc.DataType.Name(entry.data_type))
    if tensor.datatype != config_datatype:
        raise InvalidArgument(f"model '{model}': unexpected datatype TYPE_{tensor.datatype} for {kind} "
                              f"'{entry.name}', expecting TYPE_{config_datatype}")
    ragged = getattr(entry, "allow_ragged_batch", False)
    if ragged:
        if len(tensor.shape) != 1:
            raise InvalidArgument(f"model '{model}', tensor '{entry.name}': a ragged input must be one "
                                  f"dimensional in the engine, whose shape is {_shape_text(tensor.shape)}")
    else:
        check_dims(model, tensor, _config_shape(entry), batching)
    reshape = tuple(entry.reshape.shape) if entry.HasField("reshape") else None
    return TensorBinding(entry.name, tensor.name, config_datatype, tuple(entry.dims), reshape, ragged)


def _bind_batch_input(model: str, spec, info: EngineInfo) -> list[TensorBinding]:
    bound = []
    datatype = config_to_datatype(mc.DataType.Name(spec.data_type))
    for target in spec.target_name:
        tensor = info.find(target)
        if tensor is None or not tensor.is_input:
            raise InvalidArgument(f"model '{model}': batch_input target '{target}' is not an input of the engine")
        if tensor.datatype != datatype:
            raise InvalidArgument(f"model '{model}': unexpected datatype TYPE_{tensor.datatype} for batch input "
                                  f"'{target}', expecting TYPE_{datatype}")
        bound.append(TensorBinding(target, tensor.name, datatype, (), None, True))
    return bound


def bind(config: mc.ModelConfig, info: EngineInfo) -> Bindings:
    """Match the config's tensors to the engine's; raise a ServerError naming the first mismatch."""
    model, batching = config.name, config.max_batch_size > 0
    check_engine_supported(model, info)
    if config.max_batch_size > (limit := engine_max_batch_size(info, config_profiles(config, info))):
        raise InvalidArgument(f"model '{model}': configuration specified max-batch {config.max_batch_size} but "
                              f"TensorRT engine only supports max-batch {limit}")
    inputs = [_bind_one(model, e, "input", info, batching) for e in config.input]
    for spec in config.batch_input:
        inputs.extend(_bind_batch_input(model, spec, info))
    fed = {b.engine_name for b in inputs}
    for tensor in info.inputs:
        if tensor.name not in fed:
            raise InvalidArgument(f"model '{model}': engine input '{tensor.name}' is not in the model configuration; "
                                  f"every engine input must be fed")
    outputs = [_bind_one(model, e, "output", info, batching) for e in config.output]
    named = {b.engine_name for b in outputs}
    unbound = tuple(t for t in info.outputs if t.name not in named)
    return Bindings(tuple(inputs), tuple(outputs), unbound, batching)


# -- per batch -----------------------------------------------------------------------------------
def _within(shape: Shape, low: Shape, high: Shape) -> bool:
    return len(shape) == len(low) and all(lo <= s <= hi for s, lo, hi in zip(shape, low, high))


def choose_profile(info: EngineInfo, profiles: list[int], shapes: dict[str, Shape]) -> int:
    """The profile (of ``profiles``) whose range holds every input shape (engine names), closest to its
    optimum; InvalidArgument listing the ranges when none does."""
    best, best_distance = None, None
    for profile in profiles:
        distance = 0
        for tensor in info.inputs:
            low, opt, high = tensor.profiles[profile]
            shape = shapes[tensor.name]
            if not _within(shape, low, high):
                break
            distance += sum(abs(s - o) for s, o in zip(shape, opt))
        else:
            if best_distance is None or distance < best_distance:
                best, best_distance = profile, distance
    if best is None:
        asked = ", ".join(f"{name} {_shape_text(shape)}" for name, shape in shapes.items())
        ranges = "; ".join(
            f"profile {p}: " + ", ".join(f"{t.name} {_shape_text(t.profiles[p][0])}..{_shape_text(t.profiles[p][2])}"
                                         for t in info.inputs)
            for p in profiles)
        raise InvalidArgument(f"no optimization profile of the engine accepts the input shapes ({asked}); {ranges}")
    return best


def client_shape(array: np.ndarray, binding: TensorBinding, batching: bool) -> np.ndarray:
    """An output with a ``reshape`` leaves the engine in the reshape's shape; clients see its ``dims``."""
    if binding.reshape is None:
        return array
    lead = (array.shape[0],) if batching else ()
    return array.reshape(lead + binding.dims)
