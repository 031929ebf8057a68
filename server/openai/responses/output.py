"""The assistant's answer as Responses output items, whole or as the streamed event sequence.

A chat message (:func:`..chat_completion.output.message`) becomes, in order, a ``reasoning`` item (the
reasoning parser's text as ``reasoning_text`` content), a ``message`` item (``output_text``) and one
``function_call`` item per tool call. While streaming, :class:`OutputStream` turns the chat deltas into
OpenAI's events: ``response.output_item.added``, ``response.content_part.added``,
``response.reasoning_text.delta`` / ``response.output_text.delta`` / ``response.function_call_arguments.delta``,
then the matching ``.done`` events and ``response.output_item.done``; the items it finishes are built by
the same functions as the whole answer's, so the streamed events rebuild the non-streamed response.
"""

from __future__ import annotations

from .protocol import new_id


def reasoning_item(item_id: str, text: str, status: str | None = None) -> dict:
    content = [{"type": "reasoning_text", "text": text}] if text or status is None else []
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "encrypted_content": None,
            "status": status}


def message_item(item_id: str, text: str | None, status: str) -> dict:
    content = [text_part(text)] if text is not None else []
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}


def usage_doc(run, usage, reasoning: str | None) -> dict:
    """The ``usage`` of one generation (``run``, a ChatRun; ``usage``, its counts)."""
    counts = usage.doc()
    cached = (counts.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": counts["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": counts["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": run.llm.count_tokens(reasoning) if reasoning else 0},
            "total_tokens": counts["total_tokens"]}


def items_of(message: dict, reason: str) -> list[dict]:
    """The output items of a whole chat message."""
    status = "incomplete" if reason == "length" else "completed"
    items = []
    if message.get("reasoning"):
        items.append(reasoning_item(new_id("rs"), message["reasoning"]))
    if message.get("content"):
        items.append(message_item(new_id("msg"), message["content"], status))
    for call in message.get("tool_calls") or []:
        function = call["function"]
        items.append(call_item(new_id("fc"), call["id"], function["name"], function["arguments"], "completed"))
    return items


class OutputStream:
    """Chat deltas in, Responses events out (without ``sequence_number``; the writer numbers them)."""

    __slots__ = ("_calls", "_open", "items")

    def __init__(self) -> None:
        self.items: list[dict] = []  # finished items, in output order
        self._open: dict | None = None  # {"kind", "id", "index", "text", and for calls "call_id", "name"}
        self._calls: dict[int, dict] = {}  # chat tool-call index -> its open state

    def feed(self, delta: dict) -> list[dict]:
        events: list[dict] = []
        if delta.get("reasoning"):
            self._text(events, "reasoning", delta["reasoning"])
        if delta.get("content"):
            self._text(events, "message", delta["content"])
        for entry in delta.get("tool_calls") or []:
            self._call(events, entry)
        return events

    def finish(self, reason: str | None) -> list[dict]:
        events: list[dict] = []
        self._close(events, "incomplete" if reason == "length" else "completed")
        return events

    # -- items ---------------------------------------------------------------------------------------
    def _text(self, events: list[dict], kind: str, text: str) -> None:
        current = self._open
        if current is None or current["kind"] != kind:
            self._close(events, "completed")
            current = self._start(events, kind)
        current["text"] += text
        delta_type = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        event = {"type": delta_type, "item_id": current["id"], "output_index": current["index"], "content_index": 0,
                 "delta": text}
        if kind == "message":
            event["logprobs"] = []
        events.append(event)

    def _start(self, events: list[dict], kind: str) -> dict:
        index = len(self.items)
        if kind == "reasoning":
            state = {"kind": kind, "id": new_id("rs"), "index": index, "text": ""}
            item, part = reasoning_item(state["id"], "", "in_progress"), {"type": "reasoning_text", "text": ""}
        else:
            state = {"kind": kind, "id": new_id("msg"), "index": index, "text": ""}
            item, part = message_item(state["id"], None, "in_progress"), text_part("")
        events.append({"type": "response.output_item.added", "output_index": index, "item": item})
        events.append({"type": "response.content_part.added", "item_id": state["id"], "output_index": index,
                       "content_index": 0, "part": part})
        self._open = state
        return state

    def _call(self, events: list[dict], entry: dict) -> None:
        function = entry.get("function") or {}
        state = self._calls.get(entry.get("index", 0))
        if state is None or entry.get("id"):
            self._close(events, "completed")
            index = len(self.items)
            state = {"kind": "call", "id": new_id("fc"), "index": index, "text": "", "call_id": entry.get("id"),
                     "name": function.get("name") or ""}
            self._calls[entry.get("index", 0)] = state
            self._open = state
            events.append({"type": "response.output_item.added", "output_index": index,
                           "item": call_item(state["id"], state["call_id"], state["name"], "", "in_progress")})
        elif self._open is not state:  # a later piece of a call after other output: not written by our parsers
            self._close(events, "completed")
            self._open = state
        arguments = function.get("arguments") or ""
        if arguments:
            state["text"] += arguments
            events.append({"type": "response.function_call_arguments.delta", "item_id": state["id"],
                           "output_index": state["index"], "delta": arguments})

    def _close(self, events: list[dict], status: str) -> None:
        state, self._open = self._open, None
        if state is None:
            return
        item_id, index, text = state["id"], state["index"], state["text"]
        kind = state["kind"]
        if kind == "reasoning":
            item = reasoning_item(item_id, text)
            events.append({"type": "response.reasoning_text.done", "item_id": item_id, "output_index": index,
                           "content_index": 0, "text": text})
            events.append({"type": "response.content_part.done", "item_id": item_id, "output_index": index,
                           "content_index": 0, "part": {"type": "reasoning_text", "text": text}})
        elif kind == "message":
            item = message_item(item_id, text, status)
            events.append({"type": "response.output_text.done", "item_id": item_id, "output_index": index,
                           "content_index": 0, "text": text, "logprobs": []})
            events.append({"type": "response.content_part.done", "item_id": item_id, "output_index": index,
                           "content_index": 0, "part": text_part(text)})
        else:
            item = call_item(item_id, state["call_id"], state["name"], text, "completed")
            events.append({"type": "response.function_call_arguments.done", "item_id": item_id,
                           "output_index": index, "name": state["name"], "arguments": text})
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
        if index < len(self.items):  # a call reopened (see _call): its item is replaced
            self.items[index] = item
        else:
            self.items.append(item)
