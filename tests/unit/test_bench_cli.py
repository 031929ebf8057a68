"""tideserve-bench's command line without a server: compare, and arguments it refuses."""

from __future__ import annotations

import csv
import json

import pytest

from tideserve.bench.tideserve_bench import compare as compare_mod


# -- compare -------------------------------------------------------------------------------------
def _doc(label, values, tput):
    runs = [{"kind": "concurrency", "value": v, "label": f"concurrency {v}", "completed": 10, "failed": 0,
             "request_throughput": tput * v, "output_throughput": 100 * tput * v,
             "ttft_ms": {"mean": 10.0 * v, "median": 9.0 * v, "p99": 20.0 * v}} for v in values]
    return {"tool": "tideserve-bench", "label": label, "runs": runs}


def test_compare_puts_results_side_by_side_as_ratios(tmp_path, capsys):
    from tideserve.bench.tideserve_bench.cli import main

    a, b = tmp_path / "a.json", tmp_path / "b" / "result.json"
    b.parent.mkdir()
    a.write_text(json.dumps(_doc("A", [1, 8], 2.0)))
    b.write_text(json.dumps(_doc("B", [8, 1], 3.0)))
    vllm = tmp_path / "vllm.json"
    vllm.write_text(json.dumps({"request_rate": "inf", "max_concurrency": 1, "completed": 10, "failed": 0,
                                "request_throughput": 1.0, "output_throughput": 150.0, "median_ttft_ms": 4.5,
                                "mean_ttft_ms": 5.0, "p99_ttft_ms": 30.0}))
    result = compare_mod.compare([a, b.parent, vllm])
    point1 = {row["metric"]: row for row in result["points"][0]["rows"]}
    assert result["points"][0]["point"] == "concurrency 1"
    assert point1["request throughput (req/s)"]["values"][:2] == [2.0, 3.0]
    assert point1["request throughput (req/s)"]["ratios"] == [pytest.approx(1.5), pytest.approx(0.5)]
    assert point1["TTFT median (ms)"]["ratios"] == [pytest.approx(1.0), pytest.approx(0.5)]
    assert point1["TTFT p99 (ms)"]["ratios"][1] == pytest.approx(1.5)
    point8 = {row["metric"]: row for row in result["points"][1]["rows"]}
    assert point8["output throughput (tok/s)"]["values"] == [1600.0, 2400.0, None]   # matched by value
    assert main(["compare", str(a), str(b), "--plain", "--out", str(tmp_path / "cmp.csv")]) == 0
    printed = capsys.readouterr().out
    assert "1.500x" in printed and "concurrency 8" in printed
    with open(tmp_path / "cmp.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0][:2] == ["point", "metric"] and len(rows) > 10


def test_cli_rejects_bad_arguments(capsys):
    from tideserve.bench.tideserve_bench.cli import main

    base = ["run", "--target", "kserve-generate", "--model", "m", "--tokenizer", "/nonexistent"]
    with pytest.raises(SystemExit):
        main(base + ["--concurrency", "1", "--request-rate", "2"])
    with pytest.raises(SystemExit):
        main(["run", "--target", "kserve-generate", "--model", "m"])           # synthetic prompts need a tokenizer
    with pytest.raises(SystemExit):
        main(base + ["--request-rate", "inf", "--duration", "5"])
    assert main(base + ["--input-len", "uniform:9,1", "--out", "/tmp/unused"]) == 2
    assert "uniform:9,1" in capsys.readouterr().err
