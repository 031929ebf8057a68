"""Triton's CPU metrics: ``nv_cpu_utilization``, ``nv_cpu_memory_total_bytes``, ``nv_cpu_memory_used_bytes``.

Three gauges without labels, read from Linux's ``/proc`` as Triton reads them: utilization is the share of
non-idle time of all cores together (``/proc/stat``: user, nice, system, irq, softirq and steal against idle
and iowait) since the previous reading, in [0.0, 1.0]; memory is ``MemTotal`` and ``MemTotal - MemAvailable``
of ``/proc/meminfo``, in bytes. Triton polls every ``--metrics-interval-ms``; here the values are read when a
scrape asks for them and at least that interval has passed since the last reading (no thread of its own),
so one scrape per interval sees each interval's utilization. Off with ``--allow-cpu-metrics false``, and
where there is no ``/proc`` (not Linux).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

from prometheus_client.metrics_core import Metric

_FAMILIES = (
    ("nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0]"),
    ("nv_cpu_memory_total_bytes", "CPU total memory (RAM), in bytes"),
    ("nv_cpu_memory_used_bytes", "CPU used memory (RAM), in bytes"),
)


def read_cpu_times(proc: Path) -> tuple[int, int] | None:
    """(busy, idle) jiffies of all cores together, or None when ``/proc/stat`` cannot be read."""
    try:
        first = (proc / "stat").read_text().split("\n", 1)[0].split()
        user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in first[1:9])
    except (OSError, ValueError):
        return None
    if first[0] != "cpu":
        return None
    return user + nice + system + irq + softirq + steal, idle + iowait


def read_memory(proc: Path) -> tuple[int, int]:
    """(total, used) bytes of RAM, used = total - available; (0, 0) when ``/proc/meminfo`` cannot be read."""
    values = {}
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in ("MemTotal", "MemAvailable"):
                values[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return 0, 0
    total, available = values.get("MemTotal"), values.get("MemAvailable")
    if total is None or available is None or available > total:
        return 0, 0
    return total, total - available


class CpuMetrics:
    """The three gauges, refreshed at most once per ``interval_s`` when collected."""

    def __init__(self, interval_s: float = 2.0, proc: Path = Path("/proc")) -> None:
        self.interval_s = interval_s
        self._proc = proc
        self._lock = threading.Lock()
        self._times = read_cpu_times(proc)
        self._read_at = time.monotonic()
        self._utilization = 0.0
        self._memory = read_memory(proc)

    @classmethod
    def available(cls, proc: Path = Path("/proc")) -> bool:
        return read_cpu_times(proc) is not None

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._read_at < self.interval_s:
            return
        times = read_cpu_times(self._proc)
        if times is not None and self._times is not None:
            busy = max(times[0] - self._times[0], 0)
            idle = max(times[1] - self._times[1], 0)
            self._utilization = busy / (busy + idle) if busy + idle else 0.0
        self._times, self._read_at = times, now
        self._memory = read_memory(self._proc)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            self._refresh()
            values = (self._utilization, *self._memory)
        for (name, doc), value in zip(_FAMILIES, values):
            metric = Metric(name, doc, "gauge")
            metric.add_sample(name, {}, value)
            yield metric
