"""The assistant's answer as Responses output items, whole or as the streamed event sequence.

A chat message (:func:`..chat_completion.output.message`) becomes, in order, a ``reasoning`` item (the
reasoning parser's text as ``reasoning_text`` content), a ``message`` item (``output_text``) and one
``function_call`` item per tool call. While streaming, :class:`OutputStream` turns the chat deltas into
OpenAI's events: ``response.output_item.added``, ``response.content_part.added``,
``response.reasoning_text.delta`` / ``response.output_text.delta`` / ``response.function_call_arguments.delta``,
then the matching ``.done`` events and ``response.output_item.done``; the items it finishes are built by
the same functions as the whole answer's, so the streamed events rebuild the non-streamed response.
:class:`EventWriter` numbers the events and writes their bytes; a text delta that continues an open item
(:meth:`OutputStream.more_text`, or a plain answer's message item held by the stream's reader: nearly every token)
is written from a per-item template, so the tokens of a plain answer cost what a chat completion chunk costs
(``bench/responses_delta_cost.py``).
"""

from __future__ import annotations

import orjson

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


class _Open:
    """An item being streamed: its kind (``reasoning``, ``message``, ``call``), id, output index, text so far, and
    for a call its call id and name; ``head`` is the start of its delta events' bytes (:class:`EventWriter`)."""

    __slots__ = ("call_id", "head", "id", "index", "kind", "name", "parts")

    def __init__(self, kind: str, item_id: str, index: int, call_id: str | None = None, name: str = "") -> None:
        self.kind = kind
        self.id = item_id
        self.index = index
        self.parts: list[str] = []
        self.call_id = call_id
        self.name = name
        self.head: bytes | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)


_DELTA_TYPES = {"reasoning": "response.reasoning_text.delta", "message": "response.output_text.delta",
                "call": "response.function_call_arguments.delta"}


class OutputStream:
    """Chat deltas in, Responses events out (without ``sequence_number``; the writer numbers them)."""

    __slots__ = ("_calls", "_open", "items")

    def __init__(self) -> None:
        self.items: list[dict] = []  # finished items, in output order
        self._open: _Open | None = None
        self._calls: dict[int, _Open] = {}  # chat tool-call index -> its open state

    def feed(self, delta: dict) -> list[dict]:
        events: list[dict] = []
        if delta.get("reasoning"):
            self._text(events, "reasoning", delta["reasoning"])
        if delta.get("content"):
            self._text(events, "message", delta["content"])
        for entry in delta.get("tool_calls") or []:
            self._call(events, entry)
        return events

    def more_text(self, kind: str, text: str) -> _Open | None:
        """The short way of :meth:`feed` for ``text`` that continues the open item of ``kind`` (``message`` or
        ``reasoning``): the item, its text grown, for :meth:`EventWriter.delta`; None (nothing done) when no such
        item is open."""
        current = self._open
        if current is None or current.kind != kind:
            return None
        current.parts.append(text)
        return current

    def finish(self, reason: str | None) -> list[dict]:
        events: list[dict] = []
        self._close(events, "incomplete" if reason == "length" else "completed")
        return events

    # -- items ---------------------------------------------------------------------------------------
    def _text(self, events: list[dict], kind: str, text: str) -> None:
        current = self._open
        if current is None or current.kind != kind:
            self._close(events, "completed")
            current = self._start(events, kind)
        current.parts.append(text)
        event = {"type": _DELTA_TYPES[kind], "item_id": current.id, "output_index": current.index,
                 "content_index": 0, "delta": text}
        if kind == "message":
            event["logprobs"] = []
        events.append(event)

    def _start(self, events: list[dict], kind: str) -> _Open:
        state, added = self.announce(kind)
        events += added
        self._open = state
        return state

    def announce(self, kind: str) -> tuple[_Open, list[dict]]:
        """A new text item of ``kind`` (``message`` or ``reasoning``) as the next output item, and the events that
        announce it (``response.output_item.added``, ``response.content_part.added``); the stream is left as it
        is until :meth:`adopt` opens the item, so a writer may make them before the model's first text."""
        index = len(self.items)
        if kind == "reasoning":
            state = _Open(kind, new_id("rs"), index)
            item, part = reasoning_item(state.id, "", "in_progress"), {"type": "reasoning_text", "text": ""}
        else:
            state = _Open(kind, new_id("msg"), index)
            item, part = message_item(state.id, None, "in_progress"), text_part("")
        return state, [{"type": "response.output_item.added", "output_index": index, "item": item},
                       {"type": "response.content_part.added", "item_id": state.id, "output_index": index,
                        "content_index": 0, "part": part}]

    def announce_message(self, writer: EventWriter) -> tuple[_Open, bytes]:
        """:meth:`announce` of a ``message`` item written at once by ``writer`` (numbered from its next number): the
        bytes of ``writer.events(events)`` from a template, no event dict made (a streamed plain answer's opening,
        made for every request before its first token)."""
        state = _Open("message", new_id("msg"), len(self.items))
        sequence = writer.sequence
        writer.sequence = sequence + 2
        item_id = state.id.encode()
        return state, _MESSAGE_ANNOUNCED % (state.index, item_id, sequence, item_id, state.index, sequence + 1)

    def adopt(self, state: _Open, text: str) -> _Open | None:
        """``text`` starts the item :meth:`announce` made (its events written by the caller): the item, open with
        that text, for :meth:`EventWriter.delta`; None (nothing done) when an item is open or its place was taken
        since."""
        if self._open is not None or state.index != len(self.items):
            return None
        self._open = state
        state.parts.append(text)
        return state

    def _call(self, events: list[dict], entry: dict) -> None:
        function = entry.get("function") or {}
        state = self._calls.get(entry.get("index", 0))
        if state is None or entry.get("id"):
            self._close(events, "completed")
            index = len(self.items)
            state = _Open("call", new_id("fc"), index, entry.get("id"), function.get("name") or "")
            self._calls[entry.get("index", 0)] = state
            self._open = state
            events.append({"type": "response.output_item.added", "output_index": index,
                           "item": call_item(state.id, state.call_id, state.name, "", "in_progress")})
        elif self._open is not state:  # a later piece of a call after other output: not written by our parsers
            self._close(events, "completed")
            self._open = state
        arguments = function.get("arguments") or ""
        if arguments:
            state.parts.append(arguments)
            events.append({"type": "response.function_call_arguments.delta", "item_id": state.id,
                           "output_index": state.index, "delta": arguments})

    def _close(self, events: list[dict], status: str) -> None:
        state, self._open = self._open, None
        if state is None:
            return
        item_id, index, text = state.id, state.index, state.text
        kind = state.kind
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
            item = call_item(item_id, state.call_id, state.name, text, "completed")
            events.append({"type": "response.function_call_arguments.done", "item_id": item_id,
                           "output_index": index, "name": state.name, "arguments": text})
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
        if index < len(self.items):  # a call reopened (see _call): its item is replaced
            self.items[index] = item
        else:
            self.items.append(item)


# the events of OutputStream.announce("message"), as EventWriter.events writes them: output index, item id, number,
# item id, output index, number (an id of new_id: hex digits, nothing to escape)
_MESSAGE_ANNOUNCED = (
    b'event: response.output_item.added\ndata: {"type":"response.output_item.added","output_index":%d,"item":'
    b'{"id":"%s","type":"message","status":"in_progress","role":"assistant","content":[]},"sequence_number":%d}\n\n'
    b'event: response.content_part.added\ndata: {"type":"response.content_part.added","item_id":"%s",'
    b'"output_index":%d,"content_index":0,"part":{"type":"output_text","text":"","annotations":[],"logprobs":[]},'
    b'"sequence_number":%d}\n\n')


class EventWriter:
    """The Responses API's server-sent events as bytes (``event: <type>``, then the data line), numbered from 0
    (``sequence_number``). A text delta is written from its item's template (its bytes up to ``"delta":``, made
    once per item), with no dict per token; the other events from their dicts."""

    __slots__ = ("sequence",)

    def __init__(self, sequence: int = 0) -> None:
        self.sequence = sequence  # the next event's number

    def event(self, event: dict) -> bytes:
        event["sequence_number"] = self.sequence
        self.sequence += 1
        return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"

    def events(self, events: list[dict]) -> bytes:
        return b"".join([self.event(e) for e in events])

    def wrapped(self, kind: str, response: bytes) -> bytes:
        """``{"type": kind, "response": ...}`` around a response object already written as JSON."""
        sequence = self.sequence
        self.sequence += 1
        return b'event: %s\ndata: {"type":"%s","response":%s,"sequence_number":%d}\n\n' % (
            kind.encode(), kind.encode(), response, sequence)

    def delta(self, item: _Open, text: str) -> bytes:
        """The delta event of ``text`` for ``item`` (whose text the caller has grown): one formatting of the
        item's head, the text's JSON string and the event's number."""
        sequence = self.sequence
        self.sequence = sequence + 1
        return b'%s%s,"sequence_number":%d}\n\n' % (item.head or self.head(item), orjson.dumps(text), sequence)

    @staticmethod
    def head(item: _Open) -> bytes:
        """The bytes of ``item``'s delta events up to ``"delta":`` (made once, kept on the item)."""
        kind = _DELTA_TYPES[item.kind].encode()
        item.head = (b'event: %s\ndata: {"type":"%s","item_id":"%s","output_index":%d,%s"delta":' % (
            kind, kind, item.id.encode(), item.index,
            b'"content_index":0,"logprobs":[],' if item.kind == "message" else
            b'"content_index":0,' if item.kind == "reasoning" else b""))
        return item.head
