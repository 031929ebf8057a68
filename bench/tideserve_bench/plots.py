"""PNG plots (matplotlib, Agg backend): latency CDFs per sweep point, throughput and TTFT against the sweep."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .runner import PointRun, fmt_rate


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values_ms: list[float], label: str) -> None:
    import numpy as np

    if not values_ms:
        return
    xs = np.sort(np.asarray(values_ms))
    ys = np.arange(1, xs.size + 1) / xs.size
    ax.step(xs, ys, where="post", label=label)


def latency_cdfs(path: Path, runs: list[PointRun], title: str) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = (("TTFT", lambda r: [r.ttft]), ("TPOT", _tpot), ("ITL", lambda r: r.itls), ("E2EL", lambda r: [r.latency]))
    for ax, (name, values) in zip(axes.flat, panels):
        for run in runs:
            data = [v * 1000 for r in run.records if r.success for v in values(r)]
            _cdf(ax, data, f"{run.point.short} (n={len(data)})")
        ax.set_title(f"{name} CDF")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of " + ("gaps" if name == "ITL" else "requests"))
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _tpot(record) -> list[float]:
    if record.output_tokens > 1:
        return [(record.latency - record.ttft) / (record.output_tokens - 1)]
    return []


def _axis(entries: list[dict[str, Any]]) -> tuple[list[int], list[str], str]:
    kind = entries[0]["kind"]
    labels = [str(e["value"]) if kind == "concurrency" else fmt_rate(float(e["value"])) for e in entries]
    xlabel = "concurrency (requests in flight)" if kind == "concurrency" else "request rate (req/s, Poisson)"
    return list(range(len(entries))), labels, xlabel


def throughput(path: Path, entries: list[dict[str, Any]], title: str) -> None:
    plt = _pyplot()
    xs, labels, xlabel = _axis(entries)
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(xs, [e["output_throughput"] for e in entries], "o-", label="output tokens/s")
    ax.plot(xs, [e["total_token_throughput"] for e in entries], "s--", label="total tokens/s")
    ax.set_ylabel("tokens/s")
    ax.set_xticks(xs, labels)
    ax.set_xlabel(xlabel)
    ax.grid(alpha=0.3)
    right = ax.twinx()
    right.plot(xs, [e["request_throughput"] for e in entries], "^:", color="tab:red", label="requests/s")
    if any(e.get("request_goodput") is not None for e in entries):
        right.plot(xs, [e.get("request_goodput") or 0 for e in entries], "v:", color="tab:purple",
                   label="goodput (req/s)")
    right.set_ylabel("requests/s")
    handles = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], loc="best", fontsize="small")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def ttft(path: Path, entries: list[dict[str, Any]], title: str) -> None:
    plt = _pyplot()
    xs, labels, xlabel = _axis(entries)
    fig, ax = plt.subplots(figsize=(8, 5))
    for key, style, name in (("p99", "o-", "p99"), ("median", "s--", "median")):
        ax.plot(xs, [(e["ttft_ms"] or {}).get(key) for e in entries], style, label=f"TTFT {name}")
    ax.set_xticks(xs, labels)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("TTFT (ms)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def make_plots(out_dir: Path, runs: list[PointRun], entries: list[dict[str, Any]], title: str) -> list[str]:
    """Writes the PNGs; returns their file names (none when matplotlib is missing)."""
    if not available() or not runs:
        return []
    files = {"latency_cdf.png": lambda p: latency_cdfs(p, runs, title),
             "throughput.png": lambda p: throughput(p, entries, title),
             "ttft_p99.png": lambda p: ttft(p, entries, title)}
    for name, draw in files.items():
        draw(out_dir / name)
    return list(files)
