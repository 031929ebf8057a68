"""add_sub throughput and latency: tideserve vs NVIDIA Triton, same model files, same run.

Both servers load the very same Triton repository (``../shared/peers/repos/triton``: a Python-backend
add_sub model, two FP32 [4] inputs, max_batch_size 8, dynamic batching, 2 CPU instances) and
``perf_analyzer`` drives each over HTTP and gRPC at each concurrency, one server at a time.

    python bench/addsub.py [--concurrency 1 8 32] [--http-format json|binary]
                           [--servers triton tideserve:w1 tideserve:w2] [--protocols http grpc grpc-stream]

``tideserve:wN`` runs tideserve with ``--frontend-workers N --frontend-direct off``, ``tideserve:wN:direct`` with
``--frontend-direct on``
(the workers send add_sub's requests straight to its instance processes; ``:spinN`` sets
``TIDESERVE_DIRECT_SPIN_US=N``, how long an instance waits out a lone request's batching delay through loop turns
rather than its timer: ``tideserve:w2:direct:spin0``; ``:fillN`` sets ``TIDESERVE_HTTP_FILL_CONNECTIONS=N``, how many
HTTP connections a worker takes before the next takes any, 0 spreading them evenly: ``tideserve:w2:direct:fill0``),
``tideserve:wN:pyvoy`` with
``--grpc-frontend pyvoy`` (the gRPC port on Envoy; needs ``pip install 'tideserve[pyvoy]'``; the modes combine:
``tideserve:w1:pyvoy:direct``); ``tideserve:wN@PATH`` runs it from another
checkout of this repository at PATH (an A/B of two commits in one run: ``git worktree add /tmp/prev HEAD~``,
then ``--servers tideserve:w1@/tmp/prev tideserve:w1``). Besides throughput and latency it reports
the server's CPU time per request: the server process and all its descendants (core, frontend workers,
model processes; Triton and its Python stubs), measured over each perf_analyzer run, perf_analyzer's own CPU time
per request (on 2 cores the client shares the CPUs: where none is idle, the throughput follows the server's and the
client's CPU per request together) and the machine's idle share over the run; for tideserve also the event-loop
thread that serves the requests (the core process's main thread, or with one frontend worker that worker's; ``loop
(core)`` / ``loop (worker)``): its busy share of the run's wall time (``busy``: the loop is one thread, so this share,
not the process's CPU, bounds the requests it serves), its share spent ready to run but waiting for a CPU (``waiting``:
preempted, or woken and not yet running; /proc's schedstat), its CPU per request and how often another thread took
its CPU, per request (``preempted/req``).

Peers come from ``../shared/peers`` (setup scripts install them under $PEERS_HOME, /tmp/peers).
``--instances N`` sets add_sub's instance count on every server; ``--grpc-channel-share 1`` gives each of perf_analyzer's
request contexts its own gRPC connection (bench/device_scaling.sh: the scaling run on a 16-core machine).

Prints a markdown table with tideserve / Triton ratios and writes bench/results/addsub-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
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


# Put first on PYTHONPATH, this module points the editable install's packages (tideserve, its backends,
# triton_python_backend_utils) at the checkout in TIDESERVE_TREE, in the server and every process it starts.
_TREE_HOOK = """import os, sys
_tree = os.environ.get("TIDESERVE_TREE")
if _tree:
    for _name, _module in list(sys.modules.items()):
        _mapping = getattr(_module, "MAPPING", None) if _name.startswith("__editable__") else None
        if isinstance(_mapping, dict):
            for _key, _path in _mapping.items():
                _mapping[_key] = _path.replace(%r, _tree, 1)
"""


def tree_env(tree: str | None) -> dict[str, str]:
    """The environment that runs tideserve from checkout ``tree`` (nothing for this one)."""
    if not tree:
        return {}
    hook = Path(tempfile.gettempdir()) / "tideserve-bench-tree-hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(_TREE_HOOK % str(ROOT))
    return {"TIDESERVE_TREE": str(Path(tree).resolve()), "PYTHONPATH": str(hook)}


def ensure_peers(triton: bool = True) -> None:
    """Install the peers this run needs (perf_analyzer, and Triton when it is one of the servers) unless they are
    already under $PEERS_HOME/bin: a machine without ../shared (a lent GPU machine) brings its own."""
    for name, binary in (("perf-analyzer", "perf_analyzer"), ("triton", "tritonserver-cpu")):
        if (name == "triton" and not triton) or (PEERS_HOME / "bin" / binary).exists():
            continue
        subprocess.run(["bash", str(SHARED / "peers" / f"setup-{name}.sh")], check=True,
                       stdout=subprocess.DEVNULL)


def set_instances(repo: Path, count: int) -> None:
    """add_sub's instance count in the copied repository (the shared repository has Triton's 2)."""
    config = repo / "add_sub" / "config.pbtxt"
    text, n = re.subn(r"(instance_group \[ \{ kind: KIND_CPU count: )\d+", rf"\g<1>{count}", config.read_text())
    if n != 1:
        raise RuntimeError(f"no instance_group count in {config}")
    config.write_text(text)


def _role(pid: str) -> str:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "other"
    if b"tideserve.workers.main" in cmdline:
        return "frontend workers"
    if b"envoy" in cmdline:
        return "grpc frontend (pyvoy)"
    if b"tideserve.cli" in cmdline:
        return "core"
    if b"tritonserver" in cmdline:
        return "tritonserver"
    return "model processes"  # tideserve's zygote and model processes, Triton's Python stubs


def tree_cpu_seconds(root: int, workers: dict[int, float] | None = None) -> dict[str, float]:
    """User + system CPU seconds of process ``root`` and every live descendant (Linux /proc), by role; with
    ``workers``, each frontend worker process's too (by pid). (Descendants, not the session: tideserve's
    model-process zygote has a session of its own.)"""
    stats: dict[int, list[str]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            stats[int(stat.parent.name)] = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
    children: dict[int, list[int]] = {}
    for pid, fields in stats.items():
        children.setdefault(int(fields[1]), []).append(pid)
    totals: dict[str, float] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, ()))
        fields = stats.get(pid)
        if fields is not None:
            role = _role(str(pid))
            seconds = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            totals[role] = totals.get(role, 0.0) + seconds
            if workers is not None and role == "frontend workers":
                workers[pid] = seconds
    return totals


def start_server(kind: str, repo: Path, log: Path, model: str = "add_sub",
                 args: tuple[str, ...] = ()) -> tuple[subprocess.Popen, int, int]:
    """(process, http port, grpc port) of a server over ``repo`` once ``model`` is ready: ``kind`` is
    ``triton``, ``tideserve`` or ``tideserve:wN`` (``--frontend-workers N``), ``tideserve:auto`` (the default
    layout: neither flag named); ``args``: more flags."""
    http, grpc, metrics = free_ports(3)
    ports = ["--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)]
    kind, _, tree = kind.partition("@")
    env = dict(os.environ, **tree_env(tree))
    if kind == "tideserve:auto":  # the default layout: --frontend-workers auto, --frontend-direct not named
        cmd = [sys.executable, "-m", "tideserve.cli", "--model-repository", str(repo), *ports, *args]
    elif kind.startswith("tideserve"):
        _, _, workers = kind.partition(":w")
        workers, *modes = workers.split(":")
        args = (*args, "--frontend-direct", "on" if "direct" in modes else "off")
        if "pyvoy" in modes:
            args = (*args, "--grpc-frontend", "pyvoy")
        for mode in modes:  # spinN: a lone direct request waits its batching delay through loop turns up to N us
            if mode.startswith("spin") and mode[4:].isdigit():
                env["TIDESERVE_DIRECT_SPIN_US"] = mode[4:]
            if mode.startswith("fill") and mode[4:].isdigit():  # fillN: the HTTP acceptance's fill (workers/balance.py)
                env["TIDESERVE_HTTP_FILL_CONNECTIONS"] = mode[4:]
        cmd = [sys.executable, "-m", "tideserve.cli", "--model-repository", str(repo), *ports,
               "--frontend-workers", workers or "1", *args]
    else:
        cmd = [str(PEERS_HOME / "bin" / "tritonserver-cpu"), "--model-repository", str(repo), *ports, *args]
    # Triton runs from the log's folder: started in this repository, its Python stub would import
    # tideserve's own triton_python_backend_utils module from the working directory.
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True,
                            cwd=(tree or ROOT) if kind.startswith("tideserve") else log.parent, env=env)
    wait_ready(proc, http, model, kind, log)
    return proc, http, grpc


def wait_ready(proc: subprocess.Popen, http: int, model: str, kind: str, log: Path, timeout: float = 180) -> None:
    """Until ``model`` is ready on ``http``; the server is stopped and an error raised if it exits or times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{kind} exited early, see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/models/{model}/ready", timeout=2) as r:
                if r.status == 200:
                    return
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


def executions(http: int) -> tuple[int, int] | None:
    """add_sub's (inference_count, execution_count) from the server's statistics (None where it cannot say)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/models/add_sub/stats", timeout=10) as r:
            stats = json.loads(r.read())["model_stats"][0]
        return int(stats["inference_count"]), int(stats["execution_count"])
    except (OSError, ValueError, KeyError, IndexError):
        return None


def perf_analyzer(protocol: str, port: int, concurrency: int, http_format: str, log: Path, server_pid: int,
                  http: int | None = None) -> dict:
    """One perf_analyzer run; ``protocol`` ``grpc-stream`` is gRPC with ``--streaming`` (ModelStreamInfer).
    With ``http`` (the server's HTTP port), also the requests per model execution over the run (its batching)."""
    cmd = [str(PEERS_HOME / "bin" / "perf_analyzer"), "-m", "add_sub", "-u", f"127.0.0.1:{port}",
           "-i", "grpc" if protocol == "grpc-stream" else protocol, "--concurrency-range", str(concurrency),
           "--measurement-mode", "time_windows", "-p", "2000", "-s", "25", "-r", "4", "-v"]
    if protocol == "grpc-stream":
        cmd.append("--streaming")
    if protocol == "http" and http_format == "json":
        cmd += ["--input-tensor-format", "json", "--output-tensor-format", "json"]
    counts_before = executions(http) if http else None
    loop = serving_thread(server_pid)
    switches_before, loop_before = tree_switches(server_pid), loop_thread(loop)
    client_before, idle_before = _children_cpu_s(), _machine_idle()
    workers_before, workers_after = {}, {}  # each frontend worker's CPU seconds (by pid: the order they started)
    cpu_before, started = tree_cpu_seconds(server_pid, workers_before), time.monotonic()
    try:
        out, timed_out = subprocess.run(cmd, capture_output=True, text=True, timeout=300).stdout, False
    except subprocess.TimeoutExpired as exc:  # a point that never settled: its windows so far, marked, the run goes on
        out, timed_out = exc.stdout or "", True
        out = out.decode(errors="replace") if isinstance(out, bytes) else out
    wall, cpu_after = time.monotonic() - started, tree_cpu_seconds(server_pid, workers_after)
    client_cpu, idle_after = _children_cpu_s() - client_before, _machine_idle()
    switches_after, loop_after = tree_switches(server_pid), loop_thread(loop)
    roles = {role: cpu_after.get(role, 0.0) - cpu_before.get(role, 0.0) for role in cpu_after}
    cpu = sum(roles.values())
    log.write_text(out)
    result = {"command": " ".join(cmd[1:]), "server_cpu_s": cpu, "cpu_s_by_role": roles, "wall_s": wall,
              "client_cpu_s": client_cpu}
    if idle_after[1] > idle_before[1]:  # the machine's idle share over the run (all CPUs, every process on it)
        result["machine_idle"] = round((idle_after[0] - idle_before[0]) / (idle_after[1] - idle_before[1]), 3)
    if loop_before is not None and loop_after is not None:  # the serving event-loop thread: its busy share
        result["loop"] = "core" if loop == server_pid else "worker"
        result["loop_busy"] = round((loop_after[0] - loop_before[0]) / wall, 3)
        result["loop_waiting"] = round((loop_after[2] - loop_before[2]) / wall, 3)
    counts_after = executions(http) if counts_before else None
    if counts_before and counts_after and counts_after[1] > counts_before[1]:
        result["requests_per_execution"] = round((counts_after[0] - counts_before[0])
                                                 / (counts_after[1] - counts_before[1]), 2)
    if timed_out:
        result["timed_out"] = True
    if not timed_out and (m := re.search(r"Throughput: ([\d.]+) infer/sec", out)):
        result["infer_per_s"] = float(m.group(1))
        result["stable"] = True
    else:  # unstable: mean of the last three measurement windows
        passes = [float(x) for x in re.findall(r"Pass \[\d+\] throughput: ([\d.]+)", out)][-3:]
        result["infer_per_s"] = sum(passes) / len(passes) if passes else 0.0
        result["stable"] = False
    for key, label in (("p50_ms", "p50 latency"), ("p99_ms", "p99 latency"), ("avg_ms", "Avg latency")):
        if m := re.search(label + r": (\d+) usec", out):
            result[key] = int(m.group(1)) / 1000
    if result["infer_per_s"]:  # requests over the whole run (warm-up included) at the measured rate
        requests = result["infer_per_s"] * wall
        result["cpu_us_per_request"] = cpu / requests * 1e6
        result["cpu_us_per_request_by_role"] = {role: round(t / requests * 1e6, 1) for role, t in roles.items()}
        if len(workers_after) > 1:  # each frontend worker's share: whether the second one served at all
            result["cpu_us_per_request_by_worker"] = [
                round((workers_after[pid] - workers_before.get(pid, 0.0)) / requests * 1e6, 1)
                for pid in sorted(workers_after)]
        result["client_cpu_us_per_request"] = round(client_cpu / requests * 1e6, 1)
        result["switches_per_request_by_role"] = {  # processes that ran all along (a process that exited is left out)
            role: round((count - switches_before.get(role, 0)) / requests, 2) for role, count in switches_after.items()
            if role in switches_before}
        if loop_before is not None and loop_after is not None:
            result["loop_cpu_us_per_request"] = round((loop_after[0] - loop_before[0]) / requests * 1e6, 1)
            result["loop_preempted_per_request"] = round((loop_after[1] - loop_before[1]) / requests, 3)
    return result


PROTOCOLS = ("http", "grpc", "grpc-stream")


def _children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's waited-for children: perf_analyzer's, over one run."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _machine_idle() -> tuple[int, int]:
    """(idle + iowait, all) clock ticks of every CPU so far, from /proc/stat."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return ticks[3] + ticks[4], sum(ticks[:8])


def serving_thread(root: int) -> int | None:
    """The thread whose event loop serves the requests where ``root`` is tideserve's core: the core's main thread
    where no frontend worker runs, the one worker's main thread where one does; None for another server or for
    several workers (several loops)."""
    if _role(str(root)) != "core":
        return None
    workers = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == root and _role(stat.parent.name) == "frontend workers":
            workers.append(int(stat.parent.name))
    if not workers:
        return root
    return workers[0] if len(workers) == 1 else None


def loop_thread(tid: int | None) -> tuple[float, int, float] | None:
    """(CPU seconds, involuntary context switches, seconds ready to run but waiting for a CPU) of the main thread of
    process ``tid`` (:func:`serving_thread`), or None: the loop is one thread, so its busy share of the wall time, not
    the process's CPU, is what bounds the requests it can serve; its involuntary switches are the times another
    thread took its CPU while it had work, and its wait the time that cost it."""
    if tid is None:
        return None
    try:
        fields = Path(f"/proc/{tid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        status = Path(f"/proc/{tid}/task/{tid}/status").read_text()
        schedstat = Path(f"/proc/{tid}/task/{tid}/schedstat").read_text().split()
    except OSError:
        return None
    preempted = next((int(line.split()[1]) for line in status.splitlines()
                      if line.startswith("nonvoluntary_ctxt_switches:")), 0)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), preempted, int(schedstat[1]) / 1e9


def tree_switches(root: int) -> dict[str, int]:
    """Context switches (voluntary + involuntary) of every thread of process ``root`` and its live descendants, by
    role: per request, a count a loaded machine changes much less than CPU time or throughput (each is a thread
    that slept or was preempted: the hand-offs between threads and processes a request costs)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    totals: dict[str, int] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, ()))
        count = 0
        for status in Path(f"/proc/{pid}/task").glob("*/status"):
            try:
                for line in status.read_text().splitlines():
                    if "ctxt_switches:" in line:
                        count += int(line.split()[1])
            except (OSError, ValueError, IndexError):
                continue
        role = _role(str(pid))
        totals[role] = totals.get(role, 0) + count
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--http-format", choices=["json", "binary"], default="json")
    parser.add_argument("--servers", nargs="+", default=["triton", "tideserve:w1", "tideserve:w2"])
    parser.add_argument("--instances", type=int, default=None,
                        help="add_sub's CPU instance count on every server (default: the repository's 2)")
    parser.add_argument("--grpc-channel-share", type=int, default=None,
                        help="how many of perf_analyzer's request contexts share one gRPC channel (its client's "
                             "TRITON_CLIENT_GRPC_CHANNEL_MAX_SHARE_COUNT, 6 by default): 1 gives each context its "
                             "own connection, so that SO_REUSEPORT spreads them over several frontend workers")
    parser.add_argument("--protocols", nargs="+", default=["http", "grpc"], choices=PROTOCOLS,
                        help="what perf_analyzer speaks: grpc-stream is gRPC with --streaming (ModelStreamInfer, "
                             "one response per request)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="every server is up all along; each round measures each point on each server in turn "
                             "(the others idle), so that a shared machine's load falls on all alike; medians")
    args = parser.parse_args()
    ensure_peers(triton="triton" in args.servers)
    if args.grpc_channel_share is not None:
        os.environ["TRITON_CLIENT_GRPC_CHANNEL_MAX_SHARE_COUNT"] = str(args.grpc_channel_share)
    work = Path(tempfile.mkdtemp(prefix="bench-addsub-"))
    results: dict = {"load_before": open("/proc/loadavg").read().split()[:3], "cpus": os.cpu_count(),
                     "http_format": args.http_format, "rounds": args.rounds, "instances": args.instances,
                     "grpc_channel_share": args.grpc_channel_share, "runs": {}, "all": {}}
    servers = {}
    try:
        for kind in args.servers:
            label = kind.replace(":", "-").replace("@", "-").replace("/", "_")
            repo = work / f"{label}-repo"
            shutil.copytree(SHARED / "peers" / "repos" / "triton", repo)
            if args.instances is not None:
                set_instances(repo, args.instances)
            servers[kind] = start_server(kind, repo, work / f"{label}.log")
        for round_ in range(args.rounds):
            for protocol in args.protocols:
                for c in args.concurrency:
                    for kind, (proc, http, grpc) in servers.items():
                        port = http if protocol == "http" else grpc
                        r = perf_analyzer(protocol, port, c, args.http_format,
                                          work / f"pa-{kind.replace(':', '-').replace('@', '-').replace('/', '_')}-{protocol}-{c}-{round_}.txt", proc.pid,
                                          http)
                        results["all"].setdefault(f"{kind}/{protocol}/{c}", []).append(r)
                        print(f"round {round_ + 1} {kind:13s} {protocol:11s} c={c:<3d} {r['infer_per_s']:9.0f} infer/s "
                              f"p50 {r.get('p50_ms', float('nan')):.2f} ms p99 {r.get('p99_ms', float('nan')):.2f} ms "
                              f"CPU {r.get('cpu_us_per_request', float('nan')):.0f} us/req "
                              f"{r.get('requests_per_execution', float('nan')):.2f} req/exec "
                              f"{r.get('cpu_us_per_request_by_role', {})} "
                              + (f"by worker {r['cpu_us_per_request_by_worker']} "
                                 if "cpu_us_per_request_by_worker" in r else "")
                              + f"client {r.get('client_cpu_us_per_request', float('nan')):.0f} us/req "
                              f"idle {r.get('machine_idle', float('nan')):.2f} "
                              f"switches/req {r.get('switches_per_request_by_role', {})}"
                              + (f" loop ({r.get('loop', 'core')}) busy {r['loop_busy']:.2f}"
                                 f" waiting {r.get('loop_waiting', float('nan')):.2f}"
                                 f" {r.get('loop_cpu_us_per_request', float('nan')):.1f}"
                                 f" us/req preempted/req {r.get('loop_preempted_per_request', float('nan')):.2f}"
                                 if "loop_busy" in r else "")
                              + ("" if r["stable"] else "  (unstable)") + ("  (timed out)" if r.get("timed_out") else ""),
                              flush=True)
    finally:
        for proc, _, _ in servers.values():
            stop_server(proc)
    for key, rounds in results["all"].items():  # the round with the median throughput stands for the point
        results["runs"][key] = sorted(rounds, key=lambda r: r["infer_per_s"])[len(rounds) // 2]
    results["load_after"] = open("/proc/loadavg").read().split()[:3]
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"addsub-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(results, indent=1))
    runs = results["runs"]
    peer = "triton"
    for kind in [k for k in args.servers if k != peer] if peer in args.servers else []:
        print(f"\n{kind} vs {peer}\n\n| protocol | concurrency | {kind} infer/s | {peer} infer/s | ratio "
              f"| {kind} p50 / p99 ms | {peer} p50 / p99 ms | CPU us/request {kind} / {peer} "
              f"| perf_analyzer CPU us/request | machine idle |\n"
              f"|---|---|---|---|---|---|---|---|---|---|")
        for protocol in args.protocols:
            for c in args.concurrency:
                t, q = runs.get(f"{kind}/{protocol}/{c}"), runs.get(f"{peer}/{protocol}/{c}")
                if not t or not q:
                    continue
                ratio = t["infer_per_s"] / q["infer_per_s"] if q["infer_per_s"] else float("nan")
                print(f"| {protocol} | {c} | {t['infer_per_s']:.0f} | {q['infer_per_s']:.0f} | {ratio:.2f}x | "
                      f"{t.get('p50_ms', 0):.2f} / {t.get('p99_ms', 0):.2f} | {q.get('p50_ms', 0):.2f} / "
                      f"{q.get('p99_ms', 0):.2f} | {t.get('cpu_us_per_request', 0):.0f} / "
                      f"{q.get('cpu_us_per_request', 0):.0f} | {t.get('client_cpu_us_per_request', 0):.0f} / "
                      f"{q.get('client_cpu_us_per_request', 0):.0f} | {t.get('machine_idle', 0):.2f} / "
                      f"{q.get('machine_idle', 0):.2f} |")
    # the core's own CPU per request (the target with frontend workers: <= 20 us), each server beside
    # tideserve:w1's throughput
    tideserves = [k for k in args.servers if k.startswith("tideserve")]
    if tideserves:
        base = next((k for k in tideserves if k.split("@")[0] == "tideserve:w1"), tideserves[0])
        print(f"\ncore CPU us/request (all processes us/request), throughput vs {base}, the serving event-loop thread's "
              f"busy share\n\n| protocol | concurrency | "
              + " | ".join(tideserves) + " |\n|---|---|" + "---|" * len(tideserves))
        for protocol in args.protocols:
            for c in args.concurrency:
                cells, b = [], runs.get(f"{base}/{protocol}/{c}")
                for kind in tideserves:
                    r = runs.get(f"{kind}/{protocol}/{c}")
                    if not r or "cpu_us_per_request_by_role" not in r:
                        cells.append("-")
                        continue
                    ratio = r["infer_per_s"] / b["infer_per_s"] if b and b.get("infer_per_s") else float("nan")
                    cells.append(f"{r['cpu_us_per_request_by_role'].get('core', 0):.0f} "
                                 f"({r['cpu_us_per_request']:.0f}), {r['infer_per_s']:.0f}/s {ratio:.2f}x"
                                 + (f", loop ({r.get('loop', 'core')}) busy {r['loop_busy']:.2f} waiting "
                                    f"{r.get('loop_waiting', float('nan')):.2f}" if "loop_busy" in r else ""))
                print(f"| {protocol} | {c} | " + " | ".join(cells) + " |")
    print(f"\nload {results['load_before']} -> {results['load_after']}; results: {out}; logs: {work}")


if __name__ == "__main__":
    main()
