"""tideserve-bench's records and metric math without a server: SSE parsing, TTFT/TPOT/ITL/E2EL as vLLM's
benchmark computes them, token sources, goodput."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tideserve.bench.tideserve_bench import metrics
from tideserve.bench.tideserve_bench.records import RequestRecord, SSEParser


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
