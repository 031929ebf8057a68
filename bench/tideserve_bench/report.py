"""Reports: the terminal summary (rich when installed, plain text otherwise), the JSON result file, the
per-request CSV."""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path
from typing import Any

from .metrics import pkey, token_count_statement, tpot
from .runner import PointRun

LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2EL"))
CSV_FIELDS = ("point", "sweep", "index", "request_id", "send_time_s", "success", "error", "truncated",
              "finish_reason", "input_tokens", "input_token_source", "requested_output_tokens", "output_tokens",
              "output_token_source", "token_chunks", "ttft_ms", "tpot_ms", "itl_mean_ms", "itl_max_ms", "e2el_ms")


# -- files -----------------------------------------------------------------------------------------
def run_entry(run: PointRun, summary: dict[str, Any]) -> dict[str, Any]:
    point = run.point
    entry = {"point": run.index, "label": point.label, **point.to_json(),
             "concurrency": int(point.value) if point.kind == "concurrency" else None,
             "request_rate": point.to_json()["value"] if point.kind == "request_rate" else None,
             "started_at": run.started_at}
    entry.update(summary)
    entry["token_count_statement"] = token_count_statement(summary)
    return entry


def write_json(path: Path, document: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(document, indent=2, allow_nan=False) + "\n")
    os.replace(tmp, path)


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value * 1000:.3f}"


def csv_rows(run: PointRun):
    for r in run.records:
        itls = r.itls
        yield {
            "point": run.index, "sweep": run.point.short, "index": r.index, "request_id": r.request_id,
            "send_time_s": f"{r.start - run.start:.6f}", "success": int(r.success), "error": r.error,
            "truncated": r.truncated, "finish_reason": r.finish_reason or "",
            "input_tokens": r.input_tokens, "input_token_source": r.input_token_source,
            "requested_output_tokens": r.requested_output_len, "output_tokens": r.output_tokens,
            "output_token_source": r.output_token_source, "token_chunks": len(r.chunk_times),
            "ttft_ms": _ms(r.ttft if r.success else None), "tpot_ms": _ms(tpot(r) if r.success else None),
            "itl_mean_ms": _ms(sum(itls) / len(itls) if r.success and itls else None),
            "itl_max_ms": _ms(max(itls) if r.success and itls else None),
            "e2el_ms": _ms(r.latency if r.success else None),
        }


def write_csv(path: Path, runs: list[PointRun]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for run in runs:
            writer.writerows(csv_rows(run))


# -- terminal --------------------------------------------------------------------------------------
def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf"
        return f"{value:,.{digits}f}"
    return str(value)


def _console(plain: bool):
    if plain:
        return None
    try:
        from rich.console import Console
    except ImportError:
        return None
    import sys

    # a pipe or a file gets the whole table, not rich's default 80 columns
    return Console(soft_wrap=False, highlight=False, width=None if sys.stdout.isatty() else 140)


def point_lines(entry: dict[str, Any]) -> list[tuple[str, str]]:
    lines = [
        ("Requests", (f"{entry['requests']} sent, {entry['completed']} completed, {entry['failed']} failed, "
                      f"{entry['truncated']} truncated")),
        ("Duration (s)", fmt(entry["duration_s"])),
        ("Request throughput (req/s)", fmt(entry["request_throughput"], 3)),
    ]
    if entry.get("request_goodput") is not None:
        good = f"{fmt(entry['request_goodput'], 3)} ({entry['good_requests']} within the SLOs)"
        lines.append(("Request goodput (req/s)", good))
    lines += [
        ("Output token throughput (tok/s)", fmt(entry["output_throughput"])),
        ("Total token throughput (tok/s)", fmt(entry["total_token_throughput"])),
        ("Tokens in / out", f"{entry['total_input_tokens']} / {entry['total_output_tokens']}"),
        ("Token counts", entry["token_count_statement"]),
    ]
    for item in entry["errors"][:5]:
        lines.append((f"Failed x{item['count']}", item["error"]))
    for item in entry["truncations"][:5]:
        lines.append((f"Truncated x{item['count']}", item["reason"]))
    return lines


def latency_columns(percentiles) -> list[tuple[str, str]]:
    cols = [("mean", "mean"), ("median", "median"), ("std", "std")]
    cols += [(pkey(p), pkey(p)) for p in percentiles if p != 50]
    return cols + [("max", "max")]


def print_point(entry: dict[str, Any], percentiles, plain: bool = False) -> None:
    console = _console(plain)
    columns = latency_columns(percentiles)
    if console is not None:
        from rich.table import Table

        head = Table(title=f"tideserve-bench: {entry['label']}", show_header=False, title_justify="left")
        head.add_column(style="bold")
        head.add_column(overflow="fold")
        for name, value in point_lines(entry):
            head.add_row(name, value)
        console.print(head)
        table = Table(title="Latency (ms)", title_justify="left")
        table.add_column("metric", style="bold")
        for _, title in columns:
            table.add_column(title, justify="right")
        for key, name in LATENCIES:
            s = entry[key] or {}
            table.add_row(name, *(fmt(s.get(k)) for k, _ in columns))
        console.print(table)
        return
    print(f"==== tideserve-bench: {entry['label']} ====")
    for name, value in point_lines(entry):
        print(f"{name + ':':<34} {value}")
    print(f"{'Latency (ms)':<10}" + "".join(f"{t:>12}" for _, t in columns))
    for key, name in LATENCIES:
        s = entry[key] or {}
        print(f"{name:<10}" + "".join(f"{fmt(s.get(k)):>12}" for k, _ in columns))


SWEEP_COLUMNS = (
    ("point", lambda e: e["label"]), ("done", lambda e: str(e["completed"])), ("failed", lambda e: str(e["failed"])),
    ("req/s", lambda e: fmt(e["request_throughput"], 3)), ("out tok/s", lambda e: fmt(e["output_throughput"])),
    ("TTFT med", lambda e: fmt((e["ttft_ms"] or {}).get("median"))),
    ("TTFT p99", lambda e: fmt((e["ttft_ms"] or {}).get("p99"))),
    ("TPOT med", lambda e: fmt((e["tpot_ms"] or {}).get("median"))),
    ("ITL med", lambda e: fmt((e["itl_ms"] or {}).get("median"))),
    ("E2EL med", lambda e: fmt((e["e2el_ms"] or {}).get("median"))),
)


def print_sweep(entries: list[dict[str, Any]], plain: bool = False) -> None:
    if len(entries) < 2:
        return
    console = _console(plain)
    if console is not None:
        from rich.table import Table

        table = Table(title="Sweep (latencies in ms)", title_justify="left")
        for name, _ in SWEEP_COLUMNS:
            table.add_column(name, justify="left" if name == "point" else "right")
        for e in entries:
            table.add_row(*(get(e) for _, get in SWEEP_COLUMNS))
        console.print(table)
        return
    print("==== Sweep (latencies in ms) ====")
    print(f"{'point':<36}" + "".join(f"{n:>11}" for n, _ in SWEEP_COLUMNS[1:]))
    for e in entries:
        print(f"{e['label']:<36}" + "".join(f"{get(e):>11}" for _, get in SWEEP_COLUMNS[1:]))
