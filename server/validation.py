"""Checks a request against its model's configuration before it is scheduled."""

from __future__ import annotations

from dataclasses import dataclass

from tritonclient.grpc import model_config_pb2 as mc

from .datatypes import config_to_datatype
from .errors import InvalidArgument
from .types import InferenceRequest


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    dims: tuple[int, ...]
    reshape: tuple[int, ...] | None = None
    optional: bool = False
    allow_ragged_batch: bool = False


def _spec(tensor) -> TensorSpec:
    reshape = tuple(tensor.reshape.shape) if tensor.HasField("reshape") else None
    return TensorSpec(tensor.name, config_to_datatype(mc.DataType.Name(tensor.data_type)),
                      tuple(tensor.dims), reshape, getattr(tensor, "optional", False),
                      getattr(tensor, "allow_ragged_batch", False))


def _shape_matches(shape: tuple[int, ...], dims: tuple[int, ...]) -> bool:
    return shape == dims or (len(shape) == len(dims) and all(d == -1 or d == s for s, d in zip(shape, dims)))


def conform_shape(shape: tuple[int, ...], dims: tuple[int, ...], batching: bool, batch_size: int) -> tuple[int, ...]:
    """The shape a tensor takes when it is handed to an input (or output) declared ``dims`` of a model that
    batches (``batching``) or not; ``batch_size`` is the batch the tensor was made in (0: by a model that does
    not batch).

    Triton's rule for tensors passed between models, used by the ensemble scheduler and by the OpenAI frontend
    (which makes each prompt's tensors as a batch of one): a tensor made without a batch dimension that matches
    ``dims`` gains a batch dimension of 1 for a batching model; a tensor of a batch of 1 that does not match
    ``dims`` loses its batch dimension for a model that does not batch. Anything else keeps its shape, and the
    request's validation judges it."""
    shape = tuple(shape)
    if batching and batch_size == 0:
        if _shape_matches(shape, tuple(dims)):
            return (1, *shape)
    elif not batching and batch_size == 1 and shape and not _shape_matches(shape, tuple(dims)):
        return shape[1:]
    return shape


class RequestValidator:
    """Validates requests for one model; built once per loaded model version."""

    def __init__(self, config: mc.ModelConfig) -> None:
        self.model = config.name
        self.max_batch_size = config.max_batch_size
        self.inputs = {t.name: _spec(t) for t in config.input}
        self.outputs = {t.name: _spec(t) for t in config.output}
        self.required = [n for n, s in self.inputs.items() if not s.optional]

    def validate(self, request: InferenceRequest) -> None:
        """Raise InvalidArgument naming the tensor and the problem; set ``request.batch_size``."""
        model = self.model
        if self.inputs and request.inputs.keys() != self.inputs.keys():  # equal: none unknown, none missing
            unknown = [n for n in request.inputs if n not in self.inputs]
            if unknown:
                raise InvalidArgument(f"unexpected inference input '{unknown[0]}' for model '{model}'")
            missing = [n for n in self.required if n not in request.inputs]
            if missing:  # Triton's words, its lists included
                given, needed = _names(sorted(request.inputs)), _names(missing)
                expected = (f"{len(self.inputs)} inputs" if len(self.required) == len(self.inputs) else
                            f"number of inputs between {len(self.required)} and {len(self.inputs)}")
                raise InvalidArgument(
                    f"expected {expected} but got {len(request.inputs)} inputs for model '{model}'. Got "
                    f"input(s) {given}, but missing required input(s) {needed}. Please provide all required "
                    "input(s).")
        batch = None
        batching = self.max_batch_size > 0
        specs = self.inputs
        for name, tensor in request.inputs.items():
            shape = tensor.shape
            if type(shape) is not tuple:
                shape = tuple(shape)
            data = tensor.data
            if data is not None and data.shape != shape:
                raise InvalidArgument(
                    f"input '{name}': data holds {data.size} elements, shape {list(shape)} needs "
                    f"{_count(shape)}")
            spec = specs.get(name)
            if spec is None:
                continue
            if tensor.datatype != spec.datatype:
                raise InvalidArgument(
                    f"inference input '{name}' data-type is '{tensor.datatype}', but model '{model}' "
                    f"expects '{spec.datatype}'")
            if batching:
                if not shape:
                    raise InvalidArgument(
                        f"input '{name}' for model '{model}' must have a batch dimension: expected shape "
                        f"{[-1, *spec.dims]}, got []")
                if batch is None:
                    batch = shape[0]
                elif shape[0] != batch:
                    raise InvalidArgument(
                        f"input '{name}' batch size {shape[0]} does not match the batch size {batch} of the "
                        f"other inputs for model '{model}'")
                body = shape[1:]
            else:
                body = shape
            if body != spec.dims and not _shape_matches(body, spec.dims):
                expected = [-1, *spec.dims] if self.max_batch_size > 0 else list(spec.dims)
                raise InvalidArgument(
                    f"unexpected shape for input '{name}' for model '{model}'. Expected {expected}, "
                    f"got {list(shape)}")
            if spec.reshape is not None:
                new_shape = ((shape[0],) if self.max_batch_size > 0 else ()) + _fill_reshape(spec.reshape, body)
                tensor.data = tensor.data.reshape(new_shape)
                tensor.shape = new_shape
        if batching and batch is not None:
            if batch < 1 or batch > self.max_batch_size:
                raise InvalidArgument(
                    f"inference request batch-size must be <= {self.max_batch_size} for '{model}', got {batch}")
            request.batch_size = batch
        if self.outputs:
            for output in request.outputs:
                if output.name not in self.outputs:
                    raise InvalidArgument(f"unexpected inference output '{output.name}' for model '{model}'")


def _names(names: list[str]) -> str:
    return "[" + ",".join(f"'{name}'" for name in names) + "]"


def _count(shape) -> int:
    total = 1
    for d in shape:
        total *= d
    return total


def _fill_reshape(reshape: tuple[int, ...], body: tuple[int, ...]) -> tuple[int, ...]:
    if -1 not in reshape:
        return reshape
    known = _count(d for d in reshape if d != -1)
    return tuple(_count(body) // max(known, 1) if d == -1 else d for d in reshape)
