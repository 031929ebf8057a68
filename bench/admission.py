"""LLM admission control under a flood: fast 503s for the excess, and what the flood costs the admitted requests.

One tideserve process serves the tiny random Llama (``tideserve.bench.examples.tiny_llama``) through the
vllm backend with ``max_num_seqs`` S and the config parameter ``max_queue_size`` Q: at most B = S + Q
requests in flight. Rounds alternate (ABAB...) between

* unflooded: B streaming generate requests (``/generate_stream``, ``--tokens`` tokens each, greedy,
  ``ignore_eos``) sent at once; each one's TTFT (request sent to its first event);
* flooded: the same B requests, and once all of them are in the engine (its ``vllm:num_requests_running``
  + ``vllm:num_requests_waiting``, scraped from ``GET /metrics`` of the HTTP port) ``--flood-factor`` x Q
  clients that each send a short ``/generate`` request, and again every ``--flood-every-ms`` whatever the
  answer (``Retry-After`` ignored: a retry storm) until the B requests are done. Every flood answer is
  timed; a 503 must carry ``Retry-After``. The first S requests run at once, the other Q wait for them: their
  TTFT is what a flood could stretch.

Reports the admitted requests' TTFT p50 / p99 on each side (all rounds pooled) and their ratio, and the
flood's answers: how many 503s, how fast (p50 / p99 / max), how many were admitted anyway, timeouts.

    python bench/admission.py [--size tiny] [--max-num-seqs 4] [--max-queue-size 4] [--tokens 64] [--rounds 4]

Writes bench/results/admission-<time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tideserve.bench.llm_servers import (ROOT, engine_env, percentile, start_tideserve, stop_process, story_prompts,
                                         write_vllm_repository)

MODEL = "llm"




async def admitted_request(client: httpx.AsyncClient, base: str, prompt: str, tokens: int) -> dict:
    """One streaming generate request: its status and TTFT."""
    body = {"text_input": prompt, "stream": True,
            "parameters": {"max_tokens": tokens, "temperature": 0, "ignore_eos": True}}
    sent = time.monotonic()
    ttft = None
    async with client.stream("POST", f"{base}/v2/models/{MODEL}/generate_stream", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data:") and ttft is None:
                ttft = time.monotonic() - sent
    return {"status": response.status_code, "ttft_s": ttft}


async def flood_client(client: httpx.AsyncClient, base: str, stop: asyncio.Event, every_s: float,
                       answers: list[dict]) -> None:
    body = {"text_input": "flood", "parameters": {"max_tokens": 4, "temperature": 0}}
    while not stop.is_set():
        sent = time.monotonic()
        try:
            response = await client.post(f"{base}/v2/models/{MODEL}/generate", json=body)
            answers.append({"status": response.status_code, "latency_s": time.monotonic() - sent,
                            "retry_after": response.headers.get("retry-after")})
        except httpx.TimeoutException:
            answers.append({"status": "timeout", "latency_s": time.monotonic() - sent, "retry_after": None})
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except asyncio.TimeoutError:
            pass


async def in_engine(client: httpx.AsyncClient, base: str) -> int:
    """Requests in the engine, running or waiting (its last step's vllm:* gauges)."""
    text = (await client.get(f"{base}/metrics")).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")) and \
                f'model_name="{MODEL}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


async def wait_in_engine(client: httpx.AsyncClient, base: str, count: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while await in_engine(client, base) < count and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


async def run_round(base: str, bound: int, tokens: int, flood_clients: int, flood_every_s: float,
                    wait: bool = True) -> dict:
    limits = httpx.Limits(max_connections=bound + flood_clients + 4)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        admitted = [asyncio.ensure_future(admitted_request(client, base, prompt, tokens))
                    for prompt in story_prompts(bound)]
        answers: list[dict] = []
        flooders = []
        stop = asyncio.Event()
        if wait:  # both sides alike: the flood starts once all are in
            await wait_in_engine(client, base, bound)
        if flood_clients:
            flooders = [asyncio.ensure_future(flood_client(client, base, stop, flood_every_s, answers))
                        for _ in range(flood_clients)]
        results = await asyncio.gather(*admitted)
        stop.set()
        await asyncio.gather(*flooders)
    return {"admitted": results, "flood": answers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="tiny", help="tiny_llama size (default tiny)")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--max-queue-size", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=4, help="rounds per side, alternating (pooled)")
    parser.add_argument("--flood-factor", type=int, default=4, help="flood clients = factor x max_queue_size")
    parser.add_argument("--flood-every-ms", type=float, default=50)
    parser.add_argument("--pause", type=float, default=2.0, help="seconds of rest before each round")
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "tideserve-bench-llm")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from tideserve.bench.examples.tiny_llama import make_model

    work = Path(tempfile.mkdtemp(prefix="tideserve-bench-admission-"))
    env = engine_env(work)
    model = make_model(args.model_dir / args.size, args.size)
    repo = write_vllm_repository(work, model, args.max_num_seqs, args.max_queue_size)
    bound = args.max_num_seqs + args.max_queue_size
    flood_clients = args.flood_factor * args.max_queue_size
    print(f"bound {bound} in flight (max_num_seqs {args.max_num_seqs} + max_queue_size {args.max_queue_size}); "
          f"{bound} admitted streams x {args.tokens} tokens; flood: {flood_clients} clients every "
          f"{args.flood_every_ms:g} ms", flush=True)
    proc, http, _ = start_tideserve(repo, work / "tideserve.log", env, MODEL, weights=model)
    base = f"http://127.0.0.1:{http}"
    sides: dict[str, list[dict]] = {"unflooded": [], "flooded": []}
    try:
        asyncio.run(run_round(base, 1, 4, 0, 0, wait=False))  # warm-up
        for round_index in range(args.rounds):
            order = ("unflooded", "flooded") if round_index % 2 == 0 else ("flooded", "unflooded")
            for side in order:
                time.sleep(args.pause)
                result = asyncio.run(run_round(base, bound, args.tokens, flood_clients if side == "flooded" else 0,
                                               args.flood_every_ms / 1000))
                sides[side].append(result)
                ttfts = [r["ttft_s"] for r in result["admitted"] if r["ttft_s"] is not None]
                rejected = sum(1 for a in result["flood"] if a["status"] == 503)
                print(f"round {round_index + 1} {side}: TTFT p99 {percentile(ttfts, 99):.3f}s, "
                      f"flood answers {len(result['flood'])} ({rejected} x 503)", flush=True)
    finally:
        stop_process(proc)

    summary = {}
    for side, rounds in sides.items():
        admitted = [r for result in rounds for r in result["admitted"]]
        ttfts = [r["ttft_s"] for r in admitted if r["ttft_s"] is not None]
        summary[side] = {"admitted_ok": sum(1 for r in admitted if r["status"] == 200), "admitted_sent": len(admitted),
                         "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99)}
    flood = [a for result in sides["flooded"] for a in result["flood"]]
    rejected = [a for a in flood if a["status"] == 503]
    latencies = [a["latency_s"] for a in rejected]
    summary["flood"] = {
        "answers": len(flood), "rejected_503": len(rejected),
        "with_retry_after": sum(1 for a in rejected if a["retry_after"] is not None),
        "admitted_200": sum(1 for a in flood if a["status"] == 200),
        "timeouts": sum(1 for a in flood if a["status"] == "timeout"),
        "other": sum(1 for a in flood if a["status"] not in (200, 503, "timeout")),
        "latency_p50_ms": percentile(latencies, 50) * 1000, "latency_p99_ms": percentile(latencies, 99) * 1000,
        "latency_max_ms": max(latencies, default=float("nan")) * 1000}
    ratio = summary["flooded"]["ttft_p99_s"] / summary["unflooded"]["ttft_p99_s"]
    summary["ttft_p99_ratio"] = ratio

    print("\n| run | admitted ok / sent | TTFT p50 (s) | TTFT p99 (s) |")
    print("|---|---|---|---|")
    for side in ("unflooded", "flooded"):
        row = summary[side]
        print(f"| {side} | {row['admitted_ok']} / {row['admitted_sent']} | {row['ttft_p50_s']:.3f} "
              f"| {row['ttft_p99_s']:.3f} |")
    f = summary["flood"]
    print(f"\nflooded / unflooded TTFT p99: {ratio:.2f}x")
    print(f"flood: {f['answers']} answers, {f['rejected_503']} x 503 ({f['with_retry_after']} with Retry-After), "
          f"{f['admitted_200']} admitted, {f['timeouts']} timeouts, {f['other']} other; 503 latency p50 "
          f"{f['latency_p50_ms']:.1f} ms, p99 {f['latency_p99_ms']:.1f} ms, max {f['latency_max_ms']:.1f} ms")
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"admission-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
