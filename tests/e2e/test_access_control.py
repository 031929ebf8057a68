"""Access control: restricted API groups (HTTP and gRPC), the API key's scope, the metrics address.

Two real servers on free ports over toy Python-backend models (``add_sub``, and the text model
``words`` for the OpenAI routes): one in this process with restricted groups (health among them, so
it cannot be started as a process that is polled for readiness), and one ``tideserve`` process
started with the flags, whose API key guards everything but health and whose metrics port listens on
its own address. The real clients drive them: ``tritonclient.http`` / ``tritonclient.grpc`` with
``headers=``, ``openai``, ``httpx``.
"""

from __future__ import annotations

import json
import queue
import shutil
from pathlib import Path

import grpc
import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from support import TEST_MODELS, free_port, start_server
from grpc_health.v1 import health_pb2, health_pb2_grpc
from in_process import InProcessServer
from tritonclient.utils import InferenceServerException

from tideserve.access import (
    parse_restrictions,
)
from tideserve.app import ServerOptions
from tideserve.repository import ControlMode

pytestmark = pytest.mark.timeout(120)

TOY = Path(__file__).resolve().parents[1] / "openai_models"
# tritonclient.http adds its own headers to the dict it is given: pass copies (dict(INFER))
INFER = {"infer-key": "infer-secret"}
ADMIN = {"admin-key": "admin:secret=1"}  # a value may hold ':' and '='
GRPC_INFER = {"triton-grpc-protocol-infer-key": "infer-secret"}
GRPC_PROBE = {"triton-grpc-protocol-probe": "p"}
API_KEY = "sk-access-test"
BEARER = {"authorization": f"Bearer {API_KEY}"}


def _repository(root: Path) -> Path:
    repository = root / "models"
    shutil.copytree(TEST_MODELS / "add_sub", repository / "add_sub")
    (repository / "words" / "1").mkdir(parents=True)
    shutil.copy(TOY / "words.py", repository / "words" / "1" / "model.py")
    (repository / "words" / "config.pbtxt").write_text('name: "words"\n' + (TOY / "words.pbtxt").read_text())
    return repository


def _add_sub_inputs(module):
    a = np.arange(4, dtype=np.float32).reshape(1, 4)
    inputs = [module.InferInput("INPUT0", [1, 4], "FP32"), module.InferInput("INPUT1", [1, 4], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(np.ones_like(a))
    return inputs, a + 1


# -- restricted groups ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def restricted(tmp_path_factory):
    """HTTP: inference (infer-key), model-repository + model-config (admin-key). gRPC: inference, health."""
    options = ServerOptions(
        model_repositories=[_repository(tmp_path_factory.mktemp("restricted"))],
        http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
        model_control_mode=ControlMode.EXPLICIT, load_models=["*"],
        http_restricted_apis=parse_restrictions(
            ["inference:infer-key=infer-secret", "model-repository,model-config:admin-key=admin:secret=1"],
            "--http-restricted-api"),
        grpc_restricted_protocols=parse_restrictions(
            ["inference:infer-key=infer-secret", "health:probe=p"], "--grpc-restricted-protocol",
            "triton-grpc-protocol-"))
    running = InProcessServer(options)
    yield running
    running.stop()


def test_http_infer_needs_its_header(restricted):
    inputs, expected = _add_sub_inputs(httpclient)
    with httpclient.InferenceServerClient(restricted.http_url) as client:
        for headers in (None, {"infer-key": "wrong"}, {"infer-key": "infer-secret2"}, ADMIN):
            with pytest.raises(InferenceServerException) as info:
                client.infer("add_sub", inputs, headers=headers and dict(headers))
            assert info.value.status() == "403"
            assert "expecting header 'infer-key'" in info.value.message()
            assert "'inference'" in info.value.message()
        result = client.infer("add_sub", inputs, headers=dict(INFER))
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), expected)
        # the header name is matched whatever its case, the value exactly
        result = client.infer("add_sub", inputs, model_version="1", headers={"Infer-Key": "infer-secret"})
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), expected)


def test_http_refusal_is_kserve_json(restricted):
    response = httpx.post(f"{restricted.base}/v2/models/add_sub/infer", json={"inputs": []})
    assert response.status_code == 403 and response.headers["content-type"] == "application/json"
    assert response.json() == {"error": "This API is restricted, expecting header 'infer-key' "
                                        "(restricted API group 'inference')"}
    for suffix in ("generate", "generate_stream"):
        response = httpx.post(f"{restricted.base}/v2/models/words/{suffix}", json={"text_input": "x"})
        assert response.status_code == 403 and "'inference'" in response.json()["error"]
    response = httpx.post(f"{restricted.base}/v2/models/words/generate", headers=INFER,
                          json={"text_input": "x", "max_tokens": 2})
    assert response.status_code == 200 and response.json()["text_output"] == "w0 w1"


def test_model_config_and_repository_need_the_admin_header(restricted):
    with httpclient.InferenceServerClient(restricted.http_url) as client:
        for call in (lambda h: client.get_model_config("add_sub", headers=h),
                     lambda h: client.get_model_repository_index(headers=h),
                     lambda h: client.load_model("add_sub", headers=h),
                     lambda h: client.unload_model("missing", headers=h)):
            with pytest.raises(InferenceServerException, match="expecting header 'admin-key'") as info:
                call(INFER)
            assert info.value.status() == "403"
        assert client.get_model_config("add_sub", headers=ADMIN)["name"] == "add_sub"
        assert {m["name"] for m in client.get_model_repository_index(headers=ADMIN)} == {"add_sub", "words"}
        client.load_model("add_sub", headers=ADMIN)


def test_unrestricted_groups_stay_open(restricted):
    with httpclient.InferenceServerClient(restricted.http_url) as client:
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("add_sub")
        assert client.get_server_metadata()["name"]
        assert client.get_model_metadata("add_sub")["name"] == "add_sub"
        assert client.get_inference_statistics("add_sub")["model_stats"]
    assert httpx.get(f"{restricted.base}/health").status_code == 200
    with grpcclient.InferenceServerClient(restricted.grpc_url) as client:  # gRPC restricts other groups
        assert client.get_model_config("add_sub").config.name == "add_sub"
        assert client.get_model_metadata("add_sub").name == "add_sub"


def test_openai_routes_follow_their_groups(restricted):
    base = f"{restricted.base}/v1"
    with openai.OpenAI(base_url=base, api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.PermissionDeniedError, match="expecting header 'infer-key'"):
            client.completions.create(model="words", prompt="x", max_tokens=1)
        with pytest.raises(openai.PermissionDeniedError, match="expecting header 'admin-key'"):
            client.models.list()
    response = httpx.post(f"{base}/chat/completions", json={"model": "words", "messages": []})
    assert response.status_code == 403
    assert response.json()["error"]["type"] == "PermissionDeniedError" and response.json()["error"]["code"] == 403
    with openai.OpenAI(base_url=base, api_key="unused", max_retries=0, default_headers={**INFER, **ADMIN}) as client:
        assert client.completions.create(model="words", prompt="x", max_tokens=2).choices[0].text == "w0 w1"
        assert "words" in {m.id for m in client.models.list().data}


def test_grpc_infer_needs_its_metadata(restricted):
    inputs, expected = _add_sub_inputs(grpcclient)
    with grpcclient.InferenceServerClient(restricted.grpc_url) as client:
        for headers in (None, INFER, {"triton-grpc-protocol-infer-key": "nope"}):
            with pytest.raises(InferenceServerException) as info:
                client.infer("add_sub", inputs, headers=headers and dict(headers))
            assert info.value.status() == "StatusCode.PERMISSION_DENIED"
            assert "expecting header 'triton-grpc-protocol-infer-key'" in info.value.message()
            assert "'inference'" in info.value.message()
        result = client.infer("add_sub", inputs, headers=GRPC_INFER)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), expected)


def _stream(client, inputs, headers) -> tuple:
    results: queue.Queue = queue.Queue()
    client.start_stream(lambda result, error: results.put((result, error)), headers=headers)
    try:
        try:
            client.async_stream_infer("add_sub", inputs)
        except InferenceServerException:  # the call was refused before this request: the callback has why
            pass
        return results.get(timeout=30)
    finally:
        client.stop_stream()


def test_grpc_stream_infer_needs_its_metadata(restricted):
    inputs, expected = _add_sub_inputs(grpcclient)
    with grpcclient.InferenceServerClient(restricted.grpc_url) as client:
        result, error = _stream(client, inputs, None)
        assert result is None and "PERMISSION_DENIED" in str(error.status())
        assert "triton-grpc-protocol-infer-key" in error.message()
        result, error = _stream(client, inputs, GRPC_INFER)
        assert error is None
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), expected)


def test_grpc_health_restricted(restricted):
    with grpcclient.InferenceServerClient(restricted.grpc_url) as client:
        with pytest.raises(InferenceServerException, match="triton-grpc-protocol-probe") as info:
            client.is_server_live()
        assert info.value.status() == "StatusCode.PERMISSION_DENIED"
        with pytest.raises(InferenceServerException, match="'health'"):
            client.is_model_ready("add_sub")
        assert client.is_server_live(headers=GRPC_PROBE) and client.is_model_ready("add_sub", headers=GRPC_PROBE)
    with grpc.insecure_channel(restricted.grpc_url) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert info.value.code() is grpc.StatusCode.PERMISSION_DENIED
        answer = stub.Check(health_pb2.HealthCheckRequest(), metadata=tuple(GRPC_PROBE.items()), timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING


# -- the API key on everything, the metrics address -----------------------------------------------------
@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """``tideserve --api-key K --api-key-scope all --metrics-address 127.0.0.2`` and statistics restricted."""
    tmp = tmp_path_factory.mktemp("keyed")
    running = start_server([_repository(tmp)], "--api-key", API_KEY, "--api-key-scope", "all",
                           "--metrics-address", "127.0.0.2", "--http-restricted-api", "statistics:x-stats=on",
                           tmp_dir=tmp)
    yield running
    running.stop()


def test_api_key_scope_all_guards_v2(keyed):
    inputs, expected = _add_sub_inputs(httpclient)
    with httpclient.InferenceServerClient(keyed.http_url) as client:
        for headers in (None, {"authorization": "Bearer wrong"}, {"authorization": API_KEY}):
            with pytest.raises(InferenceServerException, match="Invalid or missing API key") as info:
                client.infer("add_sub", inputs, headers=headers and dict(headers))
            assert info.value.status() == "401"
        with pytest.raises(InferenceServerException, match="Invalid or missing API key"):
            client.get_model_metadata("add_sub")
        result = client.infer("add_sub", inputs, headers={"Authorization": f"bearer {API_KEY}"})
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), expected)
        assert client.get_model_metadata("add_sub", headers=BEARER)["name"] == "add_sub"
    response = httpx.get(f"{keyed.base_url}/v2")
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
    assert "Invalid or missing API key" in response.json()["error"]


def test_health_stays_open_for_probes(keyed):
    for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/add_sub/ready", "/health"):
        assert httpx.get(f"{keyed.base_url}{path}").status_code == 200, path
    with grpcclient.InferenceServerClient(keyed.grpc_url) as client:
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("add_sub")
    with grpc.insecure_channel(keyed.grpc_url) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_api_key_comes_before_a_restriction(keyed):
    url = f"{keyed.base_url}/v2/models/add_sub/stats"
    assert httpx.get(url, headers={"x-stats": "on"}).status_code == 401  # no header name leaks without the key
    response = httpx.get(url, headers=BEARER)
    assert response.status_code == 403 and "expecting header 'x-stats'" in response.json()["error"]
    assert httpx.get(url, headers={**BEARER, "x-stats": "on"}).status_code == 200


def test_api_key_scope_all_guards_grpc(keyed):
    inputs, expected = _add_sub_inputs(grpcclient)
    with grpcclient.InferenceServerClient(keyed.grpc_url) as client:
        for call in (lambda h: client.infer("add_sub", inputs, headers=h),
                     lambda h: client.get_model_repository_index(headers=h),
                     lambda h: client.get_server_metadata(headers=h)):
            with pytest.raises(InferenceServerException, match="Invalid or missing API key") as info:
                call({"authorization": "Bearer wrong"})
            assert info.value.status() == "StatusCode.UNAUTHENTICATED"
        result = client.infer("add_sub", inputs, headers=dict(BEARER))
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), expected)
        assert client.get_server_metadata(headers=BEARER).name
        result, error = _stream(client, inputs, None)
        assert result is None and "UNAUTHENTICATED" in str(error.status())
        result, error = _stream(client, inputs, BEARER)
        assert error is None


def test_api_key_on_the_openai_routes(keyed):
    base = f"{keyed.base_url}/v1"
    with openai.OpenAI(base_url=base, api_key="wrong", max_retries=0) as client, \
            pytest.raises(openai.AuthenticationError):
        client.models.list()
    with openai.OpenAI(base_url=base, api_key=API_KEY, max_retries=0) as client:
        assert client.completions.create(model="words", prompt="x", max_tokens=1).choices[0].text == "w0"


def test_metrics_on_their_own_address_behind_the_key(keyed):
    url = f"http://127.0.0.2:{keyed.metrics_port}/metrics"
    response = httpx.get(url)
    assert response.status_code == 401 and "Invalid or missing API key" in json.loads(response.text)["error"]
    response = httpx.get(url, headers=BEARER)
    assert response.status_code == 200 and "nv_inference_request_success" in response.text
    with pytest.raises(httpx.ConnectError):  # not on the HTTP address
        httpx.get(f"http://127.0.0.1:{keyed.metrics_port}/metrics")
    with pytest.raises(httpx.ConnectError):  # and the HTTP port is not on the metrics address
        httpx.get(f"http://127.0.0.2:{keyed.http_port}/v2/health/live")
