"""The ``/v1/responses`` request, and how its input items become chat messages.

Field names and defaults follow OpenAI's API reference (and vLLM's ``ResponsesRequest``). ``input`` is a
string (one user message) or a list of items: messages (``role`` user / system / developer / assistant,
``content`` a string or ``input_text`` / ``output_text`` parts), ``function_call`` and
``function_call_output`` items, and ``reasoning`` items (kept in the stored conversation, not shown to
the template: chat templates drop earlier turns' reasoning). The request becomes a
:class:`~..chat_completion.protocol.ChatCompletionRequest` (:func:`chat_request`), which decides the
sampling, tools and structured output exactly as ``/v1/chat/completions`` does. The request is validated once,
here: vLLM's extensions it passes on are typed as the chat request types them, and the chat request is built from
the validated values (:func:`chat_request`) without a second validation.
"""

from __future__ import annotations

import json
from os import urandom
from typing import Any, Literal

import orjson
from pydantic import BaseModel, Field

from ..chat_completion.protocol import (
    ChatCompletionRequest,
    FunctionCall,
    FunctionDefinition,
    Message,
    NamedFunction,
    NamedToolChoice,
    Tool,
    ToolCall,
)
from ..errors import BadRequest, OpenAIError
from ..protocol import INT64_MAX, INT64_MIN, JsonSchema, OpenAIModel, ResponseFormat, parse

# vLLM's extensions passed on to the chat request as they are
_PASSED_ON = ("top_k", "min_p", "repetition_penalty", "seed", "stop", "min_tokens", "priority", "ignore_eos",
              "chat_template_kwargs", "include_stop_str_in_output", "skip_special_tokens", "presence_penalty",
              "frequency_penalty", "structured_outputs")
# chat request field -> the Responses field it came from (error messages name what the client sent)
_FIELD_NAMES = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}


def new_id(prefix: str) -> str:
    """``<prefix>_`` and 32 random hex digits (128 random bits; ``os.urandom`` rather than a UUID object, a few
    ids are made per request before its first token)."""
    return f"{prefix}_{urandom(16).hex()}"


class TextFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIModel):
    format: TextFormat | None = None
    verbosity: str | None = None


class FunctionTool(OpenAIModel):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Reasoning(OpenAIModel):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(OpenAIModel):
    model: str | None = None
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    text: TextConfig | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    reasoning: Reasoning | None = None
    store: bool = True
    stream: bool = False
    background: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = "disabled"
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    max_tool_calls: int | None = Field(None, ge=1)
    # vLLM's extensions passed on to the generation (_PASSED_ON), typed as ChatCompletionRequest types them
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    min_tokens: int = Field(0, ge=0)
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    ignore_eos: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    structured_outputs: dict[str, Any] | None = None

    def check(self) -> None:
        """What tideserve refuses (a 400 naming the field)."""
        for i, tool in enumerate(self.tools):
            if tool.type == "mcp":  # checked with the server's --mcp-allow (mcp.servers_of)
                continue
            if tool.type != "function":
                raise BadRequest(f"tools[{i}]: tool type '{tool.type}' is not supported here (only 'function' "
                                 "and 'mcp' tools)", f"tools[{i}].type")
            if not tool.name:
                raise BadRequest(f"tools[{i}]: a function tool needs a 'name'", f"tools[{i}].name")
        if self.background and not self.store:
            raise BadRequest("background can only be used when `store` is true", "background")
        if self.background and self.stream:
            raise BadRequest("background responses are not streamed by this server: poll "
                             "GET /v1/responses/{id} instead", "stream")
        if self.top_logprobs:
            raise BadRequest("top_logprobs is not supported on /v1/responses", "top_logprobs")
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema" and fmt.schema_ is None:
            raise BadRequest("text.format of type 'json_schema' needs 'schema'", "text.format.schema")

    def echo(self) -> dict[str, Any]:
        """The request's settings as the response object repeats them."""
        fmt = self.text.format if self.text is not None else None
        choice: Any = self.tool_choice
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "metadata": self.metadata or {}, "model": self.model, "parallel_tool_calls": self.parallel_tool_calls,
                "previous_response_id": self.previous_response_id,
                "reasoning": (self.reasoning.model_dump() if self.reasoning else {"effort": None, "summary": None}),
                "temperature": self.temperature if self.temperature is not None else 1.0,
                # (no format given: TextFormat()'s dump, written out: no model made per response)
                "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None
                         else {"type": "text"}},
                "tool_choice": choice, "tools": [_echoed(t) for t in self.tools],
                "top_p": self.top_p if self.top_p is not None else 1.0, "truncation": self.truncation or "disabled",
                "user": self.user, "store": self.store, "background": self.background,
                "max_tool_calls": self.max_tool_calls, "service_tier": self.service_tier or "auto",
                "top_logprobs": self.top_logprobs}

    def echo_json(self) -> bytes:
        """``orjson.dumps(self.echo())``; for a request with no tools, metadata, reasoning or text format (nearly
        every one, with instructions of at most :data:`_ECHOED_TEXT` characters) kept per distinct settings
        (:data:`_ECHOED`, at most :data:`_ECHOED_MAX`), so a stream's opening costs no echo dict."""
        if self.tools or self.metadata is not None or self.reasoning is not None or self.text is not None \
                or not isinstance(self.tool_choice, str) or len(self.instructions or "") > _ECHOED_TEXT:
            return orjson.dumps(self.echo())
        # the settings echo() reads, each field's value of one type after validation (floats stay floats)
        key = (self.model, self.instructions, self.max_output_tokens, self.parallel_tool_calls,
               self.previous_response_id, self.temperature, self.tool_choice, self.top_p, self.truncation, self.user,
               self.store, self.background, self.max_tool_calls, self.service_tier, self.top_logprobs)
        found = _ECHOED.get(key)
        if found is None:
            if len(_ECHOED) >= _ECHOED_MAX:
                _ECHOED.clear()
            found = _ECHOED[key] = orjson.dumps(self.echo())
        return found


_ECHOED: dict[tuple, bytes] = {}  # the settings of ResponsesRequest.echo_json -> their JSON
_ECHOED_MAX = 256
_ECHOED_TEXT = 4096


def _echoed(tool: FunctionTool) -> dict:
    """A tool as the response repeats it: an MCP tool's headers and authorization left out (secrets stay out of
    answers and the store)."""
    doc = tool.model_dump(exclude_none=True)
    if tool.type == "mcp":
        doc.pop("authorization", None)
        if "headers" in doc:
            doc["headers"] = None
    return doc


# -- input items --------------------------------------------------------------------------------------
def input_items(request: ResponsesRequest) -> list[dict]:
    """The request's input as items with ids (what ``GET .../input_items`` lists); a string is one user
    message. Malformed items are a 400 naming ``input[i]``."""
    given = request.input
    if isinstance(given, str):  # one user message: the item _message_item makes of it, made at once
        return [{"id": new_id("msg"), "type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": given}], "status": "completed"}]
    items = []
    for i, item in enumerate(given):
        kind = item.get("type", "message")
        if kind == "message" or ("role" in item and "type" not in item):
            items.append(_message_item(i, item))
        elif kind == "function_call":
            _need(i, item, ("call_id", "name", "arguments"))
            items.append({"id": item.get("id") or new_id("fc"), "type": "function_call", "call_id": item["call_id"],
                          "name": item["name"], "arguments": item["arguments"], "status": "completed"})
        elif kind == "function_call_output":
            _need(i, item, ("call_id",))  # (output: a string or text parts, _output_text)
            items.append({"id": item.get("id") or new_id("fco"), "type": "function_call_output",
                          "call_id": item["call_id"], "output": _output_text(i, item["output"]),
                          "status": "completed"})
        elif kind == "reasoning":
            items.append({"id": item.get("id") or new_id("rs"), "type": "reasoning",
                          "summary": item.get("summary") or [], "content": item.get("content") or []})
        elif kind in ("mcp_list_tools", "mcp_call"):  # earlier output given back (mcp_call: rendered as a call)
            if kind == "mcp_call":
                _need(i, item, ("name", "arguments"))
            items.append({**item, "id": item.get("id") or new_id("mcp" if kind == "mcp_call" else "mcpl")})
        elif kind == "mcp_approval_request":  # earlier output given back, for an approval response to answer
            _need(i, item, ("id", "server_label", "name", "arguments"))
            items.append({"id": item["id"], "type": kind, "server_label": item["server_label"], "name": item["name"],
                          "arguments": item["arguments"]})
        elif kind == "mcp_approval_response":
            _need(i, item, ("approval_request_id",))
            if not isinstance(item.get("approve"), bool):
                raise BadRequest(f"input[{i}]: 'approve' must be true or false", f"input[{i}].approve")
            reason = item.get("reason")
            if reason is not None and not isinstance(reason, str):
                raise BadRequest(f"input[{i}]: 'reason' must be a string", f"input[{i}].reason")
            items.append({"id": item.get("id") or new_id("mcpa"), "type": kind,
                          "approval_request_id": item["approval_request_id"], "approve": item["approve"],
                          "reason": reason})
        elif kind == "item_reference":
            raise BadRequest(f"input[{i}]: item references are not supported here; send the item itself",
                             f"input[{i}].type")
        else:
            raise BadRequest(f"input[{i}]: item type '{kind}' is not supported here (message, function_call, "
                             "function_call_output, reasoning, mcp_list_tools, mcp_call, mcp_approval_request, "
                             "mcp_approval_response)", f"input[{i}].type")
    return items


def _need(i: int, item: dict, keys: tuple[str, ...]) -> None:
    for key in keys:
        if not isinstance(item.get(key), str):
            raise BadRequest(f"input[{i}]: '{key}' must be a string", f"input[{i}].{key}")


def _output_text(i: int, output: Any) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in output):
        return "".join(p["text"] for p in output)
    raise BadRequest(f"input[{i}]: 'output' must be a string or text parts", f"input[{i}].output")


def _message_item(i: int, item: dict) -> dict:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise BadRequest(f"input[{i}]: role must be one of user, system, developer, assistant, got {role!r}",
                         f"input[{i}].role")
    content = item.get("content")
    if isinstance(content, str):
        parts = [{"type": "output_text" if role == "assistant" else "input_text", "text": content}]
    elif isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                    or not isinstance(part.get("text"), str):
                shown = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(f"input[{i}].content[{j}]: only text parts are supported, got '{shown}'",
                                 f"input[{i}].content")
            parts.append({"type": part["type"], "text": part["text"]})
    else:
        raise BadRequest(f"input[{i}]: 'content' must be a string or a list of parts", f"input[{i}].content")
    out = {"id": item.get("id") or new_id("msg"), "type": "message", "role": role, "content": parts}
    out["status"] = item.get("status") or "completed"
    return out


def to_messages(items: list[dict], approval_requests: dict[str, dict] | None = None) -> list[dict]:
    """Chat messages of input or output items (consecutive function calls join one assistant message, text
    before them its content; the results of consecutive MCP calls follow their calls). An MCP approval request
    is not rendered (its call, once approved and run, is an ``mcp_call`` item); a declined one
    (``mcp_approval_response`` with ``approve`` false, its request in ``approval_requests``) is, as the call
    with a result that says so."""
    messages: list[dict] = []
    results: list[dict] = []  # tool messages of the MCP calls just before
    for item in items:
        kind = item["type"]
        if kind == "mcp_approval_response" and not item["approve"]:
            request = (approval_requests or {}).get(item["approval_request_id"])
            if request is None:
                continue
            reason = item.get("reason")
            item = {**request, "type": "mcp_call", "status": "failed",
                    "error": "the user did not approve this call" + (f": {reason}" if reason else "")}
            kind = "mcp_call"
        if kind != "mcp_call" and results:
            messages += results
            results = []
        if kind == "message":
            text = "".join(p.get("text", "") for p in item["content"])
            messages.append({"role": item["role"], "content": text})
        elif kind == "function_call":
            _add_call(messages, {"id": item["call_id"], "type": "function",
                                 "function": {"name": item["name"], "arguments": item["arguments"]}})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        elif kind == "mcp_call" and item.get("status") in (None, "completed", "failed"):
            # a call the server ran: the model's call (the item's id as its call id), then its result
            _add_call(messages, {"id": item["id"], "type": "function",
                                 "function": {"name": item["name"], "arguments": item["arguments"]}})
            error = item.get("error")
            text = item.get("output") if not error else _error_text(error)
            results.append({"role": "tool", "tool_call_id": item["id"], "content": text or ""})
    return messages + results


def _add_call(messages: list[dict], call: dict) -> None:
    """``call`` on the assistant message just before, or on a new one."""
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and "tool_call_id" not in last:
        last.setdefault("tool_calls", []).append(call)
        if last.get("content") == "":
            last["content"] = None
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _error_text(error: Any) -> str:
    """What the model reads of a failed MCP call (``error`` in OpenAI's shape, or a string)."""
    if not isinstance(error, dict):
        return f"Error: {error}"
    if error.get("type") == "mcp_tool_execution_error":
        blocks = error.get("content") or []
        if isinstance(blocks, list):
            return "Error: " + "\n".join(b.get("text", "") if isinstance(b, dict) else str(b) for b in blocks)
        return f"Error: {blocks}"
    return f"Error: {error.get('message', '')}"


# -- the chat request ---------------------------------------------------------------------------------------
def chat_request(request: ResponsesRequest, messages: list[dict], stream: bool) -> ChatCompletionRequest:
    """The chat completions request that generates this response, built from the validated request's values
    (:func:`_built`) without validating them again; a message of another shape than :func:`to_messages` writes (a
    stored conversation from elsewhere) sends the whole request through the chat request's validation instead."""
    chat = chat_doc(request, messages, stream)
    built = _trusted(chat)
    if built is not None:
        return built
    try:
        return parse(ChatCompletionRequest, chat)
    except OpenAIError as exc:
        raise renamed(exc) from None


def chat_doc(request: ResponsesRequest, messages: list[dict], stream: bool) -> dict[str, Any]:
    """The chat completions request of :func:`chat_request` as its JSON object."""
    chat: dict[str, Any] = {"model": request.model, "messages": messages, "stream": stream}
    if request.max_output_tokens is not None:
        chat["max_completion_tokens"] = request.max_output_tokens
    if request.temperature is not None:
        chat["temperature"] = request.temperature
    if request.top_p is not None:
        chat["top_p"] = request.top_p
    given = request.model_fields_set
    for name in _PASSED_ON:
        if name in given:
            chat[name] = getattr(request, name)
    fmt = request.text.format if request.text is not None else None
    if fmt is not None and fmt.type != "text":
        chat["response_format"] = {"type": fmt.type} if fmt.type == "json_object" else {
            "type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}
    if request.tools:
        chat["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.parameters, "strict": t.strict}}
                         for t in request.tools]
        chat["tool_choice"] = _tool_choice(request.tool_choice)
        chat["parallel_tool_calls"] = request.parallel_tool_calls
    elif request.tool_choice not in ("auto", "none"):
        raise BadRequest("When using `tool_choice`, `tools` must be set.", "tool_choice")
    return chat


_DEFAULTS: dict[type, tuple[dict[str, Any], dict | None]] = {}  # model class -> its defaults, extra (for _built)
_IMMUTABLE = (type(None), bool, int, float, str)
_set = object.__setattr__


def _built(cls: type[BaseModel], values: dict[str, Any]) -> BaseModel:
    """An instance of ``cls`` holding ``values``, which are valid for it (checked by the Responses request's own
    validation, or made here): what ``cls.model_validate`` makes of them, without validating them again
    (``model_construct`` would skip it too, but costs more than the validation). Unset fields take their defaults,
    and ``values``' keys are the fields set, as validation leaves them."""
    known = _DEFAULTS.get(cls)
    if known is None:
        defaults = {}
        for name, info in cls.model_fields.items():
            if not info.is_required():
                default = info.get_default(call_default_factory=True)
                if not isinstance(default, _IMMUTABLE):
                    raise TypeError(f"{cls.__name__}.{name}: a mutable default, which _built would share")
                defaults[name] = default
        known = _DEFAULTS[cls] = (defaults, {} if cls.model_config.get("extra") == "allow" else None)
    defaults, extra = known
    made = cls.__new__(cls)
    _set(made, "__dict__", {**defaults, **values})
    _set(made, "__pydantic_fields_set__", set(values))
    _set(made, "__pydantic_extra__", None if extra is None else {})
    _set(made, "__pydantic_private__", None)
    return made


_MESSAGE_KEYS = frozenset({"role", "content", "tool_calls", "tool_call_id"})
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def _trusted(chat: dict[str, Any]) -> ChatCompletionRequest | None:
    """``chat`` (:func:`chat_doc`) as the chat request, its parts built (:func:`_built`); None when a message is
    not of a shape :func:`to_messages` writes, or a tool has no name (validation then answers)."""
    messages = []
    for message in chat["messages"]:
        if type(message) is not dict or not message.keys() <= _MESSAGE_KEYS or message.get("role") not in _ROLES:
            return None
        content = message.get("content")
        if content is not None and type(content) is not str:
            return None
        if "tool_call_id" in message and type(message["tool_call_id"]) is not str:
            return None
        values = message
        if "tool_calls" in message:
            if type(message["tool_calls"]) is not list:
                return None
            calls = []
            for call in message["tool_calls"]:
                function = call.get("function") if type(call) is dict else None
                if function is None or call.keys() != {"id", "type", "function"} or type(call["id"]) is not str or call["type"] != \
                        "function" or type(function) is not dict or function.keys() != {"name", "arguments"} or \
                        type(function["name"]) is not str or type(function["arguments"]) is not str:
                    return None
                calls.append(_built(ToolCall, {"id": call["id"], "type": "function",
                                               "function": _built(FunctionCall, function)}))
            values = {**message, "tool_calls": calls}
        messages.append(_built(Message, values))
    if not messages:
        return None
    values = dict(chat)
    values["messages"] = messages
    if "tools" in chat:
        if any(type(t["function"]["name"]) is not str for t in chat["tools"]):
            return None
        values["tools"] = [_built(Tool, {"type": "function", "function": _built(FunctionDefinition, t["function"])})
                           for t in chat["tools"]]
        choice = chat["tool_choice"]
        if isinstance(choice, dict):
            values["tool_choice"] = _built(NamedToolChoice, {"type": "function", "function": _built(
                NamedFunction, {"name": choice["function"]["name"]})})
    fmt = chat.get("response_format")
    if fmt is not None:
        schema = fmt.get("json_schema")
        values["response_format"] = _built(ResponseFormat, {"type": fmt["type"]} if schema is None else {
            "type": fmt["type"], "json_schema": _built(JsonSchema, {"name": schema["name"], "json_schema": schema["schema"],
                                                                    "strict": schema["strict"]})})
    return _built(ChatCompletionRequest, values)


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if choice.get("type") in ("none", "auto", "required"):
        return choice["type"]
    raise BadRequest(f"tool_choice {json.dumps(choice)[:120]} is not supported here (none, auto, required, or "
                     "{'type': 'function', 'name': ...})", "tool_choice")


def renamed(exc: OpenAIError) -> OpenAIError:
    """``exc`` with the chat request's field names replaced by the Responses fields they came from."""
    param = exc.param
    if param:
        for chat_name, name in _FIELD_NAMES.items():
            if param == chat_name or param.startswith((chat_name + "[", chat_name + ".")):
                exc.message = exc.message.replace(chat_name, name)
                exc.param = name + param[len(chat_name):] if chat_name != "messages" else "input"
                break
    return exc
