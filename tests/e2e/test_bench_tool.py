"""tideserve-bench (bench/tideserve_bench) end to end: against a real tideserve process serving the tiny vLLM
model over KServe generate_stream, gRPC ModelStreamInfer and (when the server has it) OpenAI chat, with the
result files checked against what the server counted. Its metric math, workloads, runner and command line,
without a server, are in tests/unit/test_bench_*.py."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from llm_fixtures import VLLM_MODEL, metric_value, wait_engine_idle
from tideserve.bench.tideserve_bench import plots
from tideserve.bench.tideserve_bench.workload import LengthDist, SyntheticWorkload, Tokenizer

REPO = Path(__file__).resolve().parents[2]


# -- end to end against tideserve with the tiny vLLM model -----------------------------------------
MODEL = VLLM_MODEL


@pytest.fixture(scope="module")
def llm_server(vllm_server):
    """The session's vLLM server (``vllm_server`` in tests/conftest.py): the same engine arguments (tiny Llama,
    float32, ``max_model_len`` 512, eager) as tests/e2e/test_vllm.py's, one engine for both."""
    wait_engine_idle(vllm_server)
    return vllm_server


def bench(*args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tideserve.bench.tideserve_bench", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, check=False)


def counters(server) -> dict[str, float]:
    text = server.metrics()
    labels = {"model_name": MODEL, "version": "1"}
    return {name: metric_value(text, f"tideserve:{name}", **labels) or 0.0
            for name in ("request_success_total", "generation_tokens_total", "prompt_tokens_total")}


def read_run(out: Path) -> tuple[dict, list[dict]]:
    result = json.loads((out / "result.json").read_text())
    with open(out / "requests.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return result, rows


def engine_test(func):
    """Slow (an engine starts with the module's first one)."""
    for mark in (pytest.mark.slow, pytest.mark.timeout(420)):
        func = mark(func)
    return func


@pytest.mark.parametrize("target, sweep", [
    ("kserve-generate", ["--concurrency", "1", "4"]),
    ("grpc-stream", ["--request-rate", "30", "inf"]),
    ("openai-chat", ["--concurrency", "3"]),
])
@engine_test
def test_end_to_end_results_match_the_requests_sent(llm_server, tiny_model, tmp_path, target, sweep):
    url = llm_server.grpc_url if target == "grpc-stream" else llm_server.base_url
    out = tmp_path / "out"
    workload_file = tmp_path / "sent.jsonl"
    n = 6
    before = counters(llm_server)
    done = bench("run", "--target", target, "--url", url, "--model", MODEL, "--tokenizer", str(tiny_model),
                 "--input-len", "uniform:8,40", "--output-len", "uniform:4,12", "--ignore-eos", *sweep,
                 "--num-requests", str(n), "--warmup", "0", "--seed", "11", "--goodput", "ttft:60000", "tpot:60000",
                 "--out", str(out), "--save-workload", str(workload_file), "--no-progress", "--plain")
    after = counters(llm_server)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Latency (ms)" in done.stdout and "TTFT" in done.stdout
    result, rows = read_run(out)
    points = len(result["runs"])
    assert points == len(sweep) - 1

    # what was asked for: the seeded workload, regenerated here
    tok = Tokenizer(str(tiny_model))
    workload = SyntheticWorkload(tok, LengthDist.parse("uniform:8,40"), LengthDist.parse("uniform:4,12"), seed=11)
    assert len(rows) == points * n
    for row in rows:
        asked = workload.request(int(row["point"]), int(row["index"]))
        assert row["success"] == "1" and not row["error"] and not row["truncated"], row
        assert int(row["requested_output_tokens"]) == asked.output_len
        assert int(row["output_tokens"]) == asked.output_len          # ignore_eos: exactly what was asked
        assert row["output_token_source"] == "server"
        if target != "openai-chat":                                    # chat adds its template's tokens
            assert int(row["input_tokens"]) == asked.prompt_len
        assert int(row["token_chunks"]) >= 1
    saved = [json.loads(line) for line in workload_file.read_text().splitlines()]
    assert [s["output_tokens"] for s in saved] == [workload.request(0, i).output_len for i in range(n)]

    # what the server counted while the tool ran (no warm-up, nothing else on this model meanwhile)
    total_out = sum(int(r["output_tokens"]) for r in rows)
    total_in = sum(int(r["input_tokens"]) for r in rows)
    assert after["request_success_total"] - before["request_success_total"] == points * n
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == total_out
    if target != "openai-chat":
        assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == total_in

    for k, run in enumerate(result["runs"]):
        mine = [r for r in rows if int(r["point"]) == k]
        assert (run["requests"], run["completed"], run["failed"], run["truncated"]) == (n, n, 0, 0)
        assert run["total_output_tokens"] == sum(int(r["output_tokens"]) for r in mine)
        assert run["request_throughput"] * run["duration_s"] == pytest.approx(n)
        assert run["output_throughput"] * run["duration_s"] == pytest.approx(run["total_output_tokens"])
        ends = [float(r["send_time_s"]) + float(r["e2el_ms"]) / 1000 for r in mine]
        assert max(ends) <= run["duration_s"] + 1e-3 and run["duration_s"] - max(ends) < 0.5
        assert run["ttft_ms"]["median"] == pytest.approx(float(np.median([float(r["ttft_ms"]) for r in mine])),
                                                         abs=1e-3)
        assert run["itl_ms"]["count"] == sum(int(r["token_chunks"]) - 1 for r in mine)
        assert run["good_requests"] == n
        assert run["token_counts"]["output"] == {"server": n}
        assert "server" in run["token_count_statement"]
    assert result["settings"]["ignore_eos"] is True and result["workload"]["input_len"] == "uniform:8,40"
    if not plots.available():   # matplotlib comes with the bench extra: pip install -e ".[bench]"
        assert result["files"]["plots"] == [] and "matplotlib is not installed" in done.stderr
        return
    for name in ("latency_cdf.png", "throughput.png", "ttft_p99.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert result["files"]["plots"] == ["latency_cdf.png", "throughput.png", "ttft_p99.png"]


@pytest.mark.parametrize("target", ["kserve-generate", "grpc-stream"])
@engine_test
def test_end_to_end_a_failing_target_is_counted_not_dropped(llm_server, tiny_model, tmp_path, target):
    url = llm_server.grpc_url if target == "grpc-stream" else llm_server.base_url
    out = tmp_path / "out"
    done = bench("run", "--target", target, "--url", url, "--model", "no_such_model", "--tokenizer", str(tiny_model),
                 "--input-len", "8", "--output-len", "4", "--concurrency", "2", "--num-requests", "5",
                 "--warmup", "1", "--out", str(out), "--no-progress", "--plain")
    assert done.returncode == 1, done.stdout + done.stderr          # nothing measured
    assert "5 failed" in done.stdout
    result, rows = read_run(out)
    run = result["runs"][0]
    assert (run["requests"], run["completed"], run["failed"]) == (5, 0, 5)
    assert run["errors"][0]["count"] == 5 and "no_such_model" in run["errors"][0]["error"]
    assert run["request_throughput"] == 0 and run["ttft_ms"] is None
    assert result["warmup"]["failed"] == 1
    assert len(rows) == 5 and all(r["success"] == "0" and "no_such_model" in r["error"] for r in rows)
