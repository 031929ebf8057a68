"""The lean streaming client of ``bench/responses_vs_chat.py``: ``/v1/chat/completions`` and ``/v1/responses`` read
by one SSE reader that reads only what the measurement needs, so neither API's client costs more CPU per token
than the other's (the client shares the machine's cores with the server and its engine).

The reader parses no JSON while a stream runs. Each read from the socket is timed; its complete events (up to the
last blank line; the rest waits for the next read) are scanned for text events by a byte marker, one C-level count
per read: chat's ``"delta":{"content":"`` (the role-only chunk carries ``"role"`` first, and so is not counted, as
``--ttft-from content`` leaves it out), Responses' ``event: response.output_text.delta`` (tideserve writes no
empty text on either). The output tokens come from the usage the stream ends with (chat's
``stream_options.include_usage`` chunk, ``response.completed`` / ``response.incomplete``), the digits after
``"completion_tokens":`` / ``"output_tokens":`` found from its end (the usage follows the output in both). What the
two sides do per byte is the same; per event, the same one count.

The measures are those of tideserve-bench (``vllm bench serve``'s definitions): TTFT from the request's send to the
read holding its first text event, inter-token latency between text events (the events of one read share its
time), output tokens/s over the round's wall time. Plain answers only (the bench's model has no reasoning or tool
parser): reasoning and tool-call events are not counted.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field

import aiohttp
import orjson

CHAT_TEXT = b'"delta":{"content":"'
RESPONSES_TEXT = b"event: response.output_text.delta\n"
USAGE_KEY = {"chat": b'"completion_tokens":', "responses": b'"output_tokens":'}
FAILED = {"chat": (b'data: {"error":',),
          "responses": (b'data: {"error":', b"event: response.failed\n", b"event: error\n")}
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses"}


def body(side: str, model: str, prompt: str, tokens: int, extra: dict | None = None) -> bytes:
    """The request of ``side``, as tideserve-bench's ``openai-chat`` / ``openai-responses`` targets send it."""
    if side == "chat":
        doc = {"model": model, "stream": True, "stream_options": {"include_usage": True},
               "messages": [{"role": "user", "content": prompt}], "max_completion_tokens": tokens}
    else:
        doc = {"model": model, "input": prompt, "max_output_tokens": tokens, "stream": True, "store": False}
    doc["ignore_eos"] = True
    doc.update(extra or {})
    return orjson.dumps(doc)


def text_events(side: str, events: bytes) -> int:
    """The text events among complete ``events``."""
    if side == "chat":
        return events.count(CHAT_TEXT)
    return events.count(RESPONSES_TEXT)


def output_tokens(side: str, last: bytes) -> int | None:
    """The output tokens of the usage in ``last`` (the stream's last events), or None."""
    at = last.rfind(USAGE_KEY[side])
    if at < 0:
        return None
    start = at + len(USAGE_KEY[side])
    end = start
    while end < len(last) and 48 <= last[end] <= 57:
        end += 1
    return int(last[start:end]) if end > start else None


@dataclass(slots=True)
class Stream:
    """One request's reading: when it was sent, its text events' times, the output tokens of its usage."""

    sent: float = 0.0
    times: list[float] = field(default_factory=list)  # one per text event
    tokens: int | None = None
    error: str | None = None


class Reader:
    """The events of one stream, read by complete events (:func:`text_events`) as the socket's reads come."""

    __slots__ = ("_pending", "before", "last", "side", "stream")

    def __init__(self, side: str, stream: Stream) -> None:
        self.side = side
        self.stream = stream
        self._pending = b""
        self.before = self.last = b""  # the two latest reads' complete events (the usage is in the one or the other)

    def feed(self, data: bytes, now: float) -> None:
        pending = self._pending + data if self._pending else data
        end = pending.rfind(b"\n\n")
        if end < 0:
            self._pending = pending
            return
        complete, self._pending = pending[:end + 2], pending[end + 2:]
        count = text_events(self.side, complete)
        if count:
            self.stream.times.extend([now] * count)
        self.before, self.last = self.last, complete

    def close(self) -> None:
        last = self.before + self.last + self._pending
        stream = self.stream
        if last.startswith(FAILED[self.side]) or any(b"\n\n" + marker in last for marker in FAILED[self.side]):
            stream.error = "server error: " + last[-300:].decode(errors="replace")
        stream.tokens = output_tokens(self.side, last)


async def _one(session: aiohttp.ClientSession, url: str, side: str, payload: bytes, stream: Stream) -> None:
    reader = Reader(side, stream)
    stream.sent = time.perf_counter()
    try:
        async with session.post(url, data=payload, headers={"content-type": "application/json"}) as response:
            if response.status != 200:
                stream.error = f"HTTP {response.status}: {(await response.text(errors='replace'))[:300]}"
                return
            async for data in response.content.iter_any():
                reader.feed(data, time.perf_counter())
    except aiohttp.ClientError as exc:
        stream.error = f"{type(exc).__name__}: {exc}"
        return
    reader.close()


async def measure_async(side: str, base_url: str, model: str, prompts: list[str], tokens: int,
                        extra: dict | None = None) -> dict:
    """Every prompt at once through ``side``; the round's summary."""
    payloads = [body(side, model, prompt, tokens, extra) for prompt in prompts]  # made before the clock starts
    streams = [Stream() for _ in prompts]
    url = base_url.rstrip("/") + PATHS[side]
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        start = time.perf_counter()
        await asyncio.gather(*(_one(session, url, side, p, s) for p, s in zip(payloads, streams)))
        wall = time.perf_counter() - start
    return summary(streams, wall, tokens)


def measure(*args, **kwargs) -> dict:
    """:func:`measure_async` on a fresh event loop."""
    return asyncio.run(measure_async(*args, **kwargs))


def summary(streams: list[Stream], wall: float, tokens: int) -> dict:
    """Output tokens/s, TTFT and ITL medians (seconds), text events, and the streams that failed or fell short."""
    failed = [s.error for s in streams if s.error is not None]
    short = sum(1 for s in streams if s.error is None and s.tokens != tokens)
    total = sum(s.tokens or 0 for s in streams if s.error is None)
    ttfts = [s.times[0] - s.sent for s in streams if s.error is None and s.times]
    itls = [b - a for s in streams if s.error is None for a, b in zip(s.times, s.times[1:])]
    return {"failed": len(failed), "errors": failed[:3], "truncated": short, "total_output_tokens": total,
            "duration_s": wall, "output_throughput": total / wall if wall > 0 else 0.0,
            "ttft_s": statistics.median(ttfts) if ttfts else float("nan"),
            "itl_s": statistics.median(itls) if itls else float("nan"),
            "text_events": sum(len(s.times) for s in streams)}
