"""The generate extension's typed path without a server: which requests it takes, what GenerationRequest they
become, and that its events are, byte for byte, the tensor path's for the same engine outputs."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from tideserve import config as config_module
from tideserve.generation import EngineInfo
from tideserve.http import codec
from tideserve.http.generate import decode_generate_request, generate_response_doc, typed_generate_request
from tideserve.llm_backends.vllm import config as vllm_config
from tideserve.llm_backends.vllm.inputs import parse_inputs
from tideserve.llm_backends.vllm.lora import LORA_NAME
from tideserve.llm_backends.vllm.outputs import ResponseBuilder

MAX_INPUT = 1 << 20


def _served(typed: bool = True, version: int = 3):
    config = config_module.normalize(config_module.parse_text('name: "llm"\nbackend: "vllm"'), "llm", Path("."))
    vllm_config.auto_complete(config)
    return SimpleNamespace(config=config, version=version, engine=EngineInfo(typed_requests=typed))


def _typed(doc, served=None, body: bytes | None = None):
    body = json.dumps(doc).encode() if body is None else body
    return typed_generate_request(served or _served(), "llm", "", body, json.loads(body), MAX_INPUT)


@pytest.mark.parametrize("doc", [
    {"text_input": ["hi"]},  # an array of one string
    {"input_ids": [1, 2]},
    {"text_input": "hi", "stream": "true"},  # a flag as a string
    {"text_input": "hi", "stream": [True]},
    {"text_input": "hi", "return_prompt_logprobs": True},
    {"text_input": "hi", "sequence_id": 3},
    {"text_input": "hi", "triton_x": 1},
    {"text_input": "hi", "parameters": {"text_input": "again"}},
    {"text_input": "hi", "stream": True, "exclude_input_in_output": False},  # refused: the tensor path words it
    {"text_input": "hi", "sampling_parameters": "{not json"},
    {"text_input": "hi", "sampling_parameters": json.dumps({"lora_name": 3})},
    {"text_input": "hi", "priority": -1},
    {"text_input": "hi", "timeout": 1.5},
    {"text_input": "hi", "parameters": {"max_tokens": [1]}},
    {"parameters": {"max_tokens": 1}},  # no prompt
    {"text_input": "x" * MAX_INPUT},
    [1, 2],
])
def test_unusual_requests_take_the_tensor_path(doc):
    assert _typed(doc) is None


def test_models_without_typed_requests_take_the_tensor_path():
    assert _typed({"text_input": "hi"}, _served(typed=False)) is None
    assert _typed({"text_input": "hi"}, SimpleNamespace(config=_served().config, version=1, engine=None)) is None
    assert _typed(None, body=b'{"text_input": "a", "text_input": "b"}') is None  # a field named twice


def test_typed_request_fields():
    typed = _typed({"id": "r", "text_input": "hi", "stream": True, "exclude_input_in_output": True,
                    "return_num_output_tokens": True, "return_finish_reason": True, "priority": 2, "timeout": 500,
                    "parameters": {"max_tokens": 4, "temperature": "0.5", "add_special_tokens": False},
                    "sampling_parameters": json.dumps({"temperature": 0, LORA_NAME: "a"})})
    generation = typed.generation
    assert (typed.request_id, typed.priority, typed.timeout_us) == ("r", 2, 500)
    assert generation.prompt == "hi" and generation.stream and generation.lora_name == "a"
    assert generation.sampling == {"max_tokens": 4, "temperature": 0}  # sampling_parameters win, as on tensors
    assert not generation.add_special_tokens and not generation.logprobs and not generation.cumulative_logprob
    assert typed.prefix == "" and typed.returns == ("finish_reason", "num_output_tokens")
    assert typed.model_version == "3"
    whole = _typed({"text_input": "hi"})
    assert whole.prefix == "hi" and not whole.generation.stream  # the whole answer starts with the prompt


# -- the same events as the tensor path -----------------------------------------------------------
def _lp(value: float):
    return SimpleNamespace(logprob=value, rank=1, decoded_token="t")


def _outputs(n: int):
    """Three engine steps of ``n`` choices (the second choice silent in the second step)."""
    steps = []
    for step in range(3):
        outs = []
        for i in range(n):
            if step == 1 and i == 1:
                continue
            outs.append(SimpleNamespace(index=i, text=f" w{step}{i}", token_ids=[10 + step, 20 + i],
                                        logprobs=[{10 + step: _lp(-0.25 * step)}, {20 + i: _lp(-1.0)}],
                                        cumulative_logprob=-0.1 * (step + 1) - i,
                                        finish_reason="length" if step == 2 else None))
        steps.append(SimpleNamespace(outputs=outs, finished=step == 2, prompt="Hello there",
                                     prompt_token_ids=[1, 2, 3]))
    return steps


def _tensor_docs(doc: dict, n: int, streaming: bool) -> list[bytes]:
    request = decode_generate_request("llm", "", json.dumps(doc).encode(), _served().config, MAX_INPUT)
    inputs = parse_inputs(request)
    builder = ResponseBuilder(inputs, n, {})
    out = []
    for output in _outputs(n):
        if streaming and inputs.stream:
            out.append(builder.delta(output))
        else:
            builder.add(output)
    if not out:
        out.append(builder.whole())
    docs = []
    for response in out:
        response.model_name, response.model_version, response.id = "llm", "3", request.id
        docs.append(codec.dumps(generate_response_doc(response)))
    return docs


def _typed_docs(doc: dict, n: int, streaming: bool) -> list[bytes]:
    typed = _typed(doc)
    generation = typed.generation
    builder = ResponseBuilder(generation, n, {})
    deltas = []
    for output in _outputs(n):
        if streaming and generation.stream:
            deltas.append(builder.step(output))
        else:
            builder.add(output)
    if not deltas:
        deltas.append(builder.whole().generation)
    return [codec.dumps(typed.doc(delta)) for delta in deltas]


RETURNS = {"return_finish_reason": True, "return_cumulative_logprob": True, "return_logprobs": True,
           "return_num_input_tokens": True, "return_num_output_tokens": True}


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("doc, streaming", [
    ({"text_input": "Hello there"}, False),
    ({"text_input": "Hello there", "id": "x", **RETURNS, "parameters": {"logprobs": 1}}, False),
    ({"text_input": "Hello there", "exclude_input_in_output": True, "return_finish_reason": True}, True),
    ({"text_input": "Hello there", "stream": True, "id": "s", **RETURNS}, True),
    ({"text_input": "Hello there", "stream": True, "return_num_output_tokens": True}, False),  # on /generate
], ids=["whole", "whole-returns", "stream-endpoint-whole", "streamed-returns", "stream-flag-unary"])
def test_typed_events_are_the_tensor_paths(doc, streaming, n):
    assert _typed_docs(doc, n, streaming) == _tensor_docs(doc, n, streaming)


def test_a_whole_answer_keeps_each_choices_finish_reason():
    """n > 1: a choice that finished in an earlier step than the last keeps its reason in the whole answer (a later
    step without it is no 'None'), on both paths."""
    steps = [SimpleNamespace(outputs=[SimpleNamespace(index=0, text=" a", token_ids=[1], logprobs=None,
                                                      cumulative_logprob=None, finish_reason="stop"),
                                      SimpleNamespace(index=1, text=" b", token_ids=[2], logprobs=None,
                                                      cumulative_logprob=None, finish_reason=None)],
                             finished=False, prompt="Hi", prompt_token_ids=[1]),
             SimpleNamespace(outputs=[SimpleNamespace(index=1, text=" c", token_ids=[3], logprobs=None,
                                                      cumulative_logprob=None, finish_reason="length")],
                             finished=True, prompt="Hi", prompt_token_ids=[1])]
    doc = {"text_input": "Hi", "return_finish_reason": True}
    request = decode_generate_request("llm", "", json.dumps(doc).encode(), _served().config, MAX_INPUT)
    tensors = ResponseBuilder(parse_inputs(request), 2, {})
    typed = _typed(doc)
    builder = ResponseBuilder(typed.generation, 2, {})
    for step in steps:
        tensors.add(step)
        builder.add(step)
    assert tensors.whole().output("finish_reason").data.tolist() == [b"stop", b"length"]
    assert typed.doc(builder.whole().generation)["finish_reason"] == ["stop", "length"]
