"""generate_stream's first response, on both paths (typed deltas, tensor responses), without a server: a refusal the
deadline's timer wrote already is not answered twice; a deadline's refusal is the one event with the error's status
and Retry-After; a full queue known before scheduling is a JSON error; a client gone gets nothing; the stream is
closed in every case (one helper for both handlers)."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest
from tideserve.errors import DeadlinePassed, QueueFull
from tideserve.http.generate import _stream, _typed_stream
from tideserve.types import InferenceResponse


class _Stream:
    """A stream whose first item is ``first`` (raised when an exception); ``on_error`` as the dataplane's."""

    def __init__(self, first=None, hang: bool = False) -> None:
        self.first = first
        self.hang = hang
        self.closed = 0
        self.hook = None

    def on_error(self, hook) -> None:
        self.hook = hook

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.hang:
            await asyncio.sleep(10)
        if isinstance(self.first, BaseException):
            if self.hook is not None:
                self.hook(self.first)  # the backend's hook, as the error is put (the deadline's timer)
            raise self.first
        if self.first is None:
            raise StopAsyncIteration
        first, self.first = self.first, None
        if self.hook is not None and getattr(first, "error", None) is not None:
            self.hook(first.error)
        return first

    async def aclose(self) -> None:
        self.closed += 1


def _run(handler, stream, disconnect: bool = False):
    sent: list = []

    async def receive():
        if disconnect:
            await asyncio.sleep(0.01)
            return {"type": "http.disconnect"}
        await asyncio.sleep(10)

    async def send(message):
        sent.append(message)

    async def main():
        args = (stream, {"type": "http", "method": "POST"}, receive, send)
        if handler is _typed_stream:
            await _typed_stream(None, *args)
        else:
            await _stream(*args)

    asyncio.run(main())
    return sent


def _deadline() -> DeadlinePassed:
    return DeadlinePassed("model 'llm': the request did not start generating within its deadline of 5 ms", 1, 2)


@pytest.mark.parametrize("handler", [_typed_stream, _stream])
def test_a_deadline_refusal_is_one_event_with_its_status(handler):
    error = _deadline()
    stream = _Stream(error if handler is _typed_stream else InferenceResponse(error=error, final=True))
    sent = _run(handler, stream)
    start, body = sent  # (RefusalNow could not write it here: a plain ASGI send) the handler answers once
    assert start["status"] == 503
    headers = dict(start["headers"])
    assert headers[b"retry-after"] == b"1" and headers[b"content-type"].startswith(b"text/event-stream")
    assert b"tideserve-deadline-late-us" in headers
    assert json.loads(body["body"].decode().removeprefix("data: ").strip()) == {"error": error.message}
    assert stream.closed >= 1


@pytest.mark.parametrize("handler", [_typed_stream, _stream])
def test_a_full_queue_before_scheduling_is_a_json_error(handler):
    stream = _Stream(QueueFull("model 'llm' queue is full"))
    start, body = _run(handler, stream)
    assert start["status"] == 503 and dict(start["headers"])[b"retry-after"] == b"1"
    assert json.loads(body["body"]) == {"error": "model 'llm' queue is full"}
    assert stream.closed >= 1


@pytest.mark.parametrize("handler", [_typed_stream, _stream])
def test_a_refusal_written_at_the_deadline_is_not_answered_again(handler, monkeypatch):
    generate = sys.modules[_stream.__module__]

    written: list = []

    class Refusal(generate.RefusalNow):
        __slots__ = ()

        def __call__(self, error):  # as where send_whole writes at once (uvicorn's cycle)
            if self.armed and isinstance(error, DeadlinePassed):
                written.append(error)
                self.done = True

    monkeypatch.setattr(generate, "RefusalNow", Refusal)
    error = _deadline()
    stream = _Stream(error if handler is _typed_stream else InferenceResponse(error=error, final=True))
    assert _run(handler, stream) == []
    assert written == [error] and stream.closed >= 1


@pytest.mark.parametrize("handler", [_typed_stream, _stream])
def test_a_client_gone_before_the_first_response_gets_nothing(handler):
    stream = _Stream(hang=True)
    assert _run(handler, stream, disconnect=True) == []
    assert stream.closed >= 1
