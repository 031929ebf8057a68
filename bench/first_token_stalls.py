"""First-token stalls under bursts of streaming chats: one server (tideserve or vLLM's own api_server), rounds of
``--streams`` concurrent chat completions (the load of bench/openai_vs_vllm.py: the tiny Llama, greedy,
``--tokens`` each), TTFT spread per round.

A round whose TTFT p50, p90 and max are all alike and far above the others' had every stream's first token at once,
late: the engine's first step of the burst stalled (the frontend would delay streams one by one). Run it against
both servers to see whose stall it is:

    python bench/first_token_stalls.py --server tideserve [--rounds 4] [--streams 64 128] [--tokens 256]
    python bench/first_token_stalls.py --server vllm
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", choices=["tideserve", "vllm"], default="tideserve")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--streams", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--pause", type=float, default=3.0, help="seconds between bursts")
    args = parser.parse_args()

    import openai_vs_vllm as bench
    from tideserve.bench.examples.tiny_llama import make_model
    from tideserve.bench.tideserve_bench.api import measure

    work = Path(tempfile.mkdtemp(prefix="first-token-stalls-"))
    model = make_model(Path(tempfile.gettempdir()) / "tideserve-bench-llm" / args.size, args.size)  # (made once)
    engine_args = {"model": str(model), "dtype": "float32", "max_model_len": 1024, "enforce_eager": True}
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_CACHE_ROOT": str(work / "vc"),
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    port = bench.free_port()
    cmd = (bench.tideserve_command(engine_args, port, work) if args.server == "tideserve"
           else bench.vllm_command(model, port, engine_args))
    server = bench.Server(args.server, cmd, port, work / "server.log", env)
    try:
        print(f"{args.server} ready in {server.wait_ready():.0f} s; log {work / 'server.log'}", flush=True)
        url = f"http://127.0.0.1:{port}"
        for r in range(args.rounds):
            for n in args.streams:
                measure("openai-chat", url, bench.MODEL_NAME, ["warm up"], 8, extra={"temperature": 0})
                summary = measure("openai-chat", url, bench.MODEL_NAME, bench.prompts(n), args.tokens,
                                  extra={"temperature": 0}).summary
                ttft = summary["ttft_ms"]
                print(f"round {r + 1} {n} streams: {summary['output_throughput']:.0f} tok/s, wall "
                      f"{summary['duration_s']:.2f} s, TTFT ms p50 {ttft['median']:.0f} p90 {ttft.get('p90', 0):.0f} "
                      f"max {ttft.get('max', 0):.0f}, failed {summary['failed']}, load {os.getloadavg()[0]:.2f}",
                      flush=True)
                time.sleep(args.pause)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
