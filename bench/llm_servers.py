"""What the benchmark scripts share: free ports, a process's CPU time, percentiles, the fixed story prompts of the
LLM comparisons, the environment of a vLLM CPU engine, a one-model vLLM repository, starting a tideserve process
until it (or one model) is ready, and stopping a server's whole process group (its engine and model processes
included)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUBJECTS = ["the river", "a quiet town", "the old library", "an engineer", "the winter market", "a lighthouse",
            "the mountain road", "a small robot"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def story_prompts(count: int) -> list[str]:
    return [f"Story {i}: once upon a time {SUBJECTS[i % len(SUBJECTS)]} woke up and" for i in range(count)]


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank) of ``values``; nan for none."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def engine_env(work: Path) -> dict:
    """This process's environment plus what a vLLM CPU engine needs here (1 GiB of KV cache, no hub, its cache
    under ``work``, no usage reports)."""
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
            "VLLM_CACHE_ROOT": str(work / "vllm-cache"), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def write_vllm_repository(root: Path, model: Path, max_num_seqs: int, max_queue_size: int = 0,
                          name: str = "llm", engine_nice: int = 0) -> Path:
    """``root/models`` with one vLLM model ``name`` on ``model`` (float32, eager, 512 tokens of context) and, when
    given, the ``max_queue_size`` and ``engine_nice`` config parameters."""
    repo = root / "models"
    version = repo / name / "1"
    version.mkdir(parents=True, exist_ok=True)
    config = 'backend: "vllm"\n'
    if max_queue_size:
        config += f'parameters {{ key: "max_queue_size" value {{ string_value: "{max_queue_size}" }} }}\n'
    if engine_nice:
        config += f'parameters {{ key: "engine_nice" value {{ string_value: "{engine_nice}" }} }}\n'
    (repo / name / "config.pbtxt").write_text(config)
    (version / "model.json").write_text(json.dumps({
        "model": str(model), "dtype": "float32", "max_model_len": 512, "enforce_eager": True,
        "max_num_seqs": max_num_seqs}))
    return repo


def start_tideserve(repo: Path, log: Path, env: dict, ready_model: str | None, timeout: float = 900,
                    weights: Path | None = None, args: tuple[str, ...] = (),
                    new_session: bool = True) -> tuple[subprocess.Popen, int, int]:
    """A tideserve process over ``repo`` (in its own session), once ``ready_model`` (None: the server) is ready:
    (process, http, grpc).
    ``weights``: a model directory outside ``repo`` that the repository's configs name; ``args``: more flags;
    ``new_session`` False: a process group of its own in the caller's session (with the kernel's autogroup
    scheduling each session gets an equal share of a busy machine's CPU; servers compared against each
    other should share one)."""
    http, grpc, metrics = free_port(), free_port(), free_port()
    cmd = [sys.executable, "-m", "tideserve.cli", "--model-repository", str(repo), "--http-port", str(http),
           "--grpc-port", str(grpc), "--metrics-port", str(metrics)]
    if weights is not None:
        cmd += ["--allowed-model-root", str(weights)]
    cmd += args
    with open(log, "wb") as log_file:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                start_new_session=new_session, process_group=None if new_session else 0)
    started = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"tideserve exited with {proc.returncode}; see {log}")
        try:
            path = f"/v2/models/{ready_model}/ready" if ready_model else "/v2/health/ready"
            with urllib.request.urlopen(f"http://127.0.0.1:{http}{path}", timeout=2) as r:
                if r.status == 200:
                    break
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() - started > timeout:
            stop_process(proc)
            raise RuntimeError(f"tideserve was not ready in {timeout:.0f}s; see {log}")
        time.sleep(0.5)
    print(f"tideserve ready in {time.monotonic() - started:.0f}s", flush=True)
    return proc, http, grpc


def stop_process(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM the process group, SIGKILL it if it has not ended within ``timeout``; return once no process of the
    group runs any more, not only its leader: a vLLM engine's worker may spin on a CPU for seconds after the server
    process that started it exited (its engine core waits for it), and would slow the next server a benchmark
    starts (its own worker pinned to the same core)."""
    if proc.poll() is not None:
        return
    deadline = time.monotonic() + timeout
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    while group_running(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if group_running(proc.pid):  # what is left of the group after the timeout
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def group_running(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies, waiting to be reaped, do not count)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False
