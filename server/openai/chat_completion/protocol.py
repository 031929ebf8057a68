"""The chat completions request: messages, tools, and how they become a prompt and a constraint.

Messages are checked here (roles, content of text parts) and turned into the plain dicts a chat
template reads (content parts joined into one string, ``developer`` read as ``system``, tool-call
arguments parsed from JSON). Tools: ``tool_choice`` ``none`` renders them for the model and never
parses a call; a named function or ``required`` constrains the output with structured output (a JSON
object of the function's parameters, or a JSON array of ``{"name", "parameters"}`` calls); ``auto`` (the
default when tools are given) parses calls out of the output with the model's tool-call parser, and is a
400 for a model without one, as vLLM answers without ``--tool-call-parser``.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from ..errors import BadRequest
from ..limits import OpenAILimits
from ..protocol import OpenAIModel, SamplingRequest


class ContentPart(OpenAIModel):
    type: str
    text: str | None = None


class FunctionCall(OpenAIModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(OpenAIModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(OpenAIModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0)  # at most OpenAILimits.max_logprobs
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True  # with a reasoning parser: send the reasoning (else only the answer)
    echo: bool = False  # the answer starts with the final message when it is the assistant's (see echo_prefix)
    prompt_logprobs: int | None = Field(None, ge=0)  # the rendered prompt's log probabilities, vLLM's shape

    @property
    def max_output(self) -> tuple[int | None, str]:
        """The token limit and the field it came from (``max_completion_tokens`` wins)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    @property
    def tool_mode(self) -> str:
        """``none``, ``auto``, ``named`` or ``required``."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if self.tool_choice is None:
            return "auto"
        return "named" if isinstance(self.tool_choice, NamedToolChoice) else str(self.tool_choice)

    def check_chat(self, limits: OpenAILimits, auto_tools: bool = False) -> None:
        """Cross-field checks; ``auto_tools``: the model has a tool-call parser."""
        self.check(*self.max_output, limits)
        if self.top_logprobs is not None:
            limits.check_logprobs(self.top_logprobs, "top_logprobs")
        if self.prompt_logprobs is not None:  # the limits are read only where a check may fail
            limits.check_logprobs(self.prompt_logprobs, "prompt_logprobs")
        if self.top_logprobs is not None and not self.logprobs:  # OpenAI's rule: 0 too
            raise BadRequest("when using `top_logprobs`, `logprobs` must be set to true", "top_logprobs")
        if self.add_generation_prompt and self.continue_final_message:
            raise BadRequest("'add_generation_prompt' and 'continue_final_message' cannot both be true",
                             "continue_final_message")
        for i, message in enumerate(self.messages):
            _check_message(i, message)
        self._check_tools(auto_tools)

    def _check_tools(self, auto_tools: bool) -> None:
        if self.tools == []:
            raise BadRequest("`tools` must not be an empty array", "tools")
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise BadRequest("When using `tool_choice`, `tools` must be set.", "tool_choice")
        if not self.tools or choice == "none":
            return
        if choice is None or choice == "auto":
            if not auto_tools:
                raise BadRequest('"auto" tool choice requires --tool-call-parser to be set (or the model config '
                                 "parameter 'tool_call_parser'); tool_choice 'none', 'required' or a named "
                                 "function work without one", "tool_choice")
            return  # response_format may constrain the output as well, as vLLM allows
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise BadRequest(f"tool_choice names function '{choice.function.name}', which is not in `tools`",
                             "tool_choice")
        if self.response_format is not None and self.response_format.type != "text":
            raise BadRequest("You can only either use constraints for structured outputs or tools, not both.",
                             "response_format")

    def constraint(self) -> dict | None:
        """The structured output the request asks for (the tool calls, or response_format), or None."""
        mode = self.tool_mode
        if mode == "named":
            name = self.tool_choice.function.name
            function = next(t.function for t in self.tools if t.function.name == name)
            return self.structured({"json": function.parameters or {"type": "object"}})
        if mode == "required":
            return self.structured({"json": {"type": "array", "minItems": 1, "items": {"anyOf": [
                {"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                  "parameters": t.function.parameters or {"type": "object"}},
                 "required": ["name", "parameters"]} for t in self.tools]}}})
        return super().constraint()

    def echo_prefix(self, role: str) -> str:
        """What ``echo`` puts before each choice's content, as vLLM: the final message's text when that message
        is of the answer's ``role`` (the answer continues it, e.g. ``continue_final_message``), else ""."""
        last = self.messages[-1]
        if not self.echo or last.role != role:
            return ""
        return _template_message(last)["content"]

    def template_messages(self) -> list[dict[str, Any]]:
        return [_template_message(m) for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


_NEEDS_CONTENT = ("system", "developer", "user", "tool", "function")


def _check_message(i: int, message: Message) -> None:
    content = message.content
    if content is None:
        if message.role in _NEEDS_CONTENT or not message.tool_calls:
            raise BadRequest(f"messages[{i}] (role '{message.role}') has no content", f"messages[{i}].content")
        return
    if isinstance(content, list):
        for j, part in enumerate(content):
            if part.type not in ("text", "input_text") or part.text is None:
                raise BadRequest(f"messages[{i}].content[{j}]: only text content parts are supported, got type "
                                 f"'{part.type}'", f"messages[{i}].content")


def _template_message(message: Message) -> dict[str, Any]:
    content = message.content
    if isinstance(content, list):
        content = "\n".join(part.text for part in content)
    out: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                           "content": content if content is not None else ""}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [{"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)}}
                             for call in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _arguments(arguments: str | dict) -> Any:
    """Templates read arguments as a mapping; a string that is no JSON object is passed on as it is."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    return parsed if isinstance(parsed, dict) else arguments
