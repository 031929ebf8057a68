"""HTTP server cores for the KServe v2 infer path: uvicorn + httptools (what tideserve runs), granian
(ASGI, RSGI, and embedded on the calling process's asyncio loop), pyvoy (Envoy's HTTP in front of an ASGI
app), and NVIDIA Triton as the reference, all in one run.

Each Python variant serves a minimal KServe v2 HTTP app for one model, ``add_sub`` (``max_batch_size`` 0,
INPUT0/INPUT1 FP32 [4] in, OUTPUT0 = a + b / OUTPUT1 = a - b out): ``POST /v2/models/add_sub/infer`` with
a JSON body (tensors as JSON ``data``, or as binary data after the JSON header with
``Inference-Header-Content-Length``; outputs as JSON or binary, as the request asks), plus what
perf_analyzer and this driver ask for: ``/v2/health/live|ready``, ``/v2``, the model's metadata, ready,
config and statistics (the request count). No tideserve core is involved, so the numbers measure the HTTP
server core plus the JSON work every KServe frontend pays (the same for every variant).

    python bench/http_servers.py --rounds 2     # the default set below, alternating; ~20 min on 2 cores

Variants (``--servers``):

- ``uvicorn``: ``uvicorn.Server`` with ``http="httptools"``, ``loop="uvloop"``, lifespan off, no access log
  (tideserve's settings, less its connection limits); the app answers with the two ASGI sends.
- ``uvicorn-whole``: the same, the app answering through tideserve's ``send_response`` (one transport
  write for head and body, no ASGI messages: what tideserve's HTTP frontend does on uvicorn).
- ``granian-asgi`` / ``granian-rsgi``: granian (Rust HTTP, hyper / tokio) with 1 worker process,
  1 Rust runtime thread, uvloop, HTTP/1 only, its ASGI interface (the same app as uvicorn's) or its own
  RSGI interface (``await proto()`` for the body, ``proto.response_bytes`` for the answer).
- ``granian-embed`` / ``granian-embed-rsgi``: granian's embedded server (``granian.server.embed.Server``,
  "experimental" in 2.8) awaited on a uvloop event loop in the calling process: the Rust runtime is a
  thread of that process and hands each request to the running loop (``call_soon_threadsafe``); ASGI
  without lifespan (``asginl``) or RSGI. This is the shape tideserve could use in its own process.
- ``GRANIAN-VARIANT-rusttask`` (e.g. ``granian-embed-rusttask``): the same with granian's Rust task
  implementation (``task_impl="rust"``, "experimental", Python < 3.12) instead of asyncio tasks.
- ``pyvoy``: the ASGI app on pyvoy (Envoy with Python embedded; HTTP in C++, the app on one Python thread
  with uvloop).
- ``triton``: ``$PEERS_HOME/bin/tritonserver-cpu`` on ``--triton-repo`` (Triton's add_sub, Python backend).

granian and pyvoy are not in the venv: ``pip install --target /tmp/granian-pkgs granian==2.8.7`` and
``pip install --target /tmp/pyvoy-pkgs pyvoy`` (or ``--granian-path`` / ``--pyvoy-path``).

Each variant is started as a process group of its own (its own session) on a free port, one at a time;
perf_analyzer (``$PEERS_HOME/bin/perf_analyzer``) drives it with ``-i http --measurement-interval 3000
--max-trials MAX`` (JSON tensors in and out unless ``--http-format binary``) at each concurrency; rounds
alternate the variants. Server CPU per request is the utime + stime of every process in the server's
process group (``/proc/<pid>/stat``; Triton's python-backend stubs, granian's worker and pyvoy's Envoy
included) over the whole perf_analyzer run divided by every infer request the server answered in that run
(warm-up windows included), read from the model's statistics (``inference_count``); context switches per
request are counted the same way (every thread's voluntary + involuntary switches, ``/proc/<pid>/task``).
Before the load, each server's CPU with no requests is read over ``--idle-s`` seconds.

Prints markdown tables (each point's ratio to Triton of the same round) and writes
bench/results/http-servers-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere
from tideserve.bench.grpc_servers import group_cpu_seconds, loadavg, stop_group  # the same process-group readings

PEERS_HOME = Path(os.environ.get("PEERS_HOME", "/tmp/peers"))
TRITON_REPO = Path("/work/shared/peers/repos/triton")
MODEL = "add_sub"
DEFAULT_SERVERS = ["triton", "uvicorn", "uvicorn-whole", "granian-asgi", "granian-rsgi", "granian-embed",
                   "granian-embed-rsgi", "pyvoy"]


# --------------------------------------------------------------------------------------------------
# server side (run as ``python bench/http_servers.py --serve VARIANT --port PORT``)


class Servicer:
    """The KServe v2 HTTP logic every variant shares: ``handle`` maps (method, path, the
    Inference-Header-Content-Length header, body) to (status, [(name, value)] in bytes, body)."""

    def __init__(self) -> None:
        import numpy as np

        try:
            import orjson
            self.loads, self.dumps = orjson.loads, orjson.dumps
        except ImportError:  # pragma: no cover
            self.loads, self.dumps = json.loads, lambda o: json.dumps(o, separators=(",", ":")).encode()
        self.np = np
        dumps = self.dumps

        def tensors(prefix):
            return [{"name": f"{prefix}{i}", "datatype": "FP32", "shape": [4]} for i in (0, 1)]

        def config_tensors(prefix):
            return [{"name": f"{prefix}{i}", "data_type": "TYPE_FP32", "dims": [4]} for i in (0, 1)]

        json_type = [(b"content-type", b"application/json")]
        metadata = dumps({"name": MODEL, "versions": ["1"], "platform": "python",
                          "inputs": tensors("INPUT"), "outputs": tensors("OUTPUT")})
        config = dumps({"name": MODEL, "platform": "", "backend": "python", "max_batch_size": 0,
                        "version_policy": {"latest": {"num_versions": 1}},
                        "input": config_tensors("INPUT"), "output": config_tensors("OUTPUT"),
                        "instance_group": [{"name": MODEL, "kind": "KIND_CPU", "count": 1}]})
        server = dumps({"name": "http-bench", "version": "0", "extensions": ["binary_tensor_data", "statistics"]})
        self.get = {
            "/v2/health/live": (200, [], b""),
            "/v2/health/ready": (200, [], b""),
            "/v2": (200, json_type, server),
            f"/v2/models/{MODEL}": (200, json_type, metadata),
            f"/v2/models/{MODEL}/versions/1": (200, json_type, metadata),
            f"/v2/models/{MODEL}/ready": (200, [], b""),
            f"/v2/models/{MODEL}/versions/1/ready": (200, [], b""),
            f"/v2/models/{MODEL}/config": (200, json_type, config),
            f"/v2/models/{MODEL}/versions/1/config": (200, json_type, config),
        }
        self.infer_paths = {f"/v2/models/{MODEL}/infer", f"/v2/models/{MODEL}/versions/1/infer"}
        self.stats_paths = {f"/v2/models/{MODEL}/stats", f"/v2/models/{MODEL}/versions/1/stats"}
        self.json_type = json_type
        self.served = 0

    def error(self, status: int, message: str):
        return status, self.json_type, self.dumps({"error": message})

    def handle(self, method: str, path: str, header_length: str | None, body: bytes):
        if method == "POST" and path in self.infer_paths:
            try:
                return self.infer(header_length, body)
            except Exception as exc:  # noqa: BLE001 - a malformed request is the client's error
                return self.error(400, f"bad infer request: {exc!r}")
        if method == "GET":
            if (answer := self.get.get(path)) is not None:
                return answer
            if path in self.stats_paths:
                n = self.served
                # perf_analyzer picks the model version whose queue count grew during its window
                zero, done = {"count": 0, "ns": 0}, {"count": n, "ns": 0}
                stats = {"success": done, "fail": zero, "queue": done, "compute_input": done, "compute_infer": done,
                         "compute_output": done, "cache_hit": zero, "cache_miss": zero}
                return 200, self.json_type, self.dumps({"model_stats": [
                    {"name": MODEL, "version": "1", "last_inference": int(time.time() * 1000), "inference_count": n,
                     "execution_count": n, "inference_stats": stats, "response_stats": {}, "batch_stats": [],
                     "memory_usage": []}]})
        return self.error(404, f"no route {method} {path}")

    def infer(self, header_length: str | None, body: bytes):
        np = self.np
        if header_length is not None:
            n = int(header_length)
            request, rest = self.loads(body[:n]), memoryview(body)[n:]
        else:
            request, rest = self.loads(body), None
        arrays, offset = {}, 0
        for tensor in request["inputs"]:
            size = (tensor.get("parameters") or {}).get("binary_data_size")
            if size is not None:
                arrays[tensor["name"]] = np.frombuffer(rest[offset:offset + size], dtype=np.float32)
                offset += size
            else:
                # perf_analyzer's JSON tensors hold one value for a shape of [4]: broadcast it
                arrays[tensor["name"]] = np.broadcast_to(np.asarray(tensor["data"], dtype=np.float32), (4,))
        a, b = arrays["INPUT0"], arrays["INPUT1"]
        results = {"OUTPUT0": a + b, "OUTPUT1": a - b}
        self.served += 1
        wanted = request.get("outputs") or [{"name": n} for n in results]
        default_binary = (request.get("parameters") or {}).get("binary_data_output", False)
        outputs, blobs = [], []
        for out in wanted:
            array = results[out["name"]]
            entry = {"name": out["name"], "datatype": "FP32", "shape": [4]}
            if (out.get("parameters") or {}).get("binary_data", default_binary):
                blob = array.tobytes()
                entry["parameters"] = {"binary_data_size": len(blob)}
                blobs.append(blob)
            else:
                entry["data"] = array.tolist()
            outputs.append(entry)
        answer = {"model_name": MODEL, "model_version": "1", "outputs": outputs}
        if "id" in request:
            answer["id"] = request["id"]
        head = self.dumps(answer)
        if not blobs:
            return 200, self.json_type, head
        return 200, [(b"content-type", b"application/octet-stream"),
                     (b"inference-header-content-length", str(len(head)).encode())], b"".join((head, *blobs))


def asgi_app_for(s: Servicer, whole: bool = False):
    """The servicer as an ASGI app; ``whole``: answers through tideserve's ``send_response``."""
    handle = s.handle
    if whole:
        from tideserve.asgi import send_response
    else:
        send_response = None

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        message = await receive()
        body = message.get("body", b"")
        while message.get("more_body"):
            message = await receive()
            body += message.get("body", b"")
        header_length = None
        for name, value in scope["headers"]:
            if name == b"inference-header-content-length":
                header_length = value.decode()
        status, headers, out = handle(scope["method"], scope["path"], header_length, body)
        if send_response is not None:
            await send_response(send, status, out, list(headers))
            return
        await send({"type": "http.response.start", "status": status,
                    "headers": [*headers, (b"content-length", str(len(out)).encode())]})
        await send({"type": "http.response.body", "body": out})

    return app


def rsgi_app_for(s: Servicer):
    """The servicer as a granian RSGI app."""
    handle = s.handle

    async def app(scope, proto):
        body = await proto()
        status, headers, out = handle(scope.method, scope.path,
                                      scope.headers.get("inference-header-content-length"), body)
        proto.response_bytes(status, [(k.decode(), v.decode()) for k, v in headers], out)

    return app


def __getattr__(name: str):
    # ``http_servers:asgi_app`` / ``http_servers:rsgi_app`` (granian's and pyvoy's workers import the
    # target by name): the app is built on first access
    if name in ("asgi_app", "rsgi_app"):
        app = (asgi_app_for if name == "asgi_app" else rsgi_app_for)(Servicer())
        globals()[name] = app
        return app
    raise AttributeError(name)


def serve_uvicorn(variant: str, port: int) -> None:
    import uvicorn

    app = asgi_app_for(Servicer(), whole=variant == "uvicorn-whole")
    config = uvicorn.Config(app, host="127.0.0.1", port=port, http="httptools", loop="uvloop", lifespan="off",
                            access_log=False, log_level="warning", backlog=4096, proxy_headers=False)
    uvicorn.Server(config).run()


def serve_granian(variant: str, port: int) -> None:
    from granian import Granian

    interface = "rsgi" if variant.startswith("granian-rsgi") else "asgi"
    task_impl = "rust" if variant.endswith("-rusttask") else "asyncio"
    Granian(f"http_servers:{interface}_app", address="127.0.0.1", port=port, interface=interface, workers=1,
            runtime_threads=1, loop="uvloop", task_impl=task_impl, http="1", websockets=False, backlog=4096,
            log_level="warning", log_access=False).serve()


def serve_granian_embed(variant: str, port: int) -> None:
    import uvloop
    from granian.constants import HTTPModes, Interfaces, TaskImpl
    from granian.log import LogLevels
    from granian.server.embed import Server

    s = Servicer()
    rsgi = variant.startswith("granian-embed-rsgi")
    task_impl = TaskImpl.rust if variant.endswith("-rusttask") else TaskImpl.asyncio
    app = rsgi_app_for(s) if rsgi else asgi_app_for(s)

    async def main() -> None:
        server = Server(app, address="127.0.0.1", port=port, interface=Interfaces.RSGI if rsgi else Interfaces.ASGINL,
                        runtime_threads=1, task_impl=task_impl, http=HTTPModes.http1, websockets=False, backlog=4096,
                        log_level=LogLevels.warning)
        await server.serve()

    uvloop.run(main())


def serve_pyvoy(port: int) -> None:
    """pyvoy's CLI on this module's ``asgi_app``, in the foreground of this process group."""
    code = "import sys; from pyvoy._cli import main; sys.exit(main())"
    os.execvp(sys.executable, [sys.executable, "-c", code, "http_servers:asgi_app", "--port", str(port),
                               "--log-level", "error", "--no-lifespan"])


def serve(variant: str, port: int) -> None:
    if variant == "pyvoy":
        serve_pyvoy(port)
    elif variant.startswith("uvicorn"):
        serve_uvicorn(variant, port)
    elif variant.startswith("granian-embed"):
        serve_granian_embed(variant, port)
    elif variant.startswith("granian"):
        serve_granian(variant, port)
    else:
        raise SystemExit(f"unknown variant {variant}")


# --------------------------------------------------------------------------------------------------
# driver side


_NEXT_PORT = [0]  # --base-port: ports handed out from there on; 0: any free port


def free_port() -> int:
    import socket

    if _NEXT_PORT[0]:
        _NEXT_PORT[0] += 1
        return _NEXT_PORT[0] - 1

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def group_context_switches(pgid: int) -> int:
    """Voluntary + involuntary context switches so far of every thread of every live process in process
    group ``pgid`` (a thread handing a request to another wakes it: one switch or more per hand-off)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            for status in (stat.parent / "task").glob("*/status"):
                for line in status.read_text().splitlines():
                    if "ctxt_switches:" in line:
                        total += int(line.split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return total


def http_get(port: int, path: str, timeout: float = 5) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_ready(port: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if http_get(port, f"/v2/models/{MODEL}/ready", timeout=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server not ready in time")


def start(variant: str, args) -> tuple[subprocess.Popen, int]:
    if _NEXT_PORT[0]:  # each server starts on a fresh range of 3 (no TIME_WAIT clash with the last one), 48 in all
        _NEXT_PORT[0] = args.base_port + (_NEXT_PORT[0] - args.base_port + 2) // 3 * 3 % 48
    port = free_port()
    log_dir = Path(os.environ.get("TMPDIR", "/tmp"))
    if variant == "triton":
        cmd = [str(PEERS_HOME / "bin" / "tritonserver-cpu"), "--model-repository", str(args.triton_repo),
               "--http-port", str(port), "--grpc-port", str(free_port()), "--metrics-port", str(free_port()),
               "--log-verbose", "0"]
        # cwd outside the repository: its triton_python_backend_utils.py would shadow the stub's own
        with open(log_dir / "http-servers-triton.log", "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd="/")
    else:
        env = dict(os.environ)
        extra = {"pyvoy": args.pyvoy_path}.get(variant, args.granian_path if variant.startswith("granian") else "")
        paths = [str(Path(__file__).resolve().parent), extra, env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        with open(log_dir / f"http-servers-{variant}.log", "w") as log:
            proc = subprocess.Popen([sys.executable, __file__, "--serve", variant, "--port", str(port)],
                                    stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd="/")
    try:
        wait_ready(port, proc)
    except Exception:
        stop_group(proc)
        raise
    return proc, port


def perf_analyzer(port: int, concurrency: int, http_format: str, max_trials: int) -> tuple[dict, str]:
    cmd = [str(PEERS_HOME / "bin" / "perf_analyzer"), "-m", MODEL, "-u", f"127.0.0.1:{port}", "-i", "http",
           "--concurrency-range", str(concurrency), "--measurement-interval", "3000",
           "--max-trials", str(max_trials), "-v"]
    if http_format == "json":
        cmd += ["--input-tensor-format", "json", "--output-tensor-format", "json"]
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
    result["windows"] = len(re.findall(r"Pass \[\d+\] throughput", out))
    if not result["windows"]:
        result["output_tail"] = out[-2000:]
    return result, out


def served(port: int) -> int:
    """Infer requests the server has answered (the model statistics' inference_count)."""
    status, body = http_get(port, f"/v2/models/{MODEL}/stats")
    if status != 200:
        raise RuntimeError(f"statistics: {status} {body[:200]!r}")
    return int(json.loads(body)["model_stats"][0]["inference_count"])


def check(port: int, http_format: str, batched: bool = False) -> None:
    """One infer request with tritonclient (the format perf_analyzer will use): the right sums or an error.
    ``batched``: the model has a batch dimension (Triton's add_sub, ``max_batch_size`` 8)."""
    import numpy as np
    import tritonclient.http as httpclient

    binary = http_format == "binary"
    shape = [1, 4] if batched else [4]
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        a, b = np.arange(4, dtype=np.float32).reshape(shape), np.full(shape, 2, dtype=np.float32)
        inputs = [httpclient.InferInput("INPUT0", shape, "FP32"), httpclient.InferInput("INPUT1", shape, "FP32")]
        inputs[0].set_data_from_numpy(a, binary_data=binary)
        inputs[1].set_data_from_numpy(b, binary_data=binary)
        outputs = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("OUTPUT0", "OUTPUT1")]
        result = client.infer(MODEL, inputs, outputs=outputs, request_id="check")
        if not (np.array_equal(result.as_numpy("OUTPUT0"), a + b) and np.array_equal(result.as_numpy("OUTPUT1"), a - b)):
            raise RuntimeError("wrong add_sub answer")
    finally:
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", nargs="+", default=DEFAULT_SERVERS)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-trials", type=int, default=6, help="perf_analyzer windows per point at most")
    parser.add_argument("--http-format", choices=["json", "binary"], default="json",
                        help="perf_analyzer's input and output tensor format (json: as bench/addsub.py)")
    parser.add_argument("--idle-s", type=float, default=3, help="seconds of idle CPU measured before the load")
    parser.add_argument("--triton-repo", type=Path, default=TRITON_REPO)
    parser.add_argument("--granian-path", default="/tmp/granian-pkgs", help="where granian is installed (pip --target)")
    parser.add_argument("--pyvoy-path", default="/tmp/pyvoy-pkgs", help="where pyvoy is installed (pip --target)")
    parser.add_argument("--base-port", type=int, default=0,
                        help="take the servers' ports from BASE..BASE+47, 3 per server started (default: free ports)")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port)
        return
    _NEXT_PORT[0] = args.base_port
    results: dict = {"load_before": loadavg(), "cpus": os.cpu_count(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                     "http_format": args.http_format, "runs": [], "idle": [], "failed": []}
    print(f"load average before: {results['load_before']}", file=sys.stderr, flush=True)
    for rnd in range(1, args.rounds + 1):
        for name in args.servers:
            try:
                proc, port = start(name, args)
                check(port, args.http_format, batched=name == "triton")
            except Exception as exc:  # noqa: BLE001 - a variant that cannot start is reported, the run goes on
                if "proc" in locals() and proc.poll() is None:
                    stop_group(proc)
                results["failed"].append({"server": name, "round": rnd, "error": str(exc)})
                print(f"{name} round {rnd}: did not start: {exc}", file=sys.stderr, flush=True)
                continue
            try:
                before = group_cpu_seconds(proc.pid)
                time.sleep(args.idle_s)  # what the server burns with nothing to do (pollers, spinning threads)
                idle_pct = 100 * (group_cpu_seconds(proc.pid) - before) / args.idle_s
                results["idle"].append({"server": name, "round": rnd, "cpu_pct": idle_pct})
                for c in args.concurrency:
                    n0, before, switches = served(port), group_cpu_seconds(proc.pid), group_context_switches(proc.pid)
                    r, _ = perf_analyzer(port, c, args.http_format, args.max_trials)
                    cpu, n = group_cpu_seconds(proc.pid) - before, served(port) - n0
                    switches = group_context_switches(proc.pid) - switches
                    r.update(server=name, round=rnd, concurrency=c, server_cpu_s=cpu, requests_served=n,
                             cpu_us_per_request=1e6 * cpu / max(n, 1), switches_per_request=switches / max(n, 1),
                             load=loadavg())
                    results["runs"].append(r)
                    print(f"round {rnd} {name} c={c}: {r['infer_per_s']:.0f} infer/s, "
                          f"{r['cpu_us_per_request']:.0f} us CPU/request, "
                          f"{r['switches_per_request']:.2f} context switches/request, load {r['load'][0]}",
                          file=sys.stderr, flush=True)
            finally:
                stop_group(proc)
                del proc
    results["load_after"] = loadavg()
    print_tables(results, args)
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(exist_ok=True)
    path = out_dir / f"http-servers-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {path}  (load before {results['load_before']}, after {results['load_after']})")


def print_tables(results: dict, args) -> None:
    runs = {(r["server"], r["round"], r["concurrency"]): r for r in results["runs"]}
    rounds = range(1, args.rounds + 1)

    def cell(name, rnd, c):
        r = runs.get((name, rnd, c))
        if r is None:
            return "–", "–"
        ref = runs.get(("triton", rnd, c))
        ratio = f" ({r['infer_per_s'] / ref['infer_per_s']:.2f}x)" if ref and ref["infer_per_s"] else ""
        flag = "*" if not r["stable"] else ""
        return f"{r['infer_per_s']:.0f}{flag}{ratio}", f"{r['cpu_us_per_request']:.0f}"

    idle = {(r["server"], r["round"]): r["cpu_pct"] for r in results["idle"]}
    head = " | ".join(f"c={c} r{rnd}" for c in args.concurrency for rnd in rounds)
    print("\ninfer/s (x Triton of the same round; * unstable: mean of the last 3 windows)\n")
    print(f"| server | {head} |")
    print("|---|" + "---|" * (len(args.concurrency) * len(rounds)))
    for name in args.servers:
        print(f"| {name} | " + " | ".join(cell(name, rnd, c)[0] for c in args.concurrency for rnd in rounds) + " |")
    print("\nserver CPU µs / request (idle: % of a core with no requests, per round)\n")
    print(f"| server | {head} | idle |")
    print("|---|" + "---|" * (len(args.concurrency) * len(rounds) + 1))
    for name in args.servers:
        idles = " / ".join(f"{idle[name, rnd]:.1f}" for rnd in rounds if (name, rnd) in idle)
        print(f"| {name} | " + " | ".join(cell(name, rnd, c)[1] for c in args.concurrency for rnd in rounds)
              + f" | {idles or '–'} |")


if __name__ == "__main__":
    main()
