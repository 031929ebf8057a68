"""Ensemble planning without a server: the load-time checks of an ensemble's steps, in Triton's words, and
which tensors stream."""

from __future__ import annotations

import textwrap

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from tideserve.ensembles.plan import build_plan, read_steps
from tideserve.errors import InvalidArgument


def _config(text: str) -> mc.ModelConfig:
    return text_format.Parse(textwrap.dedent(text), mc.ModelConfig())


def _model(name: str, inputs: str, outputs: str, decoupled: bool = False, max_batch_size: int = 0):
    config = _config(f'name: "{name}" backend: "python" max_batch_size: {max_batch_size} '
                     f"input {inputs} output {outputs}")
    config.model_transaction_policy.decoupled = decoupled
    return config


def _ensemble(steps: str, inputs: str = '[ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]',
              outputs: str = '[ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]', extra: str = ""):
    return _config(f'name: "e" platform: "ensemble" input {inputs} output {outputs} {extra} '
                   f"ensemble_scheduling {{ {steps} }}")


def _step(model: str, inputs: dict, outputs: dict) -> str:
    text = f'step {{ model_name: "{model}" model_version: -1 '
    text += "".join(f'input_map {{ key: "{k}" value: "{v}" }} ' for k, v in inputs.items())
    text += "".join(f'output_map {{ key: "{k}" value: "{v}" }} ' for k, v in outputs.items())
    return text + "}"


_ONE = '[ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]'


_OUT = '[ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]'


_TWO = '[ { name: "A" data_type: TYPE_INT32 dims: [ -1 ] }, { name: "B" data_type: TYPE_INT32 dims: [ -1 ] } ]'


_MODELS = {"id": _model("id", _ONE, _OUT), "stream": _model("stream", _ONE, _OUT, decoupled=True),
           "pair": _model("pair", _TWO, _OUT), "batch4": _model("batch4", _ONE, _OUT, max_batch_size=4)}


def _plan(config: mc.ModelConfig):
    steps = read_steps(config)
    return build_plan(config, steps, {s.index: _MODELS[s.model_name] for s in steps})


@pytest.mark.parametrize("config, message", [
    (_ensemble(_step("id", {"IN": "IN"}, {"OUT": "IN"}) + _step("id", {"IN": "IN"}, {"OUT": "OUT"})),
     "step 0 (model 'id') writes ensemble tensor 'IN', which is an input of the ensemble"),
    (_ensemble(_step("id", {"IN": "IN"}, {"OUT": "OUT"}) + _step("id", {"IN": "IN"}, {"OUT": "OUT"})),
     "ensemble tensor 'OUT' is written by both step 0 (model 'id') and step 1 (model 'id')"),
    (_ensemble(_step("id", {"IN": "nowhere"}, {"OUT": "OUT"})),
     ("step 0 (model 'id') reads ensemble tensor 'nowhere' (for its input 'IN'), which is neither an ensemble input "
      "nor written by any step")),
    (_ensemble(_step("id", {"IN": "IN"}, {"OUT": "OUT"}),
               inputs='[ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] }, '
                      '{ name: "EXTRA" data_type: TYPE_INT32 dims: [ -1 ] } ]'),
     "input 'EXTRA' of ensemble 'e' is not used by any step"),
    (_ensemble(_step("id", {"IN": "IN"}, {"OUT": "OUT"}) + _step("id", {"IN": "IN"}, {"OUT": "dangling"})),
     "ensemble tensor 'dangling' written by step 1 (model 'id') is neither read by a step nor an ensemble output"),
    (_ensemble('step { model_name: "id" }'), "must specify 'input_map' in step 0 of ensemble 'e' (model 'id')"),
    (_ensemble(_step("id", {"IN": "IN"}, {"OUT": "OUT"}), extra="instance_group [ { count: 1 } ]"),
     "instance_group must not be specified for ensemble 'e'"),
    (_ensemble(_step("id", {"NOPE": "IN"}, {"OUT": "OUT"})),
     "ensemble tensor 'IN' is mapped to input 'NOPE', which model 'id' does not have (its inputs: ['IN'])"),
    (_ensemble(_step("id", {"IN": "IN"}, {"NOPE": "OUT"})),
     "ensemble tensor 'OUT' is mapped from output 'NOPE', which model 'id' does not have (its outputs: ['OUT'])"),
    (_ensemble(_step("batch4", {"IN": "IN"}, {"OUT": "OUT"}), extra="max_batch_size: 8"),
     "ensemble 'e' allows maximum batch size 8, but step 0 (model 'batch4') only allows 4"),
    (_ensemble(_step("stream", {"IN": "IN"}, {"OUT": "a"}) + _step("stream", {"IN": "IN"}, {"OUT": "b"})
               + _step("pair", {"A": "a", "B": "b"}, {"OUT": "OUT"})),
     ("step 2 (model 'pair') receives inputs originating from different decoupled models: 'a' streams from step 0 "
      "(model 'stream') and 'b' from step 1 (model 'stream')")),
])
def test_load_time_checks(config, message):
    with pytest.raises(InvalidArgument) as info:
        _plan(config)
    assert message in info.value.message


def test_streams_are_planned_per_tensor():
    plan = _plan(_ensemble(_step("stream", {"IN": "IN"}, {"OUT": "s"}) + _step("id", {"IN": "IN"}, {"OUT": "c"})
                           + _step("pair", {"A": "s", "B": "c"}, {"OUT": "OUT"})))
    assert plan.decoupled and plan.labels == {"IN": None, "s": 0, "c": None, "OUT": 0}
    assert [s.label for s in plan.steps] == [None, None, 0]
    assert plan.label_of(["OUT"]) == 0 and plan.label_of(["c"]) is None
