"""The KServe v2 / Triton HTTP frontend, end to end.

A real tideserve ``Server`` (repository, DataPlane, uvicorn) runs on 127.0.0.1 in a background
thread with toy backends registered programmatically; the real ``tritonclient.http`` and
``tritonclient.http.aio`` clients talk to it, and ``http.client`` sends the malformed requests
a well-behaved client never would.
"""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import struct
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient
from support import free_port
from in_process import InProcessServer
from tritonclient.utils import InferenceServerException
from toy_backends import instance_backend

from tideserve.app import ServerOptions
from tideserve.backend import BackendRegistry, ModelInstance
from tideserve.errors import InvalidArgument
from tideserve.repository import ControlMode
from tideserve.types import InferenceResponse, Tensor

MAX_INPUT = 256 * 1024  # the test servers' --http-max-input-size


# -- toy backends ------------------------------------------------------------------------------
class AddSubInstance(ModelInstance):
    """OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1 (one response per request)."""

    def execute(self, requests):
        responses = []
        for request in requests:
            a = request.inputs["INPUT0"].data
            b = request.inputs["INPUT1"].data
            responses.append(InferenceResponse(outputs=[Tensor.from_numpy("OUTPUT0", a + b),
                                                        Tensor.from_numpy("OUTPUT1", a - b)]))
        return responses


class IdentityInstance(ModelInstance):
    """Every input IN_<X> comes back as OUT_<X>; request parameters come back as response parameters."""

    def execute(self, requests):
        responses = []
        for request in requests:
            outputs = [Tensor("OUT_" + name[3:], t.datatype, tuple(t.data.shape), t.data)
                       for name, t in request.inputs.items()]
            params = dict(request.parameters)
            params["priority"] = request.priority
            params["timeout_us"] = request.timeout_us
            responses.append(InferenceResponse(outputs=outputs, parameters=params))
        return responses


class ScaleInstance(ModelInstance):
    """OUTPUT = 2 * INPUT (one FP32 input: the raw binary request and classification model)."""

    def execute(self, requests):
        return [InferenceResponse(outputs=[Tensor.from_numpy("OUTPUT", r.inputs["INPUT"].data * 2)])
                for r in requests]


class FailInstance(ModelInstance):
    """Answers with an error response, or raises, depending on the input value."""

    def execute(self, requests):
        responses = []
        for request in requests:
            value = int(request.inputs["IN"].data.ravel()[0])
            if value == 0:
                responses.append(InferenceResponse(error=InvalidArgument("toy model rejects the value 0")))
            elif value == 1:
                raise RuntimeError("toy model crashed")
            else:
                responses.append(InferenceResponse(outputs=[Tensor.from_numpy("OUT", request.inputs["IN"].data)]))
        return responses


class RepeatInstance(ModelInstance):
    """Decoupled: sends IN[0] responses, then the final flag."""

    def execute(self, requests):
        for request in requests:
            sender = request.response_sender
            for i in range(int(request.inputs["IN"].data.ravel()[0])):
                sender.send(InferenceResponse(outputs=[Tensor.from_numpy("OUT", np.array([i], np.int32))]))
            sender.send(None, final=True)


CANCELLED: list[str] = []  # ids of the requests the slow model saw cancelled


class SlowInstance(ModelInstance):
    """Takes up to IN[0] milliseconds, stopping early (and noting it) when the request is cancelled."""

    def execute(self, requests):
        request = requests[0]
        deadline = time.monotonic() + int(request.inputs["IN"].data.ravel()[0]) / 1000
        while time.monotonic() < deadline:
            if request.is_cancelled():
                CANCELLED.append(request.id)
                break
            time.sleep(0.005)
        return [InferenceResponse(outputs=[Tensor.from_numpy("OUT", request.inputs["IN"].data)])]


_INSTANCES = {"slow": SlowInstance, "add_sub": AddSubInstance, "identity": IdentityInstance, "scale": ScaleInstance,
              "one_string": IdentityInstance,
              "fail": FailInstance, "repeat": RepeatInstance}


ToyBackend = instance_backend(_INSTANCES)


def _param(key: str, value: str) -> str:
    return f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'


_IDENTITY_TYPES = ["FP32", "FP64", "FP16", "INT64", "INT32", "UINT8", "BOOL", "BYTES"]

CONFIGS = {
    "add_sub": """
backend: "toy"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
        { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
         { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
dynamic_batching { max_queue_delay_microseconds: 100 }
""",
    "identity": "backend: \"toy\"\nmax_batch_size: 0\n" + "".join(
        f'input {{ name: "IN_{t}" data_type: TYPE_{"STRING" if t == "BYTES" else t} dims: [ -1 ] optional: true }}\n'
        f'output {{ name: "OUT_{t}" data_type: TYPE_{"STRING" if t == "BYTES" else t} dims: [ -1 ] }}\n'
        for t in _IDENTITY_TYPES),
    "scale": """
backend: "toy"
max_batch_size: 4
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ -1 ] label_filename: "labels.txt" } ]
""",
    "one_string": """
backend: "toy"
max_batch_size: 0
input [ { name: "IN_BYTES" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "OUT_BYTES" data_type: TYPE_STRING dims: [ 1 ] } ]
""",
    "fail": """
backend: "toy"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
""",
    "slow": """
backend: "toy"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
""",
    "repeat": """
backend: "toy"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
""",
}


def write_repository(root: Path) -> Path:
    for name, text in CONFIGS.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(text)
    (root / "scale" / "labels.txt").write_text("zero\none\ntwo\nthree\n")
    (root / "add_sub" / "2").mkdir()  # a second version: latest policy serves only 2
    return root


# -- the server in a background thread ------------------------------------------------------
def start_server(repo: Path, mode: ControlMode = ControlMode.NONE, load: list[str] | None = None) -> InProcessServer:
    registry = BackendRegistry()
    registry.register("toy", ToyBackend)
    options = ServerOptions(model_repositories=[repo], http_port=free_port(), allow_grpc=False, allow_metrics=False,
                            model_control_mode=mode, load_models=load or [], exit_timeout_secs=2,
                            http_max_input_size=MAX_INPUT)
    return InProcessServer(options, registry)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    return write_repository(tmp_path_factory.mktemp("http_repo"))


@pytest.fixture(scope="module")
def srv(repo):
    server = start_server(repo)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv):
    with httpclient.InferenceServerClient(srv.http_url) as c:
        yield c


def raw(srv, method: str, path: str, body=None, headers: dict | None = None, chunked: bool = False):
    """One HTTP request exactly as given: (status, headers, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=30)
    try:
        if chunked:
            conn.request(method, path, body=iter(body), headers=headers or {}, encode_chunked=True)
        else:
            conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def post_json(srv, path: str, doc, headers: dict | None = None):
    body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    return raw(srv, "POST", path, body, {"Content-Type": "application/json", **(headers or {})})


def error_of(body: bytes) -> str:
    doc = json.loads(body)
    assert set(doc) == {"error"}, doc
    return doc["error"]


def fp32_input(name: str, data, shape=None, binary: bool = False) -> dict:
    doc = {"name": name, "datatype": "FP32", "shape": shape or [1, 4]}
    if binary:
        doc["parameters"] = {"binary_data_size": binary}
    else:
        doc["data"] = data
    return doc


GOOD_INPUTS = [fp32_input("INPUT0", [1, 2, 3, 4]), fp32_input("INPUT1", [1, 1, 1, 1])]


# -- health and metadata ----------------------------------------------------------------------
def test_health(srv, client):
    assert client.is_server_live()
    assert client.is_server_ready()
    status, _, body = raw(srv, "GET", "/v2/health/live")
    assert status == 200 and body == b""
    status, _, _ = raw(srv, "GET", "/v2/health/ready")
    assert status == 200


def test_server_metadata(client):
    meta = client.get_server_metadata()
    assert meta["name"] == "tideserve"
    assert meta["version"]
    assert "binary_tensor_data" in meta["extensions"] and "model_repository" in meta["extensions"]


def test_model_metadata(client):
    meta = client.get_model_metadata("add_sub")
    assert meta["name"] == "add_sub"
    assert meta["versions"] == ["2"]
    assert meta["platform"] == "toy"
    assert meta["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 4]},
                              {"name": "INPUT1", "datatype": "FP32", "shape": [-1, 4]}]
    assert [o["name"] for o in meta["outputs"]] == ["OUTPUT0", "OUTPUT1"]
    assert client.get_model_metadata("add_sub", "2")["name"] == "add_sub"
    identity = client.get_model_metadata("identity")
    assert {"name": "IN_BYTES", "datatype": "BYTES", "shape": [-1]} in identity["inputs"]


def test_metadata_errors(srv, client):
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("nope")
    assert info.value.status() == "404" and "nope" in info.value.message()
    status, headers, body = raw(srv, "GET", "/v2/models/add_sub/versions/7")
    assert status == 404 and "7" in error_of(body)
    assert headers["content-type"] == "application/json"
    status, _, body = raw(srv, "GET", "/v2/models/add_sub/versions/x1")
    assert status == 400 and "x1" in error_of(body)
    status, _, body = raw(srv, "GET", "/v2/models/nope/config")
    assert status == 404 and "nope" in error_of(body)


def test_model_config(client):
    config = client.get_model_config("add_sub")
    assert config["name"] == "add_sub"
    assert config["backend"] == "toy"
    assert config["max_batch_size"] == 8
    assert config["input"][0] == {**config["input"][0], "name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]}
    assert "dynamic_batching" in config
    assert config["instance_group"][0]["kind"] == "KIND_CPU"
    assert client.get_model_config("add_sub", "2")["name"] == "add_sub"


def test_model_ready(srv, client):
    assert client.is_model_ready("add_sub")
    assert client.is_model_ready("add_sub", "2")
    assert not client.is_model_ready("add_sub", "1")  # not selected by the version policy
    assert not client.is_model_ready("nope")
    status, _, body = raw(srv, "GET", "/v2/models/nope/ready")
    assert status == 400 and "nope" in error_of(body)


# -- inference --------------------------------------------------------------------------------
def _add_sub_inputs(binary: bool, rows: int = 1):
    a = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
    b = np.full((rows, 4), 0.5, np.float32)
    inputs = [httpclient.InferInput("INPUT0", [rows, 4], "FP32"), httpclient.InferInput("INPUT1", [rows, 4], "FP32")]
    inputs[0].set_data_from_numpy(a, binary_data=binary)
    inputs[1].set_data_from_numpy(b, binary_data=binary)
    return inputs, a, b


@pytest.mark.parametrize("binary_in", [True, False])
@pytest.mark.parametrize("binary_out", [True, False])
def test_infer_add_sub(client, binary_in, binary_out):
    inputs, a, b = _add_sub_inputs(binary_in, rows=3)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary_out),
               httpclient.InferRequestedOutput("OUTPUT1", binary_data=binary_out)]
    result = client.infer("add_sub", inputs, outputs=outputs, request_id="req-7")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    response = result.get_response()
    assert response["id"] == "req-7"
    assert response["model_name"] == "add_sub" and response["model_version"] == "2"
    out0 = result.get_output("OUTPUT0")
    assert out0["datatype"] == "FP32" and out0["shape"] == [3, 4]
    if binary_out:
        assert out0["parameters"]["binary_data_size"] == 48 and "data" not in out0
    else:
        assert out0["data"] == (a + b).ravel().tolist()


def test_infer_all_outputs_binary_by_default(client):
    inputs, a, b = _add_sub_inputs(True)
    result = client.infer("add_sub", inputs, model_version="2")  # no outputs: binary_data_output=true
    assert {o["name"] for o in result.get_response()["outputs"]} == {"OUTPUT0", "OUTPUT1"}
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    assert "binary_data_size" in result.get_output("OUTPUT0")["parameters"]


def test_infer_requested_output_subset(client):
    inputs, a, b = _add_sub_inputs(False)
    result = client.infer("add_sub", inputs, outputs=[httpclient.InferRequestedOutput("OUTPUT1", binary_data=False)])
    assert [o["name"] for o in result.get_response()["outputs"]] == ["OUTPUT1"]
    assert result.as_numpy("OUTPUT0") is None
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


def test_duplicate_requested_outputs_are_rejected(client):
    """A request that names the same output twice is refused with 400, in Triton's words (its core refuses it
    for every protocol)."""
    inputs, _, _ = _add_sub_inputs(False)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0"), httpclient.InferRequestedOutput("OUTPUT0")]
    with pytest.raises(InferenceServerException) as info:
        client.infer("add_sub", inputs, outputs=outputs)
    assert info.value.status() == "400"
    assert "output 'OUTPUT0' already exists in request" in info.value.message()
    assert client.infer("add_sub", inputs).as_numpy("OUTPUT0") is not None


def test_infer_json_only_wire_format(srv):
    """A plain JSON request (nested data) and a JSON response, no binary extension involved."""
    status, headers, body = post_json(srv, "/v2/models/add_sub/infer", {
        "id": "j1", "inputs": [fp32_input("INPUT0", [[1, 2, 3, 4], [5, 6, 7, 8]], [2, 4]),
                               fp32_input("INPUT1", [1.5] * 8, [2, 4])],
        "outputs": [{"name": "OUTPUT0"}]})
    assert status == 200, body
    assert headers["content-type"] == "application/json"
    assert "inference-header-content-length" not in {k.lower() for k in headers}
    doc = json.loads(body)
    assert doc["id"] == "j1"
    assert doc["outputs"] == [{"name": "OUTPUT0", "datatype": "FP32", "shape": [2, 4],
                               "data": [2.5, 3.5, 4.5, 5.5, 6.5, 7.5, 8.5, 9.5]}]


def test_infer_binary_wire_format(srv):
    """The binary extension by hand: header length, octet-stream and the order of the buffers."""
    a = np.arange(4, dtype=np.float32)
    header = json.dumps({"inputs": [fp32_input("INPUT0", None, [1, 4], binary=16),
                                    fp32_input("INPUT1", [1, 1, 1, 1])],
                         "outputs": [{"name": "OUTPUT1", "parameters": {"binary_data": True}},
                                     {"name": "OUTPUT0"}]}).encode()
    status, headers, body = raw(srv, "POST", "/v2/models/add_sub/infer", header + a.tobytes(),
                                {"Inference-Header-Content-Length": str(len(header))})
    assert status == 200, body
    headers = {k.lower(): v for k, v in headers.items()}
    assert headers["content-type"] == "application/octet-stream"
    json_len = int(headers["inference-header-content-length"])
    doc = json.loads(body[:json_len])
    by_name = {o["name"]: o for o in doc["outputs"]}
    assert by_name["OUTPUT1"]["parameters"] == {"binary_data_size": 16}
    assert by_name["OUTPUT0"]["data"] == [1, 2, 3, 4]
    np.testing.assert_array_equal(np.frombuffer(body[json_len:], np.float32), a - 1)


def _identity_inputs(binary: bool):
    arrays = {
        "FP32": np.array([1.5, -2.25, 3e10], np.float32),
        "FP64": np.array([1e-300, 2.5], np.float64),
        "FP16": np.array([0.5, -1.0], np.float16),
        "INT64": np.array([-(2 ** 62), 0, 2 ** 62], np.int64),
        "INT32": np.array([-7, 7], np.int32),
        "UINT8": np.array([0, 255], np.uint8),
        "BOOL": np.array([True, False, True]),
        "BYTES": np.array([b"hello", b"", "\u00e9t\u00e9".encode()], dtype=np.object_),
    }
    inputs = []
    for datatype, array in arrays.items():
        tensor = httpclient.InferInput(f"IN_{datatype}", list(array.shape), datatype)
        tensor.set_data_from_numpy(array, binary_data=binary)
        inputs.append(tensor)
    return inputs, arrays


@pytest.mark.parametrize("binary", [True, False])
def test_infer_datatypes(client, binary):
    inputs, arrays = _identity_inputs(binary)
    outputs = [httpclient.InferRequestedOutput(f"OUT_{t}", binary_data=binary) for t in arrays]
    result = client.infer("identity", inputs, outputs=outputs)
    for datatype, array in arrays.items():
        got = result.as_numpy(f"OUT_{datatype}")
        assert result.get_output(f"OUT_{datatype}")["datatype"] == datatype
        if datatype == "BYTES":
            assert [x.encode() if isinstance(x, str) else bytes(x) for x in got] == list(array)
        else:
            assert got.dtype == array.dtype
            np.testing.assert_array_equal(got, array)


def test_infer_bytes_binary_not_utf8(client):
    data = np.array([b"\xff\xfe\x00binary", b"x" * 300], dtype=np.object_)
    tensor = httpclient.InferInput("IN_BYTES", [2], "BYTES")
    tensor.set_data_from_numpy(data)
    result = client.infer("identity", [tensor], outputs=[httpclient.InferRequestedOutput("OUT_BYTES")])
    assert list(result.as_numpy("OUT_BYTES")) == list(data)
    # the same output cannot be returned as JSON text
    with pytest.raises(InferenceServerException) as info:
        client.infer("identity", [tensor], outputs=[httpclient.InferRequestedOutput("OUT_BYTES", binary_data=False)])
    assert info.value.status() == "400" and "OUT_BYTES" in info.value.message()


def test_infer_empty_tensor(client):
    tensor = httpclient.InferInput("IN_FP32", [0], "FP32")
    tensor.set_data_from_numpy(np.zeros(0, np.float32))
    result = client.infer("identity", [tensor])
    assert result.as_numpy("OUT_FP32").shape == (0,)


def test_infer_parameters_and_id(client):
    inputs, _ = _identity_inputs(True)
    result = client.infer("identity", inputs[:1], request_id="abc", priority=3, timeout=1500,
                          parameters={"custom": "value", "count": 4, "flag": True, "ratio": 0.5})
    response = result.get_response()
    assert response["id"] == "abc"
    assert response["parameters"] == {"custom": "value", "count": 4, "flag": True, "ratio": 0.5,
                                      "priority": 3, "timeout_us": 1500}


def test_infer_sequence_parameters_pass_through(client):
    inputs, _ = _identity_inputs(True)
    result = client.infer("identity", inputs[:1], sequence_id=42, sequence_start=True)
    params = result.get_response()["parameters"]
    assert params["sequence_id"] == 42 and params["sequence_start"] is True and params["sequence_end"] is False


def test_infer_with_version_and_compression(client):
    rows = 8
    a = np.random.default_rng(0).random((rows, 4), dtype=np.float32)
    inputs = [httpclient.InferInput("INPUT0", [rows, 4], "FP32"), httpclient.InferInput("INPUT1", [rows, 4], "FP32")]
    inputs[0].set_data_from_numpy(a, binary_data=False)  # JSON output big enough to be compressed
    inputs[1].set_data_from_numpy(a, binary_data=True)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=False),
               httpclient.InferRequestedOutput("OUTPUT1", binary_data=True)]
    for algorithm in ("gzip", "deflate"):
        result = client.infer("add_sub", inputs, model_version="2", outputs=outputs,
                              request_compression_algorithm=algorithm, response_compression_algorithm=algorithm)
        np.testing.assert_allclose(result.as_numpy("OUTPUT0"), a + a)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), np.zeros_like(a))


def test_response_compression_headers(srv):
    doc = {"inputs": [{"name": "IN_INT64", "datatype": "INT64", "shape": [500], "data": list(range(500))}]}
    status, headers, body = post_json(srv, "/v2/models/identity/infer", doc, {"Accept-Encoding": "deflate;q=0.5, gzip"})
    assert status == 200 and headers["content-encoding"] == "gzip"
    assert json.loads(gzip.decompress(body))["outputs"][0]["data"] == list(range(500))
    status, headers, body = post_json(srv, "/v2/models/identity/infer", doc, {"Accept-Encoding": "identity"})
    assert status == 200 and "content-encoding" not in {k.lower() for k in headers}


def test_raw_binary_request(srv):
    """Inference-Header-Content-Length: 0: the body is the only input's data, outputs come back binary."""
    data = np.array([1, 2, 3], np.float32)
    status, headers, body = raw(srv, "POST", "/v2/models/scale/infer", data.tobytes(),
                                {"Inference-Header-Content-Length": "0"})
    assert status == 200, body
    headers = {k.lower(): v for k, v in headers.items()}
    json_len = int(headers["inference-header-content-length"])
    doc = json.loads(body[:json_len])
    assert doc["outputs"][0]["shape"] == [1, 3]
    np.testing.assert_array_equal(np.frombuffer(body[json_len:], np.float32), data * 2)


def test_raw_binary_request_for_a_bytes_input_is_its_one_element(srv):
    """As in Triton: the body is the element itself (no length prefix), for a BYTES input of shape [1] only; the
    errors in Triton's words (its L0_http http_test.py checks them)."""
    status, headers, body = raw(srv, "POST", "/v2/models/one_string/infer", b"427",
                                {"Inference-Header-Content-Length": "0"})
    assert status == 200, body
    json_len = int({k.lower(): v for k, v in headers.items()}["inference-header-content-length"])
    assert body[json_len:] == b"\x03\x00\x00\x00427"
    cases = [("identity", "Raw request must only have 1 input (found 1) to be deduced but got "),
             ("add_sub", "Raw request must only have 1 input (found 1) to be deduced but got 2 inputs in 'add_sub'")]
    for model, text in cases:
        status, _, body = raw(srv, "POST", f"/v2/models/{model}/infer", b"427", {"Inference-Header-Content-Length": "0"})
        assert status == 400 and text in json.loads(body)["error"], body


def test_classification(client):
    tensor = httpclient.InferInput("INPUT", [2, 4], "FP32")
    tensor.set_data_from_numpy(np.array([[0.1, 0.7, 0.2, 0.0], [3, 1, 2, 4]], np.float32))
    result = client.infer("scale", [tensor], outputs=[httpclient.InferRequestedOutput("OUTPUT", class_count=2)])
    output = result.get_output("OUTPUT")
    assert output["datatype"] == "BYTES" and output["shape"] == [2, 2]
    classes = [[x.decode() for x in row] for row in result.as_numpy("OUTPUT")]
    assert classes == [["1.400000:1:one", "0.400000:2:two"], ["8.000000:3:three", "6.000000:0:zero"]]


async def test_aio_client(srv):
    async with aiohttpclient.InferenceServerClient(srv.http_url) as client:
        assert await client.is_server_live()
        assert await client.is_server_ready()
        assert await client.is_model_ready("add_sub")
        assert (await client.get_model_metadata("add_sub"))["name"] == "add_sub"
        assert (await client.get_model_config("add_sub"))["max_batch_size"] == 8
        a = np.arange(8, dtype=np.float32).reshape(2, 4)
        inputs = [aiohttpclient.InferInput("INPUT0", [2, 4], "FP32"), aiohttpclient.InferInput("INPUT1", [2, 4], "FP32")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(a, binary_data=False)
        results = await asyncio.gather(*(client.infer("add_sub", inputs, request_id=str(i)) for i in range(16)))
        for i, result in enumerate(results):
            assert result.get_response()["id"] == str(i)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + a)
        with pytest.raises(InferenceServerException) as info:
            await client.infer("nope", inputs)
        assert info.value.status() == "404"
        stats = await client.get_inference_statistics("add_sub")
        assert stats["model_stats"][0]["name"] == "add_sub"


def test_model_errors(srv, client):
    tensor = httpclient.InferInput("IN", [1], "INT32")
    for value, status, text in ((0, "400", "rejects the value 0"), (1, "500", "toy model crashed")):
        tensor.set_data_from_numpy(np.array([value], np.int32))
        with pytest.raises(InferenceServerException) as info:
            client.infer("fail", [tensor])
        assert info.value.status() == status and text in info.value.message()
    tensor.set_data_from_numpy(np.array([5], np.int32))
    assert client.infer("fail", [tensor]).as_numpy("OUT")[0] == 5


def test_decoupled_model(client):
    tensor = httpclient.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([1], np.int32))
    assert client.infer("repeat", [tensor]).as_numpy("OUT")[0] == 0  # exactly one response: fine
    tensor.set_data_from_numpy(np.array([3], np.int32))
    with pytest.raises(InferenceServerException) as info:
        client.infer("repeat", [tensor])
    assert info.value.status() == "501" and "decoupled" in info.value.message()
    tensor.set_data_from_numpy(np.array([0], np.int32))
    with pytest.raises(InferenceServerException) as info:
        client.infer("repeat", [tensor])
    assert "no response" in info.value.message()


def test_client_disconnect_cancels_the_request(srv, client):
    doc = {"id": "gone", "inputs": [{"name": "IN", "datatype": "INT32", "shape": [1], "data": [5000]}]}
    conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=10)
    conn.request("POST", "/v2/models/slow/infer", json.dumps(doc).encode(), {"Content-Type": "application/json"})
    time.sleep(0.5)
    conn.close()
    deadline = time.monotonic() + 5
    while "gone" not in CANCELLED and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "gone" in CANCELLED
    # a quick request is not affected, and a slow one whose client waits completes
    tensor = httpclient.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([400], np.int32))
    assert client.infer("slow", [tensor], request_id="kept").as_numpy("OUT")[0] == 400
    assert "kept" not in CANCELLED


# -- statistics -------------------------------------------------------------------------------
def test_statistics(srv, client):
    before = client.get_inference_statistics("scale")["model_stats"][0]
    tensor = httpclient.InferInput("INPUT", [2, 3], "FP32")
    tensor.set_data_from_numpy(np.ones((2, 3), np.float32))
    for _ in range(3):
        client.infer("scale", [tensor])
    stats = client.get_inference_statistics("scale")
    assert list(stats) == ["model_stats"]
    stat = stats["model_stats"][0]
    assert stat["name"] == "scale" and stat["version"] == "1"
    assert stat["inference_stats"]["success"]["count"] == before["inference_stats"]["success"]["count"] + 3
    assert stat["inference_count"] == before["inference_count"] + 6
    assert stat["last_inference"] > 0
    versioned = client.get_inference_statistics("scale", "1")["model_stats"]
    assert [s["version"] for s in versioned] == ["1"]
    everything = client.get_inference_statistics()["model_stats"]
    assert {"add_sub", "identity", "scale"} <= {s["name"] for s in everything}
    with pytest.raises(InferenceServerException) as info:
        client.get_inference_statistics("nope")
    assert info.value.status() == "404"
    status, _, body = raw(srv, "GET", "/v2/models/scale/versions/9/stats")
    assert status == 404 and "9" in error_of(body)



@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"])
def test_openai_body_over_the_limit_is_413(srv, path):
    """The OpenAI routes answer a body over --http-max-input-size with 413 in OpenAI's error shape, as Triton's
    OpenAI frontend does (its KServe routes: 400, above), whether the Content-Length says so or the chunks do."""
    payload = b'{"model": "m", "prompt": "' + b"x" * MAX_INPUT + b'"}'
    chunks = [payload[i:i + 65536] for i in range(0, len(payload), 65536)]
    for chunked in (False, True):
        status, _, body = raw(srv, "POST", path, chunks if chunked else payload,
                              {"Content-Type": "application/json"}, chunked=chunked)
        error = json.loads(body)["error"]
        assert status == 413 and error["code"] == 413, (chunked, body)
        assert str(MAX_INPUT) in error["message"] and "--http-max-input-size" in error["message"]
    status, _, body = post_json(srv, path, {"model": "none", "prompt": "x" * 1000})  # within the limit: read, and
    assert status in (400, 404) and "--http-max-input-size" not in body.decode()  # refused for what it says


def test_openai_load_with_a_body_over_the_limit_is_413(explicit):
    status, _, body = raw(explicit, "POST", "/v1/models/scale/load", b" " * (MAX_INPUT + 1))
    assert status == 413 and "--http-max-input-size" in json.loads(body)["error"]["message"]
    status, _, body = raw(explicit, "POST", "/v1/models/scale/load", b"")  # no body: on to the handler
    assert status == 400 and "already loaded" in json.loads(body)["error"]["message"]

# -- model repository -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def explicit(tmp_path_factory):
    repo = write_repository(tmp_path_factory.mktemp("explicit_repo"))
    server = start_server(repo, ControlMode.EXPLICIT, load=["scale"])
    yield server
    server.stop()


def test_repository_index_load_unload(explicit):
    with httpclient.InferenceServerClient(explicit.http_url) as client:
        index = {row["name"]: row for row in client.get_model_repository_index()}
        assert set(index) == set(CONFIGS)
        assert index["scale"]["state"] == "READY" and index["scale"]["version"] == "1"
        assert index["add_sub"]["state"] != "READY"
        status, _, body = post_json(explicit, "/v2/repository/index", {"ready": True})
        assert status == 200 and [row["name"] for row in json.loads(body)] == ["scale"]
        assert not client.is_model_ready("add_sub")

        client.load_model("add_sub")
        assert client.is_model_ready("add_sub")
        inputs, a, b = _add_sub_inputs(True)
        np.testing.assert_array_equal(client.infer("add_sub", inputs).as_numpy("OUTPUT0"), a + b)
        assert {r["name"] for r in client.get_model_repository_index() if r["state"] == "READY"} == {"add_sub", "scale"}

        client.unload_model("add_sub")
        assert not client.is_model_ready("add_sub")
        with pytest.raises(InferenceServerException) as info:
            client.infer("add_sub", inputs)
        assert info.value.status() in ("404", "503")


def test_repository_load_config_override(explicit):
    with httpclient.InferenceServerClient(explicit.http_url) as client:
        config = client.get_model_config("scale")
        config["max_batch_size"] = 2
        config["parameters"] = {"note": {"string_value": "override"}}
        client.load_model("scale", config=json.dumps(config))
        reloaded = client.get_model_config("scale")
        assert reloaded["max_batch_size"] == 2
        assert reloaded["parameters"]["note"]["string_value"] == "override"
        tensor = httpclient.InferInput("INPUT", [3, 1], "FP32")
        tensor.set_data_from_numpy(np.ones((3, 1), np.float32))
        with pytest.raises(InferenceServerException) as info:  # batch 3 > the new max_batch_size
            client.infer("scale", [tensor])
        assert info.value.status() == "400"
        client.load_model("scale")  # back to config.pbtxt
        assert client.get_model_config("scale")["max_batch_size"] == 4


def test_repository_errors(explicit, srv):
    with httpclient.InferenceServerClient(explicit.http_url) as client:
        with pytest.raises(InferenceServerException) as info:
            client.load_model("missing_model")
        assert info.value.status() == "404" and "missing_model" in info.value.message()
        with pytest.raises(InferenceServerException) as info:
            client.load_model("scale", config="{not json")
        assert info.value.status() == "400" and "config" in info.value.message()
        with pytest.raises(InferenceServerException) as info:
            client.unload_model("never_seen")
        assert info.value.status() == "404"
        assert client.is_model_ready("scale")  # a failed reload keeps the old version serving
    for path, doc, text in (
            ("/v2/repository/index", {"ready": "yes"}, "'ready'"),
            ("/v2/repository/index", [1], "object"),
            ("/v2/repository/models/scale/load", {"parameters": {"config": {"name": "scale"}}}, "'config'"),
            ("/v2/repository/models/scale/load", {"parameters": []}, "parameters"),
            ("/v2/repository/models/scale/unload", {"parameters": {"unload_dependents": "no"}}, "unload_dependents"),
            ("/v2/repository/index", b"{bad", "failed to parse"),
            ("/v2/repository/index", b"\xff\xfe", "failed to parse")):
        status, _, body = post_json(explicit, path, doc)
        assert status == 400 and text in error_of(body), (path, doc, body)
    status, _, body = post_json(explicit, "/v2/repository/models/scale/load", {"parameters": {"file:1/model.py": "eA=="}})
    assert status == 501 and "file:1/model.py" in error_of(body)
    status, _, body = post_json(explicit, "/v2/repository/models/..%2F..%2Fetc/load", {})
    assert status in (400, 404) and error_of(body)
    # load / unload need the explicit model control mode: Triton's UNAVAILABLE and words
    status, _, body = post_json(srv, "/v2/repository/models/scale/unload", {})
    assert status == 503 and "explicit model load / unload is not allowed if polling is enabled" in error_of(body)
    status, _, body = post_json(srv, "/v2/repository/index", b"")  # an empty body is allowed
    assert status == 200 and {"add_sub", "scale"} <= {r["name"] for r in json.loads(body)}


# -- bad input --------------------------------------------------------------------------------
def _infer_bad(srv, doc, model: str = "add_sub", headers: dict | None = None):
    return post_json(srv, f"/v2/models/{model}/infer", doc, headers)


BAD_JSON_REQUESTS = [
    # (description, request document or raw bytes, model, expected status, text the error must contain)
    ("malformed json", b'{"inputs": [', "add_sub", 400, "failed to parse"),
    ("empty body", b"", "add_sub", 400, "failed to parse"),
    ("json nested too deep", b"[" * 5000 + b"]" * 5000, "add_sub", 400, "failed to parse"),
    ("nested data in BYTES", {"inputs": [{"name": "IN_BYTES", "datatype": "BYTES", "shape": [2],
                                          "data": [["a"], [["b", "c"]]]}]}, "identity", 400, "'IN_BYTES'"),
    ("not utf-8", b'{"id": "\xff\xfe", "inputs": []}', "add_sub", 400, "UTF-8"),
    ("not an object", [1, 2], "add_sub", 400, "JSON object"),
    ("no inputs", {"id": "x"}, "add_sub", 400, "'inputs'"),
    ("inputs not array", {"inputs": {"name": "INPUT0"}}, "add_sub", 400, "'inputs' must be an array"),
    ("input not object", {"inputs": ["INPUT0"]}, "add_sub", 400, "inputs[0]"),
    ("input without name", {"inputs": [{"datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]},
     "add_sub", 400, "'name'"),
    ("duplicate input", {"inputs": [GOOD_INPUTS[0], GOOD_INPUTS[0]]}, "add_sub", 400, "'INPUT0' appears more"),
    ("datatype not string", {"inputs": [{**GOOD_INPUTS[0], "datatype": 5}, GOOD_INPUTS[1]]}, "add_sub", 400,
     "input 'INPUT0': 'datatype'"),
    ("unknown datatype", {"inputs": [{**GOOD_INPUTS[0], "datatype": "FP128"}, GOOD_INPUTS[1]]}, "add_sub", 400,
     "input 'INPUT0': unknown datatype 'FP128'"),
    ("datatype differs from model", {"inputs": [{**GOOD_INPUTS[0], "datatype": "INT32"}, GOOD_INPUTS[1]]},
     "add_sub", 400, "'INPUT0'"),
    ("shape not array", {"inputs": [{**GOOD_INPUTS[0], "shape": "1,4"}, GOOD_INPUTS[1]]}, "add_sub", 400,
     "input 'INPUT0': 'shape'"),
    ("negative shape", {"inputs": [{**GOOD_INPUTS[0], "shape": [-1, 4]}, GOOD_INPUTS[1]]}, "add_sub", 400,
     "input 'INPUT0': 'shape'"),
    ("float in shape", {"inputs": [{**GOOD_INPUTS[0], "shape": [1.0, 4]}, GOOD_INPUTS[1]]}, "add_sub", 400,
     "input 'INPUT0': 'shape'"),
    ("bool in shape", {"inputs": [{**GOOD_INPUTS[0], "shape": [True, 4]}, GOOD_INPUTS[1]]}, "add_sub", 400,
     "input 'INPUT0': 'shape'"),
    ("shape differs from model", {"inputs": [fp32_input("INPUT0", [1, 2, 3], [1, 3]),
                                             fp32_input("INPUT1", [1, 2, 3], [1, 3])]}, "add_sub", 400, "INPUT0"),
    ("string in FP32 data", {"inputs": [fp32_input("INPUT0", [1, "2", 3, 4]), GOOD_INPUTS[1]]}, "add_sub", 400,
     "input 'INPUT0': FP32 'data' must hold numbers, got string"),
    ("bool in FP32 data", {"inputs": [fp32_input("INPUT0", [1.0, True, 3, 4]), GOOD_INPUTS[1]]}, "add_sub", 400,
     "input 'INPUT0': FP32 'data' must hold numbers, got boolean"),
    ("null in FP32 data", {"inputs": [fp32_input("INPUT0", [1, None, 3, 4]), GOOD_INPUTS[1]]}, "add_sub", 400,
     "got null"),
    ("object in data", {"inputs": [fp32_input("INPUT0", [1, {"v": 2}, 3, 4]), GOOD_INPUTS[1]]}, "add_sub", 400,
     "input 'INPUT0'"),
    ("data not array", {"inputs": [fp32_input("INPUT0", "1,2,3,4"), GOOD_INPUTS[1]]}, "add_sub", 400,
     "input 'INPUT0': 'data' must be an array"),
    ("too few elements", {"inputs": [fp32_input("INPUT0", [1, 2, 3]), GOOD_INPUTS[1]]}, "add_sub", 400,
     "input 'INPUT0': shape [1, 4] needs 4 elements, 'data' holds 3"),
    ("too many nested elements", {"inputs": [fp32_input("INPUT0", [[1, 2], [3, 4, 5]]), GOOD_INPUTS[1]]},
     "add_sub", 400, "input 'INPUT0'"),
    ("too deep", {"inputs": [fp32_input("INPUT0", json.loads("[" * 200 + "1" + "]" * 200)), GOOD_INPUTS[1]]},
     "add_sub", 400, "input 'INPUT0'"),
    ("float in INT64 data", {"inputs": [{"name": "IN_INT64", "datatype": "INT64", "shape": [2], "data": [1, 2.5]}]},
     "identity", 400, "input 'IN_INT64': INT64 'data' must hold integers, got number"),
    ("bool in INT64 data", {"inputs": [{"name": "IN_INT64", "datatype": "INT64", "shape": [2], "data": [1, False]}]},
     "identity", 400, "input 'IN_INT64': INT64 'data' must hold integers, got boolean"),
    ("UINT8 out of range", {"inputs": [{"name": "IN_UINT8", "datatype": "UINT8", "shape": [2], "data": [1, 300]}]},
     "identity", 400, "input 'IN_UINT8'"),
    ("negative UINT8", {"inputs": [{"name": "IN_UINT8", "datatype": "UINT8", "shape": [1], "data": [-1]}]},
     "identity", 400, "input 'IN_UINT8'"),
    ("INT64 overflow", {"inputs": [{"name": "IN_INT64", "datatype": "INT64", "shape": [1], "data": [2 ** 64]}]},
     "identity", 400, "input 'IN_INT64'"),
    ("number in BOOL data", {"inputs": [{"name": "IN_BOOL", "datatype": "BOOL", "shape": [2], "data": [True, 1]}]},
     "identity", 400, "input 'IN_BOOL': BOOL 'data' must hold booleans, got integer"),
    ("number in BYTES data", {"inputs": [{"name": "IN_BYTES", "datatype": "BYTES", "shape": [2], "data": ["a", 1]}]},
     "identity", 400, "input 'IN_BYTES': BYTES 'data' must hold strings, got integer"),
    ("BF16 as JSON", {"inputs": [{"name": "IN_FP32", "datatype": "BF16", "shape": [1], "data": [1.0]}]},
     "identity", 400, "input 'IN_FP32'"),
    ("neither data nor binary", {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4]}, GOOD_INPUTS[1]]},
     "add_sub", 400, "input 'INPUT0' has neither"),
    ("data and binary", {"inputs": [{**GOOD_INPUTS[0], "parameters": {"binary_data_size": 16}}, GOOD_INPUTS[1]]},
     "add_sub", 400, "input 'INPUT0': set either"),
    ("binary size not int", {"inputs": [fp32_input("INPUT0", None, binary="16"), GOOD_INPUTS[1]]},
     "add_sub", 400, "input 'INPUT0': 'binary_data_size'"),
    ("binary without header length", {"inputs": [fp32_input("INPUT0", None, binary=16), GOOD_INPUTS[1]]},
     "add_sub", 400, "input 'INPUT0' has binary data but the request has no Inference-Header-Content-Length"),
    ("input parameters not object", {"inputs": [{**GOOD_INPUTS[0], "parameters": [1]}, GOOD_INPUTS[1]]},
     "add_sub", 400, "input 'INPUT0': 'parameters'"),
    ("shared memory input", {"inputs": [{**GOOD_INPUTS[0], "parameters": {"shared_memory_region": "r"}},
                                        GOOD_INPUTS[1]]}, "add_sub", 400, "input 'INPUT0' must set only one of"),
    ("id not string", {"id": 5, "inputs": GOOD_INPUTS}, "add_sub", 400, "'id'"),
    ("parameters not object", {"parameters": [], "inputs": GOOD_INPUTS}, "add_sub", 400, "'parameters'"),
    ("reserved parameter", {"parameters": {"triton_x": 1}, "inputs": GOOD_INPUTS}, "add_sub", 400, "'triton_x'"),
    ("negative priority", {"parameters": {"priority": -1}, "inputs": GOOD_INPUTS}, "add_sub", 400, "'priority'"),
    ("timeout string", {"parameters": {"timeout": "1s"}, "inputs": GOOD_INPUTS}, "add_sub", 400, "'timeout'"),
    ("binary_data_output not bool", {"parameters": {"binary_data_output": 1}, "inputs": GOOD_INPUTS}, "add_sub",
     400, "'binary_data_output'"),
    ("parameter array value", {"parameters": {"custom": [1]}, "inputs": GOOD_INPUTS}, "add_sub", 400, "'custom'"),
    ("sequence_start not bool", {"parameters": {"sequence_start": 1}, "inputs": GOOD_INPUTS}, "add_sub", 400,
     "'sequence_start'"),
    ("outputs not array", {"inputs": GOOD_INPUTS, "outputs": "OUTPUT0"}, "add_sub", 400, "'outputs'"),
    ("output without name", {"inputs": GOOD_INPUTS, "outputs": [{"parameters": {}}]}, "add_sub", 400, "outputs[0]"),
    ("binary_data not bool", {"inputs": GOOD_INPUTS, "outputs": [{"name": "OUTPUT0", "parameters": {
        "binary_data": "yes"}}]}, "add_sub", 400, "output 'OUTPUT0': 'binary_data'"),
    ("classification not int", {"inputs": GOOD_INPUTS, "outputs": [{"name": "OUTPUT0", "parameters": {
        "classification": -2}}]}, "add_sub", 400, "output 'OUTPUT0': 'classification'"),
    ("unknown output", {"inputs": GOOD_INPUTS, "outputs": [{"name": "OUTPUT9"}]}, "add_sub", 400, "'OUTPUT9'"),
    ("unknown input", {"inputs": GOOD_INPUTS + [fp32_input("INPUT7", [1, 2, 3, 4])]}, "add_sub", 400, "'INPUT7'"),
    ("missing input", {"inputs": GOOD_INPUTS[:1]}, "add_sub", 400, "INPUT1"),
    ("batch too large", {"inputs": [fp32_input("INPUT0", [0] * 36, [9, 4]), fp32_input("INPUT1", [0] * 36, [9, 4])]},
     "add_sub", 400, "batch"),
    ("unknown model", {"inputs": GOOD_INPUTS}, "nope", 404, "nope"),
]


@pytest.mark.parametrize("case", BAD_JSON_REQUESTS, ids=[c[0] for c in BAD_JSON_REQUESTS])
def test_bad_json_requests(srv, case):
    _, doc, model, expected, text = case
    status, headers, body = _infer_bad(srv, doc, model)
    assert status == expected, body
    assert headers["content-type"] == "application/json"
    message = error_of(body)
    assert text in message, message
    assert "Traceback" not in message


def _binary_request(inputs_meta: list[dict], blobs: list[bytes], extra: dict | None = None):
    header = json.dumps({"inputs": inputs_meta, **(extra or {})}).encode()
    return header, header + b"".join(blobs)


def test_bad_binary_requests(srv):
    ones = np.ones(4, np.float32).tobytes()
    path = "/v2/models/add_sub/infer"
    cases = []
    # binary_data_size larger than what is left in the body
    header, body = _binary_request([fp32_input("INPUT0", None, binary=16), fp32_input("INPUT1", None, binary=16)],
                                   [ones, ones[:8]])
    cases.append((body, {"Inference-Header-Content-Length": str(len(header))}, 400,
                  "input 'INPUT1': binary_data_size is 16 bytes but only 8"))
    # binary_data_size inconsistent with the shape
    header, body = _binary_request([fp32_input("INPUT0", None, binary=12), fp32_input("INPUT1", None, binary=16)],
                                   [ones[:12], ones])
    cases.append((body, {"Inference-Header-Content-Length": str(len(header))}, 400,
                  "input 'INPUT0': binary_data_size is 12 bytes, but a FP32 tensor of shape [1, 4] needs 16"))
    # extra bytes no input accounts for
    header, body = _binary_request([fp32_input("INPUT0", None, binary=16), fp32_input("INPUT1", None, binary=16)],
                                   [ones, ones, b"junk"])
    cases.append((body, {"Inference-Header-Content-Length": str(len(header))}, 400, "4 bytes of binary data"))
    # header length past the end of the body, negative, not a number
    header, body = _binary_request(GOOD_INPUTS, [])
    cases.append((body, {"Inference-Header-Content-Length": str(len(body) + 10)}, 400, "Inference-Header-Content-Length"))
    cases.append((body, {"Inference-Header-Content-Length": "-3"}, 400, "Inference-Header-Content-Length"))
    cases.append((body, {"Inference-Header-Content-Length": "ten"}, 400, "Inference-Header-Content-Length"))
    # header length cutting the JSON short
    cases.append((body, {"Inference-Header-Content-Length": str(len(body) - 5)}, 400, "failed to parse"))
    # BYTES element whose length prefix runs past its buffer
    blob = struct.pack("<I", 100) + b"short"
    header, body = _binary_request([{"name": "IN_BYTES", "datatype": "BYTES", "shape": [1],
                                     "parameters": {"binary_data_size": len(blob)}}], [blob])
    cases.append((body, {"Inference-Header-Content-Length": str(len(header))}, 400, "input 'IN_BYTES'"))
    # BYTES element count differing from the shape
    blob = struct.pack("<I", 1) + b"a"
    header, body = _binary_request([{"name": "IN_BYTES", "datatype": "BYTES", "shape": [2],
                                     "parameters": {"binary_data_size": len(blob)}}], [blob])
    cases.append((body, {"Inference-Header-Content-Length": str(len(header))}, 400, "input 'IN_BYTES'"))
    # a raw binary request whose size does not fit the input
    cases.append((b"\x00" * 6, {"Inference-Header-Content-Length": "0"}, 400, "'INPUT'"))
    for index, (body, headers, expected, text) in enumerate(cases):
        target = path
        if b"IN_BYTES" in body:
            target = "/v2/models/identity/infer"
        elif headers.get("Inference-Header-Content-Length") == "0":
            target = "/v2/models/scale/infer"
        status, _, response = raw(srv, "POST", target, body, headers)
        assert status == expected, (index, response)
        assert text in error_of(response), (index, response)


def test_body_size_limits(srv):
    big = {"inputs": [{"name": "IN_UINT8", "datatype": "UINT8", "shape": [MAX_INPUT], "data": [1] * MAX_INPUT}]}
    payload = json.dumps(big).encode()
    # Content-Length over the limit: refused before the body is read
    status, _, body = raw(srv, "POST", "/v2/models/identity/infer", payload)
    assert status == 400 and "exceeds the maximum allowed input size" in error_of(body)
    # no Content-Length (chunked): refused while reading
    chunks = [payload[i:i + 65536] for i in range(0, len(payload), 65536)]
    status, _, body = raw(srv, "POST", "/v2/models/identity/infer", chunks, chunked=True)
    assert status == 400 and "exceeds the maximum allowed input size" in error_of(body)
    # a small gzip body that inflates past the limit
    bomb = gzip.compress(b'{"inputs": [' + b" " * (MAX_INPUT * 2) + b"]}")
    status, _, body = raw(srv, "POST", "/v2/models/identity/infer", bomb, {"Content-Encoding": "gzip"})
    assert status == 400 and "exceeds the maximum allowed input size" in error_of(body)
    # the same limit applies to the repository endpoints
    status, _, body = raw(srv, "POST", "/v2/repository/index", b" " * (MAX_INPUT + 1))
    assert status == 400 and "exceeds the maximum allowed input size" in error_of(body)
    # within the limit, a chunked body is fine
    small = json.dumps({"inputs": GOOD_INPUTS}).encode()
    status, _, body = raw(srv, "POST", "/v2/models/add_sub/infer", [small[:10], small[10:]], chunked=True)
    assert status == 200, body


def test_bad_encodings(srv):
    doc = json.dumps({"inputs": GOOD_INPUTS}).encode()
    status, _, body = raw(srv, "POST", "/v2/models/add_sub/infer", doc, {"Content-Encoding": "br"})
    assert status == 415 and "Content-Encoding 'br'" in error_of(body)
    status, _, body = raw(srv, "POST", "/v2/models/add_sub/infer", b"not gzip", {"Content-Encoding": "gzip"})
    assert status == 400 and "decompress" in error_of(body)
    status, _, body = raw(srv, "POST", "/v2/models/add_sub/infer", zlib.compress(doc)[:-6],
                          {"Content-Encoding": "deflate"})
    assert status == 400 and error_of(body)
    status, _, body = raw(srv, "POST", "/v2/models/add_sub/infer", zlib.compress(doc), {"Content-Encoding": "deflate"})
    assert status == 200, body


def test_routing_errors(srv):
    status, _, body = raw(srv, "GET", "/v2/models/add_sub/infer")
    assert status == 405 and error_of(body)
    status, _, body = raw(srv, "GET", "/v2/nothing/here")
    assert status == 404 and error_of(body)
    status, _, body = raw(srv, "POST", "/v2/models/add_sub/versions/2/infer", json.dumps({"inputs": GOOD_INPUTS}).encode())
    assert status == 200, body
    status, _, body = raw(srv, "POST", "/v2/models/add_sub/versions/1/infer", json.dumps({"inputs": GOOD_INPUTS}).encode())
    assert status == 404 and "1" in error_of(body)
    status, _, body = raw(srv, "POST", "/v2/models/add_sub/versions/one/infer", json.dumps({"inputs": GOOD_INPUTS}).encode())
    assert status == 400 and "one" in error_of(body)
    status, _, body = raw(srv, "POST", "/v2/models/add_sub/versions//infer", b"{}")
    assert status == 404


def test_server_still_serves_after_bad_input(srv, client):
    """Runs last in the module: the bad requests above left the server healthy."""
    assert client.is_server_live() and client.is_server_ready()
    inputs, a, b = _add_sub_inputs(True, rows=2)
    np.testing.assert_array_equal(client.infer("add_sub", inputs).as_numpy("OUTPUT0"), a + b)
    stats = client.get_inference_statistics("add_sub")["model_stats"][0]
    assert stats["inference_stats"]["fail"]["count"] > 0
