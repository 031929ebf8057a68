"""gRPC server cores for ModelInfer: ``grpc.aio`` vs grpcio's synchronous (thread pool) server.

Each server variant is a minimal KServe v2 ``inference.GRPCInferenceService`` (the protos shipped with
tritonclient) serving one model, ``add_sub`` (``max_batch_size`` 0, INPUT0/INPUT1 FP32 [4] in,
OUTPUT0 = a + b / OUTPUT1 = a - b out): the servicer decodes the two raw inputs with numpy and answers
with raw output contents. No tideserve core is involved, so the numbers measure the gRPC server core
plus the protobuf work every frontend pays. ServerLive / ServerReady / ServerMetadata / ModelReady /
ModelMetadata / ModelConfig are implemented for perf_analyzer, ModelStatistics for the request count.

    python bench/grpc_servers.py --servers aio aio-uvloop sync-4 sync-8 sync-32 sync-8-opts   # ~4 min

(``--concurrency 1 8 32`` is the default.)

Variants: ``aio`` (``grpc.aio.server()``), ``sync-N`` (``grpc.server(ThreadPoolExecutor(N))``),
``sync-N-opts`` (the same with the channel arguments of ``SYNC_OPTIONS``), ``aio-uvloop``
(``grpc.aio`` on a uvloop event loop). Each variant is started as a subprocess of this script on a
free port, one at a time, and perf_analyzer (``$PEERS_HOME/bin/perf_analyzer``) drives it with ``-i grpc
--measurement-interval 3000`` at each concurrency. Server CPU per request is the server process's
utime + stime (``/proc/<pid>/stat``) over the whole perf_analyzer run divided by every ModelInfer
the server answered in that run (warm-up windows included), read from the servicer's
ModelStatistics count; perf_analyzer's reported request count is kept in the JSON next to it.

Prints a markdown table and writes bench/results/grpc-servers-<time>.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from tideserve.bench.llm_servers import cpu_seconds, free_port, stop_process

ROOT = Path(__file__).resolve().parent.parent
PEERS_HOME = Path(os.environ.get("PEERS_HOME", "/tmp/peers"))
MODEL = "add_sub"
SYNC_OPTIONS = [
    ("grpc.so_reuseport", 0),
    ("grpc.max_concurrent_streams", 1000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.experimental.tcp_min_read_chunk_size", 4096),
    ("grpc.optimization_target", "latency"),
]


# --------------------------------------------------------------------------------------------------
# server side (run as ``python bench/grpc_servers.py --serve VARIANT --port PORT``)


def _servicer_base():
    import numpy as np
    from tritonclient.grpc import model_config_pb2 as mc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pbg

    def tensor_meta(name):
        return pb.ModelMetadataResponse.TensorMetadata(name=name, datatype="FP32", shape=[4])

    metadata = pb.ModelMetadataResponse(
        name=MODEL, versions=["1"], platform="python",
        inputs=[tensor_meta("INPUT0"), tensor_meta("INPUT1")],
        outputs=[tensor_meta("OUTPUT0"), tensor_meta("OUTPUT1")])
    config = pb.ModelConfigResponse(config=mc.ModelConfig(
        name=MODEL, backend="python", max_batch_size=0,
        input=[mc.ModelInput(name=n, data_type=mc.TYPE_FP32, dims=[4]) for n in ("INPUT0", "INPUT1")],
        output=[mc.ModelOutput(name=n, data_type=mc.TYPE_FP32, dims=[4]) for n in ("OUTPUT0", "OUTPUT1")]))
    out_tensors = [pb.ModelInferResponse.InferOutputTensor(name=n, datatype="FP32", shape=[4])
                   for n in ("OUTPUT0", "OUTPUT1")]

    served = itertools.count()

    def statistics():
        # next() on itertools.count is atomic under the GIL; each statistics call takes one number too
        n = next(served) - stats_calls()
        return pb.ModelStatisticsResponse(model_stats=[
            pb.ModelStatistics(name=MODEL, version="1", inference_count=n, execution_count=n)])

    stats_calls = itertools.count().__next__  # statistics calls before this one

    def infer(request):
        next(served)
        arrays = {}
        for i, tensor in enumerate(request.inputs):
            arrays[tensor.name] = np.frombuffer(request.raw_input_contents[i], dtype=np.float32)
        a, b = arrays["INPUT0"], arrays["INPUT1"]
        return pb.ModelInferResponse(model_name=MODEL, model_version="1", id=request.id,
                                     outputs=out_tensors,
                                     raw_output_contents=[(a + b).tobytes(), (a - b).tobytes()])

    return pb, pbg, metadata, config, infer, statistics


def serve(variant: str, port: int) -> None:
    pb, pbg, metadata, config, infer, statistics = _servicer_base()
    import grpc

    server_metadata = pb.ServerMetadataResponse(name="grpc-bench", version="0", extensions=[])

    if variant.startswith("aio"):
        import asyncio

        class AioServicer(pbg.GRPCInferenceServiceServicer):
            async def ServerLive(self, request, context):
                return pb.ServerLiveResponse(live=True)

            async def ServerMetadata(self, request, context):
                return server_metadata

            async def ServerReady(self, request, context):
                return pb.ServerReadyResponse(ready=True)

            async def ModelReady(self, request, context):
                return pb.ModelReadyResponse(ready=request.name == MODEL)

            async def ModelMetadata(self, request, context):
                return metadata

            async def ModelConfig(self, request, context):
                return config

            async def ModelStatistics(self, request, context):
                return statistics()

            async def ModelInfer(self, request, context):
                return infer(request)

        async def main() -> None:
            server = grpc.aio.server()
            pbg.add_GRPCInferenceServiceServicer_to_server(AioServicer(), server)
            server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()
            print("ready", flush=True)
            await server.wait_for_termination()

        if variant == "aio-uvloop":
            import uvloop
            uvloop.run(main())
        else:
            asyncio.run(main())
        return

    from concurrent.futures import ThreadPoolExecutor

    class SyncServicer(pbg.GRPCInferenceServiceServicer):
        def ServerLive(self, request, context):
            return pb.ServerLiveResponse(live=True)

        def ServerMetadata(self, request, context):
            return server_metadata

        def ServerReady(self, request, context):
            return pb.ServerReadyResponse(ready=True)

        def ModelReady(self, request, context):
            return pb.ModelReadyResponse(ready=request.name == MODEL)

        def ModelMetadata(self, request, context):
            return metadata

        def ModelConfig(self, request, context):
            return config

        def ModelStatistics(self, request, context):
            return statistics()

        def ModelInfer(self, request, context):
            return infer(request)

    m = re.fullmatch(r"sync-(\d+)(-opts)?", variant)
    if not m:
        raise SystemExit(f"unknown variant {variant}")
    threads = int(m.group(1))
    kwargs = {}
    if m.group(2):
        kwargs = {"options": SYNC_OPTIONS}
    server = grpc.server(ThreadPoolExecutor(max_workers=threads), **kwargs)
    pbg.add_GRPCInferenceServiceServicer_to_server(SyncServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()


# --------------------------------------------------------------------------------------------------
# driver side


def start(variant: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", variant, "--port", str(port)],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        raise RuntimeError(f"{variant} did not start")
    return proc, port


def perf_analyzer(port: int, concurrency: int) -> tuple[dict, str]:
    cmd = [str(PEERS_HOME / "bin" / "perf_analyzer"), "-m", MODEL, "-u", f"127.0.0.1:{port}", "-i", "grpc",
           "--concurrency-range", str(concurrency), "--measurement-interval", "3000", "-v"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300).stdout
    result: dict = {"command": " ".join(cmd[1:])}
    if m := re.search(r"Throughput: ([\d.]+) infer/sec", out):
        result["infer_per_s"], result["stable"] = float(m.group(1)), True
    else:  # unstable: mean of the last three windows
        passes = [float(x) for x in re.findall(r"Pass \[\d+\] throughput: ([\d.]+)", out)][-3:]
        result["infer_per_s"] = sum(passes) / len(passes) if passes else 0.0
        result["stable"] = False
    for key, label in (("p50_ms", "p50 latency"), ("p99_ms", "p99 latency")):
        if m := re.search(label + r": (\d+) usec", out):
            result[key] = int(m.group(1)) / 1000
    if m := re.search(r"Request count: (\d+)", out):
        result["requests_reported"] = int(m.group(1))
    result["windows"] = len(re.findall(r"Pass \[\d+\] throughput", out))
    return result, out


def served(port: int) -> int:
    """ModelInfer calls the server has answered (its ModelStatistics inference_count)."""
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pbg

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stats = pbg.GRPCInferenceServiceStub(channel).ModelStatistics(pb.ModelStatisticsRequest(name=MODEL))
    return stats.model_stats[0].inference_count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", nargs="+", default=["aio", "aio-uvloop", "sync-4", "sync-8", "sync-32", "sync-8-opts"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port)
        return
    results: dict = {"load_before": open("/proc/loadavg").read().split()[:3], "cpus": os.cpu_count(),
                     "runs": []}
    rows = []
    for variant in args.servers:
        proc, port = start(variant)
        try:
            for c in args.concurrency:
                n0, before = served(port), cpu_seconds(proc.pid)
                r, _ = perf_analyzer(port, c)
                cpu, n = cpu_seconds(proc.pid) - before, served(port) - n0
                r.update(server=variant, concurrency=c, server_cpu_s=cpu, requests_served=n,
                         cpu_us_per_request=1e6 * cpu / max(n, 1),
                         load=open("/proc/loadavg").read().split()[:3])
                results["runs"].append(r)
                rows.append(r)
                print(f"{variant} c={c}: {r['infer_per_s']:.0f} infer/s, "
                      f"{r['cpu_us_per_request']:.0f} us CPU/request", file=sys.stderr, flush=True)
        finally:
            stop_process(proc, 10)
    results["load_after"] = open("/proc/loadavg").read().split()[:3]
    print("| server | concurrency | infer/s | p50 / p99 ms | server CPU µs / request |")
    print("|---|---|---|---|---|")
    for r in rows:
        flag = "" if r["stable"] else " (unstable)"
        print(f"| {r['server']} | {r['concurrency']} | {r['infer_per_s']:.0f}{flag} | "
              f"{r.get('p50_ms', float('nan')):.2f} / {r.get('p99_ms', float('nan')):.2f} | "
              f"{r['cpu_us_per_request']:.0f} |")
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(exist_ok=True)
    path = out_dir / f"grpc-servers-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {path}  (load before {results['load_before']}, after {results['load_after']})")


if __name__ == "__main__":
    main()
