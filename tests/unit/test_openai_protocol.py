"""The OpenAI protocol without a server: request validation (completions, chat, embeddings), the errors' field
names, the prompt limits."""

from __future__ import annotations

import pytest

from tideserve.openai.chat_completion.protocol import ChatCompletionRequest
from tideserve.openai.completion.protocol import CompletionRequest
from tideserve.openai.errors import BadRequest, from_server_error
from tideserve.openai.limits import OpenAILimits
from tideserve.openai.protocol import parse

LIMITS = OpenAILimits()


@pytest.mark.parametrize("doc, param", [
    ({"prompt": "x", "temperature": 2.5}, "temperature"),
    ({"prompt": "x", "temperature": -0.1}, "temperature"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "logprobs": -1}, "logprobs"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "seed": "abc"}, "seed"),
    ({"prompt": "x", "stream_options": {"include_usage": "maybe"}}, "stream_options.include_usage"),
])
def test_completion_fields_out_of_range_name_the_field(doc, param):
    with pytest.raises(BadRequest) as info:
        parse(CompletionRequest, doc)
    assert info.value.param == param and info.value.status == 400
    assert info.value.body()["error"]["type"] == "BadRequestError"


@pytest.mark.parametrize("doc, param", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1], []]}, "prompt"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "suffix": "y", "echo": True}, "suffix"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ({"prompt": "x", "min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ({"prompt": "x", "response_format": {"type": "json_schema"}}, "response_format"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),   # the server's limits
    ({"prompt": "x", "n": 129}, "n"),
    ({"prompt": ["x"] * 257}, "prompt"),
])
def test_completion_cross_field_checks(doc, param):
    with pytest.raises(BadRequest) as info:
        request = parse(CompletionRequest, doc)
        request.check_completion(LIMITS)
        request.prompts(LIMITS)
    assert info.value.param == param


def test_completion_prompts_and_sampling():
    request = parse(CompletionRequest, {"prompt": [[1, 2], [3]], "n": 2, "stop": "x", "top_k": 5, "ignore_eos": True,
                                        "logit_bias": {"7": -100}, "unknown_field": 1})
    assert request.prompts(LIMITS) == [[1, 2], [3]]
    assert parse(CompletionRequest, {"prompt": [5, 6] * 300}).prompts(LIMITS) == [[5, 6] * 300]  # one prompt
    assert parse(CompletionRequest, {"prompt": ["a", "b"]}).prompts(LIMITS) == ["a", "b"]
    assert request.sampling(16, None) == {"max_tokens": 16, "n": 2, "stop": ["x"], "top_k": 5, "ignore_eos": True,
                                          "logit_bias": {"7": -100}}
    schema = {"type": "object"}
    request = parse(CompletionRequest, {"prompt": "x", "response_format": {"type": "json_schema",
                                                                           "json_schema": {"name": "a", "schema": schema}}})
    assert request.sampling(4, 2)["structured_outputs"] == {"json": schema}
    assert request.sampling(4, 2)["logprobs"] == 2


@pytest.mark.parametrize("doc, param", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -5}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 129}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": []}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
])
def test_malformed_chat_requests_name_the_field(doc, param):
    with pytest.raises(BadRequest) as info:
        parse(ChatCompletionRequest, doc).check_chat(LIMITS)
    assert info.value.param == param, info.value.message


def test_chat_messages_for_the_template():
    request = parse(ChatCompletionRequest, {"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"}]})
    request.check_chat(LIMITS)
    assert request.template_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"}]


def test_tool_choices_become_structured_output():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "integer"}}}}}, {"type": "function", "function": {"name": "g"}}]
    base = {"messages": [{"role": "user", "content": "x"}], "tools": tools}
    named = parse(ChatCompletionRequest, {**base, "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert named.constraint() == {"json": tools[0]["function"]["parameters"]}
    required = parse(ChatCompletionRequest, {**base, "tool_choice": "required"}).constraint()["json"]
    assert required["type"] == "array" and len(required["items"]["anyOf"]) == 2
    assert parse(ChatCompletionRequest, {**base, "tool_choice": "none"}).constraint() is None


def test_backend_errors_keep_the_field_names():
    from tideserve.errors import InvalidArgument, NotFound

    error = from_server_error(InvalidArgument("invalid sampling parameter 'max_tokens': must be >= 1"),
                              {"max_tokens": "max_completion_tokens"})
    assert (error.status, error.param) == (400, "max_completion_tokens")
    error = from_server_error(InvalidArgument("invalid prompt: This model's maximum context length is 512 tokens"),
                              prompt_param="messages")
    assert error.param == "messages"
    assert from_server_error(NotFound("unknown model: 'x'")).body()["error"] == {
        "message": "unknown model: 'x'", "type": "NotFoundError", "param": "model", "code": 404}
    assert from_server_error(RuntimeError("boom")).status == 500


def test_prompt_tokens_are_counted_only_when_they_may_exceed_the_limit():
    from tideserve.openai.limits import count_prompt_tokens

    class NoTokenizer:
        def tokenizer(self):
            return None

    limits = OpenAILimits(max_prompt_tokens=100)
    assert not limits.may_exceed_tokens(["x" * 20, [1] * 10])
    assert limits.may_exceed_tokens(["x" * 30])
    assert count_prompt_tokens(NoTokenizer(), ["héllo", [1, 2, 3]]) == 9  # UTF-8 bytes without a tokenizer
    limits.check_prompt_tokens(100, "prompt")
    with pytest.raises(BadRequest) as info:
        limits.check_prompt_tokens(101, "messages")
    assert info.value.param == "messages" and "at most 100 prompt tokens" in info.value.message
    with pytest.raises(BadRequest) as info:
        limits.check_logprobs(21, "top_logprobs")
    assert info.value.message == "Requested sample logprobs of 21, which is greater than max allowed: 20"


@pytest.mark.parametrize("value", ["", ["a", ""], [], [[1], []]])
def test_embedding_inputs_must_not_be_empty(value):
    from tideserve.openai.embedding.protocol import EmbeddingRequest

    with pytest.raises(BadRequest) as info:
        parse(EmbeddingRequest, {"model": "m", "input": value}).inputs()
    assert info.value.param == "input" and info.value.status == 400
