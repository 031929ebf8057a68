"""tideserve-bench (bench/tideserve_bench): metric math, workloads, runner semantics, reports; then end to end
against a real tideserve process serving the tiny vLLM model over KServe generate_stream, gRPC
ModelStreamInfer and (when the server has it) OpenAI chat, with the result files checked against
what the server counted."""

from __future__ import annotations

import asyncio
import csv
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from llm_fixtures import metric_value, vllm_env, write_vllm_model

from tideserve.bench.tideserve_bench import compare as compare_mod
from tideserve.bench.tideserve_bench import metrics, plots
from tideserve.bench.tideserve_bench.records import RequestInput, RequestRecord, SSEParser
from tideserve.bench.tideserve_bench.runner import Runner, SweepPoint
from tideserve.bench.tideserve_bench.targets.base import Target, TargetOptions
from tideserve.bench.tideserve_bench.workload import (
    JsonlWorkload,
    LengthDist,
    SyntheticWorkload,
    Tokenizer,
    arrival_offsets,
    poisson_arrivals,
    save_workload,
)

REPO = Path(__file__).resolve().parents[2]


# -- records and SSE --------------------------------------------------------------------------------
def test_sse_parser_splits_events_across_reads():
    parser = SSEParser()
    assert parser.feed(b'data: {"a": 1}\n\ndata: {"b"') == ['{"a": 1}']
    assert parser.feed(b': 2}\n\n: ping\n\n') == ['{"b": 2}']          # a comment yields nothing
    assert parser.feed(b'event: x\r\ndata: one\r\ndata: two\r\n\r\n') == ["one\ntwo"]
    assert parser.feed("data: caf\u00e9".encode()[:-1]) == []         # half a UTF-8 character
    assert parser.feed("data: caf\u00e9".encode()[-1:] + b"\n\n") == ["caf\u00e9"]
    assert parser.feed(b"data: [DONE]") == []
    assert parser.close() == ["[DONE]"]                                 # no blank line at the end


def record(start: float, chunks: list[float], tokens: int = 0, *, index: int = 0, ok: bool = True,
           prompt: int = 10, asked: int = 4) -> RequestRecord:
    r = RequestRecord(index, f"r{index}", prompt, asked, start=start, chunk_times=list(chunks), ended=True)
    r.success = ok
    r.server_output_tokens = tokens or None
    if not ok:
        r.error = "boom"
    return r


# -- metric math ------------------------------------------------------------------------------------
def traces() -> list[RequestRecord]:
    """Hand-made timestamp traces (seconds)."""
    return [
        record(0.0, [0.10, 0.15, 0.25, 0.30], 4, index=0),   # TTFT 100, E2EL 300, TPOT 200/3, ITL 50 100 50
        record(1.0, [1.20, 1.30], 5, index=1, asked=5),      # two tokens a chunk: TTFT 200, E2EL 300, TPOT 25, ITL 100
        record(2.0, [], index=2, ok=False),                  # failed: in no latency, counted
        record(2.0, [2.40], 1, index=3, asked=1),            # one token: TTFT = E2EL = 400, no TPOT
    ]


def test_metrics_match_hand_computed_values():
    records = traces()
    metrics.finalize(records)
    s = metrics.summarize(records, 5.0, slos={"ttft": 250, "tpot": 50}, percentiles=(50, 90, 99))
    assert (s["requests"], s["completed"], s["failed"], s["truncated"]) == (4, 3, 1, 0)
    assert s["total_output_tokens"] == 10 and s["total_input_tokens"] == 30
    assert s["request_throughput"] == pytest.approx(3 / 5)
    assert s["output_throughput"] == pytest.approx(10 / 5)
    assert s["total_token_throughput"] == pytest.approx(40 / 5)

    ttft = s["ttft_ms"]
    assert ttft["count"] == 3
    assert ttft["mean"] == pytest.approx(700 / 3)
    assert ttft["median"] == pytest.approx(200)
    assert ttft["std"] == pytest.approx(math.sqrt(((100 - 700 / 3) ** 2 + (200 - 700 / 3) ** 2 + (400 - 700 / 3) ** 2) / 3))
    assert ttft["p90"] == pytest.approx(360)   # linear interpolation: 200 + 0.8 * (400 - 200)
    assert ttft["p99"] == pytest.approx(396)
    assert (ttft["min"], ttft["max"]) == (pytest.approx(100), pytest.approx(400))

    tpot = s["tpot_ms"]   # only requests with more than one token
    assert tpot["count"] == 2
    assert tpot["mean"] == pytest.approx((200 / 3 + 25) / 2)

    itl = s["itl_ms"]     # per-chunk gaps, all requests pooled: 50, 100, 50, 100
    assert itl["count"] == 4
    assert itl["mean"] == pytest.approx(75) and itl["median"] == pytest.approx(75)
    assert itl["p90"] == pytest.approx(100)

    e2el = s["e2el_ms"]
    assert sorted([e2el["min"], e2el["median"], e2el["max"]]) == [pytest.approx(300)] * 2 + [pytest.approx(400)]

    # goodput: r0 misses TPOT (66.7 > 50), r1 meets both, r3 misses TTFT (400 > 250); one-token TPOT counts as 0
    assert s["good_requests"] == 1 and s["request_goodput"] == pytest.approx(1 / 5)
    assert metrics.summarize(records, 5.0, slos={"tpot": 50})["good_requests"] == 2
    assert metrics.summarize(records, 5.0, slos={"e2el": 300.0001})["good_requests"] == 2
    assert metrics.summarize(records, 5.0)["request_goodput"] is None
    assert s["errors"] == [{"error": "boom", "count": 1}]


def test_metrics_with_no_completed_request_are_empty_not_zero():
    records = [record(0, [], ok=False, index=i) for i in range(3)]
    metrics.finalize(records)
    s = metrics.summarize(records, 1.0)
    assert (s["completed"], s["failed"], s["request_throughput"]) == (0, 3, 0.0)
    assert s["ttft_ms"] is None and s["itl_ms"] is None
    assert s["errors"] == [{"error": "boom", "count": 3}]


@pytest.mark.slow
def test_metrics_agree_with_vllm_calculate_metrics():
    """The same traces through vLLM's own calculate_metrics (its serve benchmark's definitions)."""
    from vllm.benchmarks.datasets.datasets import SampleRequest
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput
    from vllm.benchmarks.serve import calculate_metrics

    rng = np.random.default_rng(3)
    records, outputs = [], []
    for i in range(40):
        start = float(rng.uniform(0, 5))
        n_chunks = int(rng.integers(1, 30))
        times = (start + np.cumsum(rng.exponential(0.02, n_chunks))).tolist()
        ok = i % 7 != 3
        tokens = n_chunks + int(rng.integers(0, 3))
        r = record(start, times if ok else [], tokens, index=i, ok=ok, prompt=int(rng.integers(5, 50)))
        records.append(r)
        out = RequestFuncOutput(success=ok, prompt_len=r.prompt_len, start_time=start)
        if ok:
            out.ttft, out.latency, out.output_tokens = r.ttft, r.latency, tokens
            out.itl = r.itls
        outputs.append(out)
    metrics.finalize(records)
    slos = {"ttft": 30.0, "tpot": 20.0, "e2el": 400.0}
    ours = metrics.summarize(records, 7.5, slos=slos, percentiles=(50, 90, 99))
    inputs = [SampleRequest(prompt="x", prompt_len=r.prompt_len, expected_output_len=4) for r in records]
    theirs, _ = calculate_metrics(inputs, outputs, 7.5, None, [50, 90, 99], slos)
    assert ours["completed"] == theirs.completed
    assert ours["total_output_tokens"] == theirs.total_output
    assert ours["request_throughput"] == pytest.approx(theirs.request_throughput)
    assert ours["request_goodput"] == pytest.approx(theirs.request_goodput)
    assert ours["output_throughput"] == pytest.approx(theirs.output_throughput)
    assert ours["total_token_throughput"] == pytest.approx(theirs.total_token_throughput)
    for name in ("ttft", "tpot", "itl", "e2el"):
        mine = ours[f"{name}_ms"]
        assert mine["mean"] == pytest.approx(getattr(theirs, f"mean_{name}_ms")), name
        assert mine["median"] == pytest.approx(getattr(theirs, f"median_{name}_ms")), name
        assert mine["std"] == pytest.approx(getattr(theirs, f"std_{name}_ms")), name
        for p, value in getattr(theirs, f"percentiles_{name}_ms"):
            assert mine[metrics.pkey(p)] == pytest.approx(value), (name, p)


def test_finalize_token_sources_and_truncation():
    class Counter:
        def count(self, text):
            return len(text.split())

    server = record(0, [0.1, 0.2], 7, index=0, asked=7)
    by_text = record(0, [0.1, 0.2], 0, index=1, asked=7)
    by_text.text = "one two three"
    short = record(0, [0.1], 2, index=2, asked=5)
    cut = record(0, [0.1, 0.2], 2, index=3, asked=2)
    cut.ended = False
    server.server_prompt_tokens = 12
    records = [server, by_text, short, cut]
    metrics.finalize(records, Counter(), ignore_eos=True)
    assert (server.output_tokens, server.output_token_source) == (7, "server")
    assert (server.input_tokens, server.input_token_source) == (12, "server")
    assert (by_text.output_tokens, by_text.output_token_source) == (3, "tokenizer")
    assert (by_text.input_tokens, by_text.input_token_source) == (10, "tokenizer")
    assert "3 of 7" in by_text.truncated and "2 of 5" in short.truncated
    assert "end marker" in cut.truncated
    assert not server.truncated
    s = metrics.summarize(records, 1.0)
    assert s["truncated"] == 3 and s["completed"] == 4   # truncated requests are measured and counted
    assert s["token_counts"]["output"] == {"server": 3, "tokenizer": 1}
    assert "tokenizer (1)" in metrics.token_count_statement(s)

    metrics.finalize(records, Counter(), token_counts="tokenizer")   # always re-tokenize
    assert server.output_token_source == "tokenizer" and server.input_token_source == "tokenizer"
    metrics.finalize(records, None)                                  # no server count, no tokenizer: 1 (as vLLM)
    assert (by_text.output_tokens, by_text.output_token_source) == (1, "none")
    assert not by_text.truncated                                     # EOS not ignored: short is fine


def test_parse_goodput():
    assert metrics.parse_goodput(["ttft:200", "tpot:50.5 e2el:3000"]) == {"ttft": 200, "tpot": 50.5, "e2el": 3000}
    for bad in (["ttfb:1"], ["ttft"], ["ttft:fast"], ["tpot:-1"]):
        with pytest.raises(ValueError):
            metrics.parse_goodput(bad)


# -- workloads ------------------------------------------------------------------------------------
def test_length_distributions_parse_and_sample_seeded():
    assert LengthDist.parse("128") == LengthDist.parse("fixed:128") == LengthDist("fixed", 128)
    rng = np.random.default_rng(0)
    assert {LengthDist.parse("7").sample(rng) for _ in range(20)} == {7}

    uniform = LengthDist.parse("uniform:10,20")
    values = [uniform.sample(np.random.default_rng([1, i])) for i in range(4000)]
    assert min(values) == 10 and max(values) == 20             # both ends included
    assert np.mean(values) == pytest.approx(15, abs=0.3)
    assert values == [uniform.sample(np.random.default_rng([1, i])) for i in range(4000)]   # seeded

    normal = LengthDist.parse("normal:100,10")
    values = np.array([normal.sample(np.random.default_rng([2, i])) for i in range(4000)])
    assert values.mean() == pytest.approx(100, abs=1) and values.std() == pytest.approx(10, rel=0.08)
    clipped = LengthDist.parse("normal:100,50,90,110")
    values = [clipped.sample(np.random.default_rng([3, i])) for i in range(1000)]
    assert min(values) == 90 and max(values) == 110
    assert clipped.describe() == "normal:100,50,90,110" and uniform.describe() == "uniform:10,20"

    for bad in ("0", "uniform:5", "uniform:9,3", "normal:10", "normal:10,2,5,1", "poisson:3", "x", "1.5"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


def test_arrivals_are_poisson_scaled_to_the_rate():
    times = arrival_offsets(4.0, 2000, seed=1)
    assert times == arrival_offsets(4.0, 2000, seed=1)
    assert times != arrival_offsets(4.0, 2000, seed=2)
    assert times[-1] == pytest.approx(2000 / 4.0)             # as vLLM: the last one at count / rate
    gaps = np.diff([0.0, *times])
    assert (gaps >= 0).all()
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.08)   # exponential: CV 1
    assert arrival_offsets(float("inf"), 5, seed=0) == [0.0] * 5
    unbounded = poisson_arrivals(10.0, seed=0)
    first = [next(unbounded) for _ in range(3000)]
    assert first[-1] == pytest.approx(300, rel=0.06)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from tideserve.bench.examples.tiny_llama import train_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(1024).save_pretrained(path)
    return path


def test_synthetic_prompts_have_the_asked_token_counts(tokenizer_dir):
    tok = Tokenizer(str(tokenizer_dir))
    workload = SyntheticWorkload(tok, LengthDist.parse("uniform:8,300"), LengthDist.parse("normal:20,5"), seed=4)
    requests = [workload.request(0, i) for i in range(60)]
    for r in requests:
        assert r.prompt_len == tok.count(r.prompt)              # what the tokenizer really makes of it
    wanted = [LengthDist.parse("uniform:8,300").sample(np.random.default_rng([4, 1, i, 0])) for i in range(60)]
    assert [r.prompt_len for r in requests] == wanted
    again = SyntheticWorkload(Tokenizer(str(tokenizer_dir)), workload.input_len, workload.output_len, seed=4)
    assert [again.request(0, i).prompt for i in range(60)] == [r.prompt for r in requests]
    other_point = [workload.request(1, i).prompt for i in range(60)]
    warmup = [workload.request(-1, -i).prompt for i in range(1, 61)]
    assert not set(other_point) & {r.prompt for r in requests}   # each point has prompts of its own
    assert not set(warmup) & {r.prompt for r in requests}
    special = set(tok.hf.all_special_ids) | set(tok.hf.added_tokens_decoder)
    assert not special & {t for r in requests for t in tok.encode(r.prompt)}


def test_jsonl_workload_and_saved_workload_round_trip(tmp_path, tokenizer_dir):
    tok = Tokenizer(str(tokenizer_dir))
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Hello there", "output_tokens": 5}\n\n{"prompt": "Second one"}\n')
    workload = JsonlWorkload(path, tok, LengthDist.parse("9"))
    first, second, third = (workload.request(0, i) for i in range(3))
    assert (first.prompt, first.output_len, first.prompt_len) == ("Hello there", 5, tok.count("Hello there"))
    assert (second.output_len, third.prompt) == (9, "Hello there")   # wraps around
    saved = tmp_path / "saved.jsonl"
    synthetic = SyntheticWorkload(tok, LengthDist.parse("16"), LengthDist.parse("uniform:3,9"), seed=1)
    requests = [synthetic.request(0, i) for i in range(5)]
    save_workload(saved, requests)
    again = JsonlWorkload(saved, tok, LengthDist.parse("1"))
    assert [(r.prompt, r.output_len, r.prompt_len) for r in (again.request(0, i) for i in range(5))] == \
        [(r.prompt, r.output_len, r.prompt_len) for r in requests]
    for bad in ('{"text": "x"}', '{"prompt": "x", "output_tokens": 0}', "not json"):
        (tmp_path / "bad.jsonl").write_text(bad + "\n")
        with pytest.raises(ValueError):
            JsonlWorkload(tmp_path / "bad.jsonl", None, LengthDist.parse("1"))


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
    assert len(run.records) > 10
    assert all(r.start - run.start < 0.3 for r in run.records)
    assert 0.3 <= run.duration_s < 1.0
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
    assert len(as_vllm.chunk_times) == 5 and as_vllm.ttft < 0.05  # vLLM's way: the role chunk is the first
    assert len(by_content.chunk_times) == 4 and by_content.ttft >= 0.06   # --ttft-from content: 50 ms later
    assert not bad.success and bad.error == "server error: no such model"


# -- compare -------------------------------------------------------------------------------------
def _doc(label, values, tput):
    runs = [{"kind": "concurrency", "value": v, "label": f"concurrency {v}", "completed": 10, "failed": 0,
             "request_throughput": tput * v, "output_throughput": 100 * tput * v,
             "ttft_ms": {"mean": 10.0 * v, "median": 9.0 * v, "p99": 20.0 * v}} for v in values]
    return {"tool": "tideserve-bench", "label": label, "runs": runs}


def test_compare_puts_results_side_by_side_as_ratios(tmp_path, capsys):
    from tideserve.bench.tideserve_bench.cli import main

    a, b = tmp_path / "a.json", tmp_path / "b" / "result.json"
    b.parent.mkdir()
    a.write_text(json.dumps(_doc("A", [1, 8], 2.0)))
    b.write_text(json.dumps(_doc("B", [8, 1], 3.0)))
    vllm = tmp_path / "vllm.json"
    vllm.write_text(json.dumps({"request_rate": "inf", "max_concurrency": 1, "completed": 10, "failed": 0,
                                "request_throughput": 1.0, "output_throughput": 150.0, "median_ttft_ms": 4.5,
                                "mean_ttft_ms": 5.0, "p99_ttft_ms": 30.0}))
    result = compare_mod.compare([a, b.parent, vllm])
    point1 = {row["metric"]: row for row in result["points"][0]["rows"]}
    assert result["points"][0]["point"] == "concurrency 1"
    assert point1["request throughput (req/s)"]["values"][:2] == [2.0, 3.0]
    assert point1["request throughput (req/s)"]["ratios"] == [pytest.approx(1.5), pytest.approx(0.5)]
    assert point1["TTFT median (ms)"]["ratios"] == [pytest.approx(1.0), pytest.approx(0.5)]
    assert point1["TTFT p99 (ms)"]["ratios"][1] == pytest.approx(1.5)
    point8 = {row["metric"]: row for row in result["points"][1]["rows"]}
    assert point8["output throughput (tok/s)"]["values"] == [1600.0, 2400.0, None]   # matched by value
    assert main(["compare", str(a), str(b), "--plain", "--out", str(tmp_path / "cmp.csv")]) == 0
    printed = capsys.readouterr().out
    assert "1.500x" in printed and "concurrency 8" in printed
    with open(tmp_path / "cmp.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0][:2] == ["point", "metric"] and len(rows) > 10


def test_cli_rejects_bad_arguments(capsys):
    from tideserve.bench.tideserve_bench.cli import main

    base = ["run", "--target", "kserve-generate", "--model", "m", "--tokenizer", "/nonexistent"]
    with pytest.raises(SystemExit):
        main(base + ["--concurrency", "1", "--request-rate", "2"])
    with pytest.raises(SystemExit):
        main(["run", "--target", "kserve-generate", "--model", "m"])           # synthetic prompts need a tokenizer
    with pytest.raises(SystemExit):
        main(base + ["--request-rate", "inf", "--duration", "5"])
    assert main(base + ["--input-len", "uniform:9,1", "--out", "/tmp/unused"]) == 2
    assert "uniform:9,1" in capsys.readouterr().err


# -- end to end against tideserve with the tiny vLLM model -----------------------------------------
MODEL = "tiny_llm"


@pytest.fixture(scope="module")
def llm_server(tmp_path_factory, tiny_model):
    """One engine for the module (stopped at its end, before other modules start theirs)."""
    from support import start_server

    tmp = tmp_path_factory.mktemp("bench_server")
    write_vllm_model(tmp / "models", MODEL, {"model": str(tiny_model), "dtype": "float32", "max_model_len": 512,
                                             "enforce_eager": True})
    server = start_server([tmp / "models"], "--allowed-model-root", str(tiny_model), tmp_dir=tmp,
                          env=vllm_env(tmp), ready_timeout=280)
    yield server
    server.stop()


def bench(*args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tideserve.bench.tideserve_bench", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, check=False)


def counters(server) -> dict[str, float]:
    text = server.metrics()
    labels = {"model_name": MODEL, "version": "1"}
    return {name: metric_value(text, f"tideserve:{name}", **labels) or 0.0
            for name in ("request_success_total", "generation_tokens_total", "prompt_tokens_total")}


def read_run(out: Path) -> tuple[dict, list[dict]]:
    result = json.loads((out / "result.json").read_text())
    with open(out / "requests.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return result, rows


def engine_test(func):
    """Slow (an engine starts with the module's first one)."""
    for mark in (pytest.mark.slow, pytest.mark.timeout(420)):
        func = mark(func)
    return func


@pytest.mark.parametrize("target, sweep", [
    ("kserve-generate", ["--concurrency", "1", "4"]),
    ("grpc-stream", ["--request-rate", "30", "inf"]),
    ("openai-chat", ["--concurrency", "3"]),
])
@engine_test
def test_end_to_end_results_match_the_requests_sent(llm_server, tiny_model, tmp_path, target, sweep):
    url = llm_server.grpc_url if target == "grpc-stream" else llm_server.base_url
    out = tmp_path / "out"
    workload_file = tmp_path / "sent.jsonl"
    n = 6
    before = counters(llm_server)
    done = bench("run", "--target", target, "--url", url, "--model", MODEL, "--tokenizer", str(tiny_model),
                 "--input-len", "uniform:8,40", "--output-len", "uniform:4,12", "--ignore-eos", *sweep,
                 "--num-requests", str(n), "--warmup", "0", "--seed", "11", "--goodput", "ttft:60000", "tpot:60000",
                 "--out", str(out), "--save-workload", str(workload_file), "--no-progress", "--plain")
    after = counters(llm_server)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Latency (ms)" in done.stdout and "TTFT" in done.stdout
    result, rows = read_run(out)
    points = len(result["runs"])
    assert points == len(sweep) - 1

    # what was asked for: the seeded workload, regenerated here
    tok = Tokenizer(str(tiny_model))
    workload = SyntheticWorkload(tok, LengthDist.parse("uniform:8,40"), LengthDist.parse("uniform:4,12"), seed=11)
    assert len(rows) == points * n
    for row in rows:
        asked = workload.request(int(row["point"]), int(row["index"]))
        assert row["success"] == "1" and not row["error"] and not row["truncated"], row
        assert int(row["requested_output_tokens"]) == asked.output_len
        assert int(row["output_tokens"]) == asked.output_len          # ignore_eos: exactly what was asked
        assert row["output_token_source"] == "server"
        if target != "openai-chat":                                    # chat adds its template's tokens
            assert int(row["input_tokens"]) == asked.prompt_len
        assert int(row["token_chunks"]) >= 1
    saved = [json.loads(line) for line in workload_file.read_text().splitlines()]
    assert [s["output_tokens"] for s in saved] == [workload.request(0, i).output_len for i in range(n)]

    # what the server counted while the tool ran (no warm-up, nothing else on this model meanwhile)
    total_out = sum(int(r["output_tokens"]) for r in rows)
    total_in = sum(int(r["input_tokens"]) for r in rows)
    assert after["request_success_total"] - before["request_success_total"] == points * n
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == total_out
    if target != "openai-chat":
        assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == total_in

    for k, run in enumerate(result["runs"]):
        mine = [r for r in rows if int(r["point"]) == k]
        assert (run["requests"], run["completed"], run["failed"], run["truncated"]) == (n, n, 0, 0)
        assert run["total_output_tokens"] == sum(int(r["output_tokens"]) for r in mine)
        assert run["request_throughput"] * run["duration_s"] == pytest.approx(n)
        assert run["output_throughput"] * run["duration_s"] == pytest.approx(run["total_output_tokens"])
        ends = [float(r["send_time_s"]) + float(r["e2el_ms"]) / 1000 for r in mine]
        assert max(ends) <= run["duration_s"] + 1e-3 and run["duration_s"] - max(ends) < 0.5
        assert run["ttft_ms"]["median"] == pytest.approx(float(np.median([float(r["ttft_ms"]) for r in mine])),
                                                         abs=1e-3)
        assert run["itl_ms"]["count"] == sum(int(r["token_chunks"]) - 1 for r in mine)
        assert run["good_requests"] == n
        assert run["token_counts"]["output"] == {"server": n}
        assert "server" in run["token_count_statement"]
    assert result["settings"]["ignore_eos"] is True and result["workload"]["input_len"] == "uniform:8,40"
    if not plots.available():   # matplotlib comes with the bench extra: pip install -e ".[bench]"
        assert result["files"]["plots"] == [] and "matplotlib is not installed" in done.stderr
        return
    for name in ("latency_cdf.png", "throughput.png", "ttft_p99.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert result["files"]["plots"] == ["latency_cdf.png", "throughput.png", "ttft_p99.png"]


@pytest.mark.parametrize("target", ["kserve-generate", "grpc-stream"])
@engine_test
def test_end_to_end_a_failing_target_is_counted_not_dropped(llm_server, tiny_model, tmp_path, target):
    url = llm_server.grpc_url if target == "grpc-stream" else llm_server.base_url
    out = tmp_path / "out"
    done = bench("run", "--target", target, "--url", url, "--model", "no_such_model", "--tokenizer", str(tiny_model),
                 "--input-len", "8", "--output-len", "4", "--concurrency", "2", "--num-requests", "5",
                 "--warmup", "1", "--out", str(out), "--no-progress", "--plain")
    assert done.returncode == 1, done.stdout + done.stderr          # nothing measured
    assert "5 failed" in done.stdout
    result, rows = read_run(out)
    run = result["runs"][0]
    assert (run["requests"], run["completed"], run["failed"]) == (5, 0, 5)
    assert run["errors"][0]["count"] == 5 and "no_such_model" in run["errors"][0]["error"]
    assert run["request_throughput"] == 0 and run["ttft_ms"] is None
    assert result["warmup"]["failed"] == 1
    assert len(rows) == 5 and all(r["success"] == "0" and "no_such_model" in r["error"] for r in rows)

