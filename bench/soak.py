"""Soak: many concurrent streams for a long time against a served LLM; reports the memory growth of the
server's process tree and any lost tokens.

Each of ``--streams`` clients loops until ``--duration`` is spent: a streamed ``/v1/completions`` with
``max_tokens`` and ``ignore_eos`` (so the engine generates exactly that many), the usage chunk at the
end. A stream's tokens are counted as the client receives them - with ``--count logprobs`` (default)
the ``logprobs.tokens`` of every chunk, one entry per generated token; with ``--count words`` (the toy
``words`` model, which has no logprobs) the words of the text - and compared with the tokens the
server says it generated (``usage.completion_tokens``) and with ``max_tokens``. Lost tokens are
tokens generated but never received; short streams are those that ended before ``max_tokens``.

The resident memory (RSS) of the server process and all its descendants (vLLM's engine core
included) is sampled every ``--sample-secs``; growth is measured from the first sample after
``--warmup-secs`` (allocators and caches settle first) to the last.

    python bench/soak.py --url http://127.0.0.1:8000 --pid $(pgrep -of 'tideserve.cli') --model llm
    python bench/soak.py --model-repository model_repository --model llm          # starts tideserve itself
    python bench/soak.py --toy --streams 32 --duration 60 --warmup-secs 10       # a short run on the toy model

Not run in CI. Writes nothing; prints a summary and, with ``--json``, the whole record.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from tideserve.bench import toy_repository
from tideserve.bench.llm_servers import start_tideserve, stop_process


def process_tree_rss(pid: int) -> tuple[int, int]:
    """Resident bytes of ``pid`` and every descendant together, and of ``pid`` alone (Linux /proc)."""
    total, own, todo, seen = 0, 0, [pid], set()
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        try:
            with open(f"/proc/{current}/status") as status:
                for line in status:
                    if line.startswith("VmRSS:"):
                        rss = int(line.split()[1]) * 1024
                        total += rss
                        own = rss if current == pid else own
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as children:
                    todo.extend(int(child) for child in children.read().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total, own


@dataclass
class Soak:
    streams_done: int = 0
    streams_failed: int = 0
    short_streams: int = 0
    tokens_received: int = 0
    tokens_generated: int = 0   # as the usage of each stream says
    lost_tokens: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    # (seconds since start, bytes of the process tree, bytes of the server process alone)
    rss_samples: list[tuple[float, int, int]] = field(default_factory=list)
    seconds: float = 0.0

    def error(self, message: str) -> None:
        key = message[:120]
        self.errors[key] = self.errors.get(key, 0) + 1
        self.streams_failed += 1

    def rss_growth(self, warmup: float, which: int = 1) -> tuple[int, int] | None:
        """(RSS at the first sample after the warm-up, RSS at the last sample); ``which``: 1 the tree, 2 the
        server process alone."""
        after = [sample[which] for sample in self.rss_samples if sample[0] >= warmup]
        return (after[0], after[-1]) if len(after) >= 2 else None


def _received(chunk: dict, count: str) -> int:
    tokens = 0
    for choice in chunk.get("choices", []):
        if count == "logprobs":
            tokens += len((choice.get("logprobs") or {}).get("tokens") or [])
        else:
            tokens += len(choice.get("text", "").split())
    return tokens


async def _stream(session: aiohttp.ClientSession, url: str, body: dict, count: str, soak: Soak) -> None:
    received, usage, text = 0, None, []
    async with session.post(url, json=body) as response:
        if response.status != 200:
            soak.error(f"{response.status}: {(await response.text())[:200]}")
            return
        async for line in response.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                soak.error(f"stream error: {chunk['error'].get('message')}")
                return
            if count == "words":
                text += [c.get("text", "") for c in chunk.get("choices", [])]
            else:
                received += _received(chunk, count)
            if chunk.get("usage") and not chunk.get("choices"):
                usage = chunk["usage"]
    if count == "words":
        received = len("".join(text).split())
    # the toy's usage is 0 (no tokenizer); it generates exactly max_tokens words
    generated = usage["completion_tokens"] if usage and count == "logprobs" else body["max_tokens"]
    soak.streams_done += 1
    soak.tokens_received += received
    soak.tokens_generated += generated
    soak.lost_tokens += max(0, generated - received)
    if received < body["max_tokens"]:
        soak.short_streams += 1


async def soak_run(base_url: str, model: str, *, streams: int, duration: float, max_tokens: int, count: str,
                   pid: int | None, sample_secs: float, prompt: str) -> Soak:
    soak = Soak()
    url = f"{base_url}/v1/completions"
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    if count == "logprobs":  # an engine: exactly max_tokens tokens, each listed in its chunk's logprobs
        body.update(ignore_eos=True, temperature=0, logprobs=0)
    started = time.monotonic()
    deadline = started + duration

    async def client() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=300)) as session:
            while time.monotonic() < deadline:
                try:
                    await _stream(session, url, body, count, soak)
                except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                    soak.error(f"{type(exc).__name__}: {exc}")
                    await asyncio.sleep(1)

    async def sampler() -> None:
        last_report = started
        while time.monotonic() < deadline:
            if pid is not None:
                soak.rss_samples.append((round(time.monotonic() - started, 1), *process_tree_rss(pid)))
            if time.monotonic() - last_report >= 60:
                last_report = time.monotonic()
                rss = f", RSS {soak.rss_samples[-1][1] / 2**20:.0f} MiB" if soak.rss_samples else ""
                print(f"  {last_report - started:.0f}s: {soak.streams_done} streams, {soak.tokens_received} tokens, "
                      f"{soak.lost_tokens} lost, {soak.streams_failed} failed{rss}", flush=True)
            await asyncio.sleep(sample_secs)

    tasks = [asyncio.create_task(client()) for _ in range(streams)]
    await asyncio.gather(sampler(), *tasks)
    if pid is not None:
        soak.rss_samples.append((round(time.monotonic() - started, 1), *process_tree_rss(pid)))
    soak.seconds = time.monotonic() - started
    return soak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running tideserve (give --pid to measure its memory)")
    target.add_argument("--model-repository", type=Path, help="start tideserve over this repository")
    target.add_argument("--toy", action="store_true", help="start tideserve over the toy repository (words model)")
    parser.add_argument("--pid", type=int, help="the server's process id, with --url")
    parser.add_argument("--model", default="llm")
    parser.add_argument("--streams", type=int, default=256, help="concurrent streams")
    parser.add_argument("--duration", type=float, default=600, help="seconds")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--count", choices=["logprobs", "words"], default=None,
                        help="how received tokens are counted (default: logprobs, words with --toy)")
    parser.add_argument("--prompt", default="Once upon a time in a quiet town by the river,")
    parser.add_argument("--sample-secs", type=float, default=5)
    parser.add_argument("--warmup-secs", type=float, default=60, help="RSS growth is measured from here on")
    parser.add_argument("--max-growth-mib", type=float, default=None, help="fail when RSS grows more than this")
    parser.add_argument("--json", action="store_true", help="print the whole record as JSON")
    args = parser.parse_args()
    process, base_url, pid = None, args.url, args.pid
    count = args.count or ("words" if args.toy else "logprobs")
    model = "words" if args.toy and args.model == "llm" else args.model
    if base_url is None:
        tmp = Path(tempfile.mkdtemp(prefix="tideserve-soak-"))
        repository = toy_repository.write(tmp, delay_ms=10, max_words=args.max_tokens) if args.toy \
            else args.model_repository.resolve()
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
        process, http, _grpc = start_tideserve(repository, tmp / "server.log", env, ready_model=model)
        base_url, pid = f"http://127.0.0.1:{http}", process.pid
        print(f"tideserve log: {tmp / 'server.log'}")
    print(f"soak: {args.streams} streams x {args.duration:.0f}s on '{model}', {args.max_tokens} tokens each",
          flush=True)
    try:
        soak = asyncio.run(soak_run(base_url, model, streams=args.streams, duration=args.duration,
                                    max_tokens=args.max_tokens, count=count, pid=pid, sample_secs=args.sample_secs,
                                    prompt=args.prompt))
    finally:
        if process is not None:
            stop_process(process)
    rate = soak.tokens_received / soak.seconds if soak.seconds else 0
    print(f"{soak.streams_done} streams in {soak.seconds:.0f}s ({rate:.0f} tokens/s received); "
          f"{soak.tokens_generated} tokens generated, {soak.tokens_received} received, {soak.lost_tokens} lost; "
          f"{soak.short_streams} short streams, {soak.streams_failed} failed")
    for message, times in soak.errors.items():
        print(f"  {times}x {message}")
    growth = soak.rss_growth(args.warmup_secs)
    ok = soak.lost_tokens == 0 and soak.streams_failed == 0
    if growth is not None:
        first, last = growth
        for what, (start, end) in (("server process tree", growth),
                                   ("server process alone", soak.rss_growth(args.warmup_secs, 2))):
            print(f"RSS of the {what}: {start / 2**20:.0f} MiB after the warm-up -> {end / 2**20:.0f} MiB "
                  f"({(end - start) / 2**20:+.1f} MiB, {100 * (end - start) / start:+.1f}%)")
        if args.max_growth_mib is not None and (last - first) / 2**20 > args.max_growth_mib:
            ok = False
    elif pid is None:
        print("RSS not measured (no --pid)")
    if args.json:
        print(json.dumps(asdict(soak)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
