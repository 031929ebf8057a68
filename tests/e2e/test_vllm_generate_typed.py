"""End to end: Triton's generate extension on the typed path answers what the tensor path answers.

A ``/generate`` or ``/generate_stream`` request to a vLLM model goes as one typed generation request (no tensors);
the same request with its ``text_input`` given as an array of one string takes the tensor path (the typed path
leaves every unusual form to it). Both must give the same answer, byte for byte: status, content type and body (for
a stream, every event, when both wrote one event per token; deltas a slow reader has not taken yet join into one
event on the typed path, so otherwise the joined text and the counts are compared).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from llm_fixtures import VLLM_MODEL, wait_engine_idle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = VLLM_MODEL
PROMPT = "The quick brown fox"
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def llm_server(vllm_server):
    """The session's vLLM server (``vllm_server`` in tests/conftest.py): the same engine arguments as
    tests/e2e/test_vllm.py's (tiny Llama, float32, ``max_model_len`` 512, eager), one engine for both."""
    wait_engine_idle(vllm_server)
    return vllm_server


def _post(server, path: str, doc: dict) -> tuple[int, str, bytes, dict]:
    req = urllib.request.Request(f"{server.base_url}/v2/models/{MODEL}/{path}", data=json.dumps(doc).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.headers["Content-Type"], r.read(), {k.lower(): v for k, v in r.headers.items()}
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read(), {k.lower(): v for k, v in exc.headers.items()}


def _tensor_form(doc: dict) -> dict:
    """The same request in a form only the tensor path takes (the prompt as an array of one string)."""
    return {**doc, "text_input": [doc["text_input"]]}


def _both(server, path: str, doc: dict):
    return _post(server, path, doc), _post(server, path, _tensor_form(doc))


def _events(body: bytes) -> list[bytes]:
    return [line for line in body.split(b"\n") if line.startswith(b"data: ")]


ALL_RETURNS = {"return_finish_reason": True, "return_cumulative_logprob": True, "return_logprobs": True,
               "return_num_input_tokens": True, "return_num_output_tokens": True}


@pytest.mark.parametrize("doc", [
    {"text_input": PROMPT, "parameters": {**GREEDY, "max_tokens": 8}},  # the whole answer starts with the prompt
    {"text_input": PROMPT, "id": "r-1", "exclude_input_in_output": True, **ALL_RETURNS,
     "sampling_parameters": json.dumps({**GREEDY, "max_tokens": 6, "logprobs": 2})},
    {"text_input": PROMPT, "stream": True, "return_finish_reason": True,
     "parameters": {**GREEDY, "max_tokens": 5}},  # stream on /generate: one answer, no prompt
    {"text_input": PROMPT, "parameters": {"n": 2, "temperature": 1.0, "top_k": 1, "max_tokens": 4,  # (n > 1 is
                                          "return_num_output_tokens": True,  # no greedy sampling: top_k 1 is,
                                          "return_finish_reason": True}},  # whatever else the engine runs)
    {"text_input": PROMPT, "parameters": {"temperature": -3}},  # the model's errors, worded alike
    {"text_input": PROMPT, "parameters": {"no_such_parameter": 1}},
    {"text_input": PROMPT, "parameters": {"lora_name": "x"}},
    {"text_input": PROMPT, "stream": True, "exclude_input_in_output": False},
], ids=["whole", "returns", "stream-flag", "n2", "bad-temperature", "unknown-parameter", "lora", "stream-prompt"])
def test_generate_typed_answers_as_tensors(llm_server, doc):
    typed, tensors = _both(llm_server, "generate", doc)
    assert typed[:3] == tensors[:3]


@pytest.mark.parametrize("doc", [
    {"text_input": PROMPT, "parameters": {**GREEDY, "max_tokens": 6}},  # not streamed: one event with the prompt
    {"text_input": PROMPT, "parameters": {"temperature": -3}},  # the first response an error: its status
    {"text_input": PROMPT, "stream": True, "exclude_input_in_output": True, "id": "s-1", **ALL_RETURNS,
     "parameters": {**GREEDY, "max_tokens": 12, "logprobs": 1}},
], ids=["whole", "error-first", "streamed"])
def test_generate_stream_typed_answers_as_tensors(llm_server, doc):
    typed, tensors = _both(llm_server, "generate_stream", doc)
    assert typed[:2] == tensors[:2]
    parsed = [[json.loads(e[6:]) for e in _events(body)] for body in (typed[2], tensors[2])]
    if all(all(e.get("num_output_tokens", 1) == 1 for e in events) for events in parsed):
        assert typed[2] == tensors[2]  # one event per token on both: every event alike, byte for byte
        return
    # a reader that fell behind had deltas joined (the same number of events may still split differently)
    joined = []
    for events in parsed:
        joined.append(("".join(e["text_output"] for e in events), sum(e["num_output_tokens"] for e in events),
                       events[-1]["finish_reason"], events[-1]["cumulative_logprob"],
                       [set(e) for e in events][-1]))
    assert joined[0] == joined[1]


def test_generate_typed_deadline_refusal_as_tensors(llm_server):
    """A request past its deadline (Triton's ``timeout``, microseconds) is refused alike: 503 + Retry-After."""
    doc = {"text_input": PROMPT, "timeout": 1, "parameters": {**GREEDY, "max_tokens": 4}}
    for path in ("generate", "generate_stream"):
        typed, tensors = _both(llm_server, path, doc)
        assert typed[0] == tensors[0] == 503
        assert typed[1:3] == tensors[1:3]
        assert typed[3]["retry-after"] == tensors[3]["retry-after"]
        assert "deadline of 0.001 ms" in typed[2].decode()


def test_generate_stream_typed_deltas_are_the_whole_text(llm_server):
    """The streamed deltas add up to the whole answer (exclude_input_in_output), on the typed path."""
    sampling = {**GREEDY, "max_tokens": 16}
    status, _, body, _ = _post(llm_server, "generate", {"text_input": PROMPT, "exclude_input_in_output": True,
                                                        "parameters": sampling})
    assert status == 200
    whole = json.loads(body)["text_output"]
    status, kind, body, _ = _post(llm_server, "generate_stream", {"text_input": PROMPT, "stream": True,
                                                                  "parameters": sampling})
    assert status == 200 and kind.startswith("text/event-stream")
    events = [json.loads(e[6:]) for e in _events(body)]
    assert len(events) > 1
    assert "".join(e["text_output"] for e in events) == whole
