"""Batch assembly for backends that run a whole batch as one tensor call.

The dynamic batcher hands an instance a list of requests; :class:`TensorModelInstance`
concatenates their inputs along the batch dimension, runs the model once and splits every
output back into per-request responses. Inputs with ``allow_ragged_batch`` are flattened and
concatenated, and the config's ``batch_input`` entries (element counts and their running sums,
as Triton defines them) tell the model where each request's elements start. Inputs the model's
``pad_batch_inputs`` parameter names (a tideserve extension) batch across lengths: each request's rows
are padded with zeros to the batch's largest shape, as an in-process caller pads a batch to its longest.
"""

from __future__ import annotations

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from .backend import ModelInstance
from .datatypes import config_to_datatype, datatype_of, numpy_dtype
from .errors import InternalError, InvalidArgument
from .types import InferenceRequest, InferenceResponse, Tensor

BatchInput = mc.BatchInput
PAD_PARAMETER = "pad_batch_inputs"


def padded_inputs(config: mc.ModelConfig) -> frozenset[str]:
    """The inputs the ``pad_batch_inputs`` parameter names (comma-separated): inputs with a variable
    (-1) dimension, not ragged, whose requests batch across shapes, zero-padded to the batch's largest."""
    entry = config.parameters.get(PAD_PARAMETER)
    names = frozenset(n.strip() for n in (entry.string_value if entry else "").split(",") if n.strip())
    inputs = {t.name: t for t in config.input}
    for name in sorted(names):
        spec = inputs.get(name)
        if spec is None:
            raise InvalidArgument(f"model '{config.name}': parameter '{PAD_PARAMETER}' names '{name}', which is not "
                                  f"an input (inputs: {', '.join(inputs) or 'none'})")
        if spec.allow_ragged_batch or -1 not in spec.dims or spec.data_type == mc.TYPE_STRING:
            raise InvalidArgument(f"model '{config.name}': parameter '{PAD_PARAMETER}': input '{name}' must have a "
                                  "variable (-1) dimension, a numeric datatype and no allow_ragged_batch")
    return names


def concat_inputs(requests: list[InferenceRequest], ragged: frozenset[str] = frozenset(),
                  padded: frozenset[str] = frozenset()) -> dict[str, np.ndarray]:
    """One array per input name: requests concatenated along axis 0 (ragged ones flattened, ``padded`` ones
    zero-padded to the batch's largest shape first)."""
    first = requests[0]
    if len(requests) == 1:
        return {name: (t.data.reshape(-1) if name in ragged else t.data) for name, t in first.inputs.items()}
    merged = {}
    for name in first.inputs:
        parts = [_part(r, name) for r in requests]
        if name in ragged:
            parts = [p.reshape(-1) for p in parts]
        elif name in padded:
            parts = _pad_parts(name, parts)
        else:
            _check_batchable(name, parts)
        merged[name] = np.concatenate(parts, axis=0)
    return merged


def _pad_parts(name: str, parts: list[np.ndarray]) -> list[np.ndarray]:
    """The parts zero-padded at the end of each non-batch dimension to the largest part's size."""
    shapes = {p.shape[1:] for p in parts}
    if len(shapes) == 1:
        return parts
    if len({len(s) for s in shapes}) > 1 or len({p.dtype for p in parts}) > 1:
        _check_batchable(name, parts)  # raises: ranks or datatypes differ
    largest = tuple(max(sizes) for sizes in zip(*shapes))
    out = []
    for part in parts:
        if part.shape[1:] == largest:
            out.append(part)
        else:
            grown = np.zeros((part.shape[0], *largest), dtype=part.dtype)
            grown[(slice(None), *(slice(0, n) for n in part.shape[1:]))] = part
            out.append(grown)
    return out


def _part(request: InferenceRequest, name: str) -> np.ndarray:
    tensor = request.inputs.get(name)
    if tensor is None:
        raise InternalError(f"input '{name}' is missing from a request of the batch; requests with different "
                            "inputs cannot be batched")
    return tensor.data


def _check_batchable(name: str, parts: list[np.ndarray]) -> None:
    """Rows of one input batch only when every request's shape past the batch dimension and dtype agree."""
    first = parts[0]
    for part in parts[1:]:
        if part.shape[1:] != first.shape[1:] or part.dtype != first.dtype:
            raise InternalError(
                f"input '{name}' of the requests in a batch has shapes {list(first.shape)} and {list(part.shape)}; "
                "requests of different shapes cannot be batched unless the input sets allow_ragged_batch")


def batch_inputs(config: mc.ModelConfig, requests: list[InferenceRequest]) -> dict[str, np.ndarray]:
    """The ``batch_input`` tensors Triton derives from a batch (element counts per request)."""
    out = {}
    for spec in config.batch_input:
        source = spec.source_input[0] if spec.source_input else ""
        counts = np.array([r.inputs[source].data.size if source in r.inputs else 0 for r in requests],
                          dtype=np.int64)
        dtype = numpy_dtype(config_to_datatype(mc.DataType.Name(spec.data_type)))
        kind = spec.kind
        if kind == BatchInput.BATCH_ELEMENT_COUNT:
            value = counts
        elif kind == BatchInput.BATCH_ACCUMULATED_ELEMENT_COUNT:
            value = np.cumsum(counts)
        elif kind == BatchInput.BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO:
            value = np.concatenate([[0], np.cumsum(counts)])
        elif kind == BatchInput.BATCH_MAX_ELEMENT_COUNT_AS_SHAPE:
            value = np.zeros(int(counts.max()) if counts.size else 0)
        else:
            raise InvalidArgument(f"batch_input kind {BatchInput.Kind.Name(kind)} is not supported")
        for name in spec.target_name:
            out[name] = value.astype(dtype)
    return out


def split_outputs(outputs: dict[str, np.ndarray], requests: list[InferenceRequest],
                  datatypes: dict[str, str]) -> list[list[Tensor]]:
    """Per-request output tensors: rows of each output split by the requests' batch sizes."""
    if len(requests) == 1:
        return [[_tensor(name, array, datatypes) for name, array in outputs.items()]]
    sizes = [r.batch_size for r in requests]
    total = sum(sizes)
    bounds = np.cumsum(sizes)[:-1]
    result: list[list[Tensor]] = [[] for _ in requests]
    for name, array in outputs.items():
        if array.ndim == 0 or array.shape[0] != total:
            raise InternalError(f"output '{name}' has {array.shape[0] if array.ndim else 0} rows for a batch "
                                f"of {total}; cannot split it back into requests")
        for index, part in enumerate(np.split(array, bounds, axis=0)):
            result[index].append(_tensor(name, part, datatypes))
    return result


def _tensor(name: str, array: np.ndarray, datatypes: dict[str, str]) -> Tensor:
    datatype = datatypes.get(name) or datatype_of(array)
    return Tensor(name, datatype, tuple(array.shape), array)


class TensorModelInstance(ModelInstance):
    """An instance that runs ``infer(inputs) -> outputs`` once per batch (ONNX, FIL, PyTorch...)."""

    def __init__(self, model, ctx) -> None:
        super().__init__(model, ctx)
        config = model.config
        self.ragged = frozenset(t.name for t in config.input if t.allow_ragged_batch)
        self.padded = padded_inputs(config)
        self.output_datatypes = {t.name: config_to_datatype(mc.DataType.Name(t.data_type)) for t in config.output}
        self.has_batch_inputs = bool(config.batch_input)

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise NotImplementedError(f"{type(self).__name__} does not implement infer()")

    def execute(self, requests: list[InferenceRequest]) -> list[InferenceResponse]:
        inputs = concat_inputs(requests, self.ragged, self.padded)
        if self.has_batch_inputs:
            inputs.update(batch_inputs(self.model.config, requests))
        outputs = self.infer(inputs)
        wanted = self._wanted_outputs(requests)
        if wanted is not None:
            outputs = {k: v for k, v in outputs.items() if k in wanted}
        return [InferenceResponse(outputs=tensors)
                for tensors in split_outputs(outputs, requests, self.output_datatypes)]

    @staticmethod
    def _wanted_outputs(requests: list[InferenceRequest]) -> set[str] | None:
        if any(not r.outputs for r in requests):
            return None
        return {o.name for r in requests for o in r.outputs}
