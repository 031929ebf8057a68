"""Response cache hits vs running the model, tideserve and Triton (its ``local`` cache), same model, same run.

Two copies of one Python-backend model that takes 5 ms per request (``time.sleep``: an expensive model whose
answer is worth keeping): ``cached`` with ``response_cache { enable: true }`` and ``plain`` without. Both
servers start with ``--cache-config local,size=1048576``. ``perf_analyzer`` sends the same input in every
request (its default: random data made once), so every request to ``cached`` after the first is a hit and every
request to ``plain`` runs the model. HTTP and gRPC, one server at a time.

    python bench/response_cache.py [--concurrency 1 4] [--servers tideserve triton]

Prints throughput and p50 latency of hits and of runs, the hit / run ratios, and tideserve / Triton on hits;
writes bench/results/response_cache-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from tideserve.bench.llm_servers import stop_process
from tideserve.bench.shared_memory import ROOT, perf_analyzer, start, write_model

CONFIG = """\
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
{extra}
"""
MODEL = '''\
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.005)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0")
                                                            .as_numpy() * 2)]) for r in requests]
'''
CACHE_FLAGS = ("--cache-config", "local,size=1048576")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--servers", nargs="+", default=["tideserve", "triton"])
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-cache-"))
    results: dict = {"load_before": open("/proc/loadavg").read().split()[:3], "cpus": os.cpu_count(), "runs": {}}
    for kind in args.servers:
        repo = work / f"{kind}-repo"
        write_model(repo, "cached", CONFIG.format(name="cached", extra="response_cache { enable: true }"), MODEL)
        write_model(repo, "plain", CONFIG.format(name="plain", extra=""), MODEL)
        proc, http, grpc = start(kind, repo, work / f"{kind}.log", "cached", CACHE_FLAGS)
        try:
            for protocol, port in (("http", http), ("grpc", grpc)):
                for c in args.concurrency:
                    for model in ("cached", "plain"):
                        r = perf_analyzer(model, protocol, port, c, work / f"pa-{kind}-{protocol}-{c}-{model}.txt")
                        results["runs"][f"{kind}/{protocol}/{c}/{model}"] = r
                        print(f"{kind:10s} {protocol:5s} c={c:<2d} {model:7s} {r['infer_per_s']:8.1f} infer/s "
                              f"p50 {r.get('p50_ms', float('nan')):.2f} ms", flush=True)
        finally:
            stop_process(proc)
    runs = results["runs"]
    print("\n| server | protocol | concurrency | hits infer/s (p50 ms) | runs infer/s (p50 ms) | hit / run |"
          + (" tideserve / Triton, hits |" if "triton" in args.servers and "tideserve" in args.servers else ""))
    print("|---|---|---|---|---|---|" + ("---|" if "triton" in args.servers and "tideserve" in args.servers else ""))
    for kind in args.servers:
        for protocol in ("http", "grpc"):
            for c in args.concurrency:
                hit, run = runs[f"{kind}/{protocol}/{c}/cached"], runs[f"{kind}/{protocol}/{c}/plain"]
                nan = float("nan")
                line = (f"| {kind} | {protocol} | {c} | {hit['infer_per_s']:.0f} ({hit.get('p50_ms', nan):.2f})"
                        f" | {run['infer_per_s']:.0f} ({run.get('p50_ms', nan):.2f}) | "
                        f"{hit['infer_per_s'] / run['infer_per_s'] if run['infer_per_s'] else float('nan'):.1f}x |")
                peer = runs.get(f"triton/{protocol}/{c}/cached")
                if kind == "tideserve" and peer and peer["infer_per_s"]:
                    line += f" {hit['infer_per_s'] / peer['infer_per_s']:.2f}x |"
                print(line)
    results["load_after"] = open("/proc/loadavg").read().split()[:3]
    out = ROOT / "bench" / "results" / f"response_cache-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
