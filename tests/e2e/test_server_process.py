"""The tideserve process as users run it: CLI flags, metrics, polling, SIGTERM drain."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest


from support import start_server

SLOW_MODEL = '''
import time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        with open(__file__ + ".started", "a") as started:  # the tests wait for it, not for a fixed time
            started.write("x")
        time.sleep(float(pb_utils.get_input_tensor_by_name(requests[0], "SECONDS").as_numpy()[0]))
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "SECONDS").as_numpy())]) for r in requests]
'''
SLOW_CONFIG = '''
backend: "python"
max_batch_size: 0
input [ { name: "SECONDS" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
'''


def write_slow_model(repo: Path, name: str = "slow") -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(SLOW_CONFIG)
    (repo / name / "1" / "model.py").write_text(SLOW_MODEL)


def wait_executing(repo: Path, name: str = "slow", timeout: float = 60) -> None:
    """Until the slow model has started executing a request (its marker file): a loaded machine may take longer
    than any fixed sleep to bring a request that far."""
    marker = repo / name / "1" / "model.py.started"
    deadline = time.monotonic() + timeout
    while not marker.exists():
        assert time.monotonic() < deadline, "the slow model never started executing"
        time.sleep(0.02)


def wait_not_ready(base_url: str, timeout: float = 30) -> None:
    """Until readiness answers "not ready" (Triton's 400: the drain has begun)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{base_url}/v2/health/ready", timeout=5):
                pass
        except urllib.error.HTTPError:
            return
        assert time.monotonic() < deadline, "readiness never turned false after SIGTERM"
        time.sleep(0.02)


def post(url: str, body: dict, timeout: float = 30) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def slow_request(seconds: float) -> dict:
    return {"inputs": [{"name": "SECONDS", "datatype": "FP32", "shape": [1], "data": [seconds]}]}


def metric(text: str, name: str, **labels) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
            if all(found.get(k) == v for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} {labels} not found")


def test_metrics_count_success_failure_and_latency(tmp_path):
    write_slow_model(tmp_path)
    server = start_server([tmp_path], tmp_dir=tmp_path)
    try:
        url = f"{server.base_url}/v2/models/slow/infer"
        assert post(url, slow_request(0.0))[0] == 200
        assert post(url, slow_request(0.0))[0] == 200
        status, body = post(url, {"inputs": [{"name": "SECONDS", "datatype": "FP32", "shape": [2],
                                              "data": [0, 0]}]})
        assert status == 400 and "SECONDS" in body["error"]
        text = server.metrics()
        labels = {"model": "slow", "version": "1"}
        assert metric(text, "nv_inference_request_success", **labels) == 2
        assert metric(text, "nv_inference_request_failure", reason="OTHER", **labels) == 1
        assert metric(text, "nv_inference_count", **labels) == 2
        assert metric(text, "nv_inference_exec_count", **labels) == 2
        assert metric(text, "nv_inference_pending_request_count", **labels) == 0
        assert metric(text, "nv_inference_request_duration_us", **labels) > 0
        assert metric(text, "nv_inference_compute_infer_duration_us", **labels) > 0
        assert metric(text, "nv_inference_request_duration_histogram_ms_count", **labels) == 2
        assert metric(text, "nv_inference_first_response_histogram_ms_count", **labels) == 2
        assert "# TYPE nv_inference_request_success counter" in text
    finally:
        assert server.stop() == 0


def test_sigterm_drains_in_flight_requests_then_exits_zero(tmp_path):
    write_slow_model(tmp_path)
    server = start_server([tmp_path], "--exit-timeout-secs", "30", tmp_dir=tmp_path)
    result = {}

    def call():
        result["answer"] = post(f"{server.base_url}/v2/models/slow/infer", slow_request(4.0))

    caller = threading.Thread(target=call)
    caller.start()
    wait_executing(tmp_path)
    server.process.send_signal(signal.SIGTERM)
    wait_not_ready(server.base_url)
    status, _ = post(f"{server.base_url}/v2/models/slow/infer", slow_request(0.0), timeout=5)
    assert status == 503  # new work refused while draining
    caller.join(30)
    assert result["answer"][0] == 200 and result["answer"][1]["outputs"][0]["data"] == [4.0]
    assert server.process.wait(30) == 0


@pytest.mark.parametrize("frontends", [(), ("--frontend-workers", "2", "--frontend-direct", "on")],
                         ids=["as-configured", "direct-workers"])
def test_exit_timeout_bounds_the_drain(tmp_path, frontends):
    """A request still running when the exit timeout runs out is answered 503 and the server exits: also one that
    a frontend worker sent straight to the model's process (the drain waits for it, the worker answers it)."""
    write_slow_model(tmp_path)
    server = start_server([tmp_path], "--exit-timeout-secs", "1", *frontends, tmp_dir=tmp_path)
    result = {}

    def call():
        result["answer"] = post(f"{server.base_url}/v2/models/slow/infer", slow_request(20.0))

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    wait_executing(tmp_path)
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(15) == 0
    assert time.monotonic() - started < 15
    caller.join(5)
    status, body = result["answer"]
    assert status == 503 and "exit timeout" in body["error"]


def test_poll_mode_loads_a_model_added_later(tmp_path):
    server = start_server([tmp_path], "--model-control-mode", "poll", "--repository-poll-secs", "0.2",
                          tmp_dir=tmp_path)
    try:
        write_slow_model(tmp_path, "late")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{server.base_url}/v2/models/late/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except urllib.error.HTTPError:
                pass
            time.sleep(0.1)
        assert post(f"{server.base_url}/v2/models/late/infer", slow_request(0.0))[0] == 200
    finally:
        server.stop()


def test_bad_repository_path_fails_with_a_message(tmp_path):
    result = subprocess.run([sys.executable, "-m", "tideserve.cli", "--model-repository", str(tmp_path / "nope")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "is not a directory" in result.stderr


def test_help_lists_triton_flags():
    result = subprocess.run([sys.executable, "-m", "tideserve.cli", "--help"], capture_output=True, text=True,
                            timeout=60)
    for flag in ("--model-repository", "--http-port", "--grpc-port", "--metrics-port", "--model-control-mode",
                 "--load-model", "--repository-poll-secs", "--exit-timeout-secs", "--log-verbose",
                 "--http-max-input-size", "--host"):
        assert flag in result.stdout


# -- --load-model as tritonserver checks it (Triton qa L0_lifecycle, python/openai test_model_management) -------
def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tideserve.cli", "--http-port", "0", "--grpc-port", "0",
                           "--metrics-port", "0", "--frontend-workers", "1", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_load_model_needs_explicit_mode(tmp_path):
    write_slow_model(tmp_path)
    for mode in ([], ["--model-control-mode", "none"], ["--model-control-mode", "poll"]):
        result = run_cli("--model-repository", str(tmp_path), *mode, "--load-model", "slow")
        assert result.returncode == 2
        assert "Use of '--load-model' requires setting '--model-control-mode=explicit' as well." in result.stderr


def test_load_model_star_must_be_the_only_one(tmp_path):
    write_slow_model(tmp_path)
    result = run_cli("--model-repository", str(tmp_path), "--model-control-mode", "explicit",
                     "--load-model", "*", "--load-model", "slow")
    assert result.returncode == 2
    assert "Wildcard model name '*' must be the ONLY startup model if specified at all." in result.stderr


def test_a_missing_startup_model_fails_the_start(tmp_path):
    write_slow_model(tmp_path)
    result = run_cli("--model-repository", str(tmp_path), "--model-control-mode", "explicit",
                     "--load-model", "slow", "--load-model", "does-not-exist")
    assert result.returncode == 1
    assert "failed to poll model 'does-not-exist': model not found in any model repository" in result.stderr
    assert "failed to load all models: 'does-not-exist' did not load" in result.stderr
    assert "tideserve ready" not in result.stderr


def test_an_invalid_startup_model_fails_the_start_unless_exit_on_error_is_off(tmp_path):
    write_slow_model(tmp_path)
    (tmp_path / "broken" / "1").mkdir(parents=True)
    (tmp_path / "broken" / "config.pbtxt").write_text('backend: "python"\nmax_batch_size: 0\n'
                                                     'input [ { name: "X" data_type: TYPE_NOPE dims: [ 1 ] } ]\n')
    for name in ("broken", "../slow"):
        result = run_cli("--model-repository", str(tmp_path), "--model-control-mode", "explicit",
                         "--load-model", "slow", "--load-model", name)
        assert result.returncode == 1, result.stderr
        assert f"failed to load all models: '{name}' did not load" in result.stderr
    assert "invalid model name '../slow'" in result.stderr
    # --exit-on-error false: the failure is logged, the other models serve
    server = start_server([tmp_path], "--model-control-mode", "explicit", "--load-model", "slow",
                          "--load-model", "broken", "--exit-on-error", "false", "--strict-readiness", "false",
                          tmp_dir=tmp_path)
    try:
        assert post(f"{server.base_url}/v2/models/slow/infer", slow_request(0.0))[0] == 200
        status, index = post(f"{server.base_url}/v2/repository/index", {})
        states = {entry["name"]: entry.get("state") for entry in index}
        assert states == {"slow": "READY", "broken": "UNAVAILABLE"}
        assert "failed to load all models: 'broken' did not load" in server.log()
    finally:
        assert server.stop() == 0


# -- Triton's CPU metrics (qa L0_metrics cpu_metrics_test: the same patterns and ranges) ------------------------
def test_cpu_metrics_on_the_metrics_port(tmp_path):
    write_slow_model(tmp_path)
    server = start_server([tmp_path], "--metrics-interval-ms", "100", tmp_dir=tmp_path)
    try:
        text = server.metrics()
        utilization = float(re.search(r"^nv_cpu_utilization (\d+\.?\d*)$", text, re.M).group(1))
        used = int(re.search(r"^nv_cpu_memory_used_bytes (\d+)$", text, re.M).group(1))
        total = int(re.search(r"^nv_cpu_memory_total_bytes (\d+)$", text, re.M).group(1))
        assert 0 <= utilization <= 1.0 and 0 < used <= total
        assert "# TYPE nv_cpu_utilization gauge" in text
    finally:
        assert server.stop() == 0
    server = start_server([tmp_path], "--allow-cpu-metrics", "false", tmp_dir=tmp_path)
    try:
        assert "nv_cpu_" not in server.metrics()
    finally:
        assert server.stop() == 0
