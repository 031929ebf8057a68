"""Two running tideserve servers' CPU per 1k output tokens under the same streaming chat load, alternating (an A/B).

Each ``--server PORT:PID`` is a server already up with the model ``llm``; PID is its core process (its frontend
worker processes, its children running ``tideserve.workers.main``, are counted with it; the engine's processes are
not). Each round sends every server in turn ``--streams`` concurrent streaming chat completions of ``--tokens``
tokens (greedy, ``ignore_eos``) from an httpx client and reads the processes' utime + stime (``/proc/<pid>/stat``)
before and after:

    python bench/llm_cpu_ab.py --server 21000:1234 --server 21010:5678 [--streams 64] [--tokens 256] [--rounds 4]

Prints each round's tokens/s, chunks and CPU seconds per 1k output tokens, then each server's medians.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from tideserve.bench.llm_servers import cpu_seconds


def _pids(core: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(core), "-f", "tideserve.workers.main"], capture_output=True,
                           check=False, text=True).stdout.split()
    return [core, *(int(pid) for pid in found)]


def _cpu_s(pids: list[int]) -> float:
    return sum(cpu_seconds(pid) for pid in pids)


async def _one(client: httpx.AsyncClient, port: int, tokens: int) -> int:
    body = {"model": "llm", "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    chunks = 0
    async with client.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            chunks += line.startswith("data:")
    return chunks


async def _load(port: int, streams: int, tokens: int) -> tuple[float, int]:
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=streams + 8)) as client:
        await _one(client, port, tokens)  # warm-up
        started = time.monotonic()
        chunks = await asyncio.gather(*(_one(client, port, tokens) for _ in range(streams)))
        return time.monotonic() - started, sum(chunks)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", action="append", required=True, metavar="PORT:PID")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--pause", type=float, default=3.0)
    args = parser.parse_args()
    servers = [tuple(int(x) for x in item.split(":")) for item in args.server]
    results: dict[int, list[tuple[float, float]]] = {port: [] for port, _ in servers}
    for number in range(args.rounds):
        for port, core in servers:
            pids = _pids(core)
            before = _cpu_s(pids)
            wall, chunks = asyncio.run(_load(port, args.streams, args.tokens))
            per_1k = (_cpu_s(pids) - before) / (args.streams * args.tokens / 1000)
            rate = args.streams * args.tokens / wall
            results[port].append((rate, per_1k))
            print(f"round {number + 1} port {port}: {rate:.0f} tok/s, {chunks} chunks, CPU {per_1k:.4f} s / 1k tokens"
                  f" (load {os.getloadavg()[0]:.2f})", flush=True)
            time.sleep(args.pause)
    for port, rows in results.items():
        print(f"port {port}: median {statistics.median(r[0] for r in rows):.0f} tok/s, "
              f"{statistics.median(r[1] for r in rows):.4f} CPU s / 1k tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
