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

``python bench/responses_client.py [--streams 32] [--tokens 768] [--rounds 7]`` measures the client's own CPU per text
event for both APIs, this reader's and tideserve-bench's targets', over the bytes tideserve's writers make (no
server, no socket).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

if __name__ == "__main__":  # run as a script: the repository's tideserve
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

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


# -- the client's own cost: python bench/responses_client.py ------------------------------------------------------
def _writes(side: str, streams: int, tokens: int, text: str) -> list[list[bytes]]:
    """``streams`` streams of ``side`` as tideserve's writers make them (one write per model step,
    ``bench/responses_delta_cost.py``'s fake generation), chat's ending with its usage chunk and ``[DONE]``."""
    from tideserve.bench.responses_delta_cost import FakeRun, _chat_stream, _responses_stream, fake_llm
    from tideserve.openai.responses.serving import Responses

    llm, state = fake_llm(), Responses(store=None)

    async def one() -> list[bytes]:
        run = FakeRun(text, tokens)
        stream = _chat_stream(llm, run, tokens) if side == "chat" else _responses_stream(llm, state, run, tokens)
        chunks = [chunk async for chunk in stream]
        if side == "chat":
            usage = {"prompt_tokens": 16, "completion_tokens": tokens, "total_tokens": 16 + tokens}
            chunks[-1:] = [b"data: " + orjson.dumps({"id": "c", "object": "chat.completion.chunk", "created": 0,
                                                     "model": "llm", "choices": [], "usage": usage}) + b"\n\n",
                           chunks[-1]]
        return chunks

    async def all_of() -> list[list[bytes]]:
        return [await one() for _ in range(streams)]

    return asyncio.run(all_of())


def _read_lean(side: str, writes: list[list[bytes]]) -> int:
    events = 0
    for chunks in writes:
        stream = Stream(sent=time.perf_counter())
        reader = Reader(side, stream)
        for chunk in chunks:
            reader.feed(chunk, time.perf_counter())
        reader.close()
        events += len(stream.times)
    return events


def _read_tideserve_bench(side: str, writes: list[list[bytes]]) -> int:
    """What tideserve-bench's ``openai-chat`` (``--ttft-from content``) / ``openai-responses`` target does with the
    same bytes: its SSE parser and its per-event reading (the socket left out)."""
    from tideserve.bench.tideserve_bench.records import RequestInput, RequestRecord, SSEParser
    from tideserve.bench.tideserve_bench.targets import TargetOptions, make_target

    target = make_target("openai-chat" if side == "chat" else "openai-responses",
                         TargetOptions(url="http://127.0.0.1:1", model="llm", role_chunk_is_token=False))
    current: list[list[bytes]] = []

    async def post_stream(url, body, record, on_event) -> None:  # the target's reading of one stream
        parser = SSEParser()
        record.start = time.perf_counter()
        for chunk in current[0]:
            now = time.perf_counter()
            for data in parser.feed(chunk):
                if on_event(data, now):
                    return

    target.post_stream = post_stream

    async def read() -> int:
        events = 0
        for i, chunks in enumerate(writes):
            current[:] = [chunks]
            record = RequestRecord(i, f"r{i}", None, 0)
            await target._send(RequestInput(i, "prompt", None, 0), record)
            events += len(record.chunk_times)
        return events

    return asyncio.run(read())


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="The client's CPU per text event, chat vs Responses, for the lean "
                                                 "reader and tideserve-bench's targets, over tideserve's writers' bytes")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=768)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--text", default=" word")
    args = parser.parse_args()
    writes = {side: _writes(side, args.streams, args.tokens, args.text) for side in PATHS}
    readers = {"lean": _read_lean, "tideserve-bench": _read_tideserve_bench}
    cost: dict[tuple[str, str], list[float]] = {(c, s): [] for c in readers for s in PATHS}
    for r in range(args.rounds):
        for client, read in readers.items():
            for side in (("chat", "responses") if r % 2 == 0 else ("responses", "chat")):
                start = time.process_time()
                events = read(side, writes[side])
                cost[client, side].append((time.process_time() - start) * 1e6 / events)
                assert events == args.streams * args.tokens, (client, side, events)
    print(f"{args.streams} streams x {args.tokens} text events of {args.text!r}, {args.rounds} rounds (medians): "
          "client CPU µs per text event")
    print("| client | chat | responses | responses / chat |\n|---|---|---|---|")
    for client in readers:
        chat, responses = (statistics.median(cost[client, side]) for side in PATHS)
        print(f"| {client} | {chat:.2f} | {responses:.2f} | {responses / chat:.3f}x |")


if __name__ == "__main__":
    main()
