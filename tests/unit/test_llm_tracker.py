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


def test_observe_all_leaves_the_histogram_as_one_observe_per_value():
    bounds = (0.001, 0.01, 0.1, 1.0)
    got = Histogram("got", "", ["model_name"], registry=None, buckets=bounds).labels("llm")
    want = Histogram("want", "", ["model_name"], registry=None, buckets=bounds).labels("llm")
    values = [0.0092] * 50 + [0.001, 0.0, 0.01, 0.5, 3.0, 0.1000001]
    metrics.observe_all(got, values)
    for value in values:
        want.observe(value)
    got_samples = {k.replace("got", "want"): v for k, v in _samples(got).items() if "_created" not in k}
    want_samples = {k: v for k, v in _samples(want).items() if "_created" not in k}
    assert got_samples.keys() == want_samples.keys()
    assert all(abs(got_samples[k] - want_samples[k]) < 1e-9 for k in want_samples)


def test_vllm_prometheus_logger_writes_the_steps_latencies_together(monkeypatch):
    """vLLM's Prometheus logger (``llm_backends/vllm/prometheus.py``) gets the step's stats without the inter-token
    latencies, which go into its histogram together; the loggers after it read the stats as they came."""
    from types import SimpleNamespace

    from tideserve.llm_backends.vllm.prometheus import prometheus_logger

    seen = []
    logger_class = prometheus_logger(CollectorRegistry())
    hist = Histogram("itl", "", ["engine"], registry=None, buckets=(0.01, 0.1)).labels("0")
    logger = logger_class.__new__(logger_class)  # (no engine config: only record is called)
    logger.histogram_inter_token_latency = {0: hist}
    monkeypatch.setattr(logger_class.__mro__[1], "record",  # vLLM's own record: what it was handed
                        lambda self, scheduler, iteration, mm=None, engine_idx=0: seen.append(
                            list(iteration.inter_token_latencies_iter)))
    stats = SimpleNamespace(inter_token_latencies_iter=[0.005, 0.005, 0.05])
    logger.record(None, stats)
    assert seen == [[]] and stats.inter_token_latencies_iter == [0.005, 0.005, 0.05]
    assert _samples(hist)["itl_count"] == 3 and _samples(hist)["itl_bucket0.01"] == 2
