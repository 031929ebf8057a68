"""Prefix-aware routing vs round robin: two tideserve replicas behind ``vllm-router``, a shared-prefix workload.

The workload is the one prefix-aware routing is for: a few long system prompts (``--prefixes`` of them, each
``--prefix-words`` words) shared by many users, each user a short question of its own, sent as streaming chat
completions (``--requests`` of them, ``--concurrency`` at a time, in a seeded random order). Each replica's
engine keeps fewer KV-cache blocks (``--blocks``, vLLM's ``num_gpu_blocks_override``) than all prefixes need
together, but more than half of them: spread over both replicas by round robin every prefix competes for every
cache; kept on one replica each by ``cache_aware`` they fit.

For each policy in turn: both replicas' prefix caches are reset (``POST /reset_prefix_cache``), a router with that
policy is started, the workload runs through it. Reported side by side: the prompt-cache hit rate (the sum of
``usage.prompt_tokens_details.cached_tokens`` over the sum of prompt tokens; the replicas run with
``--enable-prompt-tokens-details``) and TTFT p50 / p90, and their ratios cache_aware / round_robin.

    python bench/prefix_routing.py [--size 100m] [--prefixes 8] [--prefix-words 250] [--requests 64]
                                   [--concurrency 4] [--blocks 38] [--tokens 8] [--rounds 2]

Writes bench/results/prefix_routing-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere
from tideserve.bench.llm_servers import free_port, start_tideserve, stop_process  # noqa: E402
from tideserve.bench.router import router_command  # noqa: E402

MODEL = "llm"
POLICIES = ("round_robin", "cache_aware")
WORDS = ("river market lantern engine harbor signal garden winter copper meadow canyon ledger orbit violet "
         "timber quartz falcon summit pebble thunder archive compass marble").split()


def system_prompts(count: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"System {i}. " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(count)]


def workload(prefixes: list[str], requests: int, seed: int = 1) -> list[tuple[int, str]]:
    rng = random.Random(seed)
    return [(rng.randrange(len(prefixes)), f"User {k}: what does line {rng.randrange(100)} say?")
            for k in range(requests)]


def start_router(port: int, workers: list[str], policy: str, log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        proc = subprocess.Popen(router_command(port, workers, policy), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm-router exited; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return proc
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            stop_process(proc)
            raise RuntimeError(f"vllm-router was not ready; see {log}")
        time.sleep(0.2)


def one_request(client, prefix: str, question: str, tokens: int) -> dict:
    started = time.perf_counter()
    ttft = None
    usage = None
    stream = client.chat.completions.create(
        model=MODEL, stream=True, max_tokens=tokens, temperature=0, stream_options={"include_usage": True},
        messages=[{"role": "system", "content": prefix}, {"role": "user", "content": question}],
        extra_body={"ignore_eos": True})
    for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.perf_counter() - started
        if chunk.usage is not None:
            usage = chunk.usage
    details = usage.prompt_tokens_details
    return {"ttft": ttft, "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": (details.cached_tokens or 0) if details is not None else 0}


def run_policy(policy: str, replicas: list[str], prefixes: list[str], jobs: list[tuple[int, str]], args,
               log: Path) -> dict:
    import openai

    for base in replicas:  # every policy starts from cold caches
        request = urllib.request.Request(f"{base}/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(request, timeout=30) as response:
            if not json.loads(response.read())["success"]:
                raise RuntimeError(f"{base}: the prefix cache was not reset")
    port = free_port()
    router = start_router(port, replicas, policy, log)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
        lock = threading.Lock()
        results: list[dict] = []

        def job(item: tuple[int, str]) -> None:
            result = one_request(client, prefixes[item[0]], item[1], args.tokens)
            with lock:
                results.append(result)

        started = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(job, jobs))
        elapsed = time.perf_counter() - started
    finally:
        stop_process(router, 30)
    ttfts = sorted(r["ttft"] for r in results if r["ttft"] is not None)
    prompt = sum(r["prompt_tokens"] for r in results)
    cached = sum(r["cached_tokens"] for r in results)
    return {"policy": policy, "requests": len(results), "elapsed_s": elapsed, "prompt_tokens": prompt,
            "cached_tokens": cached, "hit_rate": cached / prompt if prompt else 0.0,
            "ttft_p50_s": statistics.median(ttfts), "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="100m", help="the random Llama of bench/examples/tiny_llama.py")
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--prefix-words", type=int, default=250, help="about 4 tokens each with the tiny tokenizer")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=38, help="KV-cache blocks per replica (num_gpu_blocks_override)")
    parser.add_argument("--tokens", type=int, default=8, help="output tokens per request")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    from tideserve.bench.examples.tiny_llama import make_model

    work = Path(tempfile.mkdtemp(prefix="prefix-routing-"))
    weights = make_model(work / "model", args.size)
    repo = work / "models"
    (repo / MODEL / "1").mkdir(parents=True)
    (repo / MODEL / "config.pbtxt").write_text('backend: "vllm"\n')
    (repo / MODEL / "1" / "model.json").write_text(json.dumps({
        "model": str(weights), "dtype": "float32", "max_model_len": 2048, "enforce_eager": True, "max_num_seqs": 8,
        "enable_prefix_caching": True, "num_gpu_blocks_override": args.blocks}))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "VLLM_CACHE_ROOT": str(work / "cache")}
    prefixes = system_prompts(args.prefixes, args.prefix_words)
    jobs = workload(prefixes, args.requests)
    procs = []
    try:
        for k in range(2):
            proc, http, _ = start_tideserve(repo, work / f"replica{k}.log", env, MODEL, weights=weights,
                                            args=("--enable-prompt-tokens-details",), new_session=False)
            procs.append((proc, f"http://127.0.0.1:{http}"))
        replicas = [base for _, base in procs]
        runs: dict[str, list[dict]] = {policy: [] for policy in POLICIES}
        for round_index in range(args.rounds):
            order = POLICIES if round_index % 2 == 0 else tuple(reversed(POLICIES))
            for policy in order:
                result = run_policy(policy, replicas, prefixes, jobs, args, work / "router.log")
                runs[policy].append(result)
                print(json.dumps(result), flush=True)
    finally:
        for proc, _ in procs:
            stop_process(proc)

    def median(policy: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[policy])

    table = {policy: {key: median(policy, key) for key in ("hit_rate", "ttft_p50_s", "ttft_p90_s", "elapsed_s")}
             for policy in POLICIES}
    rr, ca = table["round_robin"], table["cache_aware"]
    ratios = {"hit_rate": ca["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else float("inf"),
              "ttft_p50": ca["ttft_p50_s"] / rr["ttft_p50_s"]}
    print(f"\n{'policy':<12} {'hit rate':>9} {'TTFT p50':>10} {'TTFT p90':>10} {'elapsed':>9}")
    for policy in POLICIES:
        row = table[policy]
        print(f"{policy:<12} {row['hit_rate']:>9.3f} {row['ttft_p50_s'] * 1000:>8.1f}ms "
              f"{row['ttft_p90_s'] * 1000:>8.1f}ms {row['elapsed_s']:>8.1f}s")
    print(f"cache_aware / round_robin: hit rate x{ratios['hit_rate']:.2f}, TTFT p50 x{ratios['ttft_p50']:.2f}")
    out = ROOT / "bench" / "results" / f"prefix_routing-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"args": vars(args), "runs": runs, "table": table, "ratios": ratios}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
