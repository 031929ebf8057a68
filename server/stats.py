"""Per-model-version statistics: Triton's statistics extension and the Prometheus metrics.

Every number is recorded here, once, by the DataPlane (requests) and the schedulers
(queue and compute); the statistics endpoints and ``/metrics`` both read from it. A typed LLM generation's end is
kept as one tuple (``ModelStats.generations``) and counted when the counters are read.
All updates happen on the event loop thread.
"""

from __future__ import annotations

import bisect
import itertools
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from .cpu_metrics import CpuMetrics

disable_created_metrics()  # no *_created series: Triton has none, and they double the scrape size

FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")
GENERATIONS_KEPT = 256  # typed generations' ends kept uncounted at most (ModelStats.generations)

# Milliseconds; spans sub-millisecond classic models to multi-second LLM generations.
LATENCY_BUCKETS_MS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000,
                      30000, 60000)


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns

    def as_dict(self) -> dict:
        return {"count": self.count, "ns": self.ns}


class LatencyHistogram:
    """One model version's latency histogram (LATENCY_BUCKETS_MS) in plain counters, written as a Prometheus
    histogram when scraped (:class:`_LatencyCollector`). Observed on the event loop, once or twice per request:
    no lock, as the other counters here (a ``prometheus_client`` Histogram takes one per bucket and sum)."""

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS_MS) + 1)  # per bucket (not cumulative), the last +Inf
        self.sum = 0.0

    def observe(self, ms: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS_MS, ms)] += 1  # the first bucket whose bound >= ms
        self.sum += ms


@dataclass
class BatchStat:
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


class ModelStats:
    """Counters of one model version."""

    def __init__(self, name: str, version: str, metrics: "Metrics | None" = None) -> None:
        self.name = name
        self.version = version
        self.success = Duration()
        self.fail = Duration()
        self.queue = Duration()
        self.compute_input = Duration()
        self.compute_infer = Duration()
        self.compute_output = Duration()
        self.failures = dict.fromkeys(FAILURE_REASONS, 0)
        self.inference_count = 0
        self.execution_count = 0
        self.last_inference_ms = 0
        self.pending_fn = lambda: 0  # the scheduler's queue length, read at scrape time
        self.cache_hit = Duration()   # response cache: lookups that answered the request
        self.cache_miss = Duration()  # response cache: lookup and insertion of requests that ran
        self.cache_enabled = False    # the model uses the response cache: its nv_cache_* series are written
        self.batch_stats: dict[int, BatchStat] = {}
        self.latency: LatencyHistogram | None = None  # Prometheus histograms: None without metrics
        self.first_response: LatencyHistogram | None = None
        if metrics is not None:
            self.latency = LatencyHistogram()
            self.first_response = LatencyHistogram()
        # --frontend-direct: what the model's instance processes counted for the requests they took straight from
        # the frontend workers (their latest exported counters, by process), and those of processes now gone
        self.remote: dict[object, dict] = {}
        self.retired: list[dict] = []
        # the ends of typed LLM generations not counted yet, (elapsed_ns, first_ns, compute_ns, failure reason or
        # None, end monotonic_ns) each: appended by the DataPlane's GenerationStream, counted by count_generations
        self.generations: list[tuple[int, int, int, str | None, int]] = []

    # -- recorded by the DataPlane ---------------------------------------------------------
    def record_first_response(self, elapsed_ns: int) -> None:
        if self.first_response is not None:
            self.first_response.observe(elapsed_ns / 1e6)

    def record_success(self, elapsed_ns: int, first: bool = False) -> None:
        """A request's success; ``first``: its final response was also its first (record_first_response too)."""
        success = self.success
        success.count += 1
        success.ns += elapsed_ns
        self.last_inference_ms = int(time.time() * 1000)
        latency = self.latency
        if latency is not None:  # LatencyHistogram.observe, the bucket found once for both histograms
            ms = elapsed_ns / 1e6
            bucket = bisect.bisect_left(LATENCY_BUCKETS_MS, ms)
            latency.counts[bucket] += 1
            latency.sum += ms
            if first:
                first_response = self.first_response
                first_response.counts[bucket] += 1
                first_response.sum += ms

    def count_generations(self) -> None:
        """Count the typed LLM generations that ended since the last read (:attr:`generations`, which the DataPlane's
        GenerationStream appends one tuple to per request, its only statistics work on the request's path): each
        one's first response and success, or failure for its reason (``elapsed_ns`` -1: counted already), its queue
        (none) and execution (``compute_ns`` -1: the task still ran, or its scheduler counted it). Every reader of
        these counters calls this first (:meth:`as_dict`, :meth:`view`, :meth:`export`); the stream calls it too once
        :data:`GENERATIONS_KEPT` wait."""
        ends = self.generations
        if not ends:
            return
        last = self.last_inference_ms
        ended_ns = 0
        for elapsed_ns, first_ns, compute_ns, reason, end_ns in ends:
            if elapsed_ns >= 0:
                ended_ns = end_ns
                if reason is None:
                    if first_ns == elapsed_ns:  # the first response was the end (no delta before it)
                        self.record_success(elapsed_ns, True)
                    else:
                        self.record_first_response(first_ns)
                        self.record_success(elapsed_ns)
                else:
                    if first_ns >= 0:  # (-1: cancelled before its first response)
                        self.record_first_response(first_ns)
                    self.record_failure(elapsed_ns, reason)
            if compute_ns >= 0:
                self.queue.add(0, 1)
                self.record_execution(1, 1, 0, compute_ns, 0, 1)
        ends.clear()
        if ended_ns:  # the last one's end in wall-clock time, not this read's
            ended_ms = int(time.time() * 1000 - (time.monotonic_ns() - ended_ns) / 1e6)
            self.last_inference_ms = max(last, ended_ms)

    def record_failure(self, elapsed_ns: int, reason: str) -> None:
        self.fail.add(elapsed_ns)
        self.failures[reason if reason in self.failures else "OTHER"] += 1
        self.last_inference_ms = int(time.time() * 1000)

    def record_cache_hit(self, lookup_ns: int) -> None:
        self.cache_hit.add(lookup_ns)

    def record_cache_miss(self, lookup_and_insert_ns: int) -> None:
        self.cache_miss.add(lookup_and_insert_ns)

    # -- recorded by the schedulers --------------------------------------------------------
    def record_queue(self, ns: int, count: int = 1) -> None:
        """``count`` requests waited ``ns`` in all in the queue."""
        self.queue.add(ns, count)

    def record_runs(self, count: int, elapsed_ns: int) -> None:
        """``count`` requests a frontend served by a shorter way than the model's own run, each as a success and an
        execution of one inference, ``elapsed_ns`` long (``ServingInterface.record_frontend_runs``)."""
        for _ in range(count):
            self.record_success(elapsed_ns)
            self.record_execution(1, 1, 0, elapsed_ns, 0)

    def record_execution(self, batch_size: int, requests: int, input_ns: int, infer_ns: int,
                         output_ns: int, inferences: int | None = None) -> None:
        """One model execution of ``batch_size`` rows; ``inferences``: the rows that are not padding
        (a direct sequence batch's empty slots count in the batch size only, as Triton counts them)."""
        self.execution_count += 1
        self.inference_count += batch_size if inferences is None else inferences
        # Per request, as Triton counts them: every request of the batch spent the batch's time.
        self.compute_input.add(input_ns * requests, requests)
        self.compute_infer.add(infer_ns * requests, requests)
        self.compute_output.add(output_ns * requests, requests)
        stat = self.batch_stats.get(batch_size)
        if stat is None:
            stat = self.batch_stats[batch_size] = BatchStat()
        stat.compute_input.add(input_ns)
        stat.compute_infer.add(infer_ns)
        stat.compute_output.add(output_ns)

    # -- counted elsewhere (--frontend-direct) ---------------------------------------------
    _DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit",
                  "cache_miss")

    def export(self) -> dict:
        """Every counter, as plain values (what a model process sends the core)."""
        self.count_generations()
        out = {name: [getattr(self, name).count, getattr(self, name).ns] for name in self._DURATIONS}
        out["failures"] = dict(self.failures)
        out["inference_count"] = self.inference_count
        out["execution_count"] = self.execution_count
        out["last_inference_ms"] = self.last_inference_ms
        out["batch_stats"] = {size: [s.compute_input.count, s.compute_input.ns, s.compute_infer.count,
                                     s.compute_infer.ns, s.compute_output.count, s.compute_output.ns]
                              for size, s in self.batch_stats.items()}
        for name in ("latency", "first_response"):
            histogram = getattr(self, name)
            if histogram is not None:
                out[name] = [list(histogram.counts), histogram.sum]
        return out

    def add_exported(self, data: dict) -> None:
        """Add counters :meth:`export` gave."""
        for name in self._DURATIONS:
            count, ns = data.get(name, (0, 0))
            getattr(self, name).add(ns, count)
        for reason, count in data.get("failures", {}).items():
            self.failures[reason] = self.failures.get(reason, 0) + count
        self.inference_count += data.get("inference_count", 0)
        self.execution_count += data.get("execution_count", 0)
        self.last_inference_ms = max(self.last_inference_ms, data.get("last_inference_ms", 0))
        for size, values in data.get("batch_stats", {}).items():
            size = int(size)
            stat = self.batch_stats.get(size)
            if stat is None:
                stat = self.batch_stats[size] = BatchStat()
            stat.compute_input.add(values[1], values[0])
            stat.compute_infer.add(values[3], values[2])
            stat.compute_output.add(values[5], values[4])
        for name in ("latency", "first_response"):
            histogram, found = getattr(self, name), data.get(name)
            if histogram is not None and found is not None:
                histogram.counts = [a + b for a, b in zip(histogram.counts, found[0])]
                histogram.sum += found[1]

    def retire(self, key: object) -> None:
        """The process ``key`` is gone: its last counters stay counted."""
        data = self.remote.pop(key, None)
        if data is not None:
            self.retired.append(data)

    def view(self) -> "ModelStats":
        """These counters plus what the model's processes counted (itself when they counted nothing)."""
        self.count_generations()
        if not self.remote and not self.retired:
            return self
        total = ModelStats(self.name, self.version)
        if self.latency is not None:
            total.latency, total.first_response = LatencyHistogram(), LatencyHistogram()
        remote = list(self.remote.values())
        total.pending_fn = lambda: self.pending_fn() + sum(data.get("pending", 0) for data in remote)
        total.cache_enabled = self.cache_enabled
        total.add_exported(self.export())
        for data in [*self.retired, *self.remote.values()]:
            total.add_exported(data)
        return total

    def as_dict(self) -> dict:
        """Triton's ``$model_stat`` JSON object."""
        self.count_generations()
        if self.remote or self.retired:
            return self.view().as_dict()
        return {
            "name": self.name,
            "version": self.version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                "success": self.success.as_dict(),
                "fail": self.fail.as_dict(),
                "queue": self.queue.as_dict(),
                "compute_input": self.compute_input.as_dict(),
                "compute_infer": self.compute_infer.as_dict(),
                "compute_output": self.compute_output.as_dict(),
                "cache_hit": self.cache_hit.as_dict(),
                "cache_miss": self.cache_miss.as_dict(),
            },
            "batch_stats": [
                {"batch_size": size, "compute_input": s.compute_input.as_dict(),
                 "compute_infer": s.compute_infer.as_dict(), "compute_output": s.compute_output.as_dict()}
                for size, s in sorted(self.batch_stats.items())
            ],
            "memory_usage": [],
        }


class Metrics:
    """The server's Prometheus registry: Triton's ``nv_inference_*`` families plus histograms."""

    def __init__(self, cpu: CpuMetrics | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.cpu = cpu  # Triton's nv_cpu_* gauges (server/cpu_metrics.py), None when off
        self._models: dict[tuple[str, str], ModelStats] = {}
        self._extensions: dict[str, object] = {}
        self.registry.register(_LatencyCollector(self._models))
        self._counters = _StatsCollector(self._models)

    def render(self) -> bytes:
        """Prometheus text: counters under Triton's exact names, then histograms and other collectors.

        ``prometheus_client`` writes counter families as ``<name>_total``; Triton's dashboards use
        the bare names, so the per-model counters are written here with their own headers.
        """
        lines = []
        for metric in itertools.chain(self._counters.collect(), self.cpu.collect() if self.cpu else ()):
            lines.append(f"# HELP {metric.name} {metric.documentation}")
            lines.append(f"# TYPE {metric.name} {metric.type}")
            for sample in metric.samples:
                labels = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(sample.labels.items()))
                name = f"{sample.name}{{{labels}}}" if labels else sample.name
                lines.append(f"{name} {sample.value}")
        return ("\n".join(lines) + "\n").encode() + generate_latest(self.registry)

    def model_stats(self, name: str, version: str) -> ModelStats:
        key = (name, version)
        stats = self._models.get(key)
        if stats is None:
            stats = self._models[key] = ModelStats(name, version, self)
        return stats

    def add_collector(self, collector) -> None:
        self.registry.register(collector)

    def extension(self, key: str, factory):
        """A family of metrics made once per server (e.g. the LLM metrics), shared by all backends."""
        found = self._extensions.get(key)
        if found is None:
            found = self._extensions[key] = factory(self.registry)
        return found


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class _LatencyCollector:
    """The per-model latency histograms (:class:`LatencyHistogram`), as Prometheus histogram families."""

    _FAMILIES = (
        ("nv_inference_request_duration_histogram_ms",
         "End-to-end inference request duration in milliseconds (to the final response)", "latency"),
        ("nv_inference_first_response_histogram_ms",
         "Duration from request arrival to its first response in milliseconds", "first_response"),
    )
    _BOUNDS = [floatToGoString(bound) for bound in LATENCY_BUCKETS_MS] + ["+Inf"]

    def __init__(self, models: dict[tuple[str, str], ModelStats]) -> None:
        self._models = models

    def collect(self):
        models = [stats.view() for stats in self._models.values()]
        for name, doc, attribute in self._FAMILIES:
            family = HistogramMetricFamily(name, doc, labels=["model", "version"])
            for stats in models:
                histogram = getattr(stats, attribute)
                if histogram is None:
                    continue
                buckets, total = [], 0
                for bound, count in zip(self._BOUNDS, histogram.counts):
                    total += count
                    buckets.append((bound, total))
                family.add_metric([stats.name, stats.version], buckets, histogram.sum)
            yield family


class _StatsCollector:
    """Renders the per-model counters at scrape time, with Triton's exact metric names."""

    _COUNTERS = (
        ("nv_inference_request_success", "Number of successful inference requests, all batch sizes",
         lambda s: s.success.count),
        ("nv_inference_count", "Number of inferences performed (does not include cached requests)",
         lambda s: s.inference_count),
        ("nv_inference_exec_count", "Number of model executions performed (does not include cached requests)",
         lambda s: s.execution_count),
        ("nv_inference_request_duration_us", "Cumulative inference request duration in microseconds",
         lambda s: (s.success.ns + s.fail.ns) // 1000),
        ("nv_inference_queue_duration_us", "Cumulative inference queuing duration in microseconds",
         lambda s: s.queue.ns // 1000),
        ("nv_inference_compute_input_duration_us", "Cumulative compute input duration in microseconds",
         lambda s: s.compute_input.ns // 1000),
        ("nv_inference_compute_infer_duration_us", "Cumulative compute inference duration in microseconds",
         lambda s: s.compute_infer.ns // 1000),
        ("nv_inference_compute_output_duration_us", "Cumulative inference compute output duration in microseconds",
         lambda s: s.compute_output.ns // 1000),
    )

    # Triton writes these only for models that use the response cache
    _CACHE_COUNTERS = (
        ("nv_cache_num_hits_per_model", "Requests answered from the response cache", lambda s: s.cache_hit.count),
        ("nv_cache_hit_duration_per_model", "Cumulative time of cache lookups that hit, in microseconds",
         lambda s: s.cache_hit.ns // 1000),
        ("nv_cache_num_misses_per_model", "Requests the response cache could not answer", lambda s: s.cache_miss.count),
        ("nv_cache_miss_duration_per_model",
         "Cumulative time of cache lookups that missed plus insertions, in microseconds",
         lambda s: s.cache_miss.ns // 1000),
    )

    def __init__(self, models: dict[tuple[str, str], ModelStats]) -> None:
        self._models = models

    def collect(self):
        models = [stats.view() for stats in self._models.values()]
        for name, doc, read in self._COUNTERS:
            metric = Metric(name, doc, "counter")
            for s in models:
                metric.add_sample(name, {"model": s.name, "version": s.version}, read(s))
            yield metric
        failure = Metric("nv_inference_request_failure",
                         "Number of failed inference requests, all batch sizes", "counter")
        for s in models:
            for reason, count in s.failures.items():
                failure.add_sample("nv_inference_request_failure",
                                   {"model": s.name, "version": s.version, "reason": reason}, count)
        yield failure
        pending = Metric("nv_inference_pending_request_count",
                         "Instantaneous number of pending requests awaiting execution per-model.", "gauge")
        for s in models:
            pending.add_sample("nv_inference_pending_request_count",
                               {"model": s.name, "version": s.version}, s.pending_fn())
        yield pending
        cached = [s for s in models if s.cache_enabled]
        for name, doc, read in self._CACHE_COUNTERS:
            metric = Metric(name, doc, "counter")
            for s in cached:
                metric.add_sample(name, {"model": s.name, "version": s.version}, read(s))
            yield metric
