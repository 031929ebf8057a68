"""Triton's CPU gauges (server/cpu_metrics.py) over a fake /proc."""

from __future__ import annotations

import time

from tideserve.cpu_metrics import CpuMetrics
from tideserve.stats import Metrics

MEMINFO = "MemTotal:       16000 kB\nMemFree:         2000 kB\nMemAvailable:    4000 kB\nBuffers: 1 kB\n"


def _stat(user: int, idle: int) -> str:
    # cpu user nice system idle iowait irq softirq steal guest guest_nice
    return f"cpu  {user} 0 0 {idle} 0 0 0 0 0 0\ncpu0 {user} 0 0 {idle} 0 0 0 0 0 0\n"


def _values(metrics: Metrics) -> dict[str, str]:
    lines = metrics.render().decode().splitlines()
    return {line.split()[0]: line.split()[1] for line in lines if line.startswith("nv_cpu_")}


def test_gauges_read_proc_as_triton(tmp_path):
    (tmp_path / "stat").write_text(_stat(100, 100))
    (tmp_path / "meminfo").write_text(MEMINFO)
    cpu = CpuMetrics(interval_s=0.0, proc=tmp_path)
    metrics = Metrics(cpu)
    (tmp_path / "stat").write_text(_stat(130, 110))  # 30 busy, 10 idle since the last reading
    values = _values(metrics)
    assert values == {"nv_cpu_utilization": "0.75", "nv_cpu_memory_total_bytes": str(16000 * 1024),
                      "nv_cpu_memory_used_bytes": str(12000 * 1024)}  # used = total - available
    text = metrics.render().decode()
    assert "# TYPE nv_cpu_utilization gauge" in text and "# TYPE nv_cpu_memory_used_bytes gauge" in text


def test_gauges_change_at_most_once_per_interval(tmp_path):
    (tmp_path / "stat").write_text(_stat(100, 100))
    (tmp_path / "meminfo").write_text(MEMINFO)
    metrics = Metrics(CpuMetrics(interval_s=3600, proc=tmp_path))
    (tmp_path / "stat").write_text(_stat(200, 100))
    assert _values(metrics)["nv_cpu_utilization"] == "0.0"  # not a whole interval yet
    metrics.cpu.interval_s = 0.0
    time.sleep(0.01)
    assert _values(metrics)["nv_cpu_utilization"] == "1.0"


def test_no_gauges_without_proc(tmp_path):
    assert not CpuMetrics.available(tmp_path)
    assert _values(Metrics()) == {}
