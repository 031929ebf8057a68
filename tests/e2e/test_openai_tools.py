"""Tool calling with ``tool_choice: "auto"`` and reasoning output on ``/v1/chat/completions``.

A real server over a Python-backend model that answers what its prompt scripts
(``tests/openai_models/scripted.py``: the output verbatim, token-sized pieces when streaming), one model per
parser, driven by the official ``openai`` client, streaming and not; errors (no parser, a bad ``tool_choice``,
an unknown parser name at load). The parsers alone, and unknown parser names on the command line, are in
``tests/unit/test_tool_parsers.py``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest
from openai_fixtures import CALLS, SCRIPTS, WEATHER_ARGS, WEATHER_JSON
from support import start_server

TOY = Path(__file__).resolve().parents[1] / "openai_models"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "array"}, "note": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
MODELS = {  # model -> config parameters
    "hermes": {"tool_call_parser": "hermes"},
    "llama3_json": {"tool_call_parser": "llama3_json"},
    "mistral": {"tool_call_parser": "mistral"},
    "pythonic": {"tool_call_parser": "pythonic"},
    "r1": {"reasoning_parser": "deepseek_r1"},
    "qwen3": {"reasoning_parser": "qwen3", "tool_call_parser": "hermes"},
    "plain": {"tool_call_parser": ""},   # no parser, whatever the server's default
    "default": {},                       # the server's --tool-call-parser
    "bad_parser": {"tool_call_parser": "nonsense"},
}


# -- a real server ----------------------------------------------------------------------------------------
def _repository(root: Path) -> Path:
    repository = root / "models"
    for name, parameters in MODELS.items():
        (repository / name / "1").mkdir(parents=True)
        shutil.copy(TOY / "scripted.py", repository / name / "1" / "model.py")
        extra = "".join(f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}\n' for k, v in parameters.items())
        (repository / name / "config.pbtxt").write_text(f'name: "{name}"\n' + (TOY / "scripted.pbtxt").read_text()
                                                        + extra)
    return repository


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openai_tools")
    loads = [arg for name in MODELS if name != "bad_parser" for arg in ("--load-model", name)]
    running = start_server([_repository(tmp)], "--model-control-mode", "explicit", *loads,
                           "--tool-call-parser", "hermes", tmp_dir=tmp)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def _chat(client, model: str, script: str, **kwargs):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": script}], **kwargs)


def _streamed(client, model: str, script: str, **kwargs) -> dict:
    """The chunks of a streamed answer added up: content, reasoning, calls by index, finish reasons."""
    out = {"content": "", "reasoning": "", "reasoning_content": "", "calls": {}, "finish": [], "chunks": 0}
    for chunk in _chat(client, model, script, stream=True, **kwargs):
        out["chunks"] += 1
        choice = chunk.choices[0]
        delta = choice.delta
        out["content"] += delta.content or ""
        for key in ("reasoning", "reasoning_content"):
            out[key] += (delta.model_extra or {}).get(key) or ""
        for entry in delta.tool_calls or []:
            call = out["calls"].setdefault(entry.index, {"arguments": "", "ids": []})
            if entry.id:
                assert entry.type == "function" and entry.function.name and not call["arguments"]
                call["ids"].append(entry.id)
                call["name"] = entry.function.name
            call["arguments"] += entry.function.arguments or ""
        if choice.finish_reason:
            out["finish"].append(choice.finish_reason)
    return out


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_auto_tool_calls(client, script):
    model = script.split("_v")[0]
    text, content = SCRIPTS[script]
    result = _chat(client, model, text, tools=TOOLS)
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == content
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == CALLS
    assert all(c.type == "function" for c in calls) and len({c.id for c in calls}) == 2
    if model == "mistral":
        assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)

    streamed = _streamed(client, model, text, tools=TOOLS, tool_choice="auto")
    assert streamed["content"] == (content or "")
    assert streamed["finish"] == ["tool_calls"]
    assert [(streamed["calls"][i]["name"], json.loads(streamed["calls"][i]["arguments"]))
            for i in sorted(streamed["calls"])] == CALLS
    assert all(len(call["ids"]) == 1 for call in streamed["calls"].values())
    # the calls came as they were written, not in one chunk at the end (pythonic: each call once it closes)
    assert streamed["chunks"] > (3 if model == "pythonic" else 6)


def test_text_answers_stay_content(client):
    text = "No tool needed: 2 < 3, and <tool_ca is no tag."
    message = _chat(client, "hermes", text, tools=TOOLS).choices[0]
    assert (message.message.content, message.message.tool_calls, message.finish_reason) == (text, None, "stop")
    streamed = _streamed(client, "hermes", text, tools=TOOLS)
    assert (streamed["content"], streamed["calls"], streamed["finish"]) == (text, {}, ["stop"])


def test_tools_reach_the_template_and_none_is_not_parsed(client):
    assert _chat(client, "hermes", "LIST_TOOLS", tools=TOOLS).choices[0].message.content == "get_weather get_time"
    text = SCRIPTS["hermes"][0]
    choice = _chat(client, "hermes", text, tools=TOOLS, tool_choice="none").choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (text, None, "stop")
    assert _streamed(client, "hermes", text, tools=TOOLS, tool_choice="none")["content"] == text
    # no tools: nothing is parsed either
    assert _chat(client, "hermes", text).choices[0].message.content == text


def test_the_server_default_parser(client):
    choice = _chat(client, "default", SCRIPTS["hermes"][0], tools=TOOLS).choices[0]
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather", "get_time"]


def test_reasoning(client):
    text = "<think>The user greets; greet back.</think>Hello there."
    message = _chat(client, "r1", text).choices[0].message
    extra = message.model_extra
    assert extra["reasoning_content"] == extra["reasoning"] == "The user greets; greet back."
    assert message.content == "Hello there."
    streamed = _streamed(client, "r1", text)
    assert streamed["reasoning_content"] == streamed["reasoning"] == "The user greets; greet back."
    assert streamed["content"] == "Hello there." and streamed["finish"] == ["stop"]

    hidden = _chat(client, "r1", text, extra_body={"include_reasoning": False}).choices[0].message
    assert hidden.model_extra["reasoning_content"] is None and hidden.content == "Hello there."
    assert _streamed(client, "r1", text, extra_body={"include_reasoning": False})["reasoning"] == ""
    unfinished = _chat(client, "r1", "Still weighing it up").choices[0].message
    assert (unfinished.model_extra["reasoning_content"], unfinished.content) == ("Still weighing it up", None)
    # a model without a reasoning parser sends no reasoning fields
    assert "reasoning_content" not in (_chat(client, "hermes", text).choices[0].message.model_extra or {})


def test_reasoning_with_tool_calls(client):
    call = '<tool_call>{"name": "get_weather", "arguments": ' + WEATHER_JSON + "}</tool_call>"
    for text in ("<think>It needs the weather tool.</think>" + call, "It needs the weather tool." + call):
        choice = _chat(client, "qwen3", text, tools=TOOLS).choices[0]
        assert choice.message.model_extra["reasoning_content"] == "It needs the weather tool."
        assert choice.message.content is None and choice.finish_reason == "tool_calls"
        assert json.loads(choice.message.tool_calls[0].function.arguments) == WEATHER_ARGS
        streamed = _streamed(client, "qwen3", text, tools=TOOLS)
        assert streamed["reasoning_content"] == "It needs the weather tool." and streamed["content"] == ""
        assert json.loads(streamed["calls"][0]["arguments"]) == WEATHER_ARGS
        assert streamed["finish"] == ["tool_calls"]
    no_thinking = _chat(client, "qwen3", "<think>x</think>y", extra_body={
        "chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert (no_thinking.content, no_thinking.model_extra["reasoning_content"]) == ("<think>x</think>y", None)


def test_errors(client, server):
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, "plain", "hi", tools=TOOLS)
    error = info.value.body
    assert error["param"] == "tool_choice" and "--tool-call-parser" in error["message"]
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, "plain", "hi", tools=TOOLS, stream=True)
    assert info.value.body["param"] == "tool_choice"
    for bad in ("sometimes", {"type": "function", "function": {"name": "get_stock"}}):
        with pytest.raises(openai.BadRequestError) as info:
            _chat(client, "hermes", "hi", tools=TOOLS, tool_choice=bad)
        assert info.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, "hermes", "hi", tool_choice="auto")
    assert info.value.body["param"] == "tool_choice"  # tool_choice without tools
    with pytest.raises(openai.BadRequestError) as info:  # auto with a response_format: this model has none
        _chat(client, "hermes", "hi", tools=TOOLS, response_format={"type": "json_object"})
    assert info.value.body["param"] == "response_format"

    answer = httpx.post(f"{server.base_url}/v2/repository/models/bad_parser/load", timeout=30)
    assert answer.status_code == 400
    assert "unknown parser 'nonsense'" in answer.json()["error"] and "hermes" in answer.json()["error"]
    assert httpx.get(f"{server.base_url}/v2/health/live").status_code == 200
