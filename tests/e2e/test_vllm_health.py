"""End to end: Triton's vLLM-backend switches ``ENABLE_VLLM_HEALTH_CHECK`` and ``REPORT_CUSTOM_METRICS``,
with the frontends in two worker processes (``--frontend-workers 2``).

One engine (the tiny random Llama) in a model whose config sets the health check on and vLLM's own
metrics off, driven as Triton's ``ci/L0_check_health_vllm`` and ``ci/L0_backend_vllm`` drive theirs. As
Triton's test patches vLLM, the server's ``AsyncLLM.check_health`` fails here while a flag file exists
(tests/llm_fixtures.py): a healthy engine serves and stays READY; once the check fails, the next request
is answered "Model is unavailable due to unhealthy vLLM engine" and the model is unloaded, so the one
after it finds no model. A model with the check off then serves although the check would fail: nothing
asks it. A model with a value that is not a boolean fails its load before any engine starts. Last, Ctrl-C
reaches the server and all its processes at once, as a terminal sends it: no process of the server is left once it
has exited.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from llm_fixtures import (
    GrpcStream,
    cancel_a_running_generation,
    failing_check_health_env,
    llm_inputs,
    metric_value,
    vllm_env,
    write_vllm_model,
)
from support import start_server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
]

MODEL = "vllm_opt"  # the name Triton's tests give theirs
CHECK_OFF = "vllm_check_off"
BAD_SWITCH = "vllm_bad_switch"
UNHEALTHY = "Model is unavailable due to unhealthy vLLM engine"
SAMPLING = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}


def _config(**parameters: str) -> str:
    entries = "".join(f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}\n' for k, v in parameters.items())
    return f'backend: "vllm"\n{entries}'


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("vllm_health")
    tiny = tiny_model
    repository = tmp / "models"
    engine_args = {"model": str(tiny), "dtype": "float32", "max_model_len": 512, "enforce_eager": True}
    write_vllm_model(repository, MODEL, engine_args,
                     config=_config(ENABLE_VLLM_HEALTH_CHECK="true", REPORT_CUSTOM_METRICS="false"))
    write_vllm_model(repository, CHECK_OFF, engine_args, config=_config(ENABLE_VLLM_HEALTH_CHECK="false"))
    write_vllm_model(repository, BAD_SWITCH, engine_args, config=_config(REPORT_CUSTOM_METRICS="yes"))
    flag = tmp / "unhealthy"
    server = start_server([repository], "--model-control-mode", "explicit", "--load-model", MODEL,
                          "--allowed-model-root", str(tiny), "--strict-readiness", "false",
                          "--frontend-workers", "2", tmp_dir=tmp,
                          env={**vllm_env(tmp), **failing_check_health_env(tmp, flag)}, ready_timeout=600)
    server.unhealthy_flag = flag
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


def _stream_infer(server, model: str = MODEL, prompt: str = "In this example,"):
    """One streamed request on a gRPC stream, as Triton's health test sends it: (text, error)."""
    import tritonclient.grpc as grpcclient

    stream = GrpcStream(server.grpc_url)
    try:
        stream.send(model, "1", llm_inputs(grpcclient, prompt, stream=True, sampling=SAMPLING))
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


def test_stop_stream_with_cancel_through_frontend_workers(server):
    """Triton's request_cancellation test through a worker process: the client's CANCELLED alone."""
    from tritonclient.utils import InferenceServerException

    received = cancel_a_running_generation(server, MODEL)
    assert len(received) == 1, received
    result, error = received[0]
    assert result is None and isinstance(error, InferenceServerException)
    assert error.status() == "StatusCode.CANCELLED"


def test_streaming_with_the_input_in_the_output_is_refused_in_tritons_words(server):
    import tritonclient.grpc as grpcclient

    stream = GrpcStream(server.grpc_url)
    try:
        stream.send(MODEL, "1", llm_inputs(grpcclient, "Hi", stream=True, exclude_input=False, sampling=SAMPLING))
        error = stream.wait_all(timeout=60)["1"].error
    finally:
        stream.close()
    assert str(error) == "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed."
    response = httpx.post(f"{server.base_url}/v2/models/{MODEL}/generate_stream",
                          json={"text_input": "Hi", "stream": True, "exclude_input_in_output": False}, timeout=60)
    assert "Error generating stream: When streaming" in response.text, response.text


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


def test_a_failed_health_check_answers_unavailable_and_unloads_the_model(server, grpc_client):
    """Triton's test_vllm_not_healthy: the check runs before each request and at no other time."""
    assert _state(grpc_client, MODEL)[:2] == (True, "READY")
    server.unhealthy_flag.touch()  # from now on check_health() raises
    assert _state(grpc_client, MODEL)[:2] == (True, "READY")  # nothing asked the engine yet

    text, error = _stream_infer(server)
    assert text == "" and str(error) == UNHEALTHY
    ready, state, _ = _state(grpc_client, MODEL)
    assert not ready and state != "READY"

    text, error = _stream_infer(server)
    assert text == "" and str(error) == f"Request for unknown model: '{MODEL}' has no available versions"
    assert not grpc_client.is_model_ready(MODEL)
    assert "the vLLM engine is unhealthy" in server.log()
    assert httpx.get(f"{server.base_url}/v2/health/live", timeout=10).status_code == 200


def test_with_the_check_off_a_failing_check_changes_nothing(server, grpc_client):
    """Triton's health_check_disabled_mocked_failure: check_health() would fail, nothing calls it."""
    assert server.unhealthy_flag.exists()
    grpc_client.load_model(CHECK_OFF)
    for _ in range(3):
        assert _state(grpc_client, CHECK_OFF)[:2] == (True, "READY")
        text, error = _stream_infer(server, CHECK_OFF)
        assert error is None and text
    assert _state(grpc_client, CHECK_OFF)[:2] == (True, "READY")


def test_ctrl_c_to_every_process_leaves_none_once_the_server_exits(server, grpc_client):
    """SIGINT to the server, its frontend workers and its engine's processes at once (a terminal's Ctrl-C reaches
    the whole foreground group; this server shares the test runner's, so each gets it by pid): when the server has
    exited none of them runs. The engine core ends at once on its own signal (a worker process of its own, where the
    engine runs one, would run on for seconds, torch's teardown at its exit, but for the server killing it)."""
    import psutil
    from tideserve.llm_backends.vllm.engine import process_running

    assert _state(grpc_client, CHECK_OFF)[:2] == (True, "READY")  # (the test before loaded it: an engine runs)
    processes = psutil.Process(server.process.pid).children(recursive=True)
    names = {p.pid: p.name() for p in processes}
    assert any("EngineCor" in name for name in names.values()), names  # (the model's worker runs inside it)
    for proc in [psutil.Process(server.process.pid), *processes]:
        try:
            os.kill(proc.pid, signal.SIGINT)
        except ProcessLookupError:
            pass
    assert server.process.wait(120) == 0
    server.signalled = signal.SIGINT

    deadline = time.monotonic() + 0.5  # a zombie's reaping by the init process, nothing more
    while (left := [(p.pid, names[p.pid]) for p in processes if process_running(p)]) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not left, (left, server.log()[-3000:])
