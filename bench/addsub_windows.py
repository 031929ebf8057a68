"""add_sub's CPU per request by process, several servers up at once, their perf_analyzer windows interleaved.

    python bench/addsub_windows.py SERVER [SERVER ...] [--concurrency 8 32] [--rounds 4] [--seconds 4]

SERVER as in ``bench/addsub.py`` (``tideserve:w1``, ``tideserve:w2:direct``, ``tideserve:w2:direct@PATH`` for
another checkout). Every server is started first and stays up (an idle server costs next to nothing); then, per
round and concurrency, each server in turn gets ``perf_analyzer`` over HTTP (JSON) for 1.5 s of warm-up and a
window of ``--seconds``, over which the server's processes' CPU time (``/proc``, by role), context switches, and its
requests and executions (the model's statistics) are read. On a shared, loaded machine the windows of the sides sit
seconds apart instead of minutes (``bench/addsub.py`` restarts each server per point): an A/B by CPU per request
that the load moves less than a throughput. Prints one JSON line per window and the medians over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import addsub


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("servers", nargs="+")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    addsub.ensure_peers(triton=any(s.startswith("triton") for s in args.servers))
    servers = []
    results: dict[str, list[dict]] = {}
    try:
        for kind in args.servers:
            work = Path(tempfile.mkdtemp(prefix="addsub-windows-"))
            repo = work / "repo"
            shutil.copytree(addsub.SHARED / "peers" / "repos" / "triton", repo)
            servers.append((kind, *addsub.start_server(kind, repo, work / "server.log")))
        for round_ in range(args.rounds):
            for concurrency in args.concurrency:
                for kind, proc, http, _ in servers:
                    row = window(proc, http, concurrency, args.seconds)
                    results.setdefault(f"{kind} c={concurrency}", []).append(row)
                    print(round_ + 1, kind, concurrency, json.dumps(row), flush=True)
    finally:
        for _, proc, _, _ in servers:
            addsub.stop_server(proc)
    print("\nmedians over the rounds: infer/s, all processes' CPU us/request, requests per execution, by role")
    for key, rows in results.items():
        roles = {role: statistics.median(r["cpu_us_by_role"].get(role, 0.0) for r in rows)
                 for role in rows[0]["cpu_us_by_role"]}
        print(f"{key}: {statistics.median(r['infer_per_s'] for r in rows):.0f}/s, "
              f"{statistics.median(r['cpu_us'] for r in rows):.1f} us, "
              f"{statistics.median(r['requests_per_execution'] for r in rows):.2f}, {roles}")


def window(proc: subprocess.Popen, http: int, concurrency: int, seconds: float) -> dict:
    client = subprocess.Popen(
        [str(addsub.PEERS_HOME / "bin" / "perf_analyzer"), "-m", "add_sub", "-u", f"127.0.0.1:{http}", "-i", "http",
         "--concurrency-range", str(concurrency), "--measurement-mode", "time_windows", "-p", "600000", "-r", "1",
         "--input-tensor-format", "json", "--output-tensor-format", "json"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.5)
        counts0, cpu0 = addsub.executions(http), addsub.tree_cpu_seconds(proc.pid)
        switches0, started = addsub.tree_switches(proc.pid), time.monotonic()
        time.sleep(seconds)
        counts1, cpu1 = addsub.executions(http), addsub.tree_cpu_seconds(proc.pid)
        switches1, ended = addsub.tree_switches(proc.pid), time.monotonic()
    finally:
        client.kill()
        client.wait()
    requests = max(counts1[0] - counts0[0], 1) if counts0 and counts1 else 1
    executions = max(counts1[1] - counts0[1], 1) if counts0 and counts1 else 1
    by_role = {role: round((t - cpu0.get(role, 0.0)) / requests * 1e6, 1) for role, t in cpu1.items()}
    return {"infer_per_s": round(requests / (ended - started)), "requests_per_execution": round(requests / executions, 2),
            "cpu_us": round(sum(by_role.values()), 1), "cpu_us_by_role": by_role,
            "switches_by_role": {role: round((n - switches0.get(role, 0)) / requests, 2) for role, n in switches1.items()},
            "load": round(os.getloadavg()[0], 2)}


if __name__ == "__main__":
    main()
