"""add_sub throughput and latency: tideserve vs NVIDIA Triton, same model files, same run.

Both servers load the very same Triton repository (``../shared/peers/repos/triton``: a Python-backend
add_sub model, two FP32 [4] inputs, max_batch_size 8, dynamic batching, 2 CPU instances) and
``perf_analyzer`` drives each over HTTP and gRPC at each concurrency, one server at a time.

    python bench/addsub.py [--concurrency 1 8 32] [--http-format json|binary] [--rounds 1]

Peers come from ``../shared/peers`` (setup scripts install them under $PEERS_HOME, /tmp/peers).
Prints a markdown table with tideserve / Triton ratios and writes bench/results/addsub-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("TIDESERVE_SHARED", ROOT.parent / "shared"))
PEERS_HOME = Path(os.environ.get("PEERS_HOME", "/tmp/peers"))


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def ensure_peers() -> None:
    for name in ("perf-analyzer", "triton"):
        subprocess.run(["bash", str(SHARED / "peers" / f"setup-{name}.sh")], check=True,
                       stdout=subprocess.DEVNULL)


def start_server(kind: str, repo: Path, log: Path) -> tuple[subprocess.Popen, int, int]:
    http, grpc, metrics = free_ports(3)
    ports = ["--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)]
    if kind == "tideserve":
        cmd = [sys.executable, "-m", "tideserve.cli", "--model-repository", str(repo), *ports]
    else:
        cmd = [str(PEERS_HOME / "bin" / "tritonserver-cpu"), "--model-repository", str(repo), *ports]
    # Triton runs from the log's folder: started in this repository, its Python stub would import
    # tideserve's own triton_python_backend_utils module from the working directory.
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True,
                            cwd=ROOT if kind == "tideserve" else log.parent)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{kind} exited early, see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/models/add_sub/ready", timeout=2) as r:
                if r.status == 200:
                    return proc, http, grpc
        except OSError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"{kind} did not become ready, see {log}")


def stop_server(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def perf_analyzer(protocol: str, port: int, concurrency: int, http_format: str, log: Path) -> dict:
    cmd = [str(PEERS_HOME / "bin" / "perf_analyzer"), "-m", "add_sub", "-u", f"127.0.0.1:{port}",
           "-i", protocol, "--concurrency-range", str(concurrency), "--measurement-mode", "time_windows",
           "-p", "3000", "-s", "25", "-r", "5", "-v"]
    if protocol == "http" and http_format == "json":
        cmd += ["--input-tensor-format", "json", "--output-tensor-format", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300).stdout
    log.write_text(out)
    result = {"command": " ".join(cmd[1:])}
    if m := re.search(r"Throughput: ([\d.]+) infer/sec", out):
        result["infer_per_s"] = float(m.group(1))
        result["stable"] = True
    else:  # unstable: mean of the last three measurement windows
        passes = [float(x) for x in re.findall(r"Pass \[\d+\] throughput: ([\d.]+)", out)][-3:]
        result["infer_per_s"] = sum(passes) / len(passes) if passes else 0.0
        result["stable"] = False
    for key, label in (("p50_ms", "p50 latency"), ("p99_ms", "p99 latency"), ("avg_ms", "Avg latency")):
        if m := re.search(label + r": (\d+) usec", out):
            result[key] = int(m.group(1)) / 1000
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--http-format", choices=["json", "binary"], default="json")
    parser.add_argument("--servers", nargs="+", default=["triton", "tideserve"])
    args = parser.parse_args()
    ensure_peers()
    work = Path(tempfile.mkdtemp(prefix="bench-addsub-"))
    results: dict = {"load_before": open("/proc/loadavg").read().split()[:3], "cpus": os.cpu_count(),
                     "http_format": args.http_format, "runs": {}}
    for kind in args.servers:
        repo = work / f"{kind}-repo"
        shutil.copytree(SHARED / "peers" / "repos" / "triton", repo)
        proc, http, grpc = start_server(kind, repo, work / f"{kind}.log")
        try:
            for protocol, port in (("http", http), ("grpc", grpc)):
                for c in args.concurrency:
                    r = perf_analyzer(protocol, port, c, args.http_format, work / f"pa-{kind}-{protocol}-{c}.txt")
                    results["runs"][f"{kind}/{protocol}/{c}"] = r
                    print(f"{kind:10s} {protocol:5s} c={c:<3d} {r['infer_per_s']:9.0f} infer/s "
                          f"p50 {r.get('p50_ms', float('nan')):.2f} ms p99 {r.get('p99_ms', float('nan')):.2f} ms"
                          + ("" if r["stable"] else "  (unstable)"), flush=True)
        finally:
            stop_server(proc)
    results["load_after"] = open("/proc/loadavg").read().split()[:3]
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"addsub-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(results, indent=1))
    print(f"\n| protocol | concurrency | tideserve infer/s | Triton infer/s | ratio | tideserve p50 / p99 ms "
          f"| Triton p50 / p99 ms |\n|---|---|---|---|---|---|---|")
    runs = results["runs"]
    for protocol in ("http", "grpc"):
        for c in args.concurrency:
            t, p = runs.get(f"tideserve/{protocol}/{c}"), runs.get(f"triton/{protocol}/{c}")
            if not t or not p:
                continue
            ratio = t["infer_per_s"] / p["infer_per_s"] if p["infer_per_s"] else float("nan")
            print(f"| {protocol} | {c} | {t['infer_per_s']:.0f} | {p['infer_per_s']:.0f} | {ratio:.2f}x | "
                  f"{t.get('p50_ms', 0):.2f} / {t.get('p99_ms', 0):.2f} | {p.get('p50_ms', 0):.2f} / "
                  f"{p.get('p99_ms', 0):.2f} |")
    print(f"\nresults: {out}; logs: {work}")


if __name__ == "__main__":
    main()
