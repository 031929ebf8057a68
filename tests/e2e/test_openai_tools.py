"""Tool calling with ``tool_choice: "auto"`` and reasoning output on ``/v1/chat/completions``.

A real server over a Python-backend model that answers what its prompt scripts
(``tests/openai_models/scripted.py``: the output verbatim, token-sized pieces when streaming), one model per
parser, driven by the official ``openai`` client, streaming and not; the parsers alone on outputs cut at
every position; errors (no parser, a bad ``tool_choice``, unknown parser names at load and on the command
line).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest
from support import start_server

from tideserve.cli import build_parser
from tideserve.openai.llm import OutputParsers
from tideserve.reasoning_parsers import ReasoningStream, reasoning_parser
from tideserve.tool_parsers import MAX_STREAM_PARSE_CHARS, ToolCallStream, tool_parser

TOY = Path(__file__).resolve().parents[1] / "openai_models"
WEATHER_ARGS = {"city": "Paris", "days": [1, 2], "note": 'a "quoted" } brace, ü'}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "array"}, "note": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
_W = json.dumps(WEATHER_ARGS, ensure_ascii=False)

# parser -> (model output, expected content, expected calls)
SCRIPTS = {
    "hermes": ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": ' + _W + '}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "Let me look.\n"),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": ' + _W + '}; '
                    '{"name": "get_time", "parameters": {}}', None),
    "mistral": ('Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": ' + _W + '}, '
                '{"name": "get_time", "arguments": {}}]', "Checking."),
    "mistral_v11": ("[TOOL_CALLS]get_weather[ARGS]" + _W + "[TOOL_CALLS]get_time[ARGS]{}", None),
    "pythonic": ("[get_weather(city='Paris', days=[1, 2], note='a \"quoted\" } brace, ü'), get_time()]", None),
}
CALLS = [("get_weather", WEATHER_ARGS), ("get_time", {})]
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


# -- the parsers alone ----------------------------------------------------------------------------------
def _stream(parser_name: str, text: str, step: int) -> tuple[str, dict[int, dict]]:
    stream = ToolCallStream(tool_parser(parser_name))
    content, calls = "", {}
    pieces = [stream.feed(text[i:i + step]) for i in range(0, len(text), step)] + [stream.finish()]
    for piece, entries in pieces:
        content += piece
        for entry in entries:
            call = calls.setdefault(entry["index"], {"arguments": ""})
            if "id" in entry:
                assert "name" not in call, "a call's id and name come once, first"
                call.update(id=entry["id"], name=entry["function"]["name"])
            call["arguments"] += entry["function"].get("arguments", "")
    return content, calls


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_parsers_whole_and_cut_anywhere(script):
    name = script.split("_v")[0]
    text, content = SCRIPTS[script]
    found, calls = tool_parser(name).extract(text)
    assert found == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    for step in (1, 2, 3, 5, 8, len(text)):
        streamed, deltas = _stream(name, text, step)
        assert streamed == (content or ""), step
        assert [(deltas[i]["name"], json.loads(deltas[i]["arguments"])) for i in sorted(deltas)] == CALLS, step


@pytest.mark.parametrize("name, text", [
    ("hermes", "Just text, <tool_ca no call."), ("hermes", "<tool_call>{not json</tool_call>"),
    ("llama3_json", "The answer is {42}."), ("llama3_json", "{\"no_name\": 1}"),
    ("mistral", "[TOOL_CALLS] not a call"), ("pythonic", "[1, 2, 3]"), ("pythonic", "[f(1)]"),
    ("pythonic", "Sure: [f(a=1)]"),
])
def test_output_not_in_the_format_is_content(name, text):
    assert tool_parser(name).extract(text) == (text, [])
    for step in (1, 4, len(text)):
        assert _stream(name, text, step) == (text, {})


def test_a_runaway_call_is_read_once_past_the_limit():
    """Arguments past the re-parse limit are not re-read per delta: they arrive whole once the output ends."""
    value = "x" * (MAX_STREAM_PARSE_CHARS * 3)
    text = '<tool_call>{"name": "write", "arguments": {"text": "' + value + '"}}</tool_call>'
    stream = ToolCallStream(tool_parser("hermes"))
    sent_while_streaming = ""
    for i in range(0, len(text), 4):
        for entry in stream.feed(text[i:i + 4])[1]:
            sent_while_streaming += entry["function"].get("arguments", "")
    assert 0 < len(sent_while_streaming) <= MAX_STREAM_PARSE_CHARS
    rest = "".join(e["function"].get("arguments", "") for e in stream.finish()[1])
    assert json.loads(sent_while_streaming + rest) == {"text": value}


@pytest.mark.slow
def test_whole_outputs_read_as_vllms_parsers_read_them():
    """vLLM's own parser classes (the reference) on the same outputs, with a real tokenizer holding the markers."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
    from vllm.tool_parsers.llama_tool_parser import Llama3JsonToolParser
    from vllm.tool_parsers.pythonic_tool_parser import PythonicToolParser

    vocab = {t: i for i, t in enumerate(["<unk>", "<tool_call>", "</tool_call>", "<|python_tag|>", "<think>",
                                         "</think>"])}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")))
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}])
    others = ["Just text, <tool_ca no call.", "<tool_call>{not json</tool_call>", '{"no_name": 1}', "[1, 2, 3]",
              "[f(1)]", "The answer is {42}."]
    for name, reference in (("hermes", Hermes2ProToolParser), ("llama3_json", Llama3JsonToolParser),
                            ("pythonic", PythonicToolParser)):
        for text in [SCRIPTS[name][0], *others]:
            theirs = reference(tokenizer).extract_tool_calls(text, request)
            content, calls = tool_parser(name).extract(text)
            assert (content, [(c.name, c.arguments) for c in calls]) == (
                theirs.content, [(c.function.name, c.function.arguments) for c in theirs.tool_calls]), (name, text)
    for text in ("<think>Greet them.</think>Hello!", "Greet them.</think>Hello!", "<think>Still thinking",
                 "<think>Done.</think>"):
        assert reasoning_parser("deepseek_r1").split(text) == \
            DeepSeekR1ReasoningParser(tokenizer).extract_reasoning(text, request)


@pytest.mark.parametrize("name, kwargs, text, expected", [
    ("deepseek_r1", None, "<think>Greet them.</think>Hello!", ("Greet them.", "Hello!")),
    ("deepseek_r1", None, "Greet them.</think>Hello!", ("Greet them.", "Hello!")),
    ("deepseek_r1", None, "<think>Still thinking", ("Still thinking", None)),
    ("deepseek_r1", None, "<think>Done.</think>", ("Done.", None)),
    ("qwen3", None, "<think>Use a tool.</think><tool_call>{}</tool_call>",
     ("Use a tool.", "<tool_call>{}</tool_call>")),
    ("qwen3", None, "Use a tool.<tool_call>{}</tool_call>", ("Use a tool.", "<tool_call>{}</tool_call>")),
    ("qwen3", {"enable_thinking": False}, "<think>a</think>b", (None, "<think>a</think>b")),
])
def test_reasoning_parsers_whole_and_streamed(name, kwargs, text, expected):
    assert reasoning_parser(name, kwargs).split(text) == expected
    for step in (1, 3, len(text)):
        stream = ReasoningStream(reasoning_parser(name, kwargs))
        pieces = [stream.feed(text[i:i + step]) for i in range(0, len(text), step)] + [stream.finish()]
        assert ("".join(r for r, _ in pieces) or None, "".join(a for _, a in pieces) or None) == expected


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
    call = '<tool_call>{"name": "get_weather", "arguments": ' + _W + "}</tool_call>"
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


def test_unknown_parser_flag_is_refused(capsys):
    for flag in ("--tool-call-parser", "--reasoning-parser"):
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args(["--model-repository", ".", flag, "nonsense"])
        assert info.value.code == 2 and "invalid choice: 'nonsense'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown parser 'nonsense'"):
        OutputParsers(tool_call_parser="nonsense")  # servers embedded without the command line
