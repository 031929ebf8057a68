"""tideserve-bench's runner and targets without tideserve: closed and open loops against an in-process fake
target, timed runs and timeouts, the OpenAI chat target against a fake SSE endpoint."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np

from tideserve.bench.tideserve_bench import metrics
from tideserve.bench.tideserve_bench.records import RequestInput
from tideserve.bench.tideserve_bench.runner import Runner, SweepPoint
from tideserve.bench.tideserve_bench.targets.base import Target, TargetOptions
from tideserve.bench.tideserve_bench.workload import arrival_offsets


# -- the runner, against an in-process fake target -------------------------------------------------
class FakeTarget(Target):
    """Emits ``output_len`` token chunks ``gap`` s apart after ``ttft`` s; fails prompts containing 'fail'."""

    name = "fake"

    def __init__(self, ttft=0.01, gap=0.002):
        super().__init__(TargetOptions(url="fake://", model="m"))
        self.ttft, self.gap = ttft, gap
        self.in_flight = self.peak = 0
        self.sent: list[tuple[float, RequestInput]] = []

    async def _send(self, request, rec):
        self.sent.append((time.perf_counter(), request))
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            if "fail" in request.prompt:
                raise ConnectionError("refused")
            await asyncio.sleep(self.ttft)
            for _ in range(request.output_len):
                rec.token_chunk(time.perf_counter(), "x ")
                await asyncio.sleep(self.gap)
            rec.server_output_tokens = request.output_len
            rec.ended = True
        finally:
            self.in_flight -= 1


class ListWorkload:
    def __init__(self, fail_every=0):
        self.fail_every = fail_every

    def request(self, point, index):
        fail = self.fail_every and index % self.fail_every == 1
        return RequestInput(index, "fail" if fail else f"p{point}-{index}", 3, 4)

    def describe(self):
        return {}


def test_closed_loop_keeps_the_concurrency_and_counts_failures():
    target = FakeTarget()
    runner = Runner(target, ListWorkload(fail_every=5), num_requests=20, progress=False)
    run = asyncio.run(runner.run_point(0, SweepPoint("concurrency", 4)))
    assert [r.index for r in run.records] == list(range(20))
    assert target.peak == 4
    failed = [r for r in run.records if not r.success]
    assert [r.index for r in failed] == [1, 6, 11, 16]
    assert all(r.error == "ConnectionError: refused" for r in failed)
    assert run.duration_s >= max(r.latency for r in run.records if r.success)
    metrics.finalize(run.records)
    s = metrics.summarize(run.records, run.duration_s)
    assert (s["completed"], s["failed"]) == (16, 4)


def test_open_loop_follows_the_arrival_times_and_the_cap():
    target = FakeTarget(ttft=0.0, gap=0.0)
    runner = Runner(target, ListWorkload(), num_requests=30, seed=5, progress=False)
    run = asyncio.run(runner.run_point(2, SweepPoint("request_rate", 100.0)))
    expected = arrival_offsets(100.0, 30, seed=5, point=2)
    late = np.array([r.start - run.start for r in run.records]) - np.array(expected)
    assert (late > -1e-3).all()                     # never early
    assert np.median(late) < 0.02 and late.max() < 0.5   # (a loaded machine may delay a few)
    assert expected[-1] <= run.duration_s < expected[-1] + 0.5

    target = FakeTarget(ttft=0.02, gap=0.0)
    runner = Runner(target, ListWorkload(), num_requests=12, progress=False)
    asyncio.run(runner.run_point(0, SweepPoint("request_rate", float("inf"), max_concurrency=3)))
    assert target.peak == 3


def test_a_timed_run_stops_sending_at_the_deadline():
    target = FakeTarget(ttft=0.01, gap=0.001)
    runner = Runner(target, ListWorkload(), duration=0.3, progress=False)
    run = asyncio.run(runner.run_point(0, SweepPoint("concurrency", 2)))
    assert len(run.records) > 2  # each of the 2 slots sent again after its first (how many: the machine's load)
    assert all(r.start - run.start < 0.3 for r in run.records)
    assert 0.3 <= run.duration_s < 2.0
    warm = asyncio.run(runner.warmup(3, 2))
    assert [r.request_id for r in sorted(warm, key=lambda r: -r.index)] == [f"bench-warmup-{i}" for i in (1, 2, 3)]


def test_a_timed_out_request_is_a_failure():
    target = FakeTarget(ttft=5.0)
    target.options.request_timeout = 0.05
    rec = asyncio.run(target.send(RequestInput(0, "p", 1, 2)))
    assert not rec.success and rec.error == "timed out after 0.05 s"


# -- the OpenAI target against a fake SSE server ---------------------------------------------------
def test_openai_chat_target_parses_a_stream(tmp_path):
    from aiohttp import web

    from tideserve.bench.tideserve_bench.targets import make_target

    seen = []

    async def chat(request):
        body = await request.json()
        seen.append(body)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def send(obj):
            await response.write(f"data: {json.dumps(obj)}\n\n".encode())
            await asyncio.sleep(0.02)

        if body["model"] == "bad":
            await send({"error": {"message": "no such model"}})
            return response
        await send({"choices": [{"delta": {"role": "assistant", "content": ""}}]})   # not a token
        await asyncio.sleep(0.05)
        for word in ("Hel", "lo", " world"):
            await send({"choices": [{"delta": {"content": word}, "finish_reason": None}]})
        await send({"choices": [{"delta": {"content": ""}, "finish_reason": "length"}]})
        await send({"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 4}})
        await response.write(b"data: [DONE]\n\n")
        return response

    async def main():
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        out = []
        for model, role_counts in (("m", True), ("m", False), ("bad", True)):
            target = make_target("openai-chat", TargetOptions(url=f"http://127.0.0.1:{port}", model=model,
                                                              ignore_eos=True, extra={"temperature": 0},
                                                              role_chunk_is_token=role_counts))
            await target.open()
            out.append(await target.send(RequestInput(0, "Say hi", 3, 4)))
            await target.close()
        await runner.cleanup()
        return out

    as_vllm, by_content, bad = asyncio.run(main())
    assert seen[0]["messages"] == [{"role": "user", "content": "Say hi"}]
    assert seen[0]["max_completion_tokens"] == 4 and seen[0]["ignore_eos"] is True
    assert seen[0]["stream_options"] == {"include_usage": True} and seen[0]["temperature"] == 0
    for good in (as_vllm, by_content):
        assert good.success and good.ended and good.finish_reason == "length"
        assert good.text == "Hello world"
        assert (good.server_output_tokens, good.server_prompt_tokens) == (4, 11)
        assert good.latency == good.chunk_times[-1] - good.start   # the usage chunk is no token chunk
    # vLLM's way: the role chunk is the first token, and the server's 50 ms pause comes after it
    assert len(as_vllm.chunk_times) == 5 and as_vllm.ttft == as_vllm.chunk_times[0] - as_vllm.start
    assert as_vllm.chunk_times[1] - as_vllm.chunk_times[0] >= 0.045
    assert len(by_content.chunk_times) == 4 and by_content.ttft >= 0.045   # --ttft-from content: after the pause
    assert not bad.success and bad.error == "server error: no such model"
