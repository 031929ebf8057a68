"""Sequence batcher throughput: a stateful accumulator, tideserve vs NVIDIA Triton 2.51, same model files, same run.

The model (Python backend, max_batch_size 32, 2 CPU instances) adds each request's INPUT to its
sequence's running sum. ``--state model`` keeps the sums in the model, keyed by the CORRID control
(START resets, END forgets); ``--state implicit`` keeps them in the server's implicit state
(``INPUT_STATE`` / ``OUTPUT_STATE``). ``perf_analyzer`` drives each server over HTTP and gRPC with
64 concurrent sequences of ``--sequence-length`` requests, one server at a time.

    python -m tideserve.bench.sequence [--strategy oldest|direct] [--state model|implicit]
                                       [--concurrency 64] [--sequence-length 20] [--servers triton tideserve]

Peers come from ``../shared/peers`` (setup scripts install them under $PEERS_HOME, /tmp/peers); Triton
runs from a folder outside this checkout. Prints a markdown table with tideserve / Triton ratios and
writes bench/results/sequence-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path

from . import addsub
from .addsub import PEERS_HOME, ROOT, ensure_peers, stop_server

MODEL = "accumulator"

MODEL_PY = textwrap.dedent("""
    import numpy as np
    import triton_python_backend_utils as pb_utils

    def _get(request, name):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()

    class TritonPythonModel:
        def initialize(self, args):
            self.sums = {}

        def execute(self, requests):
            responses = []
            for request in requests:
                x = _get(request, "INPUT")
                state = _get(request, "INPUT_STATE")
                if state is not None:  # implicit state: the server carries the sum
                    total = (x + state).astype(np.int32)
                    responses.append(pb_utils.InferenceResponse(
                        [pb_utils.Tensor("OUTPUT", total), pb_utils.Tensor("OUTPUT_STATE", total)]))
                    continue
                corrid = int(_get(request, "CORRID").ravel()[0])
                if _get(request, "START").ravel()[0]:
                    self.sums[corrid] = np.zeros_like(x)
                total = (self.sums.get(corrid, 0) + x).astype(np.int32)
                self.sums[corrid] = total
                if _get(request, "END").ravel()[0]:
                    self.sums.pop(corrid, None)
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", total)]))
            return responses
""")


def model_config(strategy: str, state: str) -> str:
    strategies = {"oldest": "oldest { max_candidate_sequences: 32 }", "direct": "direct { }"}
    implicit = ('state [ { input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_INT32 dims: [ 1 ] '
                'initial_state { name: "zero" data_type: TYPE_INT32 dims: [ 1 ] zero_data: true } } ]'
                if state == "implicit" else "")
    return f"""
name: "{MODEL}"
backend: "python"
max_batch_size: 32
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ count: 2 kind: KIND_CPU }} ]
sequence_batching {{
  {strategies[strategy]}
  max_sequence_idle_microseconds: 5000000
  control_input [
    {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "END" control [ {{ kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "CORRID" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 }} ] }}
  ]
  {implicit}
}}
"""


def write_repo(path: Path, strategy: str, state: str) -> Path:
    (path / MODEL / "1").mkdir(parents=True)
    (path / MODEL / "config.pbtxt").write_text(model_config(strategy, state))
    (path / MODEL / "1" / "model.py").write_text(MODEL_PY)
    return path


def start_server(kind: str, repo: Path, log: Path) -> tuple[subprocess.Popen, int, int]:
    return addsub.start_server(kind, repo, log, MODEL)


def perf_analyzer(protocol: str, port: int, concurrency: int, length: int, log: Path) -> dict:
    cmd = [str(PEERS_HOME / "bin" / "perf_analyzer"), "-m", MODEL, "-u", f"127.0.0.1:{port}", "-i", protocol,
           "--concurrency-range", str(concurrency), "--sequence-length", str(length),
           "--measurement-mode", "time_windows", "-p", "3000", "-s", "25", "-r", "5", "-v"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    log.write_text(out)
    result = {"command": " ".join(["perf_analyzer", *cmd[1:]])}
    if m := re.search(r"Throughput: ([\d.]+) infer/sec", out):
        result["infer_per_s"], result["stable"] = float(m.group(1)), True
    else:  # unstable: mean of the last three measurement windows
        passes = [float(x) for x in re.findall(r"Pass \[\d+\] throughput: ([\d.]+)", out)][-3:]
        result["infer_per_s"] = sum(passes) / len(passes) if passes else 0.0
        result["stable"] = False
    for key, label in (("p50_ms", "p50 latency"), ("p99_ms", "p99 latency")):
        if m := re.search(label + r": (\d+) usec", out):
            result[key] = int(m.group(1)) / 1000
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", choices=["oldest", "direct"], default="oldest")
    parser.add_argument("--state", choices=["model", "implicit"], default="model")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--sequence-length", type=int, default=20)
    parser.add_argument("--protocols", nargs="+", default=["http", "grpc"])
    parser.add_argument("--servers", nargs="+", default=["triton", "tideserve"])
    parser.add_argument("--rounds", type=int, default=1, help="alternate the servers this many times; medians")
    args = parser.parse_args()
    ensure_peers()
    work = Path(tempfile.mkdtemp(prefix="bench-sequence-"))
    results: dict = {"load_before": open("/proc/loadavg").read().split()[:3], "cpus": os.cpu_count(),
                     "strategy": args.strategy, "state": args.state, "runs": {}}
    rounds: dict[str, list[dict]] = {}
    for round_index in range(args.rounds):
        for kind in args.servers:
            repo = write_repo(work / f"{kind}-repo-{round_index}", args.strategy, args.state)
            proc, http, grpc = start_server(kind, repo, work / f"{kind}-{round_index}.log")
            try:
                for protocol, port in (("http", http), ("grpc", grpc)):
                    if protocol not in args.protocols:
                        continue
                    r = perf_analyzer(protocol, port, args.concurrency, args.sequence_length,
                                      work / f"pa-{kind}-{protocol}-{round_index}.txt")
                    rounds.setdefault(f"{kind}/{protocol}", []).append(r)
                    print(f"round {round_index} {kind:10s} {protocol:5s} {r['infer_per_s']:9.0f} infer/s p50 "
                          f"{r.get('p50_ms', float('nan')):.2f} ms p99 {r.get('p99_ms', float('nan')):.2f} ms"
                          + ("" if r["stable"] else "  (unstable)"), flush=True)
            finally:
                stop_server(proc)
    for key, runs in rounds.items():  # the median round by throughput
        ordered = sorted(runs, key=lambda r: r["infer_per_s"])
        results["runs"][key] = {**ordered[len(ordered) // 2], "rounds": [r["infer_per_s"] for r in runs]}
    results["load_after"] = open("/proc/loadavg").read().split()[:3]
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"sequence-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(results, indent=1))
    print("\n| protocol | tideserve infer/s | Triton infer/s | ratio | tideserve p50 / p99 ms | Triton p50 / p99 ms |"
          "\n|---|---|---|---|---|---|")
    runs = results["runs"]
    for protocol in args.protocols:
        t, p = runs.get(f"tideserve/{protocol}"), runs.get(f"triton/{protocol}")
        if not t or not p:
            continue
        ratio = t["infer_per_s"] / p["infer_per_s"] if p["infer_per_s"] else float("nan")
        print(f"| {protocol} | {t['infer_per_s']:.0f} | {p['infer_per_s']:.0f} | {ratio:.2f}x | "
              f"{t.get('p50_ms', 0):.2f} / {t.get('p99_ms', 0):.2f} | {p.get('p50_ms', 0):.2f} / "
              f"{p.get('p99_ms', 0):.2f} |")
    print(f"\nresults: {out}; logs: {work}")


if __name__ == "__main__":
    main()
