"""A 4 MB input through system shared memory vs in the request (binary tensors), tideserve and Triton.

One Python-backend model, ``big_sum``: INPUT0 FP32 [1048576] (4 MiB) -> OUTPUT0 FP32 [1], its sum, run in the
server's process (``process_isolation: false`` here; Triton's Python backend has its own stub process).
``perf_analyzer`` drives it over HTTP and gRPC, with the input sent in every request (binary tensor data on HTTP,
``raw_input_contents`` on gRPC) and with ``--shared-memory system`` (the input written once into a registered
region, the request names the region; the output goes to a region too). Same model files, same run, one
server at a time.

    python bench/shared_memory.py [--concurrency 1 4] [--servers tideserve triton]

Prints a table with shared memory / in-request throughput ratios; writes bench/results/shared_memory-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

from tideserve.bench.addsub import start_server
from tideserve.bench.llm_servers import stop_process

ROOT = Path(__file__).resolve().parent.parent
PEERS_HOME = Path(os.environ.get("PEERS_HOME", "/tmp/peers"))
ELEMENTS = 1 << 20  # 4 MiB of FP32

CONFIG = f"""\
name: "big_sum"
backend: "python"
max_batch_size: 0
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ {ELEMENTS} ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
"""
IN_PROCESS = 'parameters { key: "process_isolation" value { string_value: "false" } }\n'
MODEL = '''\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUTPUT0", np.array([pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy().sum()], np.float32))])
            for r in requests]
'''


def write_model(repo: Path, name: str, config: str, model: str) -> None:
    (repo / name / "1").mkdir(parents=True, exist_ok=True)
    (repo / name / "config.pbtxt").write_text(config)
    (repo / name / "1" / "model.py").write_text(model)


def start(kind: str, repo: Path, log: Path, model: str, args: tuple[str, ...] = ()):
    """(process, http port, grpc port) of a tideserve or Triton server over ``repo`` once ``model`` is ready."""
    return start_server(kind, repo, log, model, args)


def perf_analyzer(model: str, protocol: str, port: int, concurrency: int, log: Path, *extra: str) -> dict:
    """perf_analyzer's throughput and latencies for one setting."""
    cmd = [str(PEERS_HOME / "bin" / "perf_analyzer"), "-m", model, "-u", f"127.0.0.1:{port}", "-i", protocol,
           "--concurrency-range", str(concurrency), "--measurement-mode", "time_windows", "-p", "3000",
           "-s", "25", "-r", "5", "-v", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300).stdout
    log.write_text(out)
    result: dict = {"command": "perf_analyzer " + " ".join(cmd[1:])}
    if m := re.search(r"Throughput: ([\d.]+) infer/sec", out):
        result["infer_per_s"] = float(m.group(1))
    else:
        passes = [float(x) for x in re.findall(r"Pass \[\d+\] throughput: ([\d.]+)", out)][-3:]
        result["infer_per_s"] = sum(passes) / len(passes) if passes else 0.0
        result["unstable"] = True
    for key, label in (("p50_ms", "p50 latency"), ("p99_ms", "p99 latency")):
        if m := re.search(label + r": (\d+) usec", out):
            result[key] = int(m.group(1)) / 1000
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--servers", nargs="+", default=["tideserve", "triton"])
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-shm-"))
    results: dict = {"load_before": open("/proc/loadavg").read().split()[:3], "cpus": os.cpu_count(), "runs": {}}
    modes = {"request": (), "shm": ("--shared-memory", "system", "--output-shared-memory-size", "64")}
    for kind in args.servers:
        repo = work / f"{kind}-repo"
        write_model(repo, "big_sum", CONFIG + (IN_PROCESS if kind == "tideserve" else ""), MODEL)
        proc, http, grpc = start(kind, repo, work / f"{kind}.log", "big_sum")
        try:
            for protocol, port in (("http", http), ("grpc", grpc)):
                for c in args.concurrency:
                    for mode, extra in modes.items():
                        r = perf_analyzer("big_sum", protocol, port, c, work / f"pa-{kind}-{protocol}-{c}-{mode}.txt",
                                          *extra)
                        results["runs"][f"{kind}/{protocol}/{c}/{mode}"] = r
                        print(f"{kind:10s} {protocol:5s} c={c:<2d} {mode:8s} {r['infer_per_s']:8.1f} infer/s "
                              f"p50 {r.get('p50_ms', float('nan')):.2f} ms", flush=True)
        finally:
            stop_process(proc)
    print("\n| server | protocol | concurrency | in request (infer/s) | shared memory (infer/s) | shm / request |")
    print("|---|---|---|---|---|---|")
    for kind in args.servers:
        for protocol in ("http", "grpc"):
            for c in args.concurrency:
                plain = results["runs"][f"{kind}/{protocol}/{c}/request"]["infer_per_s"]
                shared = results["runs"][f"{kind}/{protocol}/{c}/shm"]["infer_per_s"]
                ratio = shared / plain if plain else float("nan")
                print(f"| {kind} | {protocol} | {c} | {plain:.1f} | {shared:.1f} | {ratio:.2f}x |")
    results["load_after"] = open("/proc/loadavg").read().split()[:3]
    out = ROOT / "bench" / "results" / f"shared_memory-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
