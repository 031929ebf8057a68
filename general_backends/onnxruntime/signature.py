"""The model config against the ONNX graph: auto-complete what the config leaves out, then check it.

Both follow Triton's onnxruntime backend:

* Auto-complete runs only when the config lacks inputs or outputs. The model can batch when every
  graph input and output has a variable first dimension; then an unset (or 0) ``max_batch_size``
  becomes :data:`DEFAULT_MAX_BATCH_SIZE` and, above 1, ``dynamic_batching {}`` is added unless a
  scheduler is configured. A non-zero ``max_batch_size`` on a model that cannot batch is an error.
  Missing inputs / outputs are filled from the graph (without the batch dimension when batching;
  a scalar becomes ``dims: [1]`` with an empty ``reshape``).
* The check names the first thing that disagrees: a config tensor the graph lacks, a graph input
  the config lacks, a datatype or a dimension that differs.
"""

from __future__ import annotations

import logging

from tritonclient.grpc import model_config_pb2 as mc

from tideserve.backend_api import InvalidArgument

from .tensors import GraphTensor

log = logging.getLogger(__name__)

DEFAULT_MAX_BATCH_SIZE = 4  # Triton's --backend-config=onnxruntime,default-max-batch-size default


def sequence_tensors(config: mc.ModelConfig) -> tuple[set[str], set[str]]:
    """(inputs, outputs) the sequence batcher supplies and takes: control inputs, implicit state."""
    batching = config.sequence_batching
    inputs = {c.name for c in batching.control_input} | {s.input_name for s in batching.state}
    return inputs, {s.output_name for s in batching.state}


def auto_complete(config: mc.ModelConfig, inputs: list[GraphTensor], outputs: list[GraphTensor],
                  default_max_batch_size: int = DEFAULT_MAX_BATCH_SIZE) -> None:
    """Fill ``max_batch_size``, ``input`` and ``output`` of ``config`` from the graph, in place."""
    has_inputs = bool(config.input) or bool(config.batch_input)
    if has_inputs and config.output:
        return
    sequence_inputs, sequence_outputs = sequence_tensors(config)
    inputs = [t for t in inputs if t.name not in sequence_inputs]
    outputs = [t for t in outputs if t.name not in sequence_outputs]
    _complete_max_batch_size(config, inputs + outputs, default_max_batch_size)
    if not has_inputs:
        _complete_tensors(config.input, inputs, config.max_batch_size)
    if not config.output:
        _complete_tensors(config.output, outputs, config.max_batch_size)


def _complete_max_batch_size(config: mc.ModelConfig, tensors: list[GraphTensor], default: int) -> None:
    if all(t.batchable for t in tensors):
        if config.max_batch_size == 0:
            config.max_batch_size = max(default, 0)
            log.warning("model '%s': max_batch_size set to %d since the graph can batch and the config sets "
                        "none; set max_batch_size to batch more", config.name, config.max_batch_size)
        if (config.max_batch_size > 1 and not config.HasField("dynamic_batching")
                and not config.HasField("sequence_batching")):
            config.dynamic_batching.SetInParent()
    elif config.max_batch_size != 0:
        fixed = [t.name for t in tensors if not t.batchable]
        raise InvalidArgument(
            f"auto-complete failed for model '{config.name}': max_batch_size is {config.max_batch_size} but the "
            f"model cannot batch: {fixed} do not have a variable first dimension")


def _complete_tensors(field, tensors: list[GraphTensor], max_batch_size: int) -> None:
    for tensor in tensors:
        entry = field.add(name=tensor.name, data_type=mc.DataType.Value(tensor.config_type))
        dims = tensor.dims[1:] if max_batch_size > 0 else tensor.dims
        if dims:
            entry.dims.extend(dims)
        else:
            entry.dims.append(1)
            if max_batch_size > 0:  # a per-request scalar: [batch, 1] on the wire, [batch] in the graph
                entry.reshape.SetInParent()


def check_config(config: mc.ModelConfig, inputs: list[GraphTensor], outputs: list[GraphTensor],
                 overridable: list[GraphTensor] = ()) -> None:
    """Raise InvalidArgument naming the first place the config and the graph disagree."""
    name = config.name
    graph_inputs = {t.name: t for t in [*inputs, *overridable]}
    configured = {t.name for t in config.input} | {n for b in config.batch_input for n in b.target_name}
    sequence_inputs, sequence_outputs = sequence_tensors(config)
    for tensor in sorted(sequence_inputs):
        if tensor not in graph_inputs:
            raise InvalidArgument(f"unable to load model '{name}': sequence_batching input '{tensor}' is not an "
                                  f"input of the ONNX graph (graph inputs: {sorted(graph_inputs)})")
    configured |= sequence_inputs
    for io in config.input:
        graph = graph_inputs.get(io.name)
        if graph is None:
            raise InvalidArgument(
                f"unable to load model '{name}': configuration input '{io.name}' is not an input of the ONNX "
                f"graph (graph inputs: {sorted(graph_inputs)})")
        if io.optional and config.max_batch_size != 0:
            raise InvalidArgument(f"unable to load model '{name}': optional input '{io.name}' is not supported "
                                  f"for models that batch (max_batch_size > 0)")
        _check_type(name, "input", io, graph)
        if io.allow_ragged_batch:
            if graph.dims != (-1,):
                raise InvalidArgument(
                    f"unable to load model '{name}': ragged input '{io.name}' needs graph shape [-1], the "
                    f"model provides {list(graph.dims)}")
            continue
        _check_dims(config, "input", io, graph)
    for tensor in inputs:
        if tensor.name not in configured:
            raise InvalidArgument(
                f"unable to load model '{name}': the ONNX graph's input '{tensor.name}' is not in the model "
                f"configuration (configured inputs: {sorted(configured)})")
    graph_outputs = {t.name: t for t in outputs}
    for tensor in sorted(sequence_outputs):
        if tensor not in graph_outputs:
            raise InvalidArgument(f"unable to load model '{name}': sequence_batching state output '{tensor}' is "
                                  f"not an output of the ONNX graph (graph outputs: {sorted(graph_outputs)})")
    for io in config.output:
        graph = graph_outputs.get(io.name)
        if graph is None:
            raise InvalidArgument(
                f"unable to load model '{name}': configuration output '{io.name}' is not an output of the ONNX "
                f"graph (graph outputs: {sorted(graph_outputs)})")
        _check_type(name, "output", io, graph)
        _check_dims(config, "output", io, graph)


def _check_type(model: str, kind: str, io, graph: GraphTensor) -> None:
    expected = mc.DataType.Name(io.data_type)
    if graph.config_type == "TYPE_INVALID":
        raise InvalidArgument(f"unable to load model '{model}': {kind} '{io.name}' has ONNX type {graph.onnx_type}, "
                              f"which has no Triton datatype")
    if graph.config_type != expected:
        raise InvalidArgument(
            f"unable to load model '{model}': configuration expects datatype {expected} for {kind} '{io.name}', "
            f"model provides {graph.config_type}")


def _check_dims(config: mc.ModelConfig, kind: str, io, graph: GraphTensor) -> None:
    """A fixed graph dimension must equal the config's; a variable one takes any."""
    model = config.name
    dims = tuple(io.reshape.shape) if io.HasField("reshape") else tuple(io.dims)
    shown = "reshape" if io.HasField("reshape") else "dims"
    model_dims = graph.dims
    if not model_dims:  # a scalar (or a tensor of unknown rank): ONNX Runtime reports no dimensions
        if config.max_batch_size == 0 and any(d != 1 for d in dims):
            raise InvalidArgument(
                f"unable to load model '{model}': scalar {kind} '{io.name}' must have dims [1] in a model "
                f"that does not batch, the configuration has {list(dims)}")
        return
    if config.max_batch_size > 0:
        if model_dims[0] != -1:
            raise InvalidArgument(
                f"unable to load model '{model}': max_batch_size is {config.max_batch_size} but {kind} "
                f"'{io.name}' has a fixed first dimension ({list(model_dims)}), so the model cannot batch; "
                f"set max_batch_size: 0")
        model_dims = model_dims[1:]
    if len(model_dims) != len(dims) or any(m != -1 and m != d for m, d in zip(model_dims, dims)):
        batch = "[-1] + " if config.max_batch_size > 0 else ""
        raise InvalidArgument(
            f"unable to load model '{model}': {kind} '{io.name}' has {shown} {batch}{list(dims)} in the "
            f"configuration, but the model provides shape {list(graph.dims)}")
