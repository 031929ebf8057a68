"""What a streamed ``/v1/responses`` answer writes before its first text, made from byte templates (the opening is
made for every request while the engine computes its first token): ``response.created`` / ``response.in_progress``
carry ``_Job.started()``, the bytes of ``orjson.dumps(_Job.response("in_progress", []))``; a plain answer's message
item is announced by ``OutputStream.announce_message``, the bytes ``EventWriter.events`` writes of
``OutputStream.announce("message")``; a string ``input`` is the item its one-message list form makes."""

from __future__ import annotations

import time

import orjson
import pytest
from tideserve.openai.protocol import parse
from tideserve.openai.responses import output
from tideserve.openai.responses.output import EventWriter, OutputStream
from tideserve.openai.responses.protocol import ResponsesRequest, input_items, new_id
from tideserve.openai.responses.serving import Responses, _Job

REQUESTS = [
    {"model": "m", "input": "hi", "stream": True, "store": False},
    {"model": "m", "input": "hi", "stream": True, "instructions": "Be \"brief\" \u00e9\u4e16\u2028\U0001f600\n",
     "max_output_tokens": 7, "temperature": 0, "top_p": 0.5, "metadata": {"k": "v\u00e9"}, "user": "u",
     "reasoning": {"effort": "low"}, "service_tier": "default", "truncation": "auto", "max_tool_calls": 2},
    {"model": "m", "input": "hi", "stream": True, "parallel_tool_calls": False, "tool_choice": "required",
     "tools": [{"type": "function", "name": "get", "description": "d", "parameters": {"type": "object"},
                "strict": True}],
     "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}, "strict": True}}},
    {"model": "m", "input": "hi", "stream": True, "text": {"format": {"type": "json_object"}},
     "tool_choice": {"type": "function", "name": "get"}, "previous_response_id": "resp_1",
     "tools": [{"type": "function", "name": "get"}]},
]


def _job(doc: dict, model: str = "m") -> _Job:
    request = parse(ResponsesRequest, doc)
    request.model = model  # as create_response sets it (the catalog's name)
    return _Job(None, Responses(store=None), request, model, new_id("resp"), int(time.time()), [], [])


@pytest.mark.parametrize("doc", REQUESTS)
def test_started_is_the_response_in_progress(doc):
    job = _job(doc)
    started = job.started()
    assert started == orjson.dumps(job.response("in_progress", []))
    assert orjson.loads(started)["status"] == "in_progress"


def test_started_when_the_echoed_model_differs():
    """(Not a path the server takes: the request's model is set before its settings are echoed.)"""
    job = _job(REQUESTS[0])
    job.request.model = "other"
    assert job.started() == orjson.dumps(job.response("in_progress", []))


@pytest.mark.parametrize(("before", "sequence"), [(0, 2), (1, 5), (3, 11)])
def test_message_announcement_is_the_dict_events(monkeypatch, before, sequence):
    """The template's bytes, numbered from the writer's next number, equal the dict events' at any output index;
    the writer moves on by two."""
    monkeypatch.setattr(output, "new_id", lambda prefix: f"{prefix}_0123456789abcdef0123456789abcdef")

    def stream_with(items: int) -> OutputStream:  # ``items`` finished output items before the new one
        stream = OutputStream()
        stream.items.extend({"id": f"fc_{i}"} for i in range(items))
        return stream

    writer = EventWriter(sequence)
    item, written = stream_with(before).announce_message(writer)
    expected_item, events = stream_with(before).announce("message")
    assert written == EventWriter(sequence).events(events)
    assert writer.sequence == sequence + 2
    assert (item.kind, item.id, item.index, item.parts) == ("message", expected_item.id, before, [])


def test_announced_item_opens_with_the_first_text():
    """An item announced by the template is the one ``adopt`` opens and the delta template writes."""
    writer, stream = EventWriter(2), OutputStream()
    item, written = OutputStream().announce_message(writer)
    assert stream.adopt(item, "Hi") is item
    delta = orjson.loads(writer.delta(item, "Hi").split(b"\ndata: ")[1])
    assert delta == {"type": "response.output_text.delta", "item_id": item.id, "output_index": 0,
                     "content_index": 0, "logprobs": [], "delta": "Hi", "sequence_number": 4}
    added = orjson.loads(written.split(b"\n\n")[0].split(b"\ndata: ")[1])
    assert added["item"]["id"] == item.id and added["sequence_number"] == 2


@pytest.mark.parametrize("text", ["hi", "", "\"quoted\" \u00e9\u4e16\n\U0001f600"])
def test_string_input_is_its_message_item(text):
    [item] = input_items(parse(ResponsesRequest, {"input": text}))
    [listed] = input_items(parse(ResponsesRequest, {"input": [{"role": "user", "content": text}]}))
    assert item["id"].startswith("msg_") and listed["id"].startswith("msg_")
    assert {**item, "id": None} == {**listed, "id": None}
    assert list(item) == list(listed)


def test_started_from_kept_settings_json():
    """The settings' JSON kept per distinct settings (``ResponsesRequest.echo_json``) is each request's own: the same
    settings again give the same bytes, any setting changed gives its own, and requests with tools, metadata,
    reasoning or a text format (not kept) or long instructions are written afresh."""
    base = {"model": "m", "input": "hi", "stream": True, "store": False}
    variants = [base, {**base, "temperature": 0}, {**base, "temperature": 1}, {**base, "top_p": 0.5},
                {**base, "instructions": "Be brief."}, {**base, "instructions": "x" * 5000}, {**base, "user": "u"},
                {**base, "max_output_tokens": 1}, {**base, "parallel_tool_calls": False}, {**base, "store": True},
                {**base, "previous_response_id": "resp_2"}, {**base, "tool_choice": "none"},
                {**base, "truncation": "auto"}, {**base, "service_tier": "flex"}, {**base, "max_tool_calls": 1},
                {**base, "text": {"format": {"type": "text"}}}, {**base, "metadata": {}}] + REQUESTS
    seen = set()
    for _ in range(2):  # the second time from the kept JSON
        for doc in variants:
            job = _job(doc)
            assert job.started() == orjson.dumps(job.response("in_progress", [])), doc
            assert job.request.echo_json() == orjson.dumps(job.request.echo())
            seen.add(job.request.echo_json())
    # as many distinct as the settings' own JSON (a text format of "text", empty metadata and temperature 1 echo as
    # none given; REQUESTS[0] has the base's settings)
    assert len(seen) == len({orjson.dumps(_job(doc).request.echo()) for doc in variants}) == len(variants) - 4
