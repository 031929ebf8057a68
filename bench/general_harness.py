"""Plumbing shared by bench/general_models.py: servers as subprocesses, perf_analyzer runs, JSON checks.

Every server runs alone in its own process group on free 127.0.0.1 ports and is stopped by its PID
(then its group, for MLServer's worker processes). perf_analyzer runs fixed time windows and its
client and server-side summaries are parsed into a dict (server-side: tideserve's statistics give
the average batch each execution ran; MLServer has no statistics endpoint).
"""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Self

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("TIDESERVE_SHARED", ROOT.parent / "shared"))
PEERS_HOME = Path(os.environ.get("PEERS_HOME", "/tmp/peers"))
PERF_ANALYZER = PEERS_HOME / "bin" / "perf_analyzer"
MLSERVER = PEERS_HOME / "bin" / "mlserver-tritoncfg"
MLSERVER_PYTHON = PEERS_HOME / "venvs" / "mlserver" / "bin" / "python"


def loadavg() -> list[str]:
    return open("/proc/loadavg").read().split()[:3]


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def ensure_peers(*names: str) -> None:
    """Run the shared setup scripts (idempotent) for ``names``: perf-analyzer, mlserver..."""
    for name in names:
        subprocess.run(["bash", str(SHARED / "peers" / f"setup-{name}.sh")], check=True,
                       stdout=subprocess.DEVNULL, env={**os.environ, "PEERS_HOME": str(PEERS_HOME)})


class Server:
    """A running server: its process, ports and label."""

    def __init__(self, label: str, proc: subprocess.Popen, http: int, grpc: int, log: Path) -> None:
        self.label, self.proc, self.http, self.grpc, self.log = label, proc, http, grpc, log

    def port(self, protocol: str) -> int:
        return self.http if protocol == "http" else self.grpc

    def stop(self) -> None:
        proc = self.proc
        try:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            pass
        try:  # whatever is left of its process group (MLServer's workers)
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _wait_ready(label: str, proc: subprocess.Popen, http: int, models: list[str], log: Path,
                timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    pending = list(models)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{label} exited early (rc {proc.returncode}), see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/models/{pending[0]}/ready", timeout=2) as r:
                if r.status == 200:
                    pending.pop(0)
                    if not pending:
                        return
                    continue
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{label} did not become ready, see {log}")


def start_tideserve(label: str, repo: Path, models: list[str], log: Path, args: list[str] = ()) -> Server:
    """``args``: more tideserve command-line flags (``--frontend-workers 2``)."""
    http, grpc, metrics = free_ports(3)
    cmd = [sys.executable, "-m", "tideserve.cli", "--model-repository", str(repo), "--http-port", str(http),
           "--grpc-port", str(grpc), "--metrics-port", str(metrics), *args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    server = Server(label, proc, http, grpc, log)
    try:
        _wait_ready(label, proc, http, models, log)
    except Exception:
        server.stop()
        raise
    return server


def start_mlserver(label: str, folder: Path, models: list[str], log: Path, *, parallel_workers: int,
                   env: dict[str, str] | None = None) -> Server:
    """MLServer (with the Triton config endpoints) on ``folder``, whose model folders are already written."""
    http, grpc, metrics = free_ports(3)
    (folder / "settings.json").write_text(json.dumps({
        "host": "127.0.0.1", "http_port": http, "grpc_port": grpc, "metrics_port": metrics, "debug": False,
        "parallel_workers": parallel_workers, "metrics_dir": str(folder / ".metrics"),
        "environments_dir": str(folder / ".envs")}))
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(MLSERVER), "start", str(folder)], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=folder, env={**os.environ, **(env or {})})
    server = Server(label, proc, http, grpc, log)
    try:
        _wait_ready(label, proc, http, models, log)
    except Exception:
        server.stop()
        raise
    return server


def infer_json(port: int, model: str, inputs: list[dict], outputs: list[str]) -> dict[str, list]:
    """One KServe v2 JSON inference over HTTP; output name -> flat data list."""
    body = json.dumps({"inputs": inputs, "outputs": [{"name": n} for n in outputs]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/{model}/infer", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        answer = json.load(r)
    return {t["name"]: t["data"] for t in answer["outputs"]}


def group_cpu_seconds(pgid: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of process group ``pgid``."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields after the command: state ppid pgrp ... utime(11) stime(12)
            total += int(fields[11]) + int(fields[12])
    return total / tick


def tideserve_counts(http: int, model: str) -> dict[str, int]:
    """A tideserve model's cumulative statistics (Triton's statistics extension): inferences, executions,
    successful requests and their nanoseconds in the server, queue and compute_infer."""
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/models/{model}/stats", timeout=10) as r:
        stats = json.load(r)["model_stats"]
    out = {"inference_count": 0, "execution_count": 0, "success_count": 0, "success_ns": 0, "queue_ns": 0,
           "compute_infer_ns": 0}
    for version in stats:
        out["inference_count"] += int(version.get("inference_count", 0))
        out["execution_count"] += int(version.get("execution_count", 0))
        inference = version.get("inference_stats", {})
        out["success_count"] += int(inference.get("success", {}).get("count", 0))
        for key in ("success", "queue", "compute_infer"):
            out[f"{key}_ns"] += int(inference.get(key, {}).get("ns", 0))
    return out


def server_summary(before: dict[str, int], after: dict[str, int]) -> dict:
    """What the server did during one perf_analyzer run (warm-up windows included)."""
    d = {k: after[k] - before[k] for k in before}
    out: dict = {"requests": d["success_count"], "executions": d["execution_count"]}
    if d["execution_count"]:
        out["avg_batch"] = d["inference_count"] / d["execution_count"]
        out["compute_infer_ms_per_execution"] = d["compute_infer_ns"] / d["execution_count"] / 1e6
    if d["success_count"]:
        out["request_ms"] = d["success_ns"] / d["success_count"] / 1e6
        out["queue_ms"] = d["queue_ns"] / d["success_count"] / 1e6
    return out


def perf_analyzer(model: str, protocol: str, port: int, concurrency: int, log: Path, *, http_format: str = "binary",
                  window_ms: int = 3000, stability: int = 25, trials: int = 5, extra: list[str] = (),
                  stats_port: int | None = None, server_pgid: int | None = None) -> dict:
    """One perf_analyzer point: infer/s (its stable summary, else the mean of the last 3 windows, flagged),
    latencies, every window, and with ``stats_port`` (tideserve's HTTP port) what the server did meanwhile;
    with ``server_pgid`` the cores the server's processes used, and always the cores perf_analyzer used."""
    cmd = [str(PERF_ANALYZER), "-m", model, "-u", f"127.0.0.1:{port}", "-i", protocol,
           "--concurrency-range", str(concurrency), "--measurement-mode", "time_windows", "-p", str(window_ms),
           "-s", str(stability), "-r", str(trials), "-v", *extra]
    if protocol == "http" and http_format == "json":
        cmd += ["--input-tensor-format", "json", "--output-tensor-format", "json"]
    before = tideserve_counts(stats_port, model) if stats_port else None
    cpu_before = group_cpu_seconds(server_pgid) if server_pgid else 0.0
    client_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False,
                              timeout=60 + trials * window_ms / 1000 * 4)
        out = done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        out += "\n(perf_analyzer timed out)"
    wall = time.monotonic() - start
    client_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    log.write_text(" ".join(cmd) + "\n" + out)
    result: dict = {"command": " ".join(["perf_analyzer", *cmd[1:]]), "log": str(log), "wall_s": wall,
                    "batch": int(cmd[cmd.index("-b") + 1]) if "-b" in cmd else 1,
                    "client_cores": (client_after.ru_utime + client_after.ru_stime - client_before.ru_utime
                                     - client_before.ru_stime) / wall}
    if server_pgid:  # cores the server kept busy over the whole run (warm-up windows included)
        result["server_cores"] = (group_cpu_seconds(server_pgid) - cpu_before) / wall
    if before is not None:
        result["server"] = server_summary(before, tideserve_counts(stats_port, model))
    passes = [(float(t), int(lat)) for t, lat in
              re.findall(r"Pass \[\d+\] throughput: ([\d.]+) infer/sec\. Avg latency: (\d+) usec", out)]
    result["windows_infer_per_s"] = [t for t, _ in passes]
    summary = out.split("Client:", 1)[1] if "Client:" in out else ""
    if m := re.search(r"Throughput: ([\d.]+) infer/sec", summary):
        result["infer_per_s"] = float(m.group(1))
        result["stable"] = True
        for key, label in (("avg_ms", "Avg latency"), ("p50_ms", "p50 latency"), ("p99_ms", "p99 latency")):
            if m := re.search(label + r": (\d+) usec", summary):
                result[key] = int(m.group(1)) / 1000
    else:  # unstable (or failed): mean of the last three measurement windows
        last = passes[-3:]
        result["infer_per_s"] = sum(t for t, _ in last) / len(last) if last else 0.0
        result["stable"] = False
        if last:
            result["avg_ms"] = sum(lat for _, lat in last) / len(last) / 1000
        else:
            result["error"] = out.strip().splitlines()[-1][-300:] if out.strip() else "no output"
    if m := re.search(r"Avg request latency: \d+ usec \(overhead (\d+) usec \+ queue (\d+) usec \+ "
                      r"compute input (\d+) usec \+ compute infer (\d+) usec \+ compute output (\d+) usec\)", out):
        result["server_us"] = dict(zip(("overhead", "queue", "compute_input", "compute_infer", "compute_output"),
                                       map(int, m.groups())))
    return result


def cpu_ms_per_request(r: dict, key: str = "server_cores") -> float:
    """CPU milliseconds per request, roughly: cores used over the run / requests per second in its windows
    (perf_analyzer counts the rows of a batched request as inferences)."""
    requests_per_s = r["infer_per_s"] / r.get("batch", 1)
    return r[key] / requests_per_s * 1000 if key in r and requests_per_s else float("nan")


def describe(r: dict) -> str:
    text = f"{r['infer_per_s']:9.1f} infer/s avg {r.get('avg_ms', float('nan')):8.2f} ms " \
           f"p99 {r.get('p99_ms', float('nan')):8.2f} ms"
    if "avg_batch" in r.get("server", {}):
        text += f"  server: batch {r['server']['avg_batch']:.1f}, compute {r['server']['compute_infer_ms_per_execution']:.2f} ms/exec"
    if "server_cores" in r:
        text += f"  cpu/request: server {cpu_ms_per_request(r):.2f} ms, client {cpu_ms_per_request(r, 'client_cores'):.2f} ms"
    if not r["stable"]:
        text += "  (unstable)" if "error" not in r else f"  FAILED: {r['error']}"
    return text


def write_results(name: str, results: dict) -> Path:
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(results, indent=1))
    return out
