"""Where the server process's CPU goes per add_sub request: cProfile of the core under perf_analyzer.

Starts tideserve (one server process, ``--frontend-workers 1``) on Triton's add_sub repository (as
bench/addsub.py) with a profiling hook, drives it with ``perf_analyzer`` at one concurrency per protocol and,
while it runs, measures two windows of the same length:

- unprofiled: the server process's own CPU (``/proc`` ticks, model processes not included) per request;
- profiled: ``cProfile`` enabled in the server's event-loop thread (SIGUSR1 / SIGUSR2), its functions'
  self-time and call counts divided by the requests served in the window (the model's success count).

The profiler inflates times (every Python call is hooked), so read its µs as shares and its call counts as
exact; the unprofiled CPU µs per request is the number to compare between trees.

    python bench/addsub_profile.py [--protocol http grpc grpc-stream] [--concurrency 32] [--seconds 6] [--top 30]
                                   [--tree /tmp/other-checkout] [--save DIR]

``--tree`` runs the server from another checkout of this repository (e.g. ``git worktree add /tmp/prev
HEAD~``): its packages replace this one's in the server and its model processes (see bench/addsub.py).
``--ab BASE_TREE`` profiles nothing: it compares the server process's CPU per request of two checkouts, both
servers up and driven in turn over several windows (on a shared machine, read the min):

    python bench/addsub_profile.py --ab /tmp/prev --windows 4 --seconds 4
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import addsub  # noqa: E402  (bench/addsub.py: the peers, the server's start and stop, tree_cpu_seconds)

# Runs as the server process: cProfile the main (event-loop) thread between SIGUSR1 and SIGUSR2, then the CLI.
HOOK = """
import cProfile, os, signal, sys, runpy
_out = os.environ["TIDESERVE_PROFILE_OUT"]
_state = {}
def _start(signum, frame):
    _state["p"] = cProfile.Profile(); _state["p"].enable()
def _stop(signum, frame):
    p = _state.pop("p", None)
    if p is not None:
        p.disable(); p.dump_stats(_out)
signal.signal(signal.SIGUSR1, _start)
signal.signal(signal.SIGUSR2, _stop)
sys.argv[0] = "tideserve"
runpy.run_module("tideserve.cli", run_name="__main__")
"""


def success_count(http_port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/models/add_sub/stats", timeout=5) as r:
        stats = json.load(r)["model_stats"]
    return sum(int(s["inference_stats"]["success"]["count"]) for s in stats)


def own_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start(repo: Path, log: Path, profile_out: Path, tree: str | None) -> tuple[subprocess.Popen, int, int]:
    http, grpc, metrics = addsub.free_ports(3)
    cmd = [sys.executable, "-c", HOOK, "--model-repository", str(repo), "--http-port", str(http), "--grpc-port",
           str(grpc), "--metrics-port", str(metrics), "--frontend-workers", "1"]
    env = dict(os.environ, TIDESERVE_PROFILE_OUT=str(profile_out), **addsub.tree_env(tree))
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True,
                            cwd=tree or addsub.ROOT, env=env)
    addsub.wait_ready(proc, http, "add_sub", "the server", log)
    return proc, http, grpc


def short(func: tuple[str, int, str]) -> str:
    filename, line, name = func
    for marker in ("/site-packages/", "/work/main/", "/lib/python3"):
        if marker in filename:
            filename = filename.split(marker, 1)[1]
            break
    return f"{filename}:{line}({name})" if line else name


def load_command(port: int, protocol: str, concurrency: int) -> list[str]:
    """perf_analyzer keeping ``concurrency`` add_sub requests in flight for up to a minute (stopped by the caller)."""
    cmd = [str(addsub.PEERS_HOME / "bin" / "perf_analyzer"), "-m", "add_sub", "-u", f"127.0.0.1:{port}",
           "-i", "grpc" if protocol == "grpc-stream" else protocol, "--concurrency-range", str(concurrency),
           "--measurement-mode", "time_windows", "-p", "60000", "-s", "1", "-r", "10"]
    if protocol == "grpc-stream":  # ModelStreamInfer, one response per request
        cmd.append("--streaming")
    if protocol == "http":
        cmd += ["--input-tensor-format", "json", "--output-tensor-format", "json"]
    return cmd


def measure(proc, http: int, port: int, protocol: str, concurrency: int, seconds: float, profile_out: Path,
            work: Path) -> dict:
    pa = subprocess.Popen(load_command(port, protocol, concurrency), stdout=open(work / f"pa-{protocol}.txt", "wb"),
                          stderr=subprocess.STDOUT)
    try:
        time.sleep(3)  # warm-up
        n0, c0, t0 = success_count(http), own_cpu_seconds(proc.pid), time.monotonic()
        time.sleep(seconds)
        n1, c1, t1 = success_count(http), own_cpu_seconds(proc.pid), time.monotonic()
        profile_out.unlink(missing_ok=True)
        os.kill(proc.pid, signal.SIGUSR1)
        n2 = success_count(http)
        time.sleep(seconds)
        n3 = success_count(http)
        os.kill(proc.pid, signal.SIGUSR2)
        for _ in range(100):
            if profile_out.exists() and profile_out.stat().st_size:
                break
            time.sleep(0.1)
        time.sleep(0.3)
    finally:
        pa.terminate()
        pa.wait(30)
    plain = n1 - n0
    return {"requests": plain, "rate": plain / (t1 - t0), "cpu_us_per_request": (c1 - c0) / max(plain, 1) * 1e6,
            "profiled_requests": n3 - n2, "profile": str(profile_out)}


def cpu_windows(servers: dict, protocol: str, concurrency: int, seconds: float, windows: int, work: Path) -> dict:
    """``windows`` unprofiled windows per server, the servers in turn (one driven at a time): the server process's
    CPU µs per request in each."""
    found: dict[str, list[tuple[float, float]]] = {label: [] for label in servers}
    for window in range(windows):
        for label, (proc, http, grpc) in servers.items():
            port = http if protocol == "http" else grpc
            pa = subprocess.Popen(load_command(port, protocol, concurrency),
                                  stdout=open(work / f"pa-ab-{protocol}.txt", "wb"), stderr=subprocess.STDOUT)
            try:
                time.sleep(2)  # warm-up
                n0, c0, t0 = success_count(http), own_cpu_seconds(proc.pid), time.monotonic()
                time.sleep(seconds)
                n1, c1, t1 = success_count(http), own_cpu_seconds(proc.pid), time.monotonic()
            finally:
                pa.terminate()
                pa.wait(30)
            done = max(n1 - n0, 1)
            found[label].append(((c1 - c0) / done * 1e6, done / (t1 - t0)))
            print(f"  window {window + 1} {label:10s} {protocol} c={concurrency}: "
                  f"{found[label][-1][0]:6.1f} CPU us/request, {found[label][-1][1]:6.0f} req/s", flush=True)
    return found


def report(result: dict, top: int) -> list[dict]:
    stats = pstats.Stats(result["profile"])
    n = max(result["profiled_requests"], 1)
    rows = []
    total = 0.0
    calls = 0
    for func, (cc, nc, tt, ct, callers) in stats.stats.items():
        total += tt
        calls += nc
        rows.append({"func": short(func), "calls": nc / n, "self_us": tt / n * 1e6, "cum_us": ct / n * 1e6})
    rows.sort(key=lambda r: r["self_us"], reverse=True)
    print(f"  profiled: {n} requests, {calls / n:.0f} Python calls and {total / n * 1e6:.0f} us profiled self-time "
          f"per request")
    print(f"  {'self us/req':>11s} {'cum us/req':>10s} {'calls/req':>9s}  function")
    for r in rows[:top]:
        print(f"  {r['self_us']:11.1f} {r['cum_us']:10.1f} {r['calls']:9.2f}  {r['func']}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--protocol", nargs="+", default=["http", "grpc"], choices=["http", "grpc", "grpc-stream"])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--tree", help="run the server from this checkout of the repository")
    parser.add_argument("--save", help="keep the profiles (.prof) in this folder")
    parser.add_argument("--ab", metavar="BASE_TREE",
                        help="no profile: the server from checkout BASE_TREE (\"base\") and from --tree or this one "
                             "(\"new\") both up, --windows unprofiled windows each, in turn; min and median CPU "
                             "us/request of each (a loaded machine: the min is the better hint)")
    parser.add_argument("--windows", type=int, default=4)
    args = parser.parse_args()
    addsub.ensure_peers()
    work = Path(tempfile.mkdtemp(prefix="bench-addsub-profile-"))
    repo = work / "repo"
    shutil.copytree(addsub.SHARED / "peers" / "repos" / "triton", repo)
    print(f"load {open('/proc/loadavg').read().split()[:3]}; tree {args.tree or addsub.ROOT}")
    if args.ab:
        ab(args, repo, work)
        return
    proc, http, grpc = start(repo, work / "server.log", work / "profile.prof", args.tree)
    try:
        for protocol in args.protocol:
            result = measure(proc, http, http if protocol == "http" else grpc, protocol, args.concurrency,
                             args.seconds, work / "profile.prof", work)
            out = work / f"{protocol}.prof"
            os.replace(result["profile"], out)
            result["profile"] = str(out)
            print(f"\n{protocol} c={args.concurrency}: {result['rate']:.0f} req/s unprofiled, server process "
                  f"{result['cpu_us_per_request']:.1f} CPU us/request")
            report(result, args.top)
            if args.save:
                Path(args.save).mkdir(parents=True, exist_ok=True)
                shutil.copy(out, Path(args.save) / out.name)
    finally:
        addsub.stop_server(proc)
    print(f"\nload {open('/proc/loadavg').read().split()[:3]}; logs: {work}")


def ab(args, repo: Path, work: Path) -> None:
    servers = {}
    try:
        for label, tree in (("base", args.ab), ("new", args.tree)):
            servers[label] = start(repo, work / f"server-{label}.log", work / f"{label}.prof", tree)
        for protocol in args.protocol:
            found = cpu_windows(servers, protocol, args.concurrency, args.seconds, args.windows, work)
            cpu = {label: sorted(c for c, _ in rows) for label, rows in found.items()}
            print(f"\n{protocol} c={args.concurrency}, server process CPU us/request over {args.windows} windows:")
            for label, values in cpu.items():
                print(f"  {label:5s} min {values[0]:6.1f}  median {statistics.median(values):6.1f}  "
                      f"({', '.join(f'{v:.1f}' for v in values)})")
            print(f"  new / base: min {cpu['new'][0] / cpu['base'][0]:.3f}x, median "
                  f"{statistics.median(cpu['new']) / statistics.median(cpu['base']):.3f}x\n")
    finally:
        for proc, _, _ in servers.values():
            addsub.stop_server(proc)
    print(f"load {open('/proc/loadavg').read().split()[:3]}; logs: {work}")


if __name__ == "__main__":
    main()
