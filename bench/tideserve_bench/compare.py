"""``tideserve-bench compare A.json B.json ...``: result files side by side, each as ratios to the first.

Sweep points are matched by (kind, value); files whose points do not match but have as many points
are paired in order. A ``vllm bench serve --save-result`` JSON file is read too (one point).
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from .report import _console, fmt

# (row title, getter, True when higher is better / False when lower is / None for counts)
ROWS: list[tuple[str, Any, bool | None]] = [
    ("completed", lambda e: e.get("completed"), None),
    ("failed", lambda e: e.get("failed"), None),
    ("truncated", lambda e: e.get("truncated"), None),
    ("request throughput (req/s)", lambda e: e.get("request_throughput"), True),
    ("request goodput (req/s)", lambda e: e.get("request_goodput"), True),
    ("output throughput (tok/s)", lambda e: e.get("output_throughput"), True),
    ("total throughput (tok/s)", lambda e: e.get("total_token_throughput"), True),
]
for _metric, _name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2EL")):
    for _stat in ("mean", "median", "p90", "p99"):
        ROWS.append((f"{_name} {_stat} (ms)", lambda e, m=_metric, s=_stat: (e.get(m) or {}).get(s), False))


def load(path: str | Path) -> tuple[str, list[dict[str, Any]]]:
    """(label, sweep entries) of a tideserve-bench result (file or its directory) or a vLLM result."""
    path = Path(path)
    if path.is_dir():
        path = path / "result.json"
    doc = json.loads(path.read_text())
    if isinstance(doc, dict) and doc.get("tool") == "tideserve-bench":
        return doc.get("label") or str(path), doc["runs"]
    if isinstance(doc, dict) and "median_ttft_ms" in doc:
        return f"{path} (vllm bench serve)", [_from_vllm(doc)]
    raise ValueError(f"{path}: neither a tideserve-bench result nor a vllm bench serve result")


def _from_vllm(doc: dict[str, Any]) -> dict[str, Any]:
    rate = doc.get("request_rate", "inf")
    rate = float("inf") if rate in ("inf", None) else float(rate)
    cap = doc.get("max_concurrency")
    if math.isinf(rate) and cap:
        kind, value = "concurrency", int(cap)
    else:
        kind, value = "request_rate", "inf" if math.isinf(rate) else rate
    entry: dict[str, Any] = {"kind": kind, "value": value, "label": f"{kind} {value}",
                             "completed": doc.get("completed"), "failed": doc.get("failed"),
                             "request_throughput": doc.get("request_throughput"),
                             "request_goodput": doc.get("request_goodput"),
                             "output_throughput": doc.get("output_throughput"),
                             "total_token_throughput": doc.get("total_token_throughput")}
    for metric in ("ttft", "tpot", "itl", "e2el"):
        stats = {s: doc.get(f"{s}_{metric}_ms") for s in ("mean", "median", "std")}
        for key, value in doc.items():
            if key.startswith("p") and key.endswith(f"_{metric}_ms"):
                stats[key.split("_")[0]] = value
        entry[f"{metric}_ms"] = stats if any(v is not None for v in stats.values()) else None
    return entry


def _key(entry: dict[str, Any]) -> tuple[str, str]:
    return entry["kind"], str(entry["value"])


def pair(base: list[dict[str, Any]], other: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
    by_key = {_key(e): e for e in other}
    matched = [by_key.get(_key(e)) for e in base]
    if not any(matched) and len(base) == len(other):
        return list(other)
    return matched


def ratio(value: Any, baseline: Any) -> float | None:
    if value is None or baseline is None or not isinstance(value, (int, float)) or not baseline:
        return None
    return value / baseline


def compare(paths: list[str | Path]) -> dict[str, Any]:
    if len(paths) < 2:
        raise ValueError("compare needs two or more result files")
    loaded = [load(p) for p in paths]
    labels = [label for label, _ in loaded]
    base_runs = loaded[0][1]
    columns = [base_runs] + [pair(base_runs, runs) for _, runs in loaded[1:]]
    points = []
    for i, base in enumerate(base_runs):
        rows = []
        for title, get, higher in ROWS:
            values = [get(col[i]) if col[i] is not None else None for col in columns]
            if all(v is None for v in values):
                continue
            rows.append({"metric": title, "higher_is_better": higher, "values": values,
                         "ratios": [ratio(v, values[0]) for v in values[1:]]})
        points.append({"point": base.get("label", _key(base)), "rows": rows})
    return {"files": [str(p) for p in paths], "labels": labels, "points": points}


def print_comparison(result: dict[str, Any], plain: bool = False) -> None:
    labels = result["labels"]
    names = [f"[{i}] " for i in range(len(labels))]
    console = _console(plain)
    legend = "\n".join(f"[{i}] {label}" for i, label in enumerate(labels))
    for point in result["points"]:
        header = ["metric", "[0]"]
        for i in range(1, len(labels)):
            header += [names[i].strip(), f"[{i}]/[0]"]
        table_rows = []
        for row in point["rows"]:
            cells = [row["metric"], fmt(row["values"][0])]
            for value, r in zip(row["values"][1:], row["ratios"]):
                cells += [fmt(value), "-" if r is None else f"{r:.3f}x"]
            table_rows.append(cells)
        title = f"compare: {point['point']}"
        if console is not None:
            from rich.table import Table

            table = Table(title=title, title_justify="left", caption=legend, caption_justify="left")
            for i, h in enumerate(header):
                table.add_column(h, justify="left" if i == 0 else "right")
            for cells in table_rows:
                table.add_row(*cells)
            console.print(table)
        else:
            print(f"==== {title} ====")
            print(legend)
            print(f"{header[0]:<28}" + "".join(f"{h:>14}" for h in header[1:]))
            for cells in table_rows:
                print(f"{cells[0]:<28}" + "".join(f"{c:>14}" for c in cells[1:]))


def write_comparison(path: str | Path, result: dict[str, Any]) -> None:
    path = Path(path)
    if path.suffix.lower() == ".csv":
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            n = len(result["labels"])
            writer.writerow(["point", "metric"] + [f"value[{i}]" for i in range(n)]
                            + [f"ratio[{i}]/[0]" for i in range(1, n)])
            for point in result["points"]:
                for row in point["rows"]:
                    writer.writerow([point["point"], row["metric"], *row["values"], *row["ratios"]])
    else:
        path.write_text(json.dumps(result, indent=2) + "\n")
