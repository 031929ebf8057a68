"""Custom metrics: ``pb_utils.MetricFamily`` / ``Metric``, exported on the server's ``/metrics``.

Families live in the Prometheus registry of the server the calling model runs in (one collector
per registry reads them at scrape time). Counters are exposed with the ``_total`` suffix that
the Prometheus text format requires.
"""

from __future__ import annotations

import bisect
import enum
import threading
import weakref

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from .errors import TritonModelException
from .scope import current_link


class MetricKind(enum.IntEnum):
    COUNTER = 0
    GAUGE = 1
    HISTOGRAM = 2


class Metric:
    """One labelled series of a family."""

    def __init__(self, family: MetricFamily, labels: dict[str, str], buckets: list[float] | None) -> None:
        self._family = family
        self._labels = labels
        self._buckets = buckets
        self._lock = threading.Lock()
        self._value = 0.0
        self._counts = [0] * (len(buckets) + 1) if buckets is not None else None
        self._sum = 0.0

    def increment(self, value: float) -> None:
        kind = self._family._kind
        if kind is MetricKind.HISTOGRAM:
            raise TritonModelException("Failed to increment metric value. Metric kind HISTOGRAM does not "
                                       "support increment.")
        if kind is MetricKind.COUNTER and value < 0:
            raise TritonModelException("Failed to increment metric value. Counters can only be incremented "
                                       "by non-negative values.")
        with self._lock:
            self._value += value

    def set(self, value: float) -> None:
        if self._family._kind is not MetricKind.GAUGE:
            raise TritonModelException(f"Failed to set metric value. Metric kind "
                                       f"{self._family._kind.name} does not support set.")
        with self._lock:
            self._value = float(value)

    def observe(self, value: float) -> None:
        if self._family._kind is not MetricKind.HISTOGRAM:
            raise TritonModelException(f"Failed to observe metric value. Metric kind "
                                       f"{self._family._kind.name} does not support observe.")
        with self._lock:
            self._counts[bisect.bisect_left(self._buckets, value)] += 1
            self._sum += value

    def value(self) -> float:
        if self._family._kind is MetricKind.HISTOGRAM:
            raise TritonModelException("Failed to get metric value. Metric kind HISTOGRAM does not support "
                                       "value.")
        with self._lock:
            return self._value

    def _histogram(self) -> tuple[list[tuple[str, float]], float]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        buckets, running = [], 0
        for bound, count in zip(self._buckets + [float("inf")], counts):
            running += count
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        return buckets, total


class MetricFamily:
    """``MetricFamily(name, description, kind)``; ``kind`` is COUNTER, GAUGE or HISTOGRAM."""

    COUNTER = MetricKind.COUNTER
    GAUGE = MetricKind.GAUGE
    HISTOGRAM = MetricKind.HISTOGRAM

    def __init__(self, name: str, description: str, kind: int) -> None:
        self._name = name
        self._description = description
        self._kind = MetricKind(kind)
        self._metrics: dict[tuple, Metric] = {}
        self._lock = threading.Lock()
        _registry_collector().add(self)

    def Metric(self, labels: dict[str, str] | None = None, buckets: list[float] | None = None) -> Metric:
        labels = {str(k): str(v) for k, v in (labels or {}).items()}
        if self._kind is MetricKind.HISTOGRAM:
            if buckets is None:
                raise TritonModelException("Missing required buckets for histogram metric.")
            buckets = sorted(float(b) for b in buckets)
        elif buckets is not None:
            raise TritonModelException("Unexpected buckets: only histogram metrics take buckets.")
        key = tuple(sorted(labels.items()))
        with self._lock:
            metric = self._metrics.get(key)
            if metric is None:
                metric = self._metrics[key] = Metric(self, labels, buckets)
            return metric

    def _collect(self):
        with self._lock:
            metrics = list(self._metrics.values())
        label_names = sorted({k for m in metrics for k in m._labels})
        if self._kind is MetricKind.COUNTER:
            family = CounterMetricFamily(self._name, self._description, labels=label_names)
        elif self._kind is MetricKind.GAUGE:
            family = GaugeMetricFamily(self._name, self._description, labels=label_names)
        else:
            family = HistogramMetricFamily(self._name, self._description, labels=label_names)
        for metric in metrics:
            values = [metric._labels.get(k, "") for k in label_names]
            if self._kind is MetricKind.HISTOGRAM:
                buckets, total = metric._histogram()
                family.add_metric(values, buckets, total)
            else:
                family.add_metric(values, metric.value())
        return family


class _Collector:
    """Reads every custom family of one registry at scrape time."""

    def __init__(self) -> None:
        self._families: dict[str, MetricFamily] = {}
        self._lock = threading.Lock()

    def add(self, family: MetricFamily) -> None:
        with self._lock:
            existing = self._families.get(family._name)
            if existing is not None and (existing._kind != family._kind
                                         or existing._description != family._description):
                raise TritonModelException(
                    f"metric family '{family._name}' already exists with a different kind or description")
            if existing is not None:  # same family again: share its series, as Triton does
                family._metrics, family._lock = existing._metrics, existing._lock
            else:
                self._families[family._name] = family

    def collect(self):
        with self._lock:
            families = list(self._families.values())
        for family in families:
            yield family._collect()


_collectors: weakref.WeakKeyDictionary[object, _Collector] = weakref.WeakKeyDictionary()
_standalone = _Collector()  # families made outside any server (never exported)
_collectors_lock = threading.Lock()


def _registry_collector() -> _Collector:
    try:
        link = current_link()
    except TritonModelException:
        return _standalone
    registry = getattr(getattr(link.dataplane, "metrics", None), "registry", None)
    if registry is None:
        return _standalone
    with _collectors_lock:
        collector = _collectors.get(registry)
        if collector is None:
            collector = _collectors[registry] = _Collector()
            registry.register(collector)
        return collector
