"""tideserve replicas behind vLLM's router (``vllm-router``, the ``bench`` extra): the router's overhead, and
two replicas behind it vs one.

The router is a Rust HTTP proxy that forwards OpenAI requests to the replica its policy picks. Three sides
are measured, one after the other in each round (the order turns every round, so a busy machine's
background load falls on all alike), all streaming chat completions sent by tideserve-bench
(``bench.tideserve_bench.api``, the definitions of ``vllm bench serve``):

* ``direct``: straight to replica A;
* ``router->A``: through a router whose only worker is A (the same engine: the difference is the router);
* ``router->A+B``: through a round-robin router over A and B;
* ``direct 2-thread`` (``--same-threads``): one replica C whose engine has as many threads as A and B
  together, the fair one-replica peer of ``router->A+B``.

First ``--pairs`` single requests alternate between ``direct`` and ``router->A`` (the router's added TTFT: the
median of the pairs' differences, robust to a busy machine's drift). Then each side gets two loads per round:
``--latency-requests`` requests one at a time (TTFT p50) and ``--streams`` streams at once (output tokens/s). Replicas A and B run one engine
thread each, bound to cores 0 and 1 (``VLLM_CPU_OMP_THREADS_BIND``); C binds ``0-1``.

    python bench/router.py [--size 100m] [--streams 16] [--tokens 64] [--rounds 3] [--pairs 40]
                           [--same-threads | --overhead-only]

Prints a table with the medians over the rounds and the ratios to ``direct``; writes
bench/results/router-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere
from tideserve.bench.llm_servers import free_port, start_tideserve, stop_process, story_prompts

MODEL_NAME = "llm"


# -- the router -----------------------------------------------------------------------------------
def router_binary() -> str:
    """The ``vllm-router`` executable of this environment (pip install vllm-router, or the bench extra)."""
    beside = Path(sys.executable).parent / "vllm-router"
    found = str(beside) if beside.exists() else shutil.which("vllm-router")
    if found is None:
        raise RuntimeError("vllm-router is not installed: pip install vllm-router (or the 'bench' extra)")
    return found


def router_command(port: int, workers: list[str], policy: str = "round_robin", metrics_port: int | None = None,
                   health_endpoint: str = "/v2/health/ready") -> list[str]:
    """The router over ``workers`` (base URLs of tideserve HTTP ports): it probes ``health_endpoint`` of each
    (readiness, so a replica whose model is still loading gets no traffic) and serves on 127.0.0.1:``port``."""
    return [router_binary(), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
            "--policy", policy, "--health-check-endpoint", health_endpoint,
            "--prometheus-port", str(metrics_port or free_port()), "--prometheus-host", "127.0.0.1",
            "--worker-startup-check-interval", "1", "--health-check-interval-secs", "5",
            "--request-timeout-secs", "600", "--log-level", "warning"]


def start_router(workers: list[str], log: Path, policy: str = "round_robin", timeout: float = 120,
                 **options) -> tuple[subprocess.Popen, int]:
    """A router process (own session) once it answers ``GET /health`` (it first waits for its workers):
    (process, port)."""
    port = free_port()
    with open(log, "wb") as log_file:  # the child keeps its own descriptor
        proc = subprocess.Popen(router_command(port, workers, policy, **options), stdout=log_file,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm-router exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, port
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            stop_process(proc)
            raise RuntimeError(f"vllm-router was not ready in {timeout:.0f}s; see {log}")
        time.sleep(0.2)


# -- load -----------------------------------------------------------------------------------------
def load(url: str, latency_requests: int, streams: int, tokens: int) -> dict:
    """One round on one side: requests one at a time (TTFT), then ``streams`` at once (throughput)."""
    from tideserve.bench.tideserve_bench.api import measure

    extra = {"temperature": 0}
    measure("openai-chat", url, MODEL_NAME, ["warm up"], 4, extra=extra)
    serial = _checked(measure("openai-chat", url, MODEL_NAME, story_prompts(latency_requests), 8, concurrency=1,
                              extra=extra))
    burst = _checked(measure("openai-chat", url, MODEL_NAME, story_prompts(streams), tokens, extra=extra))
    return {"ttft_p50_ms": serial["ttft_ms"]["median"], "burst_ttft_p50_ms": burst["ttft_ms"]["median"],
            "tokens_per_s": burst["output_throughput"], "itl_p50_ms": burst["itl_ms"]["median"]}


def _checked(result) -> dict:
    summary = result.summary
    if summary["failed"] or summary["truncated"]:
        raise RuntimeError(f"{summary['failed']} failed, {summary['truncated']} truncated: "
                           f"{summary['errors'] or summary['truncations']}")
    return summary


def paired_ttft(direct: str, routed: str, pairs: int) -> dict:
    """``pairs`` single requests to each side, alternating (direct, routed, routed, direct, ...), so drift in
    the machine's load falls on both alike: each side's TTFT p50 and the median of the pairs' differences."""
    from tideserve.bench.tideserve_bench.api import measure

    ttft: dict[str, list[float]] = {"direct": [], "routed": []}
    for index in range(pairs):
        order = [("direct", direct), ("routed", routed)]
        for name, url in (order if index % 2 == 0 else order[::-1]):
            summary = _checked(measure("openai-chat", url, MODEL_NAME, story_prompts(1), 4, extra={"temperature": 0}))
            ttft[name].append(summary["ttft_ms"]["median"])
    differences = [r - d for d, r in zip(ttft["direct"], ttft["routed"])]
    return {"pairs": pairs, "direct_ttft_p50_ms": statistics.median(ttft["direct"]),
            "routed_ttft_p50_ms": statistics.median(ttft["routed"]),
            "added_ttft_p50_ms": statistics.median(differences), "ttft_ms": ttft}


def paired_round_trip(direct: str, routed: str, pairs: int) -> dict:
    """The router's hop alone: ``GET /v1/models`` (no engine work) alternating between the two sides; the
    median of the pairs' differences in milliseconds."""
    times: dict[str, list[float]] = {"direct": [], "routed": []}
    for index in range(pairs):
        order = [("direct", direct), ("routed", routed)]
        for name, url in (order if index % 2 == 0 else order[::-1]):
            started = time.perf_counter()
            with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as response:
                response.read()
            times[name].append((time.perf_counter() - started) * 1000)
    differences = [r - d for d, r in zip(times["direct"], times["routed"])]
    return {"pairs": pairs, "direct_p50_ms": statistics.median(times["direct"]),
            "routed_p50_ms": statistics.median(times["routed"]), "added_p50_ms": statistics.median(differences)}


def medians(runs: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


# -- main -----------------------------------------------------------------------------------------
def _replica_env(work: Path, kv_cache_gib: str, cores: str) -> dict:
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": kv_cache_gib, "VLLM_CPU_OMP_THREADS_BIND": cores,
            "HF_HUB_OFFLINE": "1", "VLLM_CACHE_ROOT": str(work / "vllm-cache"), "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1"}


def _write_repository(work: Path, engine_args: dict) -> Path:
    repo = work / "models"
    (repo / MODEL_NAME / "1").mkdir(parents=True, exist_ok=True)
    (repo / MODEL_NAME / "config.pbtxt").write_text('backend: "vllm"\n')
    (repo / MODEL_NAME / "1" / "model.json").write_text(json.dumps(engine_args))
    return repo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="100m", help="tiny_llama size (default 100m)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--latency-requests", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=40,
                        help="single requests to each of direct / router->A, alternating, for the router's added TTFT")
    parser.add_argument("--overhead-only", action="store_true",
                        help="only replica A and its router: the paired TTFT and the rounds of those two sides")
    parser.add_argument("--same-threads", action="store_true",
                        help="also start replica C with both cores' threads (a third engine)")
    parser.add_argument("--pause", type=float, default=2.0, help="seconds of rest before each side's round")
    parser.add_argument("--kv-cache-gib", default="1", help="VLLM_CPU_KVCACHE_SPACE of each replica")
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "tideserve-bench-llm")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out

    from tideserve.bench.examples.tiny_llama import make_model

    work = Path(tempfile.mkdtemp(prefix="tideserve-bench-router-"))
    model = make_model(args.model_dir / args.size, args.size)
    engine_args = {"model": str(model), "dtype": args.dtype, "max_model_len": 1024, "enforce_eager": True}
    repo = _write_repository(work, engine_args)
    print(f"engine args {engine_args}; router {router_binary()}", flush=True)
    replicas = {"A": "0"} if args.overhead_only else {"A": "0", "B": "1", **({"C": "0-1"} if args.same_threads else {})}
    processes: list[subprocess.Popen] = []
    try:
        ports = {}
        for name, cores in replicas.items():  # one at a time: two engines compiling at once starve each other
            proc, http, _grpc = start_tideserve(repo, work / f"replica-{name}.log",
                                                _replica_env(work, args.kv_cache_gib, cores), MODEL_NAME,
                                                weights=model)
            processes.append(proc)
            ports[name] = http
        url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        router_one, port_one = start_router([url["A"]], work / "router-A.log")
        processes.append(router_one)
        sides = {"direct": url["A"], "router->A": f"http://127.0.0.1:{port_one}"}
        if "B" in url:
            router_two, port_two = start_router([url["A"], url["B"]], work / "router-AB.log")
            processes.append(router_two)
            sides["router->A+B"] = f"http://127.0.0.1:{port_two}"
        if "C" in url:
            sides["direct 2-thread"] = url["C"]
        hop = paired_round_trip(sides["direct"], sides["router->A"], 10 * args.pairs)
        print(f"paired GET /v1/models: direct {hop['direct_p50_ms']:.2f} ms, router->A {hop['routed_p50_ms']:.2f} ms, "
              f"added (median of pairs) {hop['added_p50_ms']:+.2f} ms", flush=True)
        paired = paired_ttft(sides["direct"], sides["router->A"], args.pairs)
        paired["round_trip"] = hop
        print(f"paired: TTFT p50 direct {paired['direct_ttft_p50_ms']:.1f} ms, router->A "
              f"{paired['routed_ttft_p50_ms']:.1f} ms, added (median of pairs) {paired['added_ttft_p50_ms']:+.2f} ms",
              flush=True)
        runs = _rounds(sides, args)
    finally:
        for proc in reversed(processes):
            stop_process(proc)
    _report(runs, paired, engine_args, args)


def _rounds(sides: dict[str, str], args) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    names = list(sides)
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            time.sleep(args.pause)
            result = load(sides[name], args.latency_requests, args.streams, args.tokens)
            runs[name].append(result)
            print(f"round {round_index + 1} {name}: TTFT p50 {result['ttft_p50_ms']:.1f} ms (one at a time), "
                  f"{result['tokens_per_s']:.1f} tok/s ({args.streams} streams)", flush=True)
    return runs


def _report(runs: dict[str, list[dict]], paired: dict, engine_args: dict, args) -> None:
    table = {name: medians(rounds) for name, rounds in runs.items()}
    base = table["direct"]
    print(f"\n| side | TTFT p50, 1 at a time (ms) | TTFT p50, {args.streams} streams (ms) | output tok/s | "
          "throughput vs direct |")
    print("|---|---|---|---|---|")
    for name, row in table.items():
        print(f"| {name} | {row['ttft_p50_ms']:.1f} | {row['burst_ttft_p50_ms']:.1f} | {row['tokens_per_s']:.1f} | "
              f"{row['tokens_per_s'] / base['tokens_per_s']:.3f}x |")
    added = paired["added_ttft_p50_ms"]
    print(f"\nrouter overhead (one replica): TTFT p50 {added:+.2f} ms (median of {paired['pairs']} alternating pairs), "
          f"throughput {table['router->A']['tokens_per_s'] / base['tokens_per_s']:.3f}x")
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"router-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"engine_args": engine_args, "streams": args.streams, "tokens": args.tokens,
                               "latency_requests": args.latency_requests, "rounds": args.rounds,
                               "medians": table, "runs": runs, "paired": paired, "router_ttft_added_ms": added},
                              indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
