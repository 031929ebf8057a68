"""The cost of a frontend worker's vllm:* read (workers/engines.py): what a worker spends at each generation's end
reading its engine client's registry and diffing it (``engine_values`` + ``engine_increments``), what a step
whose scheduler stats came to it costs (gauges only), and the core's side (``add_engine_increments``), on a
registry shaped as vLLM 0.32's PrometheusStatLogger fills it (18 histograms of 24 buckets, 20 counters, 8 gauges).

    .venv/bin/python bench/engine_metrics_read.py
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from tideserve.workers.engines import add_engine_increments, engine_increments, engine_values

ROUNDS = 2000


def registry() -> tuple[CollectorRegistry, list]:
    reg = CollectorRegistry(auto_describe=False)
    labels = ["model_name", "engine"]
    metrics = [Histogram(f"vllm:h{i}", "d", labels, buckets=[0.01 * j for j in range(1, 25)], registry=reg)
               for i in range(18)]
    metrics += [Counter(f"vllm:c{i}", "d", labels, registry=reg) for i in range(20)]
    metrics += [Gauge(f"vllm:g{i}", "d", labels, registry=reg) for i in range(8)]
    return reg, metrics


def main() -> None:
    worker, metrics = registry()
    core, _ = registry()
    sent: dict = {}
    entries = []
    start = time.perf_counter()
    for i in range(ROUNDS):
        for metric in metrics:  # a generation's worth of records
            child = metric.labels("m", "0")
            if isinstance(metric, Histogram):
                child.observe(0.05 * (i % 7))
            elif isinstance(metric, Counter):
                child.inc()
            else:
                child.set(i)
    records = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(ROUNDS):
        values = engine_values(worker)
        entries = engine_increments(values, sent)
        sent = {k: v for k, v in values.items() if k[0] != "gauge"}
    full = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(ROUNDS):
        engine_increments(engine_values(worker, counters=False), {})
    gauges = time.perf_counter() - start
    entries = engine_increments(engine_values(worker), {})
    start = time.perf_counter()
    for _ in range(ROUNDS):
        add_engine_increments(core, entries)
    core_side = time.perf_counter() - start
    print(f"(records, for scale: {records / ROUNDS * 1e6:.1f} us per generation's worth)")
    print(f"worker, a generation's end (read + diff): {full / ROUNDS * 1e6:.1f} us")
    print(f"worker, a step's gauges: {gauges / ROUNDS * 1e6:.1f} us")
    print(f"core, adding one message's {len(entries)} entries: {core_side / ROUNDS * 1e6:.1f} us")


if __name__ == "__main__":
    main()
