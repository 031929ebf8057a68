"""--frontend-direct: the counters a model process exports are added to the core's view of the model version
(statistics and /metrics alike), and stay counted once the process is gone."""

from __future__ import annotations

import msgspec
from tideserve.stats import Metrics, ModelStats


def _process_counters() -> dict:
    stats = ModelStats("m", "1", metrics=True)
    stats.record_first_response(1_000_000)
    stats.record_success(2_000_000)
    stats.record_first_response(1_000_000)
    stats.record_success(4_000_000)
    stats.record_failure(500_000, "REJECTED")
    stats.record_queue(100)
    stats.record_queue(300)
    stats.record_execution(2, 2, 0, 1_000, 0)
    return msgspec.msgpack.decode(msgspec.msgpack.encode(stats.export()))  # as it crosses


def _value(text: str, family: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(family + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {family} {labels}")


def test_a_process_counters_add_to_the_cores_in_statistics_and_metrics():
    metrics = Metrics()
    stats = metrics.model_stats("m", "1")
    stats.record_success(1_000_000)  # one request through the core
    stats.record_execution(1, 1, 0, 500, 0)
    stats.remote["instance 0"] = _process_counters()
    view = stats.as_dict()
    assert view["inference_stats"]["success"] == {"count": 3, "ns": 7_000_000}
    assert view["inference_stats"]["fail"]["count"] == 1
    assert view["inference_stats"]["queue"] == {"count": 2, "ns": 400}
    assert view["inference_count"] == 3 and view["execution_count"] == 2
    assert [b["batch_size"] for b in view["batch_stats"]] == [1, 2]
    text = metrics.render().decode()
    assert _value(text, "nv_inference_request_success", model="m") == 3
    assert _value(text, "nv_inference_request_failure", model="m", reason="REJECTED") == 1
    assert _value(text, "nv_inference_exec_count", model="m") == 2
    assert _value(text, "nv_inference_request_duration_histogram_ms_count", model="m") == 3
    assert stats.success.count == 1  # the core's own counters are untouched
    stats.pending_fn = lambda: 2
    stats.remote["instance 0"]["pending"] = 3  # what waits in the process's queue
    assert _value(metrics.render().decode(), "nv_inference_pending_request_count", model="m") == 5


def test_a_gone_process_stays_counted_and_nothing_is_added_twice():
    stats = ModelStats("m", "1")
    stats.remote["p"] = _process_counters()
    stats.remote["p"] = _process_counters()  # fetched again: replaces, not adds
    assert stats.as_dict()["inference_stats"]["success"]["count"] == 2
    stats.retire("p")
    assert not stats.remote
    assert stats.as_dict()["inference_stats"]["success"]["count"] == 2
    stats.remote["q"] = _process_counters()
    assert stats.as_dict()["inference_stats"]["success"]["count"] == 4


def test_without_process_counters_the_view_is_the_stats_themselves():
    stats = ModelStats("m", "1")
    assert stats.view() is stats
