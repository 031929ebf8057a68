"""A streamed ``/v1/responses`` answer as ``responses.serving._Job.events`` writes it, driven over a fake generation
(no engine, no HTTP): a plain answer's text after its first delta is written straight from the message item's
template (the per-token path); its events are the same JSON, numbered the same, as those the event dicts of
``OutputStream.feed`` give, and a model error in the middle still numbers ``response.failed`` right after them."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from tideserve.errors import InternalError
from tideserve.generation import GenerationDelta
from tideserve.openai.chat_run import ChatRun
from tideserve.openai.llm import LLMModel
from tideserve.openai.protocol import parse
from tideserve.openai.responses.output import EventWriter, OutputStream
from tideserve.openai.responses.protocol import ResponsesRequest, chat_request, new_id
from tideserve.openai.responses.serving import Responses, _Job

TEXTS = ["Hel", "lo, \"wo\\rld\"\n", "", "\u00e9\u4e16\u2028", "\U0001f600", " end"]


class _Run:
    """What ``_Job.events`` reads of a DataPlane run: its steps, then (``fail``) an error or the end."""

    def __init__(self, steps: list[GenerationDelta], fail: bool = False) -> None:
        self.steps = list(steps)
        self.fail = fail
        self.prompt_tokens = 3
        self.cached_tokens = None

    async def step(self):
        if self.steps:
            return self.steps.pop(0)
        if self.fail:
            raise InternalError("the engine went away")
        return None

    async def close(self) -> None:
        pass


def _llm() -> LLMModel:
    return LLMModel(name="m", backend="vllm", batched=False, structured=False, input_types={}, outputs=frozenset(),
                    template=None, tokenizer_dir=None, typed=True)


def _stream(steps: list[GenerationDelta], fail: bool = False, ahead: bool = True) -> list[dict]:
    doc = {"model": "m", "input": "hi", "stream": True, "store": False}
    request = parse(ResponsesRequest, doc)
    messages = [{"role": "user", "content": "hi"}]
    chat = chat_request(request, messages, True)
    llm = _llm()
    job = _Job(SimpleNamespace(), Responses(store=None), request, "m", new_id("resp"), int(time.time()), [], messages)
    if ahead:  # the opening made while the engine computes the first token, as the server makes it
        job.prepare(chat, llm)

    async def read() -> bytes:
        return b"".join([chunk async for chunk in job.events(ChatRun(chat, llm, _Run(steps, fail), "hi", {}))])

    return _parse(asyncio.run(read()))


def _parse(stream: bytes) -> list[dict]:
    events = []
    for block in stream.decode().split("\n\n"):
        if block:
            kind, data = block.split("\n")
            event = json.loads(data.removeprefix("data: "))
            assert kind == "event: " + event["type"]
            events.append(event)
    return events


def _by_dicts(texts: list[str], reason: str | None) -> list[dict]:
    """The same answer's item events from their dicts (``OutputStream.feed``, ``EventWriter.event``)."""
    writer, stream = EventWriter(2), OutputStream()
    out = b"".join(writer.events(stream.feed({"content": t})) for t in texts if t)
    return _parse(out + writer.events(stream.finish(reason)))


def _blank(events: list[dict]) -> list[dict]:
    text = json.dumps(events)
    for event in events:
        if "item_id" in event:
            text = text.replace(event["item_id"], "ID")
    return json.loads(text)


@pytest.mark.parametrize("ahead", [True, False])
def test_plain_deltas_are_the_dict_events(ahead):
    steps = [GenerationDelta([t], [None], [1]) for t in TEXTS] + [GenerationDelta(["."], ["length"], [1])]
    events = _stream(steps, ahead=ahead)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] == "response.incomplete"
    assert _blank(events[2:-1]) == _blank(_by_dicts([*TEXTS, "."], "length"))
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [e["delta"] for e in deltas] == [t for t in TEXTS if t] + ["."]
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == "".join(TEXTS) + "."
    assert final["usage"]["output_tokens"] == len(steps)


def test_error_after_plain_deltas_numbers_the_failure():
    steps = [GenerationDelta([t], [None], [1]) for t in TEXTS]
    events = _stream(steps, fail=True)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.failed"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and "the engine went away" in failed["error"]["message"]
    assert failed["output"][0]["content"][0]["text"] == "".join(TEXTS)
