"""What a ``sequence_batching`` section asks of the scheduler: control tensors and implicit state.

:func:`read_sequence_config` checks the section as Triton does at load (each control kind at most
once, a boolean control with exactly one ``*_false_true`` pair, CORRID with an integer or string
``data_type``, state entries with names, a datatype and at most one ``initial_state`` that agrees
with them) and returns the plain data the scheduler adds to each request: :class:`Controls` makes
the START / END / READY / CORRID tensors of one batch row, each :class:`StateSpec` the state
tensor a sequence starts from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from ..datatypes import config_to_datatype, element_size, from_raw, numpy_dtype
from ..errors import InvalidArgument
from ..types import Tensor

Control = mc.ModelSequenceBatching.Control
INITIAL_STATE_FOLDER = "initial_state"  # <model>/initial_state/<data_file>, as Triton reads it
CORRID_TYPES = ("TYPE_UINT64", "TYPE_INT64", "TYPE_UINT32", "TYPE_INT32", "TYPE_STRING")
_BOOLEAN_KINDS = {Control.CONTROL_SEQUENCE_START: "start", Control.CONTROL_SEQUENCE_END: "end",
                  Control.CONTROL_SEQUENCE_READY: "ready"}


@dataclass(frozen=True)
class BooleanControl:
    name: str
    datatype: str
    false_value: object
    true_value: object


@dataclass
class Controls:
    """The control inputs a model declares, and the tensors for each (start, end, ready) row."""

    batched: bool
    start: BooleanControl | None = None
    end: BooleanControl | None = None
    ready: BooleanControl | None = None
    corrid: tuple[str, str] | None = None  # (input name, protocol datatype)
    _rows: dict = field(default_factory=dict)

    @property
    def names(self) -> set[str]:
        named = {c.name for c in (self.start, self.end, self.ready) if c is not None}
        return named | ({self.corrid[0]} if self.corrid else set())

    def tensors(self, start: bool, end: bool, ready: bool, corrid: int | str) -> list[Tensor]:
        """The control tensors of one batch row (shared, read-only, made once per flag combination)."""
        key = (start, end, ready)
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = [self._boolean(c, value) for c, value in
                                     ((self.start, start), (self.end, end), (self.ready, ready)) if c is not None]
        if self.corrid is None:
            return row
        name, datatype = self.corrid
        if datatype == "BYTES":
            value = np.array([str(corrid).encode()], dtype=np.object_)
        else:
            value = np.array([corrid if isinstance(corrid, int) else 0], dtype=numpy_dtype(datatype))
        return [*row, self._tensor(name, datatype, value)]

    def _boolean(self, control: BooleanControl, value: bool) -> Tensor:
        data = np.array([control.true_value if value else control.false_value], dtype=numpy_dtype(control.datatype))
        return self._tensor(control.name, control.datatype, data)

    def _tensor(self, name: str, datatype: str, data: np.ndarray) -> Tensor:
        if self.batched:
            data = data.reshape(1, 1)
        return Tensor(name, datatype, tuple(data.shape), data)

    def check_corrid(self, corrid: int | str, model: str) -> None:
        """A string correlation id for an integer CORRID (or the reverse) cannot be delivered."""
        if self.corrid is None:
            return
        wants_string = self.corrid[1] == "BYTES"
        if wants_string != isinstance(corrid, str):
            raise InvalidArgument(
                f"inference request to model '{model}' has a {'string' if isinstance(corrid, str) else 'integer'} "
                f"correlation ID but the model's CONTROL_SEQUENCE_CORRID input '{self.corrid[0]}' is "
                f"{self.corrid[1]}; send a {'string' if wants_string else 'integer'} sequence_id")
        if not wants_string:
            info = np.iinfo(numpy_dtype(self.corrid[1]))
            if not info.min <= corrid <= info.max:
                raise InvalidArgument(f"correlation ID {corrid} does not fit the {self.corrid[1]} "
                                      f"CONTROL_SEQUENCE_CORRID input of model '{model}'")


@dataclass(frozen=True)
class StateSpec:
    """One implicit state: the model reads ``input_name`` and writes ``output_name``."""

    input_name: str
    output_name: str
    datatype: str
    initial: np.ndarray  # the input state of a starting request (batch dimension included when batched)

    def initial_tensor(self) -> Tensor:
        return Tensor(self.input_name, self.datatype, tuple(self.initial.shape), self.initial)


def read_sequence_config(config: mc.ModelConfig, model_path: Path, check_file=None) -> tuple[Controls, list[StateSpec]]:
    """Check ``config.sequence_batching``; raise InvalidArgument naming the field that is wrong."""
    batching = config.sequence_batching
    name = config.name
    if batching.HasField("oldest"):
        for size in batching.oldest.preferred_batch_size:
            if size < 1 or size > max(config.max_batch_size, 1):
                raise InvalidArgument(f"model '{name}': sequence_batching oldest preferred_batch_size {size} must be "
                                      f"in [1, max_batch_size={max(config.max_batch_size, 1)}]")
    controls = _read_controls(config)
    states = [_read_state(config, state, model_path, check_file) for state in batching.state]
    inputs = {t.name for t in config.input}
    taken: dict[str, str] = {}
    for kind, names in (("control input", sorted(controls.names)), ("state input", [s.input_name for s in states])):
        for tensor in names:
            if tensor in inputs:
                raise InvalidArgument(f"model '{name}': sequence_batching {kind} '{tensor}' is also a model input; "
                                      "the sequence batcher supplies it, so it must not be listed under 'input'")
            if tensor in taken:
                raise InvalidArgument(f"model '{name}': sequence_batching {kind} '{tensor}' is also a {taken[tensor]}")
            taken[tensor] = kind
    return controls, states


def _read_controls(config: mc.ModelConfig) -> Controls:
    name = config.name
    controls = Controls(batched=config.max_batch_size > 0)
    seen_kinds: set[int] = set()
    for control_input in config.sequence_batching.control_input:
        if not control_input.name:
            raise InvalidArgument(f"model '{name}': sequence_batching control_input must have a name")
        if len(control_input.control) != 1:
            raise InvalidArgument(
                f"model '{name}': sequence_batching control_input '{control_input.name}' must have exactly one "
                f"control, found {len(control_input.control)}")
        control = control_input.control[0]
        kind = Control.Kind.Name(control.kind)
        if control.kind in seen_kinds:
            raise InvalidArgument(f"model '{name}': sequence_batching control kind {kind} is given more than once")
        seen_kinds.add(control.kind)
        where = f"model '{name}': sequence_batching control {kind} for input '{control_input.name}'"
        pairs = [(values, datatype) for values, datatype in ((control.int32_false_true, "INT32"),
                                                               (control.fp32_false_true, "FP32"),
                                                               (control.bool_false_true, "BOOL")) if values]
        if control.kind in _BOOLEAN_KINDS:
            if len(pairs) != 1:
                raise InvalidArgument(f"{where} must give exactly one of int32_false_true, fp32_false_true or "
                                      f"bool_false_true, found {len(pairs)}")
            values, datatype = pairs[0]
            if len(values) != 2:
                raise InvalidArgument(f"{where}: its *_false_true must hold exactly 2 values (false, true), "
                                      f"found {len(values)}")
            if control.data_type != mc.TYPE_INVALID:
                raise InvalidArgument(f"{where} must not set data_type; the *_false_true field decides it")
            setattr(controls, _BOOLEAN_KINDS[control.kind],
                    BooleanControl(control_input.name, datatype, values[0], values[1]))
        elif control.kind == Control.CONTROL_SEQUENCE_CORRID:
            if pairs:
                raise InvalidArgument(f"{where} must not set *_false_true; it takes data_type")
            data_type = mc.DataType.Name(control.data_type)
            if data_type not in CORRID_TYPES:
                raise InvalidArgument(f"{where} has data_type {data_type}; expected one of {', '.join(CORRID_TYPES)}")
            controls.corrid = (control_input.name, config_to_datatype(data_type))
        else:
            raise InvalidArgument(f"{where}: unknown control kind")
    return controls


def _read_state(config: mc.ModelConfig, state, model_path: Path, check_file) -> StateSpec:
    name = config.name
    if not state.input_name or not state.output_name:
        raise InvalidArgument(f"model '{name}': sequence_batching state must set input_name and output_name")
    where = f"model '{name}': sequence_batching state '{state.input_name}'"
    if state.data_type == mc.TYPE_INVALID:
        raise InvalidArgument(f"{where} must set data_type")
    datatype = config_to_datatype(mc.DataType.Name(state.data_type))
    if any(d < -1 or d == 0 for d in state.dims):
        raise InvalidArgument(f"{where} has invalid dims {list(state.dims)}")
    if len(state.initial_state) > 1:
        raise InvalidArgument(f"{where}: initial_state must hold zero or one entry, found {len(state.initial_state)}")
    batch = (1,) if config.max_batch_size > 0 else ()
    if not state.initial_state:  # Triton starts from unset data, a variable dimension as 1: here zeros
        shape = batch + tuple(1 if d == -1 else d for d in state.dims)
        return StateSpec(state.input_name, state.output_name, datatype, _zeros(datatype, shape))
    initial = state.initial_state[0]
    if initial.data_type != state.data_type:
        raise InvalidArgument(f"{where}: the data_type of initial_state does not match the state's data_type")
    if not initial.name:
        raise InvalidArgument(f"{where}: initial_state must set 'name'")
    if len(initial.dims) != len(state.dims):
        raise InvalidArgument(f"{where}: initial_state has {len(initial.dims)} dims, the state {len(state.dims)}")
    for got, want in zip(initial.dims, state.dims):
        if got < 1:
            raise InvalidArgument(f"{where}: initial_state dims {list(initial.dims)} must all be fixed (>= 1)")
        if want != -1 and got != want:
            raise InvalidArgument(f"{where}: initial_state dims {list(initial.dims)} do not match the state dims "
                                  f"{list(state.dims)}")
    shape = batch + tuple(initial.dims)
    which = initial.WhichOneof("state_data")
    if which == "data_file":
        data = _read_initial_file(where, initial.data_file, datatype, shape, model_path, check_file)
    elif which == "zero_data":
        data = _zeros(datatype, shape)
    else:
        raise InvalidArgument(f"{where}: initial_state must set zero_data or data_file")
    return StateSpec(state.input_name, state.output_name, datatype, data)


def _zeros(datatype: str, shape: tuple[int, ...]) -> np.ndarray:
    if datatype == "BYTES":
        data = np.empty(shape, dtype=np.object_)
        data.fill(b"")
        return data
    return np.zeros(shape, dtype=numpy_dtype(datatype))


def _read_initial_file(where: str, data_file: str, datatype: str, shape: tuple[int, ...], model_path: Path,
                       check_file) -> np.ndarray:
    path = model_path / INITIAL_STATE_FOLDER / data_file
    if check_file is not None:
        path = check_file(path, "initial_state data_file", data_file)
    if not path.is_file():
        raise InvalidArgument(f"{where}: initial_state data_file '{data_file}' is not a file in "
                              f"'{model_path / INITIAL_STATE_FOLDER}'")
    raw = path.read_bytes()
    if datatype != "BYTES":
        needed = math.prod(shape) * element_size(datatype)
        if len(raw) < needed:
            raise InvalidArgument(f"{where}: initial_state expects {needed} bytes, but the data provided from "
                                  f"'{data_file}' only has {len(raw)} bytes")
        raw = raw[:needed]
    return from_raw(raw, datatype, shape, data_file)
