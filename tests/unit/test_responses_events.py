"""The ``/v1/responses`` stream's event bytes (``responses.output.EventWriter``): a text delta written from its
item's template is the same event as one written from its dict, and every event is ``event: <type>`` then one
JSON ``data`` line numbered in order."""

from __future__ import annotations

import json

import pytest

from tideserve.openai.responses.output import EventWriter, OutputStream

DELTAS = [{"reasoning": "Think"}, {"reasoning": " more", "reasoning_content": " more"}, {"content": "Hello"},
          {"content": ", \"world\" \u00e9\u4e16\n"}, {"content": "!"},
          {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                           "function": {"name": "get", "arguments": "{\"a\""}}]},
          {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}]


def _parse(stream: bytes) -> list[dict]:
    events = []
    for block in stream.decode().split("\n\n"):
        if not block:
            continue
        kind, data = block.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: ")
        event = json.loads(data[len("data: "):])
        assert event["type"] == kind[len("event: "):]
        events.append(event)
    return events


def _plain(deltas: list[dict]) -> tuple[bytes, list[dict]]:
    """Every event from its dict."""
    writer, stream = EventWriter(), OutputStream()
    out = b"".join(writer.events(stream.feed(delta)) for delta in deltas) + writer.events(stream.finish("stop"))
    return out, stream.items


def _short_way(deltas: list[dict]) -> tuple[bytes, list[dict]]:
    """Text that continues an open item from its template (as ``_Job.events`` writes it)."""
    writer, stream = EventWriter(), OutputStream()
    out = b""
    for delta in deltas:
        kinds = [k for k in ("content", "reasoning") if delta.get(k)]
        if len(kinds) == 1 and "tool_calls" not in delta:
            kind = kinds[0]
            item = stream.more_text("message" if kind == "content" else "reasoning", delta[kind])
            if item is not None:
                out += writer.delta(item, delta[kind])
                continue
        out += writer.events(stream.feed(delta))
    return out + writer.events(stream.finish("stop")), stream.items


def _blank_ids(events: list[dict]) -> list[dict]:
    text = json.dumps(events)
    for event in events:
        for key in ("item_id",):
            if key in event:
                text = text.replace(event[key], "ID")
    return json.loads(text)


def test_template_deltas_equal_dict_deltas():
    plain, plain_items = _plain(DELTAS)
    short, short_items = _short_way(DELTAS)
    assert _blank_ids(_parse(short)) == _blank_ids(_parse(plain))
    assert [e["sequence_number"] for e in _parse(short)] == list(range(len(_parse(short))))
    kinds = [e["type"] for e in _parse(short)]
    assert kinds.count("response.output_text.delta") == 3 and kinds.count("response.reasoning_text.delta") == 2
    assert [i["type"] for i in short_items] == [i["type"] for i in plain_items] == ["reasoning", "message",
                                                                                      "function_call"]
    assert short_items[1]["content"][0]["text"] == "Hello, \"world\" \u00e9\u4e16\n!"
    assert short_items[2]["arguments"] == "{\"a\": 1}"


def test_wrapped_response_and_numbering():
    writer = EventWriter()
    response = json.dumps({"id": "resp_1", "status": "in_progress", "output": []}).encode()
    events = _parse(writer.wrapped("response.created", response) + writer.wrapped("response.in_progress", response)
                    + writer.event({"type": "response.completed", "response": {"id": "resp_1"}}))
    assert [(e["type"], e["sequence_number"]) for e in events] == [
        ("response.created", 0), ("response.in_progress", 1), ("response.completed", 2)]
    assert events[0]["response"] == {"id": "resp_1", "status": "in_progress", "output": []}


def test_more_text_needs_the_open_item():
    stream = OutputStream()
    assert stream.more_text("message", "x") is None  # nothing open: the events that open an item come first
    stream.feed({"content": "a"})
    assert stream.more_text("reasoning", "x") is None
    assert stream.more_text("message", "b").text == "ab"


@pytest.mark.parametrize("text", ["", "\u2028\u2029", "\"\\\n\t", "\U0001f600"])
def test_template_escapes_like_json(text):
    writer, stream = EventWriter(), OutputStream()
    writer.events(stream.feed({"content": "x"}))
    [event] = _parse(writer.delta(stream.more_text("message", text), text))
    assert event["delta"] == text and event["logprobs"] == [] and event["content_index"] == 0


def test_item_announced_ahead_writes_the_same_events():
    """A plain answer's message item announced before the model's first text (``OutputStream.announce``, as the
    stream's opening is made while the engine computes) and opened with that text (``adopt``): the same events,
    numbered the same, as the item opened by ``feed`` when the text came."""
    texts = ["Hello", ", world", "!"]
    plain, plain_items = _plain([{"content": t} for t in texts])

    writer, stream = EventWriter(2), OutputStream()  # 0 and 1: response.created / in_progress, made ahead too
    item, events = OutputStream().announce("message")
    announced = EventWriter(2).events(events)
    writer.head(item)
    assert stream.adopt(item, texts[0]) is item and writer.sequence == 2
    writer.sequence = 4
    out = announced + writer.delta(item, texts[0])
    for text in texts[1:]:
        out += writer.delta(stream.more_text("message", text), text)
    out += writer.events(stream.finish("stop"))
    ahead = _parse(out)
    assert [e["sequence_number"] for e in ahead] == list(range(2, len(ahead) + 2))
    assert _blank_ids([{**e, "sequence_number": 0} for e in ahead]) == \
        _blank_ids([{**e, "sequence_number": 0} for e in _parse(plain)])
    assert [{**i, "id": None} for i in stream.items] == [{**i, "id": None} for i in plain_items]
    assert stream.items[0]["id"] == item.id and stream.items[0]["content"][0]["text"] == "Hello, world!"


def test_adopt_refuses_a_taken_place():
    item, _ = OutputStream().announce("message")
    stream = OutputStream()
    stream.feed({"content": "a"})  # an item is open
    assert stream.adopt(item, "b") is None
    stream.finish("stop")  # closed: index 0 is taken
    assert stream.adopt(item, "b") is None and item.parts == []
