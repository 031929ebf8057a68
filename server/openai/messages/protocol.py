"""The ``/v1/messages`` request (Anthropic's Messages API), and how it becomes a chat request.

Field names follow Anthropic's API reference (and vLLM's ``AnthropicMessagesRequest``). ``system`` (a
string or text blocks) is the system message; user and assistant ``content`` is a string or blocks:
``text``, ``tool_use`` (an assistant's call: a chat ``tool_calls`` entry, ``input`` as its JSON arguments),
``tool_result`` (a user block: a ``tool`` message for ``tool_use_id``), ``thinking`` / ``redacted_thinking``
(earlier reasoning: dropped, as chat templates drop it). ``tool_choice`` ``auto`` / ``any`` / ``tool`` /
``none`` are chat's ``auto`` / ``required`` / a named function / ``none``.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from ..chat_completion.protocol import ChatCompletionRequest
from ..errors import BadRequest, OpenAIError
from ..protocol import OpenAIModel, parse

_PASSED_ON = ("min_p", "repetition_penalty", "seed", "min_tokens", "priority", "chat_template_kwargs",
              "presence_penalty", "frequency_penalty")
_FIELD_NAMES = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "messages": "messages"}


class Message(OpenAIModel):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class Tool(OpenAIModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    type: str | None = None


class ToolChoice(OpenAIModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(OpenAIModel):
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    service_tier: str | None = None


class CountTokensRequest(OpenAIModel):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None


def _text_of(blocks: Any, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    texts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise BadRequest(f"{where}.{j}: only text blocks are supported here, got '{kind}'")
        texts.append(block["text"])
    return "\n".join(texts)


def to_messages(request: MessagesRequest | CountTokensRequest) -> list[dict]:
    """The chat messages of the request (system first)."""
    out: list[dict] = []
    if request.system:
        out.append({"role": "system", "content": _text_of(request.system, "system")})
    for i, message in enumerate(request.messages):
        where = f"messages.{i}.content"
        content = message.content
        if isinstance(content, str):
            out.append({"role": message.role, "content": content})
            continue
        texts: list[str] = []
        calls: list[dict] = []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and message.role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise BadRequest(f"{where}.{j}: a tool_use block needs 'id' and 'name'")
                calls.append({"id": block["id"], "type": "function",
                              "function": {"name": block["name"],
                                           "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
            elif kind == "tool_result" and message.role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise BadRequest(f"{where}.{j}: a tool_result block needs 'tool_use_id'")
                result = block.get("content", "")
                text = _text_of(result, f"{where}.{j}.content") if result else ""
                if block.get("is_error"):
                    text = f"Error: {text}"
                out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
            elif kind in ("thinking", "redacted_thinking") and message.role == "assistant":
                continue
            else:
                raise BadRequest(f"{where}.{j}: block type '{kind}' is not supported here in a {message.role} "
                                 "message (text, tool_use, tool_result, thinking)")
        if texts or calls:
            entry: dict = {"role": message.role, "content": "\n".join(texts) if texts else None}
            if calls:
                entry["tool_calls"] = calls
            elif entry["content"] is None:
                entry["content"] = ""
            out.append(entry)
    return out


def chat_request(request: MessagesRequest | CountTokensRequest, doc: dict, stream: bool = False) -> ChatCompletionRequest:
    chat: dict[str, Any] = {"model": request.model, "messages": to_messages(request), "stream": stream}
    if isinstance(request, MessagesRequest):
        chat["max_completion_tokens"] = request.max_tokens
        for name in ("temperature", "top_p", "top_k"):
            if getattr(request, name) is not None:
                chat[name] = getattr(request, name)
        if request.stop_sequences:
            chat["stop"] = request.stop_sequences
        for name in _PASSED_ON:
            if name in doc:
                chat[name] = doc[name]
    for i, tool in enumerate(request.tools or []):
        if tool.type not in (None, "custom"):
            raise BadRequest(f"tools.{i}: tool type '{tool.type}' is not supported here (server tools are not run by "
                             "this server; give client tools as name, description, input_schema)")
    if request.tools:
        chat["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema}} for t in request.tools]
        choice = request.tool_choice
        if choice is not None:
            if choice.type == "tool":
                if not choice.name:
                    raise BadRequest("tool_choice of type 'tool' needs 'name'")
                chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            else:
                chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
            if choice.disable_parallel_tool_use:
                chat["parallel_tool_calls"] = False
    try:
        return parse(ChatCompletionRequest, chat)
    except OpenAIError as exc:
        raise renamed(exc) from None


def renamed(exc: OpenAIError) -> OpenAIError:
    param = exc.param
    if param:
        for chat_name, name in _FIELD_NAMES.items():
            if param == chat_name or param.startswith(chat_name + "[") or param.startswith(chat_name + "."):
                exc.message = exc.message.replace(chat_name, name)
                exc.param = name
                break
    return exc


def parse_request(model: type, doc: Any):
    return parse(model, doc)
