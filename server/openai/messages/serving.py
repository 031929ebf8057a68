"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Anthropic's Messages API).

A request becomes one chat generation (:mod:`..chat_run`): the same chat template, limits, structured
output, tool-call and reasoning parsers as ``/v1/chat/completions``. The answer's content blocks are, in
order, ``thinking`` (the reasoning parser's text), ``text`` and one ``tool_use`` per call; ``stop_reason``
is ``tool_use`` when there are calls, ``max_tokens`` when the limit cut the output, else ``end_turn``.
Streaming sends Anthropic's events: ``message_start``, per block ``content_block_start``,
``content_block_delta`` (``thinking_delta``, ``text_delta``, ``input_json_delta``) and
``content_block_stop``, then ``message_delta`` (``stop_reason``, output tokens) and ``message_stop``.
"""

from __future__ import annotations

import json
import uuid

import orjson

from ..chat_run import ChatRun, render, start
from ..errors import BadRequest, OpenAIError
from ..http import EventStream, request_received_ns, request_timeout_us
from .http import sse
from .protocol import CountTokensRequest, MessagesRequest, chat_request, parse_request, renamed


def _stop_reason(reason: str | None, called: bool) -> str:
    if called:
        return "tool_use"
    return "max_tokens" if reason == "length" else "end_turn"


def _input(arguments: str) -> dict:
    try:
        parsed = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _usage(counts: dict, output_tokens: int | None = None) -> dict:
    cached = (counts.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": counts["prompt_tokens"], "output_tokens": counts["completion_tokens"]
            if output_tokens is None else output_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached}


async def create_message(server, doc, scope) -> bytes | EventStream:
    timeout_us = request_timeout_us(scope)  # x-request-timeout-ms: refused (503) if not generating by then
    request: MessagesRequest = parse_request(MessagesRequest, doc)
    llm = server.catalog.get(request.model)
    chat = chat_request(request, doc, request.stream)
    message_id = f"msg_{uuid.uuid4().hex}"
    try:
        run = await start(server, chat, llm, stream=request.stream, request_id=message_id,
                          max_tokens_field="max_tokens", timeout_us=timeout_us, received_ns=request_received_ns(scope) if timeout_us else 0)
    except OpenAIError as exc:
        raise renamed(exc) from None
    head = {"id": message_id, "type": "message", "role": "assistant", "model": llm.name}
    if request.stream:
        return EventStream(_events(run, head), run.close)
    try:
        message, reason, usage = await run.whole()
    except OpenAIError as exc:
        raise renamed(exc) from None
    blocks = []
    if message.get("reasoning"):
        blocks.append({"type": "thinking", "thinking": message["reasoning"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    calls = message.get("tool_calls") or []
    for call in calls:
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": _input(call["function"]["arguments"])})
    return orjson.dumps({**head, "content": blocks, "stop_reason": _stop_reason(reason, bool(calls)),
                         "stop_sequence": None, "usage": _usage(usage.doc())})


async def _events(run: ChatRun, head: dict):
    usage = run.usage()
    counts = usage.doc()
    yield sse("message_start", {"type": "message_start", "message": {
        **head, "content": [], "stop_reason": None, "stop_sequence": None, "usage": _usage(counts, 0)}})
    blocks = _Blocks()
    reason = None
    async for delta, reason in run.deltas(usage):
        for kind, doc in blocks.feed(delta):
            yield sse(kind, doc)
    for kind, doc in blocks.close():
        yield sse(kind, doc)
    counts = usage.doc()
    yield sse("message_delta", {"type": "message_delta",
                                "delta": {"stop_reason": _stop_reason(reason, blocks.called), "stop_sequence": None},
                                "usage": {"output_tokens": counts["completion_tokens"]}})
    yield sse("message_stop", {"type": "message_stop"})


class _Blocks:
    """Chat deltas in, content block events out."""

    __slots__ = ("_calls", "_kind", "called", "index")

    def __init__(self) -> None:
        self.index = -1  # the open block's index
        self._kind: str | None = None
        self._calls: dict[int, int] = {}  # chat tool-call index -> block index
        self.called = False

    def feed(self, delta: dict) -> list[tuple[str, dict]]:
        events: list[tuple[str, dict]] = []
        if delta.get("reasoning"):
            self._open(events, "thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning"]}))
        if delta.get("content"):
            self._open(events, "text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for entry in delta.get("tool_calls") or []:
            function = entry.get("function") or {}
            if entry.get("id") or entry.get("index", 0) not in self._calls:
                self._open(events, "tool_use", {"type": "tool_use", "id": entry.get("id") or f"toolu_{uuid.uuid4().hex}",
                                                "name": function.get("name") or "", "input": {}}, force=True)
                self._calls[entry.get("index", 0)] = self.index
                self.called = True
            if function.get("arguments"):
                events.append(self._delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
        return events

    def close(self) -> list[tuple[str, dict]]:
        events: list[tuple[str, dict]] = []
        if self._kind is not None:
            events.append(("content_block_stop", {"type": "content_block_stop", "index": self.index}))
            self._kind = None
        return events

    def _open(self, events: list, kind: str, block: dict, force: bool = False) -> None:
        if self._kind == kind and not force:
            return
        events.extend(self.close())
        self.index += 1
        self._kind = kind
        events.append(("content_block_start", {"type": "content_block_start", "index": self.index,
                                               "content_block": block}))

    def _delta(self, delta: dict) -> tuple[str, dict]:
        return "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}


async def count_tokens(server, doc, _scope) -> bytes:
    request: CountTokensRequest = parse_request(CountTokensRequest, doc)
    llm = server.catalog.get(request.model)
    if llm.tokenizer() is None:
        raise BadRequest(f"model '{llm.name}' has no tokenizer files (tokenizer.json) to count tokens with", "model")
    chat = chat_request(request, doc)
    prompt = await render(server, chat, llm)
    count = await server.run_blocking(llm.count_tokens, prompt)
    return orjson.dumps({"input_tokens": count})
