"""Custom metrics: ``pb_utils.MetricFamily`` / ``Metric``, exported on the server's ``/metrics``.

Families live in the Prometheus registry of the server the calling model runs in (one collector
per registry reads them at scrape time). Counters are exposed with the ``_total`` suffix that
the Prometheus text format requires.

A series keeps its values in "cells", doubles: ``[value, time of the last write]`` for counters and
gauges, ``[count per bucket..., count above the last bucket, sum]`` for histograms. In the server's
process the cells are plain memory; in a model process they lie in a page of shared memory that the
server reads at scrape time (:class:`RemoteSeries`), so an update costs no message. The same series
(family and labels) from several processes is summed (counters, histograms) or taken from the latest
write (gauges).
"""

from __future__ import annotations

import bisect
import enum
import logging
import threading
import time
import weakref
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from .errors import TritonModelException
from .scope import current_link

log = logging.getLogger(__name__)


class MetricKind(enum.IntEnum):
    COUNTER = 0
    GAUGE = 1
    HISTOGRAM = 2


def cell_count(kind: MetricKind, buckets: list[float] | None) -> int:
    return len(buckets) + 2 if kind is MetricKind.HISTOGRAM else 2


def local_cells(count: int) -> memoryview:
    return memoryview(bytearray(8 * count)).cast("d")


class Metric:
    """One labelled series of a family."""

    def __init__(self, family: MetricFamily, labels: dict[str, str], buckets: list[float] | None,
                 cells: memoryview) -> None:
        self._family = family
        self._labels = labels
        self._buckets = buckets
        self._lock = threading.Lock()
        self._cells = cells

    def increment(self, value: float) -> None:
        kind = self._family._kind
        if kind is MetricKind.HISTOGRAM:
            raise TritonModelException("Failed to increment metric value. Metric kind HISTOGRAM does not "
                                       "support increment.")
        if kind is MetricKind.COUNTER and value < 0:
            raise TritonModelException("Failed to increment metric value. Counters can only be incremented "
                                       "by non-negative values.")
        with self._lock:
            self._cells[0] += value
            self._cells[1] = time.monotonic()

    def set(self, value: float) -> None:
        if self._family._kind is not MetricKind.GAUGE:
            raise TritonModelException(f"Failed to set metric value. Metric kind "
                                       f"{self._family._kind.name} does not support set.")
        with self._lock:
            self._cells[0] = float(value)
            self._cells[1] = time.monotonic()

    def observe(self, value: float) -> None:
        if self._family._kind is not MetricKind.HISTOGRAM:
            raise TritonModelException(f"Failed to observe metric value. Metric kind "
                                       f"{self._family._kind.name} does not support observe.")
        with self._lock:
            self._cells[bisect.bisect_left(self._buckets, value)] += 1
            self._cells[len(self._buckets) + 1] += value

    def value(self) -> float:
        if self._family._kind is MetricKind.HISTOGRAM:
            raise TritonModelException("Failed to get metric value. Metric kind HISTOGRAM does not support "
                                       "value.")
        with self._lock:
            return self._cells[0]

    def _read(self) -> list[float]:
        with self._lock:
            return self._cells.tolist()


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
        self._collector = _registry_collector()
        self._collector.add(self)

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
                cells = self._collector.new_cells(self, labels, buckets)
                metric = self._metrics[key] = Metric(self, labels, buckets, cells)
            return metric


@dataclass
class RemoteSeries:
    """A series a model process keeps in shared memory: the server reads its cells at scrape time."""

    family: str
    description: str
    kind: MetricKind
    labels: dict[str, str]
    buckets: list[float] | None
    cells: memoryview


class Collector:
    """Reads every custom family of one registry at scrape time: those of the models in this process
    and the series model processes registered."""

    def __init__(self) -> None:
        self._families: dict[str, MetricFamily] = {}
        self._remote: dict[object, list[RemoteSeries]] = {}  # owner (a model process) -> its series
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

    def new_cells(self, family: MetricFamily, labels: dict[str, str], buckets: list[float] | None) -> memoryview:
        """Where a new series of ``family`` keeps its values."""
        return local_cells(cell_count(family._kind, buckets))

    def add_remote(self, owner: object, series: RemoteSeries) -> None:
        with self._lock:
            family = self._families.get(series.family)
            if family is not None:
                known = (family._kind, family._description)
            else:
                same = next((s for ss in self._remote.values() for s in ss if s.family == series.family), None)
                known = None if same is None else (same.kind, same.description)
            if known is not None and known != (series.kind, series.description):
                log.error("metric family '%s' of a model process differs in kind or description from the one "
                          "already exported; its series is not exported", series.family)
                return
            self._remote.setdefault(owner, []).append(series)

    def drop_remote(self, owner: object) -> None:
        with self._lock:
            self._remote.pop(owner, None)

    def collect(self):
        with self._lock:
            local = list(self._families.values())
            remote = [s for series in self._remote.values() for s in series]
        rows: dict[str, tuple[MetricKind, str, dict[tuple, list]]] = {}
        for family in local:
            with family._lock:
                metrics = list(family._metrics.values())
            entry = rows.setdefault(family._name, (family._kind, family._description, {}))
            for metric in metrics:
                entry[2].setdefault(tuple(sorted(metric._labels.items())), []).append(
                    (metric._labels, metric._buckets, metric._read()))
        for series in remote:
            entry = rows.setdefault(series.family, (series.kind, series.description, {}))
            entry[2].setdefault(tuple(sorted(series.labels.items())), []).append(
                (series.labels, series.buckets, series.cells.tolist()))
        for name, (kind, description, series) in rows.items():
            yield _family(name, kind, description, series)


def _family(name: str, kind: MetricKind, description: str, series: dict[tuple, list]):
    label_names = sorted({k for key in series for k, _ in key})
    if kind is MetricKind.COUNTER:
        family = CounterMetricFamily(name, description, labels=label_names)
    elif kind is MetricKind.GAUGE:
        family = GaugeMetricFamily(name, description, labels=label_names)
    else:
        family = HistogramMetricFamily(name, description, labels=label_names)
    for key, parts in series.items():
        labels = dict(key)
        values = [labels.get(k, "") for k in label_names]
        if kind is MetricKind.HISTOGRAM:
            buckets = parts[0][1]
            counts = [0.0] * (len(buckets) + 2)
            for _labels, their_buckets, cells in parts:
                if their_buckets == buckets:
                    counts = [a + b for a, b in zip(counts, cells)]
            running, rows = 0.0, []
            for bound, count in zip(buckets + [float("inf")], counts):
                running += count
                rows.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
            family.add_metric(values, rows, counts[-1])
        elif kind is MetricKind.COUNTER:
            family.add_metric(values, sum(cells[0] for _l, _b, cells in parts))
        else:  # a gauge: the value written last
            family.add_metric(values, max(parts, key=lambda part: part[2][1])[2][0])
    return family


_collectors: weakref.WeakKeyDictionary[object, Collector] = weakref.WeakKeyDictionary()
_standalone = Collector()  # families made outside any server (never exported)
_collectors_lock = threading.Lock()


def registry_collector(registry) -> Collector:
    """The collector of a server's Prometheus registry (made and registered on first use)."""
    with _collectors_lock:
        collector = _collectors.get(registry)
        if collector is None:
            collector = _collectors[registry] = Collector()
            registry.register(collector)
        return collector


def _registry_collector() -> Collector:
    try:
        link = current_link()
    except TritonModelException:
        return _standalone
    # a model process: the link brings the collector whose series the server reads
    if link.metrics_collector is not None:
        return link.metrics_collector
    registry = getattr(link.metrics, "registry", None)
    if registry is None:
        return _standalone
    return registry_collector(registry)
