"""Request tracing end to end, as Triton's qa/L0_trace pins it: ``--trace-config`` flags, spans sent over
OTLP/HTTP to a collector running in the test (it decodes the protobuf export request with
opentelemetry-proto), the W3C ``traceparent`` of HTTP headers and gRPC metadata as the parent of the
``InferRequest`` span, with one and with two frontend worker processes; ensemble steps as child spans;
``/v2/trace/setting`` and the gRPC TraceSetting RPC (global and per model, bad settings refused); Triton's
JSON trace file in ``triton`` mode.
"""

from __future__ import annotations

import gzip
import http.server
import json
import shutil
import threading
import time

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from support import TEST_MODELS, free_port, start_server
from tritonclient.utils import InferenceServerException

TRACE_ID = "0af7651916cd43dd8448eb211c12666c"
PARENT_SPAN = "b7ad6b7169242424"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN}-01"

DOUBLE = """\
name: "double"
backend: "python"
max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
parameters { key: "process_isolation" value { string_value: "false" } }
"""
DOUBLE_MODEL = '''\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
                    "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() * 2)]) for r in requests]
'''
ENSEMBLE = """\
name: "twice"
platform: "ensemble"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]
ensemble_scheduling {
  step { model_name: "double" model_version: -1 input_map { key: "IN" value: "X" } output_map { key: "OUT" value: "mid" } }
  step { model_name: "double" model_version: -1 input_map { key: "IN" value: "mid" } output_map { key: "OUT" value: "Y" } }
}
"""


class Collector:
    """An OTLP/HTTP trace receiver: keeps every span it is sent, as (resource attributes, span)."""

    def __init__(self) -> None:
        self.spans: list = []
        self.resources: list[dict] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                message = ExportTraceServiceRequest()
                message.ParseFromString(body)
                with collector.lock:
                    for resource_spans in message.resource_spans:
                        attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                        collector.resources.append(attributes)
                        for scope_spans in resource_spans.scope_spans:
                            collector.spans.extend(scope_spans.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.port = free_port()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def trace(self, trace_id: str, count: int, timeout: float = 15) -> list:
        """The spans of trace ``trace_id`` once ``count`` of them have come."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                spans = [s for s in self.spans if s.trace_id.hex() == trace_id]
            if len(spans) >= count or time.monotonic() > deadline:
                return spans
            time.sleep(0.05)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _repository(root):
    repo = root / "models"
    (repo / "double" / "1").mkdir(parents=True)
    (repo / "double" / "config.pbtxt").write_text(DOUBLE)
    (repo / "double" / "1" / "model.py").write_text(DOUBLE_MODEL)
    (repo / "twice" / "1").mkdir(parents=True)
    (repo / "twice" / "config.pbtxt").write_text(ENSEMBLE)
    shutil.copytree(TEST_MODELS / "repeat", repo / "repeat")
    return repo


@pytest.fixture(scope="module")
def collector():
    found = Collector()
    yield found
    found.close()


@pytest.fixture(scope="module", params=["1", "2"], ids=["one-process", "two-frontend-workers"])
def server(request, tmp_path_factory, collector):
    root = tmp_path_factory.mktemp("tracing")
    running = start_server(
        [_repository(root)], "--frontend-workers", request.param,
        "--trace-config", "mode=opentelemetry", "--trace-config", "level=TIMESTAMPS",
        "--trace-config", "rate=0",  # only requests that carry a traceparent are traced
        "--trace-config", f"opentelemetry,url=127.0.0.1:{collector.port}/v1/traces",
        "--trace-config", "opentelemetry,bsp_schedule_delay=50",
        "--trace-config", "opentelemetry,resource=service.name=test_tideserve", tmp_dir=root)
    yield running
    running.stop()


def _traceparent() -> tuple[str, str]:
    trace_id = np.random.default_rng().bytes(16).hex()
    return trace_id, f"00-{trace_id}-{PARENT_SPAN}-01"


def _tree(spans) -> dict[str, list[str]]:
    names = {s.span_id: s.name for s in spans}
    tree: dict[str, list[str]] = {}
    for span in spans:
        if span.parent_span_id in names:
            tree.setdefault(names[span.parent_span_id], []).append(span.name)
    return {k: sorted(v) for k, v in tree.items()}


def _events(spans, name: str) -> list[str]:
    return [e.name for e in next(s for s in spans if s.name == name).events]


def _check_simple(spans, model: str) -> None:
    assert sorted(s.name for s in spans) == sorted(["InferRequest", model, "compute"])
    assert _tree(spans) == {"InferRequest": [model], model: ["compute"]}
    root = next(s for s in spans if s.name == "InferRequest")
    assert root.parent_span_id.hex() == PARENT_SPAN  # the client's span is the parent
    assert _events(spans, model) == ["REQUEST_START", "QUEUE_START", "REQUEST_END"]
    assert _events(spans, "compute") == ["COMPUTE_START", "COMPUTE_END"]
    for span in spans:
        assert span.start_time_unix_nano <= span.end_time_unix_nano
        assert abs(span.start_time_unix_nano / 1e9 - time.time()) < 60  # the wall clock, as OTel wants
    attributes = {a.key: a.value for a in next(s for s in spans if s.name == model).attributes}
    assert attributes["triton.model_name"].string_value == model


def _input(module, name, array):
    tensor = module.InferInput(name, list(array.shape), "FP32")
    tensor.set_data_from_numpy(array)
    return tensor


def test_http_traceparent_is_the_parent(server, collector):
    trace_id, traceparent = _traceparent()
    client = httpclient.InferenceServerClient(server.http_url)
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    result = client.infer("double", [_input(httpclient, "IN", x)], headers={"traceparent": traceparent})
    np.testing.assert_array_equal(result.as_numpy("OUT"), x * 2)
    spans = collector.trace(trace_id, 3)
    _check_simple(spans, "double")
    assert {"service.name": "test_tideserve"}.items() <= collector.resources[-1].items()


def test_grpc_traceparent_is_the_parent(server, collector):
    trace_id, traceparent = _traceparent()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    x = np.ones((1, 3), np.float32)
    client.infer("double", [_input(grpcclient, "IN", x)], headers={"traceparent": traceparent})
    _check_simple(collector.trace(trace_id, 3), "double")


def test_requests_without_traceparent_are_not_sampled_at_rate_0(server, collector):
    before = len(collector.spans)
    client = httpclient.InferenceServerClient(server.http_url)
    client.infer("double", [_input(httpclient, "IN", np.ones((1, 2), np.float32))])
    time.sleep(0.5)
    assert len(collector.spans) == before


def test_ensemble_steps_are_child_spans(server, collector):
    trace_id, traceparent = _traceparent()
    client = httpclient.InferenceServerClient(server.http_url)
    x = np.ones((1, 2), np.float32)
    result = client.infer("twice", [_input(httpclient, "X", x)], headers={"traceparent": traceparent})
    np.testing.assert_array_equal(result.as_numpy("Y"), x * 4)
    spans = collector.trace(trace_id, 6)
    assert _tree(spans) == {"InferRequest": ["twice"], "twice": ["double", "double"], "double": ["compute", "compute"]}
    steps = [s for s in spans if s.name == "double"]
    assert all(s.trace_id.hex() == trace_id for s in spans)
    assert len({s.span_id for s in steps}) == 2


def test_decoupled_model_has_a_first_response_span(server, collector):
    trace_id, traceparent = _traceparent()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    got = []
    client.start_stream(callback=lambda result, error: got.append(error or result), headers={"traceparent": traceparent})
    values = grpcclient.InferInput("IN", [3], "INT32")
    values.set_data_from_numpy(np.array([4, 5, 6], np.int32))
    client.async_stream_infer("repeat", [values], enable_empty_final_response=True)
    deadline = time.monotonic() + 10
    while len(got) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    client.stop_stream()
    spans = collector.trace(trace_id, 4)
    assert _tree(spans) == {"InferRequest": ["repeat"], "repeat": ["compute", "first_response"]}
    first = next(s for s in spans if s.name == "first_response")
    model = next(s for s in spans if s.name == "repeat")
    assert model.start_time_unix_nano <= first.end_time_unix_nano <= model.end_time_unix_nano


# -- settings --------------------------------------------------------------------------------------------------
def test_settings_get_and_update(server):
    client = httpclient.InferenceServerClient(server.http_url)
    settings = client.get_trace_settings()
    assert settings["trace_level"] == ["TIMESTAMPS"] and settings["trace_rate"] == "0"
    assert settings["trace_mode"] == "opentelemetry" and settings["bsp_schedule_delay"] == "50"
    assert "trace_file" not in settings and "log_frequency" not in settings
    # a model's setting: what it names, the global one for the rest (also after a global change)
    updated = client.update_trace_settings(model_name="double", settings={"trace_rate": "7"})
    assert updated["trace_rate"] == "7" and updated["trace_count"] == "-1"
    assert client.get_trace_settings()["trace_rate"] == "0"
    client.update_trace_settings(settings={"trace_count": "100"})
    assert client.get_trace_settings(model_name="double")["trace_count"] == "100"
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    over_grpc = grpc.get_trace_settings(model_name="double", as_json=True)["settings"]
    assert over_grpc["trace_rate"]["value"] == ["7"] and over_grpc["trace_level"]["value"] == ["TIMESTAMPS"]
    # null clears: the model reads the global value again, the global one goes back to its start value
    assert client.update_trace_settings(model_name="double", settings={"trace_rate": None})["trace_rate"] == "0"
    assert grpc.update_trace_settings(settings={"trace_count": []}, as_json=True)["settings"]["trace_count"]["value"] \
        == ["-1"]


@pytest.mark.parametrize("body, message", [
    ({"trace_level": ["LOUD"]}, "unknown trace level"),
    ({"trace_level": ["OFF", "TIMESTAMPS"]}, "cannot be combined"),
    ({"trace_level": ["TENSORS"]}, "not supported in opentelemetry mode"),
    ({"trace_rate": "10000000000"}, "out of range"),
    ({"trace_rate": "-1"}, "out of range"),
    ({"trace_count": "many"}, "must be an integer"),
    ({"trace_rate": 5}, "must be a string"),
    ({"trace_file": "elsewhere.json"}, "trace file location can not be updated through network protocol"),
    ({"url": "127.0.0.1:1/v1/traces"}, "can not be updated"),
    ({"sample": "1"}, "unknown trace setting 'sample'"),
])
def test_bad_settings_are_400(server, body, message):
    response = httpx.post(f"{server.base_url}/v2/models/double/trace/setting", json=body)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]
    if any(type(v) is int for v in body.values()):  # gRPC values are strings: nothing else can be sent
        return
    with pytest.raises(InferenceServerException, match="INVALID_ARGUMENT") as info:
        grpcclient.InferenceServerClient(server.grpc_url).update_trace_settings(model_name="double", settings=body)
    assert message in str(info.value)


def test_unknown_model_and_bad_body(server):
    response = httpx.get(f"{server.base_url}/v2/models/nowhere/trace/setting")
    assert response.status_code == 400 and "Request for unknown model : nowhere" in response.json()["error"]
    response = httpx.post(f"{server.base_url}/v2/trace/setting", content=b"[1, 2]")
    assert response.status_code == 400 and "JSON object" in response.json()["error"]


# -- triton mode: the JSON trace file --------------------------------------------------------------------------
def test_triton_mode_trace_file(tmp_path):
    repo = _repository(tmp_path)
    trace_file = tmp_path / "trace.json"
    running = start_server([repo], "--frontend-workers", "1", "--trace-config", "level=TIMESTAMPS",
                           "--trace-config", "rate=2", "--trace-config", f"triton,file={trace_file}",
                           "--trace-config", "triton,log-frequency=1", tmp_dir=tmp_path)
    try:
        client = httpclient.InferenceServerClient(running.http_url)
        settings = client.get_trace_settings()
        assert settings == {"trace_level": ["TIMESTAMPS"], "trace_rate": "2", "trace_count": "-1",
                            "trace_mode": "triton", "trace_file": str(trace_file), "log_frequency": "1"}
        for _ in range(4):  # rate 2: every second request is traced
            client.infer("double", [_input(httpclient, "IN", np.ones((1, 2), np.float32))], request_id="r")
        deadline = time.monotonic() + 10
        while not (tmp_path / "trace.json.1").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not (tmp_path / "trace.json.2").exists()
        entries = json.loads((tmp_path / "trace.json.0").read_text())
        head, stamps = entries
        assert head["model_name"] == "double" and head["model_version"] == 1 and head["request_id"] == "r"
        names = [t["name"] for t in stamps["timestamps"]]
        assert names == ["REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_END", "REQUEST_END"]
        ns = [t["ns"] for t in stamps["timestamps"]]
        assert ns == sorted(ns)
        # an ensemble's steps name it as their parent
        client.update_trace_settings(settings={"trace_rate": "1"})
        client.infer("twice", [_input(httpclient, "X", np.ones((1, 2), np.float32))])
        while not (tmp_path / "trace.json.2").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        entries = json.loads((tmp_path / "trace.json.2").read_text())
        heads = [e for e in entries if "model_name" in e]
        ensemble = next(h for h in heads if h["model_name"] == "twice")
        assert sorted(h.get("parent_id") for h in heads if h["model_name"] == "double") == [ensemble["id"]] * 2
        # level TENSORS: the inputs as queued and the outputs as the backend gave them
        client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS", "TENSORS"]})
        client.infer("double", [_input(httpclient, "IN", np.array([[1.5, 2]], np.float32))])
        while not (tmp_path / "trace.json.3").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        entries = json.loads((tmp_path / "trace.json.3").read_text())
        tensors = {e["activity"]: e["tensor"] for e in entries if "activity" in e}
        assert tensors["TENSOR_QUEUE_INPUT"] == {"name": "IN", "data": "1.5,2.0", "shape": "1,2", "dtype": "FP32"}
        assert tensors["TENSOR_BACKEND_OUTPUT"]["data"] == "3.0,4.0"
    finally:
        running.stop()
