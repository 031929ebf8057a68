"""The tool-call and reasoning parsers without a server: whole outputs and outputs cut at every position, output
not in a parser's format, vLLM's own parsers as the reference, unknown parser names."""

from __future__ import annotations

import json

import pytest
from openai_fixtures import CALLS, SCRIPTS

from tideserve.cli import build_parser
from tideserve.openai.llm import OutputParsers
from tideserve.reasoning_parsers import ReasoningStream, reasoning_parser
from tideserve.tool_parsers import MAX_STREAM_PARSE_CHARS, ToolCallStream, tool_parser


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


def test_unknown_parser_flag_is_refused(capsys):
    for flag in ("--tool-call-parser", "--reasoning-parser"):
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args(["--model-repository", ".", flag, "nonsense"])
        assert info.value.code == 2 and "invalid choice: 'nonsense'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown parser 'nonsense'"):
        OutputParsers(tool_call_parser="nonsense")  # servers embedded without the command line
