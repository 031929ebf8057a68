"""tideserve-bench as a library: one measured batch of requests, for scripts that compare two servers or two models.

``measure`` sends a fixed list of prompts through one of the tool's targets, closed loop at the given
concurrency, and returns the same summary (``ttft_ms``, ``itl_ms``, ``output_throughput``...) as one
sweep point of ``tideserve-bench run``, with the per-request records (their texts included). The
comparison scripts of ``bench/`` (``openai_vs_vllm.py``, ``ensemble_vs_direct.py``) measure with it,
so their numbers have the tool's definitions (those of ``vllm bench serve``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from .metrics import finalize, summarize
from .records import RequestInput, RequestRecord
from .runner import Runner, SweepPoint
from .targets import TargetOptions, make_target
from .workload import Workload


class PromptList(Workload):
    """The given prompts, in order (wrapping around), each asking for ``output_len`` tokens."""

    def __init__(self, prompts: list[str], output_len: int) -> None:
        if not prompts:
            raise ValueError("no prompts")
        self.prompts = list(prompts)
        self.output_len = output_len

    def request(self, point: int, index: int) -> RequestInput:
        return RequestInput(index, self.prompts[abs(index) % len(self.prompts)], None, self.output_len)

    def describe(self) -> dict[str, Any]:
        return {"kind": "prompt-list", "prompts": len(self.prompts), "output_len": self.output_len}


@dataclass
class Measurement:
    summary: dict[str, Any]          # as a sweep point's entry of result.json
    records: list[RequestRecord]     # one per request, in the order of the prompts

    @property
    def texts(self) -> list[str]:
        return [r.text for r in self.records]


async def measure_async(target: str, url: str, model: str, prompts: list[str], output_len: int, *,
                        concurrency: int | None = None, num_requests: int | None = None, ignore_eos: bool = True,
                        extra: dict[str, Any] | None = None, warmup: int = 0, tokenizer=None,
                        request_timeout: float = 1800.0, role_chunk_is_token: bool = True) -> Measurement:
    """``num_requests`` (default: one per prompt) requests at ``concurrency`` (default: all at once).
    ``role_chunk_is_token`` False: the chat stream's first token is its first chunk with content (as the CLI's
    ``--ttft-from content``), the definition that compares with the other APIs' first text event."""
    count = num_requests or len(prompts)
    options = TargetOptions(url=url, model=model, ignore_eos=ignore_eos, extra=dict(extra or {}),
                            request_timeout=request_timeout, role_chunk_is_token=role_chunk_is_token)
    client = make_target(target, options)
    runner = Runner(client, PromptList(prompts, output_len), num_requests=count, progress=False)
    await client.open()
    try:
        if warmup:
            await runner.warmup(warmup, min(warmup, concurrency or count))
        run = await runner.run_point(0, SweepPoint("concurrency", concurrency or count))
    finally:
        await client.close()
    finalize(run.records, tokenizer, ignore_eos=ignore_eos)
    return Measurement(summarize(run.records, run.duration_s), run.records)


def measure(*args, **kwargs) -> Measurement:
    """:func:`measure_async` on a fresh event loop."""
    return asyncio.run(measure_async(*args, **kwargs))
