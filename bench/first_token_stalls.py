"""First-token stalls under bursts of streaming chats: one server (tideserve or vLLM's own api_server), rounds of
``--streams`` concurrent chat completions (the load of bench/openai_vs_vllm.py: the tiny Llama, greedy,
``--tokens`` each), TTFT spread per round.

A round whose TTFT p50, p90 and max are all alike and far above the others' had every stream's first token at once,
late: the engine's first step of the burst stalled (the frontend would delay streams one by one). Run it against
both servers to see whose stall it is:

    python bench/first_token_stalls.py --server tideserve [--rounds 4] [--streams 64 128] [--tokens 256]
    python bench/first_token_stalls.py --server vllm

Each round also says where the time to its last first token went, per process: the client (this process: the
bench's streams), the API process (tideserve's core process or vLLM's api_server), vLLM's engine core and its worker,
each as ``run/wait`` milliseconds, on a CPU and waiting in the kernel's run queue for one (``/proc/<pid>/task/*/
schedstat`` summed over the threads, read every 20 ms by a sampler process of its own). A process that neither runs
nor waits was idle: it had nothing to do. ``--phases 0.2`` adds the same split per 0.2 s of the round's start.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", choices=["tideserve", "vllm"], default="tideserve")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--streams", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--pause", type=float, default=3.0, help="seconds between bursts")
    parser.add_argument("--phases", type=float, default=0.0, help="also print the split per this many seconds")
    args = parser.parse_args()

    import openai_vs_vllm as bench
    from tideserve.bench.examples.tiny_llama import make_model
    from tideserve.bench.tideserve_bench.api import measure

    work = Path(tempfile.mkdtemp(prefix="first-token-stalls-"))
    model = make_model(Path(tempfile.gettempdir()) / "tideserve-bench-llm" / args.size, args.size)  # (made once)
    engine_args = {"model": str(model), "dtype": "float32", "max_model_len": 1024, "enforce_eager": True}
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_CACHE_ROOT": str(work / "vc"),
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    port = bench.free_port()
    cmd = (bench.tideserve_command(engine_args, port, work) if args.server == "tideserve"
           else bench.vllm_command(model, port, engine_args))
    server = bench.Server(args.server, cmd, port, work / "server.log", env)
    sampler = None
    try:
        print(f"{args.server} ready in {server.wait_ready():.0f} s; log {work / 'server.log'}", flush=True)
        sampler = Sampler(work / "schedstat.jsonl", {"client": os.getpid(), **server_processes(server.proc.pid)})
        url = f"http://127.0.0.1:{port}"
        for r in range(args.rounds):
            for n in args.streams:
                measure("openai-chat", url, bench.MODEL_NAME, ["warm up"], 8, extra={"temperature": 0})
                started = time.monotonic()
                summary = measure("openai-chat", url, bench.MODEL_NAME, bench.prompts(n), args.tokens,
                                  extra={"temperature": 0}).summary
                ttft = summary["ttft_ms"]
                print(f"round {r + 1} {n} streams: {summary['output_throughput']:.0f} tok/s, wall "
                      f"{summary['duration_s']:.2f} s, TTFT ms p50 {ttft['median']:.0f} p90 {ttft.get('p90', 0):.0f} "
                      f"max {ttft.get('max', 0):.0f}, failed {summary['failed']}, load {os.getloadavg()[0]:.2f}",
                      flush=True)
                end = started + ttft.get("max", 0) / 1000
                print(f"  to the last first token, run/wait ms: {sampler.split(started, end)}", flush=True)
                at = started
                while args.phases and at < end:
                    print(f"    +{at - started:.1f} s: {sampler.split(at, min(at + args.phases, end))}", flush=True)
                    at += args.phases
                time.sleep(args.pause)
    finally:
        if sampler is not None:
            sampler.close()
        server.stop()


def server_processes(pid: int) -> dict[str, int]:
    """The server's API process and vLLM's engine core and worker among its descendants, by process title."""
    import psutil

    found = {"api": pid}
    for child in psutil.Process(pid).children(recursive=True):
        name = child.name()
        if "EngineCor" in name:
            found["core"] = child.pid
        elif "Worker" in name:
            found["worker"] = child.pid
    return found


SAMPLER = r"""
import json, os, sys, time
pids = json.loads(sys.argv[2])
def sched(pid):
    run = wait = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for task in tasks:
        try:
            fields = open(f"/proc/{pid}/task/{task}/schedstat").read().split()
        except OSError:
            continue
        run, wait = run + int(fields[0]), wait + int(fields[1])
    return run, wait
with open(sys.argv[1], "w") as out:
    while True:
        t = time.monotonic()
        out.write(json.dumps({"t": t, "s": {k: sched(v) for k, v in pids.items()}}) + "\n")
        out.flush()
        time.sleep(max(0.0, 0.02 - (time.monotonic() - t)))
"""


class Sampler:
    """A process of its own (this one's loop runs the bench's streams) that writes each process's summed run and
    run-queue wait nanoseconds every 20 ms."""

    def __init__(self, path: Path, pids: dict[str, int]) -> None:
        self.path = path
        self.proc = subprocess.Popen([sys.executable, "-c", SAMPLER, str(path), json.dumps(pids)])

    def split(self, start: float, end: float) -> str:
        try:
            text = self.path.read_text()
        except OSError:
            return "no samples"
        rows = [json.loads(line) for line in text.splitlines() if line.endswith("}")]
        before = [row for row in rows if row["t"] <= start] or rows[:1]
        after = [row for row in rows if row["t"] >= end] or rows[-1:]
        if not before or not after:
            return "no samples"
        a, b = before[-1], after[0]
        parts = []
        for key, ns in b["s"].items():
            if ns is not None and a["s"].get(key) is not None:
                parts.append(f"{key} {(ns[0] - a['s'][key][0]) / 1e6:.0f}/{(ns[1] - a['s'][key][1]) / 1e6:.0f}")
        return f"{', '.join(parts)} (over {b['t'] - a['t']:.2f} s)"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


if __name__ == "__main__":
    main()
