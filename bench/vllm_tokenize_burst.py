"""A burst of prompts tokenized for the vLLM engine: vLLM's ``render_cmpl_async`` per prompt (one hand-off to the
renderer's thread each) vs the vllm backend's ``_Tokenizing`` (the prompts that arrive together in one hand-off).

``--prompts`` (default 128) chat-rendered prompts start at once on a loop that also has other work (a 0.2 ms callback
every 0.5 ms, standing for request parsing and output handling); per side, over ``--rounds`` alternating rounds, the
median time until half and until all of them are tokenized, and the process's CPU time. The token ids of both
sides are checked equal. No engine is started (only its renderer, from the tiny example Llama's files).

    python bench/vllm_tokenize_burst.py [--prompts 128] [--rounds 6]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tideserve.bench.examples.tiny_llama import make_model
    from tideserve.llm_backends.vllm.generation import _Tokenizing
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.renderers import renderer_from_config
    from vllm.renderers.inputs.preprocess import parse_model_prompt

    model = make_model(Path(tempfile.gettempdir()) / "tideserve-bench-llm" / "tiny", "tiny")
    config = AsyncEngineArgs(model=str(model), dtype="float32", max_model_len=1024,
                             enforce_eager=True).create_engine_config()
    renderer = renderer_from_config(config)
    prompts = [f"<|user|>Story {i}: tell me about the river and the mountain road.<|assistant|>" for i in range(args.prompts)]

    async def busy() -> None:
        while True:
            t = time.perf_counter()
            while time.perf_counter() - t < 0.0002:
                pass
            await asyncio.sleep(0.0005)

    async def one_round(kind: str, tokenizing: _Tokenizing):
        noise = asyncio.ensure_future(busy())
        await asyncio.sleep(0.01)
        start = time.perf_counter()
        done = []
        async def one(p: str):
            parsed = parse_model_prompt(config.model_config, p)
            if kind == "vllm":
                (r,) = await renderer.render_cmpl_async([parsed], None)
            else:
                r = await tokenizing.render(parsed, None)
            done.append(time.perf_counter() - start)
            return r
        results = await asyncio.gather(*(one(p) for p in prompts))
        noise.cancel()
        return [r["prompt_token_ids"] for r in results], sorted(done)

    async def run() -> None:
        tokenizing = _Tokenizing(renderer)
        out = {"vllm": [], "batched": []}
        ids = {}
        for i in range(args.rounds):
            for kind in (("vllm", "batched") if i % 2 == 0 else ("batched", "vllm")):
                cpu = time.process_time()
                ids[kind], done = await one_round(kind, tokenizing)
                out[kind].append((done[len(done) // 2] * 1000, done[-1] * 1000, (time.process_time() - cpu) * 1000))
        assert ids["vllm"] == ids["batched"], "the two ways gave different token ids"
        for kind, rows in out.items():
            print(f"{kind:8s} half {statistics.median(r[0] for r in rows):6.1f} ms, all "
                  f"{statistics.median(r[1] for r in rows):6.1f} ms, process CPU {statistics.median(r[2] for r in rows):6.1f}"
                  f" ms (medians of {len(rows)} rounds); all, per round " + " / ".join(f"{r[1]:.0f}" for r in rows))
    asyncio.run(run())

if __name__ == "__main__":
    main()
