"""A choice's output text as the assistant's answer: reasoning, content and tool calls.

The model's reasoning parser (if any) splits the reasoning off first; what follows is read by the request's
tool mode: ``none`` content; ``named`` the arguments of the named function; ``required`` a JSON array of
``{"name", "parameters"}`` calls; ``auto`` the model's tool-call parser (:mod:`tideserve.tool_parsers`).
Reasoning goes out as ``reasoning`` and, under its older name, ``reasoning_content`` (both as vLLM has
sent them), unless the request sets ``include_reasoning`` false.
"""

from __future__ import annotations

import json
import uuid

from ...reasoning_parsers import ReasoningStream, reasoning_parser
from ...tool_parsers import ToolCallStream, tool_parser
from ..llm import LLMModel
from .protocol import ChatCompletionRequest

ROLE = "assistant"


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _calls(calls: list) -> list[dict]:
    return [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            for call_id, name, arguments in calls]


def _required_calls(text: str) -> list[dict] | None:
    """The calls of a ``required`` tool choice's JSON array (None when the text is not one)."""
    try:
        calls = json.loads(text)
    except ValueError:
        return None
    if not isinstance(calls, list) or not all(isinstance(c, dict) and "name" in c for c in calls):
        return None
    return _calls([(tool_call_id(), c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False))
                   for c in calls])


def message(request: ChatCompletionRequest, llm: LLMModel, text: str, reason: str | None) -> tuple[dict, str]:
    """The message of a whole output and its finish reason."""
    reason = reason or "stop"
    reasoning, content = None, text
    if llm.reasoning_parser:
        reasoning, content = reasoning_parser(llm.reasoning_parser, request.chat_template_kwargs).split(text)
    out: dict = {"role": ROLE, "content": content}
    mode = request.tool_mode
    if mode == "named":
        out = {"role": ROLE, "content": None, "tool_calls": _calls([(tool_call_id(), request.tool_choice.function.name,
                                                                    content or "")])}
    elif mode == "required":
        calls = _required_calls(content or "")
        if calls is not None:
            out = {"role": ROLE, "content": None, "tool_calls": calls}
            reason = "tool_calls" if reason == "stop" else reason
    elif mode == "auto":
        parser = tool_parser(llm.tool_call_parser)
        found, calls = parser.extract(content or "")
        if calls:
            out = {"role": ROLE, "content": found, "tool_calls": _calls([(parser.call_id(), c.name, c.arguments)
                                                                         for c in calls])}
            reason = "tool_calls"
    if llm.reasoning_parser:
        shown = reasoning if request.include_reasoning else None
        out["reasoning"] = out["reasoning_content"] = shown
    return out, reason


def merge(delta: dict, more: dict) -> dict:
    """Two deltas as one (texts joined, tool-call entries listed in order)."""
    for key, value in more.items():
        delta[key] = delta[key] + value if key in delta else value
    return delta


class ChoiceStream:
    """One streamed choice: text deltas in, ``delta`` objects out."""

    __slots__ = ("_buffer", "_named", "_reasoning", "_started", "_tools", "include_reasoning", "mode")

    def __init__(self, request: ChatCompletionRequest, llm: LLMModel) -> None:
        self.mode = request.tool_mode
        self.include_reasoning = request.include_reasoning
        self._reasoning = (ReasoningStream(reasoning_parser(llm.reasoning_parser, request.chat_template_kwargs))
                           if llm.reasoning_parser else None)
        self._tools = ToolCallStream(tool_parser(llm.tool_call_parser)) if self.mode == "auto" else None
        self._named = request.tool_choice.function.name if self.mode == "named" else None
        self._started = False        # a named call's first entry carries its id and name
        self._buffer: list[str] = []  # required calls are parsed whole at the end

    @property
    def plain(self) -> bool:
        """Text goes out as it comes, as ``content`` (no tool mode, no reasoning parser)."""
        return self.mode == "none" and self._reasoning is None

    def feed(self, text: str) -> dict:
        if self._reasoning is None:
            return self._answer(text)
        reasoning, answer = self._reasoning.feed(text)
        return merge(self._thought(reasoning), self._answer(answer) if answer else {})

    def finish(self, reason: str | None) -> tuple[dict, str]:
        """The last delta (what was held back) and the finish reason."""
        reason = reason or "stop"
        delta = self._thought(self._reasoning.finish()[0]) if self._reasoning is not None else {}
        if self.mode == "auto":
            content, entries = self._tools.finish()
            merge(delta, self._auto(content, entries))
            if self._tools.called:
                reason = "tool_calls"
        elif self.mode == "required":
            text = "".join(self._buffer)
            calls = _required_calls(text)
            if calls is not None:
                merge(delta, {"tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]})
                reason = "tool_calls" if reason == "stop" else reason
            elif text:
                merge(delta, {"content": text})
        elif self.mode == "named" and not self._started:
            merge(delta, self._answer(""))
        return delta, reason

    def _thought(self, text: str) -> dict:
        return {"reasoning": text, "reasoning_content": text} if text and self.include_reasoning else {}

    def _answer(self, text: str) -> dict:
        mode = self.mode
        if mode == "none":
            return {"content": text} if text else {}
        if mode == "auto":
            return self._auto(*self._tools.feed(text))
        if mode == "required":
            self._buffer.append(text)
            return {}
        if not self._started:
            self._started = True
            return {"tool_calls": [{"index": 0, "id": tool_call_id(), "type": "function",
                                    "function": {"name": self._named, "arguments": text}}]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}

    @staticmethod
    def _auto(content: str, entries: list[dict]) -> dict:
        delta: dict = {"content": content} if content else {}
        if entries:
            delta["tool_calls"] = entries
        return delta
