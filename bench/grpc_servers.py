"""gRPC server cores for ModelInfer / ModelStreamInfer: grpc.aio, grpcio's synchronous server, generic
(raw-bytes) handlers on both, grpclib, pyvoy (Envoy's HTTP/2 in front of an ASGI app), and NVIDIA Triton
as the reference, all in one run.

Each Python variant is a minimal KServe v2 ``inference.GRPCInferenceService`` (the protos shipped with
tritonclient) serving one model, ``add_sub`` (``max_batch_size`` 0, INPUT0/INPUT1 FP32 [4] in,
OUTPUT0 = a + b / OUTPUT1 = a - b out): the servicer decodes the two raw inputs with numpy and answers
with raw output contents. No tideserve core is involved, so the numbers measure the gRPC server core
plus the protobuf work every frontend pays. ServerLive / ServerReady / ServerMetadata / ModelReady /
ModelMetadata / ModelConfig are implemented for perf_analyzer, ModelStatistics for the request count,
ModelStreamInfer (one response per request) for ``perf_analyzer --streaming``.

    python bench/grpc_servers.py --rounds 2     # the default set below, alternating; ~25 min on 2 cores

Variants (``--servers``):

- ``aio``: ``grpc.aio.server()`` with the generated servicer (protobuf messages in and out);
  ``aio-uvloop``: the same on a uvloop event loop.
- ``aio-generic``: ``grpc.aio.server()`` whose ModelInfer / ModelStreamInfer are generic handlers on raw
  bytes (no request_deserializer / response_serializer): the request is parsed with the protobuf (upb)
  class here, the response bytes are built here from a constant prefix (no message object).
- ``sync-N``: ``grpc.server(ThreadPoolExecutor(N))``; ``sync-N-opts`` adds the channel arguments of
  ``SYNC_OPTIONS``; ``sync-generic`` (8 threads, or ``sync-generic-N``): the raw-bytes handlers on it.
- ``grpclib`` / ``grpclib-uvloop``: grpclib's asyncio server (pure Python over h2) with a pass-through codec
  for the raw-bytes handlers.
- ``pyvoy``: the raw-bytes handlers as an ASGI app (gRPC framing and trailers written here) served by pyvoy
  (Envoy with Python embedded: HTTP/2 in C++); needs pyvoy importable (``--pyvoy-path`` to a
  ``pip install --target`` folder, default /tmp/pyvoy-pkgs).
- ``hypercorn``: the same ASGI app on Hypercorn (pure Python over h2; ``--hypercorn-path``, default
  /tmp/hypercorn-pkgs).
- ``triton``: ``$PEERS_HOME/bin/tritonserver-cpu`` on ``--triton-repo`` (Triton's add_sub, Python backend).
- ``VARIANT+stream``: the same server driven with ``perf_analyzer --streaming`` (ModelStreamInfer).

Each variant is started as a process group of its own (its own session) on a free port, one at a time;
perf_analyzer (``$PEERS_HOME/bin/perf_analyzer``) drives it with ``-i grpc --measurement-interval 3000
--max-trials MAX`` at each concurrency; rounds alternate the variants. Server CPU per request is the
utime + stime of every process in the server's process group (``/proc/<pid>/stat``; Triton's python-backend
stubs and pyvoy's Envoy included) over the whole perf_analyzer run divided by every ModelInfer the server
answered in that run (warm-up windows included), read from the server's ModelStatistics inference count.

Prints markdown tables (with each point's ratio to Triton of the same round) and writes
bench/results/grpc-servers-<time>.json.
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

ROOT = Path(__file__).resolve().parent.parent
PEERS_HOME = Path(os.environ.get("PEERS_HOME", "/tmp/peers"))
TRITON_REPO = Path("/work/shared/peers/repos/triton")
MODEL = "add_sub"
SERVICE = "inference.GRPCInferenceService"
SYNC_OPTIONS = [
    ("grpc.so_reuseport", 0),
    ("grpc.max_concurrent_streams", 1000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.experimental.tcp_min_read_chunk_size", 4096),
    ("grpc.optimization_target", "latency"),
]
DEFAULT_SERVERS = ["triton", "aio", "aio-generic", "sync-8", "sync-generic", "grpclib", "grpclib-uvloop",
                   "pyvoy", "triton+stream", "aio+stream", "aio-generic+stream", "pyvoy+stream"]


# --------------------------------------------------------------------------------------------------
# server side (run as ``python bench/grpc_servers.py --serve VARIANT --port PORT``)


def _varint(n: int) -> bytes:
    from tideserve.grpc.codec import varint  # the frontend's own (its answers' bytes use it)

    return varint(n)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


class Servicer:
    """The add_sub servicer logic every variant shares: protobuf messages (``infer``) or raw bytes
    (``infer_bytes`` / ``stream_bytes``) for ModelInfer, the protobuf messages of the other calls."""

    def __init__(self) -> None:
        import numpy as np
        from tritonclient.grpc import model_config_pb2 as mc
        from tritonclient.grpc import service_pb2 as pb

        self.np, self.pb = np, pb

        def tensor_meta(name):
            return pb.ModelMetadataResponse.TensorMetadata(name=name, datatype="FP32", shape=[4])

        self.metadata = pb.ModelMetadataResponse(
            name=MODEL, versions=["1"], platform="python",
            inputs=[tensor_meta("INPUT0"), tensor_meta("INPUT1")],
            outputs=[tensor_meta("OUTPUT0"), tensor_meta("OUTPUT1")])
        self.config = pb.ModelConfigResponse(config=mc.ModelConfig(
            name=MODEL, backend="python", max_batch_size=0,
            input=[mc.ModelInput(name=n, data_type=mc.TYPE_FP32, dims=[4]) for n in ("INPUT0", "INPUT1")],
            output=[mc.ModelOutput(name=n, data_type=mc.TYPE_FP32, dims=[4]) for n in ("OUTPUT0", "OUTPUT1")]))
        self.server_metadata = pb.ServerMetadataResponse(name="grpc-bench", version="0", extensions=[])
        self.out_tensors = [pb.ModelInferResponse.InferOutputTensor(name=n, datatype="FP32", shape=[4])
                            for n in ("OUTPUT0", "OUTPUT1")]
        # the raw response: model_name (1), model_version (2), then id (3), outputs (5), raw contents (6)
        self.head = _field(1, MODEL.encode()) + _field(2, b"1")
        self.outputs = b"".join(_field(5, t.SerializeToString()) for t in self.out_tensors)
        self.served = itertools.count()
        self.stats_calls = itertools.count().__next__  # statistics calls before this one

    def statistics(self):
        # next() on itertools.count is atomic under the GIL; each statistics call takes one number too
        pb = self.pb
        n = next(self.served) - self.stats_calls()
        return pb.ModelStatisticsResponse(model_stats=[
            pb.ModelStatistics(name=MODEL, version="1", inference_count=n, execution_count=n)])

    def _add_sub(self, request):
        next(self.served)
        np = self.np
        arrays = {}
        for i, tensor in enumerate(request.inputs):
            arrays[tensor.name] = np.frombuffer(request.raw_input_contents[i], dtype=np.float32)
        a, b = arrays["INPUT0"], arrays["INPUT1"]
        return (a + b).tobytes(), (a - b).tobytes()

    def infer(self, request):
        out0, out1 = self._add_sub(request)
        return self.pb.ModelInferResponse(model_name=MODEL, model_version="1", id=request.id,
                                          outputs=self.out_tensors, raw_output_contents=[out0, out1])

    def infer_bytes(self, data: bytes) -> bytes:
        request = self.pb.ModelInferRequest.FromString(data)
        out0, out1 = self._add_sub(request)
        rid = _field(3, request.id.encode()) if request.id else b""
        return b"".join((self.head, rid, self.outputs, _field(6, out0), _field(6, out1)))

    def stream_bytes(self, data: bytes) -> bytes:
        """A ModelStreamInferResponse whose infer_response (2) answers the raw ModelInferRequest ``data``."""
        return _field(2, self.infer_bytes(data))

    def unary(self):
        """Method name -> (function of the request message, request class, response class) for the calls
        other than ModelInfer / ModelStreamInfer (not on the hot path: protobuf messages everywhere)."""
        pb = self.pb
        return {
            "ServerLive": (lambda r: pb.ServerLiveResponse(live=True), pb.ServerLiveRequest, pb.ServerLiveResponse),
            "ServerReady": (lambda r: pb.ServerReadyResponse(ready=True), pb.ServerReadyRequest,
                            pb.ServerReadyResponse),
            "ServerMetadata": (lambda r: self.server_metadata, pb.ServerMetadataRequest, pb.ServerMetadataResponse),
            "ModelReady": (lambda r: pb.ModelReadyResponse(ready=r.name == MODEL), pb.ModelReadyRequest,
                           pb.ModelReadyResponse),
            "ModelMetadata": (lambda r: self.metadata, pb.ModelMetadataRequest, pb.ModelMetadataResponse),
            "ModelConfig": (lambda r: self.config, pb.ModelConfigRequest, pb.ModelConfigResponse),
            "ModelStatistics": (lambda r: self.statistics(), pb.ModelStatisticsRequest, pb.ModelStatisticsResponse),
        }


def _grpcio_generic_handlers(s: Servicer, asynchronous: bool) -> dict:
    """grpcio method handlers: ModelInfer / ModelStreamInfer on raw bytes, the rest with protobuf (de)serializers."""
    import grpc

    handlers = {}
    for name, (fn, req, resp) in s.unary().items():
        if asynchronous:
            async def call(request, context, fn=fn):
                return fn(request)
        else:
            def call(request, context, fn=fn):
                return fn(request)
        handlers[name] = grpc.unary_unary_rpc_method_handler(
            call, request_deserializer=req.FromString, response_serializer=resp.SerializeToString)
    infer_bytes, stream_bytes = s.infer_bytes, s.stream_bytes
    if asynchronous:
        async def model_infer(data, context):
            return infer_bytes(data)

        async def model_stream_infer(request_iterator, context):
            async for data in request_iterator:
                yield stream_bytes(data)
    else:
        def model_infer(data, context):
            return infer_bytes(data)

        def model_stream_infer(request_iterator, context):
            for data in request_iterator:
                yield stream_bytes(data)
    handlers["ModelInfer"] = grpc.unary_unary_rpc_method_handler(model_infer)
    handlers["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(model_stream_infer)
    return handlers


def _add_generic(server, handlers: dict) -> None:
    import grpc

    # as the generated code does: the generic handler, plus the registered methods where grpcio has them
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    if hasattr(server, "add_registered_method_handlers"):
        server.add_registered_method_handlers(SERVICE, handlers)


def serve_aio(s: Servicer, variant: str, port: int) -> None:
    import asyncio

    import grpc
    from tritonclient.grpc import service_pb2_grpc as pbg

    unary = s.unary()

    class AioServicer(pbg.GRPCInferenceServiceServicer):
        async def ModelInfer(self, request, context):
            return s.infer(request)

        async def ModelStreamInfer(self, request_iterator, context):
            async for request in request_iterator:
                yield s.pb.ModelStreamInferResponse(infer_response=s.infer(request))

    for name, (fn, _, _) in unary.items():
        async def method(self, request, context, fn=fn):
            return fn(request)
        setattr(AioServicer, name, method)

    async def main() -> None:
        server = grpc.aio.server()
        if variant == "aio-generic":
            _add_generic(server, _grpcio_generic_handlers(s, asynchronous=True))
        else:
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


def serve_sync(s: Servicer, variant: str, port: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    from tritonclient.grpc import service_pb2_grpc as pbg

    class SyncServicer(pbg.GRPCInferenceServiceServicer):
        def ModelInfer(self, request, context):
            return s.infer(request)

        def ModelStreamInfer(self, request_iterator, context):
            for request in request_iterator:
                yield s.pb.ModelStreamInferResponse(infer_response=s.infer(request))

    for name, (fn, _, _) in s.unary().items():
        def method(self, request, context, fn=fn):
            return fn(request)
        setattr(SyncServicer, name, method)

    m = re.fullmatch(r"sync-(generic)?-?(\d+)?(-opts)?", variant)
    if not m or not (m.group(1) or m.group(2)):
        raise SystemExit(f"unknown variant {variant}")
    threads = int(m.group(2) or 8)
    kwargs = {"options": SYNC_OPTIONS} if m.group(3) else {}
    server = grpc.server(ThreadPoolExecutor(max_workers=threads), **kwargs)
    if m.group(1):
        _add_generic(server, _grpcio_generic_handlers(s, asynchronous=False))
    else:
        pbg.add_GRPCInferenceServiceServicer_to_server(SyncServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()


def serve_grpclib(s: Servicer, variant: str, port: int) -> None:
    import asyncio

    from grpclib.const import Cardinality, Handler
    from grpclib.encoding.base import CodecBase
    from grpclib.server import Server

    class PassThroughCodec(CodecBase):
        """Protobuf for the messages of the metadata calls; ``bytes`` passes through as it is."""
        __content_subtype__ = "proto"

        def encode(self, message, message_type):
            return message if message_type is bytes else message.SerializeToString()

        def decode(self, data, message_type):
            return data if message_type is bytes else message_type.FromString(data)

    mapping = {}
    for name, (fn, req, resp) in s.unary().items():
        async def call(stream, fn=fn):
            request = await stream.recv_message()
            await stream.send_message(fn(request))
        mapping[f"/{SERVICE}/{name}"] = Handler(call, Cardinality.UNARY_UNARY, req, resp)

    infer_bytes, stream_bytes = s.infer_bytes, s.stream_bytes

    async def model_infer(stream):
        data = await stream.recv_message()
        await stream.send_message(infer_bytes(data))

    async def model_stream_infer(stream):
        async for data in stream:
            await stream.send_message(stream_bytes(data))

    mapping[f"/{SERVICE}/ModelInfer"] = Handler(model_infer, Cardinality.UNARY_UNARY, bytes, bytes)
    mapping[f"/{SERVICE}/ModelStreamInfer"] = Handler(model_stream_infer, Cardinality.STREAM_STREAM, bytes, bytes)

    class Service:
        def __mapping__(self):
            return mapping

    async def main() -> None:
        server = Server([Service()], codec=PassThroughCodec())
        await server.start("127.0.0.1", port)
        print("ready", flush=True)
        await server.wait_closed()

    if variant == "grpclib-uvloop":
        import uvloop
        uvloop.run(main())
    else:
        asyncio.run(main())


def asgi_grpc_app(s: Servicer):
    """gRPC over ASGI (HTTP/2 trailers through the ``http.response.trailers`` extension): the raw-bytes
    handlers, gRPC's 5-byte message framing written and read here."""
    unary = {f"/{SERVICE}/{name}": (fn, req) for name, (fn, req, _) in s.unary().items()}
    infer_path, stream_path = f"/{SERVICE}/ModelInfer", f"/{SERVICE}/ModelStreamInfer"
    start = {"type": "http.response.start", "status": 200, "trailers": True,
             "headers": [(b"content-type", b"application/grpc")]}
    ok = {"type": "http.response.trailers", "headers": [(b"grpc-status", b"0")], "more_trailers": False}

    def frame(payload: bytes) -> bytes:
        return b"\x00" + len(payload).to_bytes(4, "big") + payload

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path = scope["path"]
        if path == stream_path:
            await send(start)
            buffer = b""
            while True:
                message = await receive()
                buffer += message.get("body", b"")
                while len(buffer) >= 5 and len(buffer) >= 5 + int.from_bytes(buffer[1:5], "big"):
                    end = 5 + int.from_bytes(buffer[1:5], "big")
                    await send({"type": "http.response.body", "body": frame(s.stream_bytes(buffer[5:end])),
                                "more_body": True})
                    buffer = buffer[end:]
                if message["type"] != "http.request" or not message.get("more_body"):
                    break
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            await send(ok)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if path == infer_path:
            out = s.infer_bytes(body[5:])
        elif path in unary:
            fn, req = unary[path]
            out = fn(req.FromString(body[5:])).SerializeToString()
        else:
            await send(start)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            await send({"type": "http.response.trailers", "more_trailers": False,
                        "headers": [(b"grpc-status", b"12"), (b"grpc-message", b"unimplemented")]})
            return
        await send(start)
        await send({"type": "http.response.body", "body": frame(out), "more_body": False})
        await send(ok)

    return app


def __getattr__(name: str):
    # ``pyvoy bench.grpc_servers:asgi_app`` (run by serve_pyvoy): the app is built on first access
    if name == "asgi_app":
        app = asgi_grpc_app(Servicer())
        globals()["asgi_app"] = app
        return app
    raise AttributeError(name)


def serve_pyvoy(port: int) -> None:
    """pyvoy's CLI on this module's ``asgi_app``, in the foreground of this process group."""
    code = "import sys; from pyvoy._cli import main; sys.exit(main())"
    os.execvp(sys.executable, [sys.executable, "-c", code, "grpc_servers:asgi_app", "--port", str(port),
                               "--log-level", "error"])


def serve_hypercorn(port: int) -> None:
    """Hypercorn (pure Python over h2, HTTP/2 trailers since 0.17) on this module's ASGI app."""
    import asyncio

    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    asyncio.run(hypercorn_serve(asgi_grpc_app(Servicer()), config))


def serve(variant: str, port: int) -> None:
    if variant == "pyvoy":
        serve_pyvoy(port)
    if variant == "hypercorn":
        serve_hypercorn(port)
        return
    s = Servicer()
    if variant.startswith("aio"):
        serve_aio(s, variant, port)
    elif variant.startswith("sync"):
        serve_sync(s, variant, port)
    elif variant.startswith("grpclib"):
        serve_grpclib(s, variant, port)
    else:
        raise SystemExit(f"unknown variant {variant}")


# --------------------------------------------------------------------------------------------------
# driver side


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU time so far of every live process in process group ``pgid`` (Linux /proc)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def stop_group(proc: subprocess.Popen, timeout: float = 10) -> None:
    import signal

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    try:  # children left behind (Triton's stubs, Envoy)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def wait_ready(port: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pbg

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                if pbg.GRPCInferenceServiceStub(channel).ModelReady(pb.ModelReadyRequest(name=MODEL), timeout=2).ready:
                    return
        except grpc.RpcError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server not ready in time")


def start(variant: str, args) -> tuple[subprocess.Popen, int]:
    port = free_port()
    if variant == "triton":
        cmd = [str(PEERS_HOME / "bin" / "tritonserver-cpu"), "--model-repository", str(args.triton_repo),
               "--grpc-port", str(port), "--http-port", str(free_port()), "--metrics-port", str(free_port()),
               "--log-verbose", "0"]
        # cwd outside the repository: its triton_python_backend_utils.py would shadow the stub's own
        with open(Path(os.environ.get("TMPDIR", "/tmp")) / "grpc-servers-triton.log", "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd="/")
    else:
        env = dict(os.environ)
        if variant in ("pyvoy", "hypercorn"):
            extra = args.pyvoy_path if variant == "pyvoy" else args.hypercorn_path
            paths = [str(Path(__file__).resolve().parent), extra, env.get("PYTHONPATH", "")]
            env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        proc = subprocess.Popen([sys.executable, __file__, "--serve", variant, "--port", str(port)],
                                stdout=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        wait_ready(port, proc)
    except Exception:
        stop_group(proc)
        raise
    return proc, port


def perf_analyzer(port: int, concurrency: int, streaming: bool, max_trials: int) -> tuple[dict, str]:
    cmd = [str(PEERS_HOME / "bin" / "perf_analyzer"), "-m", MODEL, "-u", f"127.0.0.1:{port}", "-i", "grpc",
           "--concurrency-range", str(concurrency), "--measurement-interval", "3000",
           "--max-trials", str(max_trials), "-v"]
    if streaming:
        cmd.append("--streaming")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False).stdout
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
    if not result["windows"]:
        result["output_tail"] = out[-2000:]
    return result, out


def served(port: int) -> int:
    """ModelInfer calls the server has answered (its ModelStatistics inference_count)."""
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pbg

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stats = pbg.GRPCInferenceServiceStub(channel).ModelStatistics(pb.ModelStatisticsRequest(name=MODEL))
    return stats.model_stats[0].inference_count


def loadavg() -> list[str]:
    return open("/proc/loadavg").read().split()[:3]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", nargs="+", default=DEFAULT_SERVERS)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-trials", type=int, default=6, help="perf_analyzer windows per point at most")
    parser.add_argument("--triton-repo", type=Path, default=TRITON_REPO)
    parser.add_argument("--pyvoy-path", default="/tmp/pyvoy-pkgs", help="where pyvoy is installed (pip --target)")
    parser.add_argument("--hypercorn-path", default="/tmp/hypercorn-pkgs", help="where hypercorn is installed")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port)
        return
    results: dict = {"load_before": loadavg(), "cpus": os.cpu_count(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                     "runs": [], "failed": []}
    print(f"load average before: {results['load_before']}", file=sys.stderr, flush=True)
    for rnd in range(1, args.rounds + 1):
        for name in args.servers:
            variant, streaming = name.removesuffix("+stream"), name.endswith("+stream")
            try:
                proc, port = start(variant, args)
            except Exception as exc:  # noqa: BLE001 - a variant that cannot start is reported, the run goes on
                results["failed"].append({"server": name, "round": rnd, "error": str(exc)})
                print(f"{name} round {rnd}: did not start: {exc}", file=sys.stderr, flush=True)
                continue
            try:
                for c in args.concurrency:
                    n0, before = served(port), group_cpu_seconds(proc.pid)
                    r, _ = perf_analyzer(port, c, streaming, args.max_trials)
                    cpu, n = group_cpu_seconds(proc.pid) - before, served(port) - n0
                    r.update(server=name, round=rnd, concurrency=c, server_cpu_s=cpu, requests_served=n,
                             cpu_us_per_request=1e6 * cpu / max(n, 1), load=loadavg())
                    results["runs"].append(r)
                    print(f"round {rnd} {name} c={c}: {r['infer_per_s']:.0f} infer/s, "
                          f"{r['cpu_us_per_request']:.0f} us CPU/request, load {r['load'][0]}",
                          file=sys.stderr, flush=True)
            finally:
                stop_group(proc)
    results["load_after"] = loadavg()
    print_tables(results, args)
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(exist_ok=True)
    path = out_dir / f"grpc-servers-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {path}  (load before {results['load_before']}, after {results['load_after']})")


def print_tables(results: dict, args) -> None:
    runs = {(r["server"], r["round"], r["concurrency"]): r for r in results["runs"]}
    rounds = range(1, args.rounds + 1)

    def cell(name, rnd, c):
        r = runs.get((name, rnd, c))
        if r is None:
            return "–", "–"
        ref = runs.get(("triton+stream" if name.endswith("+stream") else "triton", rnd, c))
        ratio = f" ({r['infer_per_s'] / ref['infer_per_s']:.2f}x)" if ref and ref["infer_per_s"] else ""
        flag = "*" if not r["stable"] else ""
        return f"{r['infer_per_s']:.0f}{flag}{ratio}", f"{r['cpu_us_per_request']:.0f}"

    head = " | ".join(f"c={c} r{rnd}" for c in args.concurrency for rnd in rounds)
    print("\ninfer/s (x Triton of the same round and mode; * unstable: mean of the last 3 windows)\n")
    print(f"| server | {head} |")
    print("|---|" + "---|" * (len(args.concurrency) * len(rounds)))
    for name in args.servers:
        print(f"| {name} | " + " | ".join(cell(name, rnd, c)[0] for c in args.concurrency for rnd in rounds) + " |")
    print("\nserver CPU µs / request\n")
    print(f"| server | {head} |")
    print("|---|" + "---|" * (len(args.concurrency) * len(rounds)))
    for name in args.servers:
        print(f"| {name} | " + " | ".join(cell(name, rnd, c)[1] for c in args.concurrency for rnd in rounds) + " |")


if __name__ == "__main__":
    main()
