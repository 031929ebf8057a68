"""An ensemble's steps as a data-flow graph, checked at load time as Triton checks it.

Two phases. :func:`read_steps` needs only the ensemble's own config: every step names a model and
maps tensors both ways, each ensemble tensor has one writer, every tensor a step reads exists, the
steps form no cycle, every ensemble output is written and every input and intermediate tensor is
read. :func:`build_plan` then takes the configs of the composing models: every mapped name is a
real input / output of the step's model, every required model input is mapped, and each ensemble
tensor has one datatype and compatible shapes wherever it appears.

Streams. A decoupled step answers 0..N times per request, and each response feeds the steps
downstream on its own. A tensor's *label* says which stream it varies with: ``None`` for the
ensemble's inputs and whatever is computed from them once, else the index of the decoupled step
whose responses produce it (a step downstream of a stream inherits its label). A step may read
tensors of one stream and of the streams (or the static tensors) that stream itself came from, but
never of two unrelated streams: Triton refuses those too ("inputs originated from different
decoupled models"). Triton is stricter still and also refuses mixing a stream with static tensors;
that mix is allowed here (the static tensor is simply reused for every response).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field

from tritonclient.grpc import model_config_pb2 as mc

from tideserve.backend_api import InvalidArgument

Label = int | None  # None: static; otherwise the index of the decoupled step the tensor streams from


@dataclass(frozen=True)
class Step:
    """One ``ensemble_scheduling.step``; the fields after ``outputs`` are filled by :func:`build_plan`."""

    index: int
    model_name: str
    model_version: int  # -1: the latest ready version
    inputs: dict[str, str]  # model input name -> ensemble tensor
    outputs: dict[str, str]  # model output name -> ensemble tensor
    decoupled: bool = False  # the step's model is decoupled: each response feeds downstream on its own
    label: Label = None  # the stream this step runs once per response of (None: once per request)
    optional: frozenset[str] = frozenset()  # model inputs the step's model declares optional
    batching: bool = False  # the step's model batches (max_batch_size > 0)
    input_dims: dict[str, tuple[int, ...]] = field(default_factory=dict)  # model input -> its declared dims

    @property
    def version(self) -> str:
        """The version as the DataPlane takes it ("" = latest)."""
        return "" if self.model_version < 0 else str(self.model_version)

    def describe(self) -> str:
        return f"step {self.index} (model '{self.model_name}')"


@dataclass
class EnsemblePlan:
    """What the scheduler needs to run one ensemble version."""

    name: str
    steps: list[Step]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    consumers: dict[str, tuple[int, ...]]  # ensemble tensor -> indices of the steps that read it
    labels: dict[str, Label]  # ensemble tensor -> its stream
    label_parent: dict[int, Label] = field(default_factory=dict)  # stream -> the stream it came from
    max_inflight: int = 0  # ``max_inflight_requests``: 0 = no limit per step
    decoupled: bool = False  # some step streams: the ensemble is decoupled
    batching: bool = False  # the ensemble batches (max_batch_size > 0)
    output_dims: dict[str, tuple[int, ...]] = field(default_factory=dict)  # ensemble output -> declared shape

    def label_of(self, tensors) -> Label:
        """The deepest stream among ``tensors`` (they lie on one chain, as :func:`build_plan` checked)."""
        deepest: Label = None
        for name in tensors:
            label = self.labels.get(name)
            if _depth(self.label_parent, label) > _depth(self.label_parent, deepest):
                deepest = label
        return deepest


# -- phase 1: the ensemble's own config -------------------------------------------------------------
def read_steps(config: mc.ModelConfig) -> list[Step]:
    """The steps of ``config`` in topological order; InvalidArgument names the first problem."""
    name = config.name
    if config.platform != "ensemble":
        raise InvalidArgument(f"ensemble scheduling cannot be set for model '{name}' whose platform is not "
                              f"'ensemble'")
    if not config.HasField("ensemble_scheduling") or not config.ensemble_scheduling.step:
        raise InvalidArgument(f"ensemble '{name}' must specify 'ensemble_scheduling {{ step [ ... ] }}'")
    if config.instance_group:
        raise InvalidArgument(f"instance_group must not be specified for ensemble '{name}': its steps run "
                              f"on their own models' instances")
    steps = [_read_step(name, index, s) for index, s in enumerate(config.ensemble_scheduling.step)]
    inputs = [t.name for t in config.input]
    outputs = [t.name for t in config.output]

    writers: dict[str, Step] = {}
    readers: dict[str, list[Step]] = defaultdict(list)
    for step in steps:
        for tensor in step.outputs.values():
            if tensor in inputs:
                raise InvalidArgument(f"in ensemble '{name}', {step.describe()} writes ensemble tensor "
                                      f"'{tensor}', which is an input of the ensemble")
            if tensor in writers:
                raise InvalidArgument(f"in ensemble '{name}', ensemble tensor '{tensor}' is written by both "
                                      f"{writers[tensor].describe()} and {step.describe()}")
            writers[tensor] = step
        for tensor in step.inputs.values():
            readers[tensor].append(step)
    for step in steps:
        for model_input, tensor in step.inputs.items():
            if tensor not in writers and tensor not in inputs:
                raise InvalidArgument(f"in ensemble '{name}', {step.describe()} reads ensemble tensor '{tensor}' "
                                      f"(for its input '{model_input}'), which is neither an ensemble input nor "
                                      f"written by any step")
    order = _topological_order(name, steps, writers)
    for output in outputs:
        if output not in writers:
            raise InvalidArgument(f"output '{output}' of ensemble '{name}' is not written by any step")
    for tensor in inputs:
        if tensor not in readers:
            raise InvalidArgument(f"input '{tensor}' of ensemble '{name}' is not used by any step")
    for tensor, step in writers.items():
        if tensor not in readers and tensor not in outputs:
            raise InvalidArgument(f"in ensemble '{name}', ensemble tensor '{tensor}' written by {step.describe()} "
                                  f"is neither read by a step nor an ensemble output")
    return order


def _read_step(ensemble: str, index: int, step: mc.ModelEnsembling.Step) -> Step:
    where = f"step {index} of ensemble '{ensemble}'"
    if not step.model_name:
        raise InvalidArgument(f"must specify 'model_name' in {where}")
    if not step.input_map:
        raise InvalidArgument(f"must specify 'input_map' in {where} (model '{step.model_name}')")
    if not step.output_map:
        raise InvalidArgument(f"must specify 'output_map' in {where} (model '{step.model_name}')")
    version = step.model_version if step.model_version >= 0 else -1
    # protobuf maps have no order: sort them, so that messages name the same tensor every time
    return Step(index, step.model_name, version, dict(sorted(step.input_map.items())),
                dict(sorted(step.output_map.items())))


def _topological_order(ensemble: str, steps: list[Step], writers: dict[str, Step]) -> list[Step]:
    """Steps with each after the steps it reads from; a cycle is an error that spells it out."""
    upstream = {s.index: sorted({writers[t].index for t in s.inputs.values() if t in writers}) for s in steps}
    order: list[Step] = []
    state: dict[int, str] = {}  # "open" while on the path, "done" once ordered
    path: list[int] = []

    def visit(index: int) -> None:
        state[index] = "open"
        path.append(index)
        for before in upstream[index]:
            if state.get(before) == "open":
                cycle = path[path.index(before):] + [before]
                cycle.reverse()  # data-flow direction: writer -> reader
                chain = " -> ".join(steps[i].describe() for i in cycle)
                raise InvalidArgument(f"in ensemble '{ensemble}', steps form a cycle: {chain}")
            if before not in state:
                visit(before)
        path.pop()
        state[index] = "done"
        order.append(steps[index])

    for step in steps:
        if step.index not in state:
            visit(step.index)
    return order


# -- phase 2: with the composing models' configs ----------------------------------------------------
@dataclass
class _TensorUse:
    """Where an ensemble tensor's datatype and shape were inferred from."""

    datatype: int
    dims: tuple[int, ...]
    full_dims: tuple[int, ...]  # with the batch dimension (-1) when the source batches
    source: str


def _use(datatype: int, dims, batching: bool, source: str) -> _TensorUse:
    dims = tuple(dims)
    return _TensorUse(datatype, dims, ((-1,) + dims) if batching else dims, source)


def _compatible(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return len(a) == len(b) and all(x == y or x == -1 or y == -1 for x, y in zip(a, b))


def _record(ensemble: str, tensor: str, use: _TensorUse, uses: dict[str, _TensorUse]) -> None:
    seen = uses.get(tensor)
    if seen is None:
        uses[tensor] = use
        return
    where = f"in ensemble '{ensemble}', ensemble tensor '{tensor}'"
    if seen.datatype != use.datatype:
        raise InvalidArgument(f"{where}: inconsistent data type: {mc.DataType.Name(seen.datatype)} is inferred "
                              f"from {seen.source} while {mc.DataType.Name(use.datatype)} is inferred from "
                              f"{use.source}")
    # A batching model's [d...] matches a non-batching model's [-1, d...] (Triton's rule).
    if not _compatible(seen.dims, use.dims) and not _compatible(seen.full_dims, use.full_dims):
        raise InvalidArgument(f"{where}: inconsistent shape: {list(seen.full_dims)} is inferred from {seen.source} "
                              f"while {list(use.full_dims)} is inferred from {use.source}")


def build_plan(config: mc.ModelConfig, steps: list[Step], step_configs: dict[int, mc.ModelConfig]) -> EnsemblePlan:
    """Check ``steps`` (from :func:`read_steps`) against their models' configs and plan the streams."""
    name = config.name
    batching = config.max_batch_size > 0
    uses: dict[str, _TensorUse] = {}
    for kind, tensors in (("input", config.input), ("output", config.output)):
        for t in tensors:
            dims = t.reshape.shape if t.HasField("reshape") else t.dims
            _record(name, t.name, _use(t.data_type, dims, batching, f"ensemble '{name}' ({kind})"), uses)
    planned = []
    for step in steps:
        model = step_configs[step.index]
        _check_batch_size(config, step, model)
        _check_mapping(name, step, model, uses)
        planned.append(dataclasses.replace(
            step, decoupled=model.model_transaction_policy.decoupled,
            optional=frozenset(t.name for t in model.input if t.optional), batching=model.max_batch_size > 0,
            input_dims={t.name: tuple(t.dims) for t in model.input}))
    return _plan_streams(config, planned)


def _check_batch_size(config: mc.ModelConfig, step: Step, model: mc.ModelConfig) -> None:
    if model.max_batch_size != 0 and model.max_batch_size < config.max_batch_size:
        raise InvalidArgument(f"ensemble '{config.name}' allows maximum batch size {config.max_batch_size}, but "
                              f"{step.describe()} only allows {model.max_batch_size}")


def _check_mapping(ensemble: str, step: Step, model: mc.ModelConfig, uses: dict[str, _TensorUse]) -> None:
    batching = model.max_batch_size > 0
    source = f"model '{step.model_name}'"
    model_inputs = {t.name: t for t in model.input}
    model_outputs = {t.name: t for t in model.output}
    for model_input, tensor in step.inputs.items():
        spec = model_inputs.get(model_input)
        if spec is None:
            raise InvalidArgument(f"in ensemble '{ensemble}', ensemble tensor '{tensor}' is mapped to input "
                                  f"'{model_input}', which model '{step.model_name}' does not have (its inputs: "
                                  f"{sorted(model_inputs)})")
        _record(ensemble, tensor, _use(spec.data_type, spec.dims, batching, source), uses)
    for spec in model.input:
        if spec.name not in step.inputs and not spec.optional:
            raise InvalidArgument(f"in ensemble '{ensemble}', input '{spec.name}' of model '{step.model_name}' "
                                  f"(step {step.index}) is not mapped to any ensemble tensor")
    for model_output, tensor in step.outputs.items():
        spec = model_outputs.get(model_output)
        if spec is None:
            raise InvalidArgument(f"in ensemble '{ensemble}', ensemble tensor '{tensor}' is mapped from output "
                                  f"'{model_output}', which model '{step.model_name}' does not have (its outputs: "
                                  f"{sorted(model_outputs)})")
        _record(ensemble, tensor, _use(spec.data_type, spec.dims, batching, source), uses)


def _depth(parents: dict[int, Label], label: Label) -> int:
    depth = 0
    while label is not None:
        depth += 1
        label = parents[label]
    return depth


def _is_within(parents: dict[int, Label], label: Label, ancestor: Label) -> bool:
    """``label`` is ``ancestor`` or a stream that came from it."""
    while True:
        if label == ancestor:
            return True
        if label is None:
            return False
        label = parents[label]


def _deepest(ensemble: str, parents: dict[int, Label], labels: dict[str, Label], tensors: list[str],
             steps: list[Step], reader: str) -> Label:
    deepest: Label = None
    deepest_tensor = ""
    for tensor in tensors:
        label = labels[tensor]
        if _is_within(parents, deepest, label):
            continue
        if _is_within(parents, label, deepest):
            deepest, deepest_tensor = label, tensor
            continue
        raise InvalidArgument(
            f"in ensemble '{ensemble}', {reader} receives inputs originating from different decoupled models: "
            f"'{deepest_tensor}' streams from {steps[deepest].describe()} and '{tensor}' from "
            f"{steps[label].describe()}")
    return deepest


def _plan_streams(config: mc.ModelConfig, ordered: list[Step]) -> EnsemblePlan:
    name = config.name
    by_index = {s.index: s for s in ordered}
    all_steps = [by_index[i] for i in range(len(ordered))]
    labels: dict[str, Label] = {t.name: None for t in config.input}
    parents: dict[int, Label] = {}
    for step in ordered:
        label = _deepest(name, parents, labels, list(step.inputs.values()), all_steps, f"{step.describe()}")
        planned = dataclasses.replace(step, label=label)
        all_steps[step.index] = planned
        if step.decoupled:
            parents[step.index] = label
            label = step.index
        for tensor in step.outputs.values():
            labels[tensor] = label
    outputs = tuple(t.name for t in config.output)
    _deepest(name, parents, labels, list(outputs), all_steps, "the ensemble's output")
    consumers: dict[str, list[int]] = defaultdict(list)
    for step in all_steps:
        for tensor in dict.fromkeys(step.inputs.values()):
            consumers[tensor].append(step.index)
    return EnsemblePlan(
        name=name, steps=all_steps, inputs=tuple(t.name for t in config.input), outputs=outputs,
        consumers={k: tuple(v) for k, v in consumers.items()}, labels=labels, label_parent=parents,
        max_inflight=config.ensemble_scheduling.max_inflight_requests,
        decoupled=any(s.decoupled for s in all_steps), batching=config.max_batch_size > 0,
        output_dims={t.name: tuple(t.reshape.shape if t.HasField("reshape") else t.dims) for t in config.output})
