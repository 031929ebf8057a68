"""The LLM metrics' per-request tracker (llm_backends/metrics.py): a request's inter-token gaps, held per bucket
between its histogram's updates, leave the histogram as one ``observe`` per token would."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from tideserve.llm_backends import metrics
from tideserve.llm_backends.metrics import ITL_FLUSH_STEPS, GenerationTracker, LLMMetrics


def _samples(hist) -> dict[str, float]:
    return {f"{s.name}{s.labels.get('le', '')}": s.value for family in hist.collect() for s in family.samples
            if s.labels.get("model_name", "llm") == "llm"}


def test_held_gaps_reach_the_histogram_as_observations_would(monkeypatch):
    m = LLMMetrics(CollectorRegistry())
    tracker = GenerationTracker(m, "llm", "1", arrival=0.0)
    now = [1.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: now[0])
    expected = Histogram("expected", "", ["model_name", "version"], registry=None,
                         buckets=m.inter_token_latency._upper_bounds).labels("llm", "1")
    tracker.tokens(1)  # the first token: its time to first token, no gap
    gaps = [0.001, 0.02, 0.02, 0.3, 5.0, 0.0004, 100.0]
    for step in range(ITL_FLUSH_STEPS + 5):
        gap, count = gaps[step % len(gaps)], 1 + step % 3
        before = now[0]
        now[0] += gap * count
        tracker.tokens(count)
        for _ in range(count):  # (the gap as the tracker reads it: an increment's gap spread over its tokens)
            expected.observe((now[0] - before) / count)
        if step + 1 == ITL_FLUSH_STEPS:  # held gaps are in the histogram every ITL_FLUSH_STEPS increments
            assert _samples(m.inter_token_latency)["tideserve:inter_token_latency_seconds_count"] == \
                _samples(expected)["expected_count"]
    tracker.finish(prompt_tokens=4)  # and all of them at the end
    got = {k.replace("tideserve:inter_token_latency_seconds", "expected"): v
           for k, v in _samples(m.inter_token_latency).items() if "_created" not in k}
    want = {k: v for k, v in _samples(expected).items() if "_created" not in k}
    assert got.keys() == want.keys() and all(abs(got[k] - want[k]) < 1e-9 for k in want)
