"""The API code's CPU per text delta: ``/v1/chat/completions`` streaming against ``/v1/responses`` streaming, with
no engine and no HTTP.

Each side's real stream writer runs over the same fake generation: ``--streams`` streams of ``--tokens`` steps, one
text delta each (as a typed LLM backend hands them to the frontend, ``GenerationDelta``), the last one with finish
reason ``length``. Chat: ``chat_completion.serving._events`` (the chunks of one choice, its text written around the
header made once per request). Responses: ``responses.serving._Job.events`` (its opening made ahead as the server
makes it while the engine computes the first token, the request validated once: its bytes into the Responses
request, the chat request built from it, then the text deltas from the message item's template, the
``.done`` events and ``response.completed``; ``store: false``, as the bench sends it). What is timed is the process
CPU of making each stream (the handler's work before the engine) and reading every event's bytes out of its writer
(what the HTTP layer does, minus the socket write, which costs both sides the same per event), divided by the number
of text deltas; the bytes per delta event are reported beside it, and the CPU per request from making the stream to
its first text's bytes (the API code's own share of a first token: chat's role chunk and first text chunk,
Responses' opening and first delta). Rounds alternate the two sides; the medians are
reported.

    python bench/responses_delta_cost.py [--streams 32] [--tokens 768] [--rounds 7] [--text " word"]

This measures the API code only; ``bench/responses_vs_chat.py`` measures the whole server on a real engine.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

import orjson
from tideserve.generation import GenerationDelta
from tideserve.http.body import BodyReader
from tideserve.openai.chat_completion.protocol import ChatCompletionRequest
from tideserve.openai.chat_completion.serving import _events as chat_events
from tideserve.openai.chat_run import ChatRun
from tideserve.openai.llm import LLMModel
from tideserve.openai.protocol import parse
from tideserve.openai.responses.protocol import ResponsesRequest, chat_request, input_items, new_id, to_messages
from tideserve.openai.responses.serving import Responses, _Job

MODEL = "llm"
READER = BodyReader()  # the HTTP port's JSON limits
PROMPT = "Write a long story about a lighthouse keeper and the sea."


class FakeRun:
    """What the writers read of a DataPlane run (``generation.Run``): its steps, made up front."""

    __slots__ = ("_steps", "cached_tokens", "prompt_tokens")

    def __init__(self, text: str, tokens: int) -> None:
        self._steps = [GenerationDelta([text], [None], [1]) for _ in range(tokens - 1)]
        self._steps.append(GenerationDelta([text], ["length"], [1]))
        self._steps.reverse()
        self.prompt_tokens = 16
        self.cached_tokens = None

    async def step(self):
        steps = self._steps
        return steps.pop() if steps else None

    async def close(self) -> None:
        pass


def fake_llm() -> LLMModel:
    return LLMModel(name=MODEL, backend="vllm", batched=False, structured=False, input_types={},
                    outputs=frozenset(), template=None, tokenizer_dir=None, typed=True)


def _chat_stream(llm: LLMModel, run: FakeRun, tokens: int):
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "stream": True,
                         "max_tokens": tokens, "temperature": 0, "ignore_eos": True})
    request = parse(ChatCompletionRequest, body, READER)  # the handler validates the body's bytes
    header = {"id": f"chatcmpl-{new_id('x')[2:]}", "object": "chat.completion.chunk", "created": int(time.time()),
              "model": MODEL}
    return chat_events(request, header, llm, run, "prompt", {})


def _responses_stream(llm: LLMModel, state: Responses, run: FakeRun, tokens: int):
    body = orjson.dumps({"model": MODEL, "input": PROMPT, "max_output_tokens": tokens, "stream": True,
                         "store": False, "temperature": 0, "ignore_eos": True})
    request = parse(ResponsesRequest, body, READER)  # the handler validates the body's bytes, as chat's
    request.check()
    items = input_items(request)
    conversation = to_messages(items, {})
    chat = chat_request(request, conversation, True)
    job = _Job(SimpleNamespace(), state, request, MODEL, new_id("resp"), int(time.time()), items, conversation)
    job.prepare(chat, llm)  # the server makes the opening while the engine computes the first token
    return job.events(ChatRun(chat, llm, run, "prompt", {}))


def _has_text(chunk: bytes) -> bool:
    """The chunk carries the stream's first text (chat: a chunk with content, not the role-only one; Responses: the
    one with the first ``response.output_text.delta``), as bench/responses_ttft_probe.py tells them."""
    return b"response.output_text.delta" in chunk or (
        b'"content":"' in chunk and b'"role":"assistant","content":""' not in chunk)


async def _drain(make: Callable, runs: list[FakeRun]) -> tuple[float, float, float, int, int]:
    """CPU seconds to make a stream per run (the handler's own work before the engine: the request validated,
    for Responses its chat request built and its opening made) and to read every event of each, one stream after
    another; of that, up to the first text's bytes (the API code's share of a first token); their bytes and their
    events."""
    size = events = 0
    setup = first = 0.0
    start = time.process_time()
    for run in runs:
        before = time.process_time()
        stream = make(run)
        setup += time.process_time() - before
        waiting = True
        async for chunk in stream:
            if waiting and _has_text(chunk):
                first += time.process_time() - before
                waiting = False
            size += len(chunk)
            events += 1
    return time.process_time() - start, setup, first, size, events


def one_round(side: str, llm: LLMModel, state: Responses, args) -> dict:
    if side == "chat":
        def make(run):
            return _chat_stream(llm, run, args.tokens)
    else:
        def make(run):
            return _responses_stream(llm, state, run, args.tokens)
    runs = [FakeRun(args.text, args.tokens) for _ in range(args.streams)]  # made before the clock starts
    gc.collect()
    cpu, setup, first, size, chunks = asyncio.run(_drain(make, runs))
    deltas = args.streams * args.tokens
    return {"us_per_delta": cpu * 1e6 / deltas, "setup_us_per_request": setup * 1e6 / args.streams,
            "first_text_us_per_request": first * 1e6 / args.streams, "bytes_per_delta": size / deltas,
            "chunks": chunks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=768)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--text", default=" word", help="the text of each delta")
    args = parser.parse_args()
    llm = fake_llm()
    state = Responses(store=None)  # store: false; nothing is written
    results: dict[str, list[dict]] = {"chat": [], "responses": []}
    for r in range(args.rounds):
        for side in (("chat", "responses") if r % 2 == 0 else ("responses", "chat")):
            results[side].append(one_round(side, llm, state, args))
    print(f"{args.streams} streams x {args.tokens} deltas of {args.text!r}, {args.rounds} rounds (medians)")
    print("| side | CPU µs / delta, all in | per round | of which the handler's setup, µs / request | "
          "setup to the first text's bytes, µs / request | bytes / delta |")
    print("|---|---|---|---|---|---|")
    medians = {}
    for side, rounds in results.items():
        medians[side] = statistics.median(r["us_per_delta"] for r in rounds)
        per_round = " / ".join(f"{r['us_per_delta']:.2f}" for r in rounds)
        setup = statistics.median(r["setup_us_per_request"] for r in rounds)
        first = statistics.median(r["first_text_us_per_request"] for r in rounds)
        print(f"| {side} | {medians[side]:.2f} | {per_round} | {setup:.0f} | {first:.0f} | "
              f"{rounds[0]['bytes_per_delta']:.0f} |")
    print(f"responses / chat: {medians['responses'] / medians['chat']:.3f}x CPU per delta")


if __name__ == "__main__":
    main()
