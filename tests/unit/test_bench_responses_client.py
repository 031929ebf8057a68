"""The lean SSE reader of ``bench/responses_vs_chat.py`` (``bench/responses_client.py``) reads both APIs' streams, as
tideserve's writers make them, to what a JSON-parsing client reads of them: one token time per text event (the
chat stream's role-only chunk and Responses' announcements not counted), the output tokens of the usage that
ends the stream, and an error event as a failure, however the socket's reads cut the bytes."""

from __future__ import annotations

import asyncio
import json

import orjson
import pytest
from tideserve.bench.responses_client import Reader, Stream, body, output_tokens, summary
from tideserve.bench.responses_delta_cost import FakeRun, _chat_stream, _responses_stream, fake_llm
from tideserve.bench.tideserve_bench.records import RequestRecord, SSEParser
from tideserve.bench.tideserve_bench.targets import TargetOptions, make_target
from tideserve.openai.responses.serving import Responses

TOKENS = 9


def _chunks(side: str, text: str = ' w"\\\n\u00e9') -> list[bytes]:
    """One stream's writes, as the server's writer for ``side`` makes them over a fake generation."""
    llm, run = fake_llm(), FakeRun(text, TOKENS)
    stream = _chat_stream(llm, run, TOKENS) if side == "chat" else _responses_stream(llm, Responses(store=None), run,
                                                                                     TOKENS)

    async def read() -> list[bytes]:
        return [chunk async for chunk in stream]

    chunks = asyncio.run(read())
    if side == "chat":  # the usage chunk (stream_options.include_usage) and [DONE], as the route ends a chat stream
        usage = {"prompt_tokens": 16, "completion_tokens": TOKENS, "total_tokens": 16 + TOKENS}
        chunks[-1:] = [b"data: " + orjson.dumps({"id": "c", "choices": [], "usage": usage}) + b"\n\n", chunks[-1]]
    return chunks


def _lean(side: str, reads: list[bytes]) -> Stream:
    stream = Stream()
    reader = Reader(side, stream)
    for at, data in enumerate(reads):
        reader.feed(data, float(at))
    reader.close()
    return stream


def _parsed_times(side: str, reads: list[bytes]) -> list[float]:
    """The token times a client that parses every event's JSON reads (Responses: tideserve-bench's target)."""
    parser, times = SSEParser(), []
    target = make_target("openai-responses", TargetOptions(url="http://127.0.0.1:1", model="m"))
    record = RequestRecord(0, "r0", None, TOKENS)
    for at, data in enumerate(reads):
        for event in parser.feed(data):
            if side == "responses":
                target.read_event(record, event, float(at))
            elif event != "[DONE]":
                choices = json.loads(event)["choices"]
                if choices and choices[0]["delta"].get("content"):
                    times.append(float(at))
    return record.chunk_times if side == "responses" else times


def _cut(chunks: list[bytes], size: int) -> list[bytes]:
    whole = b"".join(chunks)
    return [whole[i:i + size] for i in range(0, len(whole), size)]


@pytest.mark.parametrize("side", ["chat", "responses"])
@pytest.mark.parametrize("size", [None, 1, 7, 64, 4096])
def test_text_events_and_usage_however_cut(side, size):
    reads = _chunks(side) if size is None else _cut(_chunks(side), size)
    stream = _lean(side, reads)
    assert stream.error is None
    assert stream.tokens == TOKENS
    assert len(stream.times) == TOKENS  # one text event per step; the role chunk and announcements not counted
    assert stream.times == _parsed_times(side, reads)


def test_usage_and_done_in_separate_reads():
    usage = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":12,"total_tokens":15}}\n\n'
    stream = _lean("chat", [usage, b"data: [DONE]\n\n"])
    assert stream.tokens == 12 and stream.error is None and stream.times == []
    assert output_tokens("responses", b'"output":[{"text":"\\"output_tokens\\":1"}],"usage":{"input_tokens":2,'
                                      b'"output_tokens":34,"total_tokens":36}') == 34


@pytest.mark.parametrize("side,events", [
    ("chat", [b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n',
              b'data: {"error":{"message":"boom","type":"InternalServerError","code":500}}\n\ndata: [DONE]\n\n']),
    ("responses", [b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"a"}\n\n',
                   (b'event: response.failed\ndata: {"type":"response.failed","response":{"error":{"message":"boom"}}}'
                    b'\n\n')]),
])
def test_an_error_event_fails_the_stream(side, events):
    stream = _lean(side, events)
    assert stream.error is not None and "boom" in stream.error and stream.times == [0.0]


def test_summary_and_bodies():
    good = Stream(sent=1.0, times=[1.5, 1.5, 2.0], tokens=3)
    late = Stream(sent=1.0, times=[2.0, 3.0], tokens=2)
    out = summary([good, late, Stream(error="HTTP 500: x")], 4.0, 3)
    assert out["failed"] == 1 and out["truncated"] == 1 and out["total_output_tokens"] == 5
    assert out["output_throughput"] == 5 / 4.0 and out["ttft_s"] == 0.75 and out["text_events"] == 5
    assert out["itl_s"] == 0.5  # gaps 0, 0.5 and 1.0
    chat, responses = (orjson.loads(body(side, "m", "hi", 5, {"temperature": 0})) for side in ("chat", "responses"))
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and chat["max_completion_tokens"] == 5
    assert chat["stream_options"] == {"include_usage": True} and chat["ignore_eos"] and chat["temperature"] == 0
    assert responses["input"] == "hi" and responses["max_output_tokens"] == 5 and responses["store"] is False
