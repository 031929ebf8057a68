"""LLM metrics, alike for every LLM backend: token latencies, token counts, engine load.

Names follow vLLM's ``vllm:*`` metrics under the ``tideserve:`` prefix, labelled by model and
version. Histograms (never summaries) so replicas can be summed. A backend makes one
:class:`GenerationTracker` per request and reports engine-wide state with :meth:`LLMMetrics.set_engine_state`.
"""

from __future__ import annotations

import time
from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import Metric

LABELS = ["model_name", "version"]
TOKEN_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                         7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


class LLMMetrics:
    """The Prometheus families; one object per server, from ``Metrics.extension("llm", LLMMetrics)``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def histogram(name, doc, buckets):
            return Histogram(f"tideserve:{name}", doc, LABELS, buckets=buckets, registry=registry)

        def counter(name, doc):
            return Counter(f"tideserve:{name}", doc, LABELS, registry=registry)

        def gauge(name, doc):
            return Gauge(f"tideserve:{name}", doc, LABELS, registry=registry)

        self.time_to_first_token = histogram("time_to_first_token_seconds",
                                             "Time from request arrival to its first generated token",
                                             TOKEN_LATENCY_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds",
                                             "Time between consecutive generated tokens", TOKEN_LATENCY_BUCKETS)
        self.e2e_latency = histogram("e2e_request_latency_seconds", "End-to-end generation latency",
                                     REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Time a request waited in the engine before its first step", REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens_hist = histogram("request_prompt_tokens", "Prompt tokens per request",
                                            TOKEN_COUNT_BUCKETS)
        self.generation_tokens_hist = histogram("request_generation_tokens", "Generated tokens per request",
                                                TOKEN_COUNT_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.request_success = counter("request_success", "Generations that finished (stop or length)")
        self.request_aborted = counter("request_aborted", "Generations aborted in the engine (client gone, "
                                                          "cancel, timeout, shutdown)")
        self.running = gauge("num_requests_running", "Requests the engine is running now")
        self.waiting = gauge("num_requests_waiting", "Requests waiting for the engine")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1)")

    def tracker(self, model: str, version: str) -> GenerationTracker:
        return GenerationTracker(self, model, version)

    def set_engine_state(self, model: str, version: str, *, running: int, waiting: int, kv_cache_usage: float) -> None:
        self.running.labels(model, version).set(running)
        self.waiting.labels(model, version).set(waiting)
        self.kv_cache_usage.labels(model, version).set(kv_cache_usage)

    def aborted(self, model: str, version: str) -> None:
        self.request_aborted.labels(model, version).inc()


ITL_FLUSH_STEPS = 32  # a request's inter-token gaps reach its histogram at least every this many increments


def observe_many(hist, value: float, count: int) -> None:
    """``count`` observations of ``value`` in a prometheus_client Histogram, as ``count`` ``observe`` calls leave it
    (one sum and one bucket update instead of ``count`` of each)."""
    if count == 1 or not _BULK_OBSERVE:
        for _ in range(count):
            hist.observe(value)
        return
    hist._raise_if_not_observable()
    hist._sum.inc(value * count)
    for i, bound in enumerate(hist._upper_bounds):
        if value <= bound:
            hist._buckets[i].inc(count)
            break


def observe_all(hist, values) -> None:
    """One ``observe`` of each of ``values`` in a prometheus_client Histogram, as those calls leave it (the same bucket
    counts; the sum added once, so it may differ from the calls' in the last bits): a count per bucket, one sum add
    and one add per bucket hit instead of a lock and a loop over the bounds per value."""
    if not _BULK_OBSERVE:
        for value in values:
            hist.observe(value)
        return
    hist._raise_if_not_observable()
    bounds = hist._upper_bounds
    counts = [0] * len(bounds)
    for value in values:
        counts[bisect_left(bounds, value)] += 1  # (the first bound >= value, as observe)
    hist._sum.inc(sum(values))
    buckets = hist._buckets
    for i, count in enumerate(counts):
        if count:
            buckets[i].inc(count)


def record_latencies_together(logger, base: type, scheduler_stats, iteration_stats, mm_cache_stats=None,
                              engine_idx: int = 0):
    """``base.record`` (vLLM's ``PrometheusStatLogger``) for ``logger`` (llm_backends/vllm/prometheus.py installs this
    as the method of its subclass), the step's inter-token latencies (one per running request) written into
    ``vllm:inter_token_latency_seconds`` together (:func:`observe_all`: the same bucket counts and count as vLLM's
    ``observe`` per value, which took a lock and a loop over the buckets per request per engine step); the loggers
    after it read the step's stats as they came."""
    latencies = getattr(iteration_stats, "inter_token_latencies_iter", None)
    families = getattr(logger, "histogram_inter_token_latency", None)  # (another vLLM release: its own record)
    if not latencies or families is None or not _BULK_OBSERVE:
        return base.record(logger, scheduler_stats, iteration_stats, mm_cache_stats, engine_idx)
    iteration_stats.inter_token_latencies_iter = []
    try:
        base.record(logger, scheduler_stats, iteration_stats, mm_cache_stats, engine_idx)
    finally:
        iteration_stats.inter_token_latencies_iter = latencies
    observe_all(families[engine_idx], latencies)
    return None


def _bulk_observe_works() -> bool:
    """Whether this prometheus_client's Histogram has the members :func:`observe_many` writes to (its own, not an
    API: a release that renames them gets ``count`` ``observe`` calls instead)."""
    from prometheus_client import Histogram
    try:
        probe = Histogram("probe", "", registry=None)
        return (callable(getattr(probe, "_raise_if_not_observable", None)) and hasattr(probe._sum, "inc")
                and len(probe._upper_bounds) == len(probe._buckets))
    except Exception:  # noqa: BLE001 (any difference means: do not write to its members)
        return False


_BULK_OBSERVE = _bulk_observe_works()


class EngineStateGauges:
    """Where an engine's stat logger hands its scheduler's state after each step (on the server's loop): kept as
    ``state`` (the model's pending count, GET /load, deadlines) and set on the LLM metrics' gauges, whose children
    for the model's labels are looked up once (a step costs this one call and the three sets, no ``labels()``)."""

    __slots__ = ("_at", "_kv_cache_usage", "_running", "_waiting", "state")

    def __init__(self, metrics: LLMMetrics, model: str, version: str) -> None:
        self._running = metrics.running.labels(model, version)
        self._waiting = metrics.waiting.labels(model, version)
        self._kv_cache_usage = metrics.kv_cache_usage.labels(model, version)
        self.state = None  # the engine's last EngineState (running, waiting, kv_cache_usage); None before a step
        self._at = 0.0  # the ``at`` of the last state set

    def __call__(self, state) -> bool:
        """Set ``state``, unless it is older than the last one set (its ``at``, where it has one): False then."""
        at = getattr(state, "at", 0.0)
        if at:
            if at < self._at:
                return False
            self._at = at
        self.state = state
        self._running.set(state.running)
        self._waiting.set(state.waiting)
        self._kv_cache_usage.set(state.kv_cache_usage)
        return True


class GenerationTracker:
    """Timings of one generation; call :meth:`tokens` as increments arrive, :meth:`finish` at the end."""

    __slots__ = ("_gaps", "_gaps_sum", "_itl", "_labels", "_last", "_metrics", "arrival", "finished", "generated",
                 "prompt_tokens")

    def __init__(self, metrics: LLMMetrics, model: str, version: str, arrival: float | None = None) -> None:
        self._metrics = metrics
        self._labels = (model, version)
        self.arrival = arrival if arrival is not None else time.monotonic()
        self._last: float | None = None
        self._itl = None  # the inter-token latency histogram's child of these labels, once the first gap comes
        # the gaps not yet in that histogram: a count per bucket (None: none held), their sum; written to it every
        # ITL_FLUSH_STEPS increments and at the end, each step costing a bucket's search and an add, not a
        # Histogram.observe (its locks, its loop over the buckets) per request per engine step
        self._gaps: list[int] | None = None
        self._gaps_sum = 0.0
        self.generated = 0
        self.prompt_tokens = 0
        self.finished = False  # counted (finish runs once)

    def tokens(self, count: int) -> None:
        """``count`` new tokens arrived now (an increment may carry several)."""
        if count <= 0:
            return
        now = time.monotonic()
        m = self._metrics
        if self._last is None:
            m.time_to_first_token.labels(*self._labels).observe(now - self.arrival)
        else:  # an increment of several tokens spreads its gap evenly over them
            gap = (now - self._last) / count
            gaps = self._gaps
            if gaps is None:
                if self._itl is None:
                    self._itl = m.inter_token_latency.labels(*self._labels)
                if not _BULK_OBSERVE:
                    observe_many(self._itl, gap, count)
                    self._last = now
                    self.generated += count
                    return
                gaps = self._gaps = [0] * (len(self._itl._upper_bounds) + 1)  # [-1]: the increments held
            gaps[bisect_left(self._itl._upper_bounds, gap)] += count  # (the first bound >= gap, as observe)
            self._gaps_sum += gap * count
            gaps[-1] += 1
            if gaps[-1] >= ITL_FLUSH_STEPS:
                self._flush_gaps()
        self._last = now
        self.generated += count

    def _flush_gaps(self) -> None:
        """The gaps held into the inter-token latency histogram: what the ``observe`` calls would have left."""
        gaps, self._gaps = self._gaps, None
        if gaps is None:
            return
        hist = self._itl
        hist._sum.inc(self._gaps_sum)
        self._gaps_sum = 0.0
        buckets = hist._buckets
        for i in range(len(gaps) - 1):
            if gaps[i]:
                buckets[i].inc(gaps[i])

    def finish(self, prompt_tokens: int, queue_time: float | None = None, aborted: bool = False) -> None:
        """Count the generation: once (a later call does nothing)."""
        if self.finished:
            return
        self.finished = True
        if self._gaps is not None:
            self._flush_gaps()
        m, labels = self._metrics, self._labels
        self.prompt_tokens = prompt_tokens
        m.e2e_latency.labels(*labels).observe(time.monotonic() - self.arrival)
        if queue_time is not None:
            m.queue_time.labels(*labels).observe(queue_time)
        m.prompt_tokens.labels(*labels).inc(prompt_tokens)
        m.generation_tokens.labels(*labels).inc(self.generated)
        m.prompt_tokens_hist.labels(*labels).observe(prompt_tokens)
        m.generation_tokens_hist.labels(*labels).observe(self.generated)
        if aborted:
            m.request_aborted.labels(*labels).inc()
        else:
            m.request_success.labels(*labels).inc()


class EngineFamilies:
    """The engines' own metric families (vLLM's ``vllm:*``), one registry per model version, merged at scrape.

    An engine's stat logger writes into the registry :meth:`add` hands out; :meth:`collect` yields each
    family once with the samples of every model (the text format allows one ``# TYPE`` per family).
    Made once per server (``Metrics.extension("engine", EngineFamilies)``), which registers it.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self._models: dict[tuple[str, str], CollectorRegistry] = {}
        registry.register(self)

    def add(self, model: str, version: str) -> CollectorRegistry:
        """A fresh registry for ``model`` / ``version`` (replacing the one of an earlier load)."""
        found = self._models[(model, version)] = CollectorRegistry(auto_describe=False)
        return found

    def remove(self, model: str, version: str) -> None:
        self._models.pop((model, version), None)

    def collect(self):
        families: dict[str, Metric] = {}
        seen: set[tuple] = set()
        for registry in list(self._models.values()):
            for family in registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type,
                                                            family.unit)
                for sample in family.samples:
                    key = (sample.name, tuple(sorted(sample.labels.items())))
                    if key not in seen:  # two versions of one model share its name: the first one wins
                        seen.add(key)
                        merged.samples.append(sample)
        yield from families.values()
