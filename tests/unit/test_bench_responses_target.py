"""tideserve-bench's ``openai-responses`` target reads a Responses stream as the server writes it: a token per text
delta (its first the TTFT mark), the usage and finish of ``response.completed``, and the announcements passed
over unparsed (their ``type`` leads the JSON) with the same outcome as when each is parsed."""

from __future__ import annotations

import json

import orjson
import pytest
from tideserve.bench.tideserve_bench.records import RequestRecord, SSEParser
from tideserve.bench.tideserve_bench.targets import TargetOptions, make_target
from tideserve.openai.responses.output import EventWriter, OutputStream

TEXTS = ["Once", " upon", " a", " time"]


def _stream() -> list[bytes]:
    """A plain answer's stream, one chunk per model step, as ``/v1/responses`` writes it."""
    writer, stream = EventWriter(), OutputStream()
    response = {"id": "resp_1", "object": "response", "status": "in_progress", "output": [], "usage": None,
                "instructions": None, "tools": [], "metadata": {}}
    started = orjson.dumps(response)
    first = writer.wrapped("response.created", started) + writer.wrapped("response.in_progress", started)
    chunks = [first + writer.events(stream.feed({"content": TEXTS[0]}))]
    chunks += [writer.delta(stream.more_text("message", text), text) for text in TEXTS[1:]]
    final = {**response, "status": "completed", "output": stream.items,
             "usage": {"input_tokens": 9, "output_tokens": len(TEXTS), "total_tokens": 9 + len(TEXTS)}}
    chunks.append(writer.events(stream.finish("stop")) + writer.wrapped("response.completed", orjson.dumps(final)))
    return chunks


def _read(chunks: list[bytes], spaced: bool = False) -> RequestRecord:
    target = make_target("openai-responses", TargetOptions(url="http://127.0.0.1:1", model="m"))
    record = RequestRecord(0, "r0", None, len(TEXTS))
    parser = SSEParser()
    for at, chunk in enumerate(chunks):
        for data in parser.feed(chunk):
            if spaced:  # a server that writes its JSON with spaces: every event parsed
                data = json.dumps(json.loads(data))
            if target.read_event(record, data, float(at)):
                return record
    return record


@pytest.mark.parametrize("spaced", [False, True])
def test_tokens_usage_and_end(spaced):
    record = _read(_stream(), spaced)
    assert record.chunk_times == [0.0, 1.0, 2.0, 3.0]  # the first chunk's delta is the first token
    assert record.text == "".join(TEXTS)
    assert (record.server_output_tokens, record.server_prompt_tokens) == (len(TEXTS), 9)
    assert record.ended and record.finish_reason == "stop" and not record.error


def test_failed_response_fails_the_request():
    writer = EventWriter()
    failed = orjson.dumps({"id": "resp_1", "status": "failed", "error": {"code": "server_error", "message": "boom"}})
    record = _read([writer.wrapped("response.created", b"{}") + writer.wrapped("response.failed", failed)])
    assert record.error == "server error: boom" and not record.chunk_times
