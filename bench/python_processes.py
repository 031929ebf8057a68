"""Python-backend models in processes of their own vs in the server's process: what the process costs.

Three measurements, each for ``process_isolation`` true (the default) and false, on Triton's add_sub
(``tests/models/add_sub``: two FP32 [4] inputs, max_batch_size 8, dynamic batching, 2 CPU instances):

- hop: sequential requests straight into the DataPlane (no frontend, no client) to add_sub without
  dynamic batching and one instance; wall time and CPU time (server, model process) per request. The
  difference between the modes is the cost of the IPC hop.
- throughput: ``perf_analyzer`` (from ../shared/peers, $PEERS_HOME/bin) over gRPC and HTTP (binary
  tensors) at each concurrency against a tideserve process.
- start: explicit loads of add_sub with 1 and with 4 instances (the first load of a server also starts
  its zygote).

    python -m tideserve.bench.python_processes [--concurrency 1 8 32] [--skip throughput]

Prints markdown tables and writes bench/results/python-processes-<time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from tideserve.bench.llm_servers import cpu_seconds, start_tideserve, stop_process

ROOT = Path(__file__).resolve().parent.parent
ADD_SUB = ROOT / "tests" / "models" / "add_sub"
PEERS_HOME = Path(os.environ.get("PEERS_HOME", "/tmp/peers"))
MODES = {"process": "true", "in_process": "false"}


def write_add_sub(repo: Path, name: str, isolation: str, *, batching: bool = True, count: int = 2) -> None:
    shutil.copytree(ADD_SUB, repo / name)
    config = (repo / name / "config.pbtxt").read_text().replace('name: "add_sub"', f'name: "{name}"')
    config = config.replace("count: 2", f"count: {count}")
    if not batching:
        config = "\n".join(line for line in config.splitlines() if not line.startswith("dynamic_batching"))
    config += f'\nparameters {{ key: "process_isolation" value {{ string_value: "{isolation}" }} }}\n'
    (repo / name / "config.pbtxt").write_text(config)


# -- hop: the DataPlane alone ---------------------------------------------------------------------------
async def _hop(repo: Path, requests: int) -> dict:
    from tideserve.backend import BackendRegistry
    from tideserve.dataplane import DataPlane
    from tideserve.repository import ControlMode, ModelRepository
    from tideserve.stats import Metrics
    from tideserve.types import InferenceRequest, Tensor

    metrics = Metrics()
    repository = ModelRepository([repo], BackendRegistry(), metrics, ControlMode.NONE)
    dataplane = DataPlane(repository, metrics)
    await repository.start()
    arrays = {"INPUT0": np.ones((1, 4), np.float32), "INPUT1": np.ones((1, 4), np.float32)}
    results = {}
    try:
        for mode in MODES:
            name = f"hop_{mode}"
            instance = dataplane.model(name).slots[0].instance
            pid = getattr(instance, "pid", 0)

            async def one(name: str = name) -> None:
                request = InferenceRequest(name, {k: Tensor.from_numpy(k, v) for k, v in arrays.items()})
                await dataplane.infer_unary(request)

            for _ in range(500):
                await one()
            child = cpu_seconds(pid) if pid else 0.0
            server, start = time.process_time(), time.perf_counter()
            for _ in range(requests):
                await one()
            wall = time.perf_counter() - start
            results[mode] = {"wall_us": wall / requests * 1e6,
                             "server_cpu_us": (time.process_time() - server) / requests * 1e6,
                             "model_process_cpu_us": ((cpu_seconds(pid) - child) / requests * 1e6) if pid else 0.0}
    finally:
        await repository.shutdown(drain_timeout=5)
    return results


def hop(work: Path, requests: int) -> dict:
    repo = work / "hop"
    for mode, isolation in MODES.items():
        write_add_sub(repo, f"hop_{mode}", isolation, batching=False, count=1)
    return asyncio.run(_hop(repo, requests))


# -- servers -------------------------------------------------------------------------------------------
def start_server(repo: Path, log: Path, *args: str) -> tuple[subprocess.Popen, int, int]:
    return start_tideserve(repo, log, dict(os.environ), ready_model=None, timeout=120, args=args)


# -- throughput: perf_analyzer ------------------------------------------------------------------------------
def perf_analyzer(protocol: str, port: int, concurrency: int, log: Path) -> dict:
    cmd = [str(PEERS_HOME / "bin" / "perf_analyzer"), "-m", "add_sub", "-u", f"127.0.0.1:{port}", "-i", protocol,
           "--concurrency-range", str(concurrency), "--measurement-mode", "time_windows", "-p", "3000", "-s", "25",
           "-r", "5", "-v"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False).stdout
    log.write_text(out)
    result = {"stable": True}
    if match := re.search(r"Throughput: ([\d.]+) infer/sec", out):
        result["infer_per_s"] = float(match.group(1))
    else:  # no stable windows on a busy machine: the mean of the last three
        passes = [float(x) for x in re.findall(r"Pass \[\d+\] throughput: ([\d.]+)", out)][-3:]
        result["infer_per_s"] = sum(passes) / len(passes) if passes else 0.0
        result["stable"] = False
    for key, label in (("p50_ms", "p50 latency"), ("p99_ms", "p99 latency")):
        if match := re.search(label + r": (\d+) usec", out):
            result[key] = int(match.group(1)) / 1000
    return result


def throughput(work: Path, concurrencies: list[int]) -> dict:
    results = {}
    for mode, isolation in MODES.items():
        repo = work / f"throughput-{mode}"
        write_add_sub(repo, "add_sub", isolation)
        proc, http, grpc = start_server(repo, work / f"throughput-{mode}.log")
        try:
            for protocol, port in (("grpc", grpc), ("http", http)):
                for concurrency in concurrencies:
                    key = f"{mode}/{protocol}/{concurrency}"
                    results[key] = perf_analyzer(protocol, port, concurrency, work / f"pa-{mode}-{protocol}-"
                                                                                     f"{concurrency}.txt")
                    print(key, results[key], flush=True)
        finally:
            stop_process(proc)
    return results


# -- start: explicit loads -----------------------------------------------------------------------------------
def _post(url: str) -> float:
    start = time.perf_counter()
    request = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read()
    return time.perf_counter() - start


def start_cost(work: Path) -> dict:
    repo = work / "start"
    for mode, isolation in MODES.items():
        for count in (1, 4):
            write_add_sub(repo, f"start_{mode}_{count}", isolation, count=count)
    proc, http, _ = start_server(repo, work / "start.log", "--model-control-mode", "explicit")
    base = f"http://127.0.0.1:{http}/v2/repository/models"
    results = {}
    try:
        results["process/1/first (with the zygote)"] = _post(f"{base}/start_process_1/load")
        for mode in MODES:
            for count in (1, 4):
                name = f"start_{mode}_{count}"
                _post(f"{base}/{name}/unload")
                results[f"{mode}/{count}"] = min(_post(f"{base}/{name}/load") for _ in range(3))
    finally:
        stop_process(proc)
    return {key: round(seconds * 1000, 1) for key, seconds in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=5000, help="sequential requests of the hop measurement")
    parser.add_argument("--skip", nargs="*", default=[], choices=["hop", "throughput", "start"])
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-python-processes-"))
    results: dict = {"cpus": os.cpu_count(), "load_before": Path("/proc/loadavg").read_text().split()[:3]}
    if "hop" not in args.skip:
        results["hop"] = hop(work, args.requests)
        print("\n| mode | wall per request (us) | server CPU (us) | model process CPU (us) |\n|---|---|---|---|")
        for mode, r in results["hop"].items():
            print(f"| {mode} | {r['wall_us']:.0f} | {r['server_cpu_us']:.0f} | {r['model_process_cpu_us']:.0f} |")
    if "start" not in args.skip:
        results["start_ms"] = start_cost(work)
        print("\n| load | ms |\n|---|---|")
        for key, ms in results["start_ms"].items():
            print(f"| {key} | {ms} |")
    if "throughput" not in args.skip:
        results["throughput"] = throughput(work, args.concurrency)
        print("\n| protocol | concurrency | process infer/s | in-process infer/s | ratio | process p50 ms | "
              "in-process p50 ms |\n|---|---|---|---|---|---|---|")
        for protocol in ("grpc", "http"):
            for c in args.concurrency:
                p, i = results["throughput"][f"process/{protocol}/{c}"], results["throughput"][f"in_process/{protocol}/{c}"]
                ratio = p.get("infer_per_s", 0) / i["infer_per_s"] if i.get("infer_per_s") else float("nan")
                print(f"| {protocol} | {c} | {p.get('infer_per_s', 0):.0f} | {i.get('infer_per_s', 0):.0f} | "
                      f"{ratio:.2f} | {p.get('p50_ms', float('nan')):.2f} | {i.get('p50_ms', float('nan')):.2f} |")
    results["load_after"] = Path("/proc/loadavg").read_text().split()[:3]
    out = ROOT / "bench" / "results" / f"python-processes-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwritten {out}")


if __name__ == "__main__":
    main()
