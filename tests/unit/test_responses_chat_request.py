"""The chat request a ``/v1/responses`` request becomes (``responses.protocol.chat_request``), built from the validated
Responses request without a second validation: for every shape of request it is the request the chat request's own
validation makes of the same JSON (``chat_doc``), field for field, with the same fields set, the same template
messages and tools, sampling and constraint; vLLM's extensions passed on are typed as the chat request types them,
so a bad one is refused by the Responses request's validation, naming the field."""

from __future__ import annotations

import pytest
from tideserve.openai.chat_completion.protocol import ChatCompletionRequest
from tideserve.openai.errors import OpenAIError
from tideserve.openai.limits import OpenAILimits
from tideserve.openai.protocol import parse
from tideserve.openai.responses import protocol
from tideserve.openai.responses.protocol import ResponsesRequest, chat_doc, chat_request, input_items, to_messages

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather", "parameters": SCHEMA},
         {"type": "function", "name": "get_time", "strict": True}]
ITEMS = [{"role": "developer", "content": "Be brief."},
         {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                                         {"type": "input_text", "text": "Paris?"}]},
         {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
         {"role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
         {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
         {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
         {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
         {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "noon"}]},
         {"role": "user", "content": "And tomorrow?"}]
EXTENSIONS = {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "seed": 7, "stop": ["END", "STOP"], "min_tokens": 2,
              "priority": -1, "ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False},
              "include_stop_str_in_output": True, "skip_special_tokens": False, "presence_penalty": 0.5,
              "frequency_penalty": -0.5, "structured_outputs": {"disable_any_whitespace": True}}

REQUESTS = [
    {"model": "m", "input": "hi", "stream": True, "store": False, "temperature": 0, "ignore_eos": True,
     "max_output_tokens": 16},
    {"model": "m", "input": "hi", "instructions": "You are terse.", "top_p": 0.5},
    {"model": "m", "input": ITEMS, "tools": TOOLS},
    {"model": "m", "input": ITEMS, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
    {"model": "m", "input": ITEMS, "tools": TOOLS, "tool_choice": {"type": "function", "name": "get_time"}},
    {"model": "m", "input": ITEMS, "tools": TOOLS, "tool_choice": "none"},
    {"model": "m", "input": "hi", "text": {"format": {"type": "json_schema", "name": "w", "schema": SCHEMA,
                                                       "strict": True}}},
    {"model": "m", "input": "hi", "text": {"format": {"type": "json_object"}}},
    {"model": "m", "input": "hi", "text": {"format": {"type": "text"}}, **EXTENSIONS},
    {"model": "m", "input": "hi", "stop": "END", "seed": None, "top_k": -1},
]


def _messages(request: ResponsesRequest) -> list[dict]:
    messages = to_messages(input_items(request))
    return ([{"role": "system", "content": request.instructions}] if request.instructions else []) + messages


def _same(built, validated) -> None:
    assert type(built) is type(validated)
    assert built == validated  # (pydantic: the same type and field values, nested models compared alike)
    assert built.model_fields_set == validated.model_fields_set
    assert built.model_dump() == validated.model_dump()
    assert built.model_dump(exclude_unset=True) == validated.model_dump(exclude_unset=True)
    assert built.model_extra == validated.model_extra


@pytest.mark.parametrize("doc", REQUESTS)
@pytest.mark.parametrize("stream", [False, True])
def test_built_chat_request_is_the_validated_one(doc, stream):
    request = parse(ResponsesRequest, doc)
    request.check()
    messages = _messages(request)
    assert protocol._trusted(chat_doc(request, messages, stream)) is not None  # built, not validated again
    built = chat_request(request, messages, stream)
    validated = parse(ChatCompletionRequest, chat_doc(request, messages, stream))
    _same(built, validated)
    for mine, theirs in zip(built.messages, validated.messages, strict=True):
        _same(mine, theirs)
        for call, their_call in zip(mine.tool_calls or [], theirs.tool_calls or [], strict=True):
            _same(call, their_call)
            _same(call.function, their_call.function)
    for tool, their_tool in zip(built.tools or [], validated.tools or [], strict=True):
        _same(tool.function, their_tool.function)
    if validated.response_format is not None:
        _same(built.response_format, validated.response_format)
    limits = OpenAILimits()
    built.check_chat(limits, auto_tools=True)
    validated.check_chat(limits, auto_tools=True)
    assert built.template_messages() == validated.template_messages()
    assert built.template_tools() == validated.template_tools()
    assert built.tool_mode == validated.tool_mode
    assert built.constraint() == validated.constraint()
    assert built.sampling(*built.max_output[:1], None) == validated.sampling(*validated.max_output[:1], None)


def test_a_conversation_of_another_shape_is_validated():
    """A stored conversation whose messages are not of to_messages' shapes (here a name, content parts) goes through
    the chat request's validation, as before, and a bad one is a 400 naming ``input``."""
    request = parse(ResponsesRequest, {"model": "m", "input": "hi"})
    odd = [{"role": "user", "name": "ann", "content": [{"type": "text", "text": "hi"}]}]
    assert protocol._trusted(chat_doc(request, odd, False)) is None
    built = chat_request(request, odd, False)
    _same(built, parse(ChatCompletionRequest, chat_doc(request, odd, False)))
    for bad in ([{"role": "robot", "content": "hi"}], ["hi"], [{"role": "assistant", "tool_calls": "x"}],
                [{"role": "assistant", "tool_calls": ["x"]}], [{"role": "user", "content": 3}]):
        assert protocol._trusted(chat_doc(request, bad, False)) is None
        with pytest.raises(OpenAIError) as caught:
            chat_request(request, bad, False)
        assert caught.value.status == 400 and caught.value.param.startswith("input"), bad


def test_passed_on_extensions_are_typed_as_chat_types_them():
    for name in protocol._PASSED_ON:
        mine, theirs = ResponsesRequest.model_fields[name], ChatCompletionRequest.model_fields[name]
        assert mine.annotation == theirs.annotation, name
        assert mine.metadata == theirs.metadata, name
        assert mine.get_default() == theirs.get_default(), name


@pytest.mark.parametrize("field,value", [("top_k", -5), ("min_p", 2), ("repetition_penalty", 0), ("seed", "x"),
                                         ("stop", 3), ("min_tokens", -1), ("priority", 2**64),
                                         ("ignore_eos", "maybe"), ("chat_template_kwargs", [1]),
                                         ("presence_penalty", 3), ("structured_outputs", "json")])
def test_a_bad_extension_names_its_field(field, value):
    with pytest.raises(OpenAIError) as caught:
        parse(ResponsesRequest, {"model": "m", "input": "hi", field: value})
    assert caught.value.status == 400 and caught.value.param == field
