"""The KServe v2 gRPC frontend, driven by the real tritonclient (sync and aio) against an
in-process server whose asyncio loop runs in a background thread.

Models come from a toy backend registered programmatically, so these tests do not depend on
the Python backend or on ``tests/models``.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from support import free_port
from grpc_health.v1 import health_pb2, health_pb2_grpc
from in_process import InProcessServer
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException
from toy_backends import instance_backend

from tideserve.app import ServerOptions
from tideserve.backend import BackendRegistry, ModelInstance
from tideserve.errors import InvalidArgument
from tideserve.repository import ControlMode
from tideserve.types import InferenceResponse, Tensor

pytestmark = pytest.mark.timeout(60)

# request id -> set when the toy backend sees the request cancelled
CANCELLED: dict[str, threading.Event] = {}


def _cancelled(request_id: str) -> threading.Event:
    return CANCELLED.setdefault(request_id, threading.Event())


# request id -> set when the toy identity model starts on the request
STARTED: dict[str, threading.Event] = {}


def _started(request_id: str) -> threading.Event:
    return STARTED.setdefault(request_id, threading.Event())


# -- the toy backend ------------------------------------------------------------------------------
class ToyInstance(ModelInstance):
    def execute(self, requests):
        kind = self.model.ctx.parameter("kind")
        if kind == "identity":
            return [self._identity(r) for r in requests]
        if kind == "add_sub":
            return [self._add_sub(r) for r in requests]
        for request in requests:  # decoupled kinds answer from their own threads
            threading.Thread(target=getattr(self, f"_{kind}"), args=(request,), daemon=True).start()
        return None

    def _identity(self, request):
        params = request.parameters
        if params.get("fail"):
            raise RuntimeError("toy model failure on request")
        sleep_ms = params.get("sleep_ms", 0)
        _started(request.id).set()
        deadline = time.monotonic() + sleep_ms / 1000
        while time.monotonic() < deadline:
            if request.is_cancelled():
                _cancelled(request.id).set()
                break
            time.sleep(0.005)
        tensor = request.inputs["INPUT0"]
        out = Tensor("OUTPUT0", tensor.datatype, tensor.shape, tensor.data)
        echoed = dict(params)
        echoed["priority"] = request.priority
        echoed["timeout_us"] = request.timeout_us
        return InferenceResponse(outputs=[out], parameters=echoed)

    def _add_sub(self, request):
        a = request.inputs["INPUT0"].data
        b = request.inputs["INPUT1"].data
        return InferenceResponse(outputs=[Tensor.from_numpy("OUTPUT0", a + b), Tensor.from_numpy("OUTPUT1", a - b)])

    def _repeat(self, request):
        sender = request.response_sender
        count = int(request.inputs["IN"].data.reshape(-1)[0])
        delay = request.parameters.get("delay_ms", 0) / 1000
        if count < 0:
            sender.send_error(InvalidArgument(f"repeat count must be >= 0, got {count}"))
            return
        final_with_last = bool(request.parameters.get("final_with_last"))
        for i in range(count):
            time.sleep(delay)
            last = final_with_last and i == count - 1
            sender.send(InferenceResponse(outputs=[Tensor.from_numpy("OUT", np.array([i], np.int32))]), final=last)
        if not final_with_last or count == 0:
            sender.send(None, final=True)

    def _endless(self, request):
        sender = request.response_sender
        i = 0
        while not request.is_cancelled():
            sender.send(InferenceResponse(outputs=[Tensor.from_numpy("OUT", np.array([i], np.int32))]))
            i += 1
            time.sleep(0.02)
        _cancelled(request.id).set()
        sender.send(None, final=True)


ToyBackend = instance_backend(ToyInstance)


def _config(name, kind, inputs, outputs, max_batch_size=0, decoupled=False, instances=1, extra=""):
    def tensors(items):
        return ", ".join(f'{{ name: "{n}" data_type: {t} dims: {d} {rest}}}' for n, t, d, rest in items)

    text = f"""
name: "{name}"
backend: "toy"
max_batch_size: {max_batch_size}
input [ {tensors(inputs)} ]
output [ {tensors(outputs)} ]
instance_group [ {{ count: {instances} kind: KIND_CPU }} ]
parameters {{ key: "kind" value: {{ string_value: "{kind}" }} }}
{extra}
"""
    if decoupled:
        text += "model_transaction_policy { decoupled: true }\n"
    return text


DTYPES = {"FP32": "TYPE_FP32", "FP16": "TYPE_FP16", "FP64": "TYPE_FP64", "INT8": "TYPE_INT8", "INT32": "TYPE_INT32",
          "INT64": "TYPE_INT64", "UINT16": "TYPE_UINT16", "UINT64": "TYPE_UINT64", "BOOL": "TYPE_BOOL",
          "BYTES": "TYPE_STRING"}

ADD_SUB = _config("add_sub", "add_sub", [("INPUT0", "TYPE_FP32", "[ 4 ]", ""), ("INPUT1", "TYPE_FP32", "[ 4 ]", "")],
                  [("OUTPUT0", "TYPE_FP32", "[ 4 ]", 'label_filename: "labels.txt" '),
                   ("OUTPUT1", "TYPE_FP32", "[ 4 ]", "")], max_batch_size=8)


def _write_repository(root):
    models = {"add_sub": ADD_SUB, "reloadable": ADD_SUB.replace('"add_sub"', '"reloadable"', 1)}
    for dt, config_type in DTYPES.items():
        name = f"identity_{dt.lower()}"
        models[name] = _config(name, "identity", [("INPUT0", config_type, "[ -1 ]", "")],
                               [("OUTPUT0", config_type, "[ -1 ]", "")], instances=2)
    models["repeat"] = _config("repeat", "repeat", [("IN", "TYPE_INT32", "[ 1 ]", "")],
                               [("OUT", "TYPE_INT32", "[ 1 ]", "")], decoupled=True)
    models["endless"] = _config("endless", "endless", [("IN", "TYPE_INT32", "[ 1 ]", "")],
                                [("OUT", "TYPE_INT32", "[ 1 ]", "")], decoupled=True)
    for name, text in models.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(text)
    (root / "add_sub" / "labels.txt").write_text("a\nb\nc\nd\n")


@pytest.fixture(scope="module")
def tideserve(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpc_repo")
    _write_repository(root)
    registry = BackendRegistry()
    registry.register("toy", ToyBackend)
    options = ServerOptions(model_repositories=[root], grpc_port=free_port(), allow_http=False, allow_metrics=False,
                            model_control_mode=ControlMode.EXPLICIT, load_models=["*"], exit_timeout_secs=2)
    running = InProcessServer(options, registry)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(tideserve):
    with grpcclient.InferenceServerClient(tideserve.grpc_url) as c:
        yield c


@pytest.fixture(scope="module")
def stub(tideserve):
    channel = grpc.insecure_channel(tideserve.grpc_url, options=[("grpc.max_receive_message_length", 2**31 - 1),
                                                                  ("grpc.max_send_message_length", 2**31 - 1)])
    yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
    channel.close()


def tideserve_stub(server):
    return service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(server.grpc_url))


def _input(name, array, datatype=None):
    array = np.asarray(array)
    tensor = grpcclient.InferInput(name, list(array.shape), datatype or grpcclient.np_to_triton_dtype(array.dtype))
    tensor.set_data_from_numpy(array)
    return tensor


def _add_sub_inputs(batch=1):
    a = np.arange(4 * batch, dtype=np.float32).reshape(batch, 4)
    b = np.ones((batch, 4), dtype=np.float32)
    return a, b, [_input("INPUT0", a), _input("INPUT1", b)]


def _assert_serving(client):
    a, b, inputs = _add_sub_inputs()
    result = client.infer("add_sub", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)


# -- health and metadata ----------------------------------------------------------------------------
def test_live_ready_and_server_metadata(client):
    assert client.is_server_live()
    assert client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta.name == "tideserve"
    assert meta.version
    assert "binary_tensor_data" in meta.extensions
    assert "statistics" in meta.extensions


def test_model_ready_and_metadata(client):
    assert client.is_model_ready("add_sub")
    assert client.is_model_ready("add_sub", "1")
    assert not client.is_model_ready("add_sub", "2")
    assert not client.is_model_ready("no_such_model")

    meta = client.get_model_metadata("add_sub", as_json=True)
    assert meta["name"] == "add_sub"
    assert meta["versions"] == ["1"]
    assert meta["platform"] == "toy"
    assert meta["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": ["-1", "4"]},
                              {"name": "INPUT1", "datatype": "FP32", "shape": ["-1", "4"]}]
    assert [o["name"] for o in meta["outputs"]] == ["OUTPUT0", "OUTPUT1"]
    assert client.get_model_metadata("identity_bytes").inputs[0].datatype == "BYTES"

    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("no_such_model")
    assert info.value.status() == "StatusCode.NOT_FOUND"
    assert "no_such_model" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("add_sub", "7")
    assert info.value.status() == "StatusCode.NOT_FOUND"


def test_model_config(client):
    config = client.get_model_config("add_sub").config
    assert config.name == "add_sub"
    assert config.max_batch_size == 8
    assert config.backend == "toy"
    assert [i.name for i in config.input] == ["INPUT0", "INPUT1"]
    as_json = client.get_model_config("repeat", as_json=True)
    assert as_json["config"]["model_transaction_policy"]["decoupled"] is True
    with pytest.raises(InferenceServerException) as info:
        client.get_model_config("no_such_model")
    assert info.value.status() == "StatusCode.NOT_FOUND"


def test_statistics(client):
    _assert_serving(client)
    stats = client.get_inference_statistics("add_sub")
    assert len(stats.model_stats) == 1
    entry = stats.model_stats[0]
    assert entry.name == "add_sub" and entry.version == "1"
    assert entry.inference_stats.success.count >= 1
    assert entry.inference_stats.success.ns > 0
    everything = client.get_inference_statistics(as_json=True)
    assert {"add_sub", "repeat", "identity_fp32"} <= {m["name"] for m in everything["model_stats"]}
    assert len(client.get_inference_statistics("add_sub", "1").model_stats) == 1
    with pytest.raises(InferenceServerException) as info:
        client.get_inference_statistics("no_such_model")
    assert info.value.status() == "StatusCode.NOT_FOUND"


def test_health_service(tideserve):
    with grpc.insecure_channel(tideserve.grpc_url) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "inference.GRPCInferenceService"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()


# -- repository -------------------------------------------------------------------------------------
def test_repository_index(client):
    index = client.get_model_repository_index(as_json=True)["models"]
    by_name = {m["name"]: m for m in index}
    assert by_name["add_sub"]["state"] == "READY"
    assert by_name["add_sub"]["version"] == "1"
    assert {"repeat", "endless", "identity_fp32", "reloadable"} <= set(by_name)


def test_load_unload_explicit(client, tideserve):
    name = "reloadable"
    assert client.is_model_ready(name)
    client.unload_model(name, unload_dependents=True)  # a plain model has no steps: only itself goes
    assert client.is_model_ready("add_sub")
    assert not client.is_model_ready(name)
    rows = {m.name: m for m in client.get_model_repository_index().models}
    assert rows[name].state == "UNAVAILABLE"
    ready_only = tideserve_stub(tideserve).RepositoryIndex(pb.RepositoryIndexRequest(ready=True), timeout=5)
    assert name not in {m.name for m in ready_only.models}
    assert "add_sub" in {m.name for m in ready_only.models}
    _, _, inputs = _add_sub_inputs()
    with pytest.raises(InferenceServerException) as info:
        client.infer(name, inputs)
    assert info.value.status() in ("StatusCode.UNAVAILABLE", "StatusCode.NOT_FOUND")

    # load with a config override: the override replaces config.pbtxt
    override = client.get_model_config("add_sub", as_json=True)["config"]
    override["name"] = name
    override["max_batch_size"] = 2
    client.load_model(name, config=json.dumps(override))
    assert client.is_model_ready(name)
    assert client.get_model_config(name).config.max_batch_size == 2
    _, _, inputs = _add_sub_inputs(batch=3)
    with pytest.raises(InferenceServerException) as info:
        client.infer(name, inputs)
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"

    client.load_model(name)  # back to config.pbtxt
    assert client.get_model_config(name).config.max_batch_size == 8
    a, b, inputs = _add_sub_inputs(batch=3)
    np.testing.assert_array_equal(client.infer(name, inputs).as_numpy("OUTPUT1"), a - b)


def test_load_errors(client):
    with pytest.raises(InferenceServerException) as info:
        client.load_model("missing_model_dir")
    assert info.value.status() == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException) as info:
        client.load_model("reloadable", config="{not json")
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException) as info:
        client.load_model("reloadable", config="{}", files={"file:1/model.bin": b"x"})
    assert info.value.status() == "StatusCode.UNIMPLEMENTED"
    with pytest.raises(InferenceServerException) as info:
        client.load_model("../escape")
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException) as info:
        client.unload_model("never_seen_model")
    assert info.value.status() == "StatusCode.NOT_FOUND"
    assert client.is_server_ready()  # a load of an unknown name leaves nothing behind
    assert client.is_model_ready("reloadable")  # a failed reload keeps the loaded version serving


# -- ModelInfer ---------------------------------------------------------------------------------------
SAMPLES = {
    "FP32": np.array([1.5, -2.0, 3.25], np.float32),
    "FP16": np.array([1.5, -2.0], np.float16),
    "FP64": np.array([1e300, -2.5], np.float64),
    "INT8": np.array([-128, 0, 127], np.int8),
    "INT32": np.array([-(2**31), 7], np.int32),
    "INT64": np.array([2**40, -(2**62), 0], np.int64),
    "UINT16": np.array([0, 65535], np.uint16),
    "UINT64": np.array([2**64 - 1, 3], np.uint64),
    "BOOL": np.array([True, False, True, True]),
    "BYTES": np.array([b"hello", b"", "w\u00f6rld".encode(), b"\x00\xff"], dtype=np.object_),
}


@pytest.mark.parametrize("datatype", list(SAMPLES))
def test_infer_raw_contents(client, datatype):
    data = SAMPLES[datatype]
    result = client.infer(f"identity_{datatype.lower()}", [_input("INPUT0", data, datatype)])
    out = result.as_numpy("OUTPUT0")
    assert result.get_output("OUTPUT0").datatype == datatype
    assert out.shape == data.shape
    if datatype == "BYTES":
        assert list(out) == list(data)
    else:
        assert out.dtype == data.dtype
        np.testing.assert_array_equal(out, data)


TYPED = {
    "FP32": ("fp32_contents", [1.5, -2.0, 3.25]),
    "FP64": ("fp64_contents", [1e300, -2.5]),
    "INT8": ("int_contents", [-128, 0, 127]),
    "INT32": ("int_contents", [-(2**31), 7]),
    "INT64": ("int64_contents", [2**40, -(2**62), 0]),
    "UINT16": ("uint_contents", [0, 65535]),
    "UINT64": ("uint64_contents", [2**64 - 1, 3]),
    "BOOL": ("bool_contents", [True, False, True]),
    "BYTES": ("bytes_contents", [b"hello", b"", b"\x00\xff"]),
}


def _typed_request(model, datatype, field, values, shape=None, name="INPUT0"):
    request = pb.ModelInferRequest(model_name=model, id="typed")
    tensor = request.inputs.add(name=name, datatype=datatype, shape=[len(values)] if shape is None else shape)
    getattr(tensor.contents, field).extend(values)
    return request


@pytest.mark.parametrize("datatype", list(TYPED))
def test_infer_typed_contents(stub, datatype):
    field, values = TYPED[datatype]
    response = stub.ModelInfer(_typed_request(f"identity_{datatype.lower()}", datatype, field, values), timeout=10)
    assert response.id == "typed"
    assert response.model_name == f"identity_{datatype.lower()}"
    assert response.model_version == "1"
    assert len(response.raw_output_contents) == 1  # outputs always come back raw
    out = grpcclient.InferResult(response).as_numpy("OUTPUT0")
    if datatype == "BYTES":
        assert list(out) == values
    else:
        np.testing.assert_array_equal(out, np.array(values, dtype=SAMPLES[datatype].dtype))


def test_infer_add_sub_batched_and_request_id(client):
    a, b, inputs = _add_sub_inputs(batch=3)
    result = client.infer("add_sub", inputs, request_id="req-42")
    response = result.get_response()
    assert response.id == "req-42"
    assert response.model_name == "add_sub"
    assert response.model_version == "1"
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    assert result.as_numpy("OUTPUT0").shape == (3, 4)


def test_requested_outputs(client):
    a, b, inputs = _add_sub_inputs(batch=2)
    result = client.infer("add_sub", inputs, outputs=[grpcclient.InferRequestedOutput("OUTPUT1")])
    assert [o.name for o in result.get_response().outputs] == ["OUTPUT1"]
    assert len(result.get_response().raw_output_contents) == 1
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    assert result.as_numpy("OUTPUT0") is None
    with pytest.raises(InferenceServerException) as info:
        client.infer("add_sub", inputs, outputs=[grpcclient.InferRequestedOutput("NOPE")])
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "NOPE" in info.value.message()


def test_classification(client):
    a = np.array([[0.5, 3.0, 1.0, 2.0], [4.0, 0.0, 1.0, 0.0]], np.float32)
    b = np.zeros((2, 4), np.float32)
    outputs = [grpcclient.InferRequestedOutput("OUTPUT0", class_count=2), grpcclient.InferRequestedOutput("OUTPUT1")]
    result = client.infer("add_sub", [_input("INPUT0", a), _input("INPUT1", b)], outputs=outputs)
    classes = result.as_numpy("OUTPUT0")
    assert classes.shape == (2, 2)
    assert [x.decode() for x in classes[0]] == ["3.000000:1:b", "2.000000:3:d"]
    assert [x.decode() for x in classes[1]] == ["4.000000:0:a", "1.000000:2:c"]
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a)


def test_request_parameters(client):
    result = client.infer("identity_fp32", [_input("INPUT0", SAMPLES["FP32"])], priority=3, timeout=250000,
                          parameters={"text": "hi", "count": 7, "flag": True, "ratio": 0.5},
                          sequence_id=11, sequence_start=True)
    params = {k: grpcclient.service_pb2.InferParameter.WhichOneof(v, "parameter_choice")
              for k, v in result.get_response().parameters.items()}
    values = {k: getattr(v, params[k]) for k, v in result.get_response().parameters.items()}
    assert values["text"] == "hi"
    assert values["count"] == 7 and params["count"] == "int64_param"
    assert values["flag"] is True and params["flag"] == "bool_param"
    assert values["ratio"] == 0.5 and params["ratio"] == "double_param"
    assert values["priority"] == 3
    assert values["timeout_us"] == 250000
    assert values["sequence_id"] == 11 and values["sequence_start"] is True
    assert "triton_final_response" not in values  # unary responses carry no stream flags


def test_large_message(client):
    data = np.random.default_rng(0).random(8 * 1024 * 1024, dtype=np.float32)  # 32 MiB each way
    result = client.infer("identity_fp32", [_input("INPUT0", data)])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data)


def test_decoupled_model_rejected_on_unary(client):
    with pytest.raises(InferenceServerException) as info:
        client.infer("repeat", [_input("IN", np.array([2], np.int32))])
    assert info.value.status() == "StatusCode.UNIMPLEMENTED"
    assert "stream" in info.value.message()


def test_backend_failure_is_reported(client):
    with pytest.raises(InferenceServerException) as info:
        client.infer("identity_fp32", [_input("INPUT0", SAMPLES["FP32"])], parameters={"fail": True})
    assert info.value.status() == "StatusCode.INTERNAL"
    assert "toy model failure" in info.value.message()
    _assert_serving(client)


def test_unknown_model_and_version(client):
    with pytest.raises(InferenceServerException) as info:
        client.infer("no_such_model", [_input("INPUT0", SAMPLES["FP32"])])
    assert info.value.status() == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException) as info:
        client.infer("identity_fp32", [_input("INPUT0", SAMPLES["FP32"])], model_version="9")
    assert info.value.status() == "StatusCode.NOT_FOUND"


def test_unary_deadline_cancels_the_request(client):
    request_id = "deadline-1"
    with pytest.raises(InferenceServerException) as info:
        client.infer("identity_fp32", [_input("INPUT0", SAMPLES["FP32"])], request_id=request_id,
                     parameters={"sleep_ms": 5000}, client_timeout=0.3)
    assert info.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert _cancelled(request_id).wait(5), "the backend never saw the cancellation"


# -- bad input ------------------------------------------------------------------------------------------
def _raw_request(model="identity_fp32", name="INPUT0", datatype="FP32", shape=(3,), raw=None):
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name=name, datatype=datatype, shape=list(shape))
    request.raw_input_contents.append(SAMPLES["FP32"].tobytes() if raw is None else raw)
    return request


def _bad_requests():
    cases = {}
    cases["raw size mismatch"] = (_raw_request(raw=b"\x00" * 10), "INPUT0")
    cases["raw size vs shape"] = (_raw_request(shape=(4,)), "INPUT0")
    both = _raw_request()
    both.inputs[0].contents.fp32_contents.extend([1, 2, 3])
    cases["raw and typed"] = (both, "INPUT0")
    cases["wrong datatype"] = (_raw_request(datatype="INT32", raw=np.zeros(3, np.int32).tobytes()), "INPUT0")
    cases["unknown datatype"] = (_raw_request(datatype="FLOAT"), "INPUT0")
    cases["negative dim"] = (_raw_request(shape=(-3,)), "INPUT0")
    cases["overflowing shape"] = (_raw_request(shape=(2**32, 2**32), raw=b""), "INPUT0")
    cases["typed count vs shape"] = (_typed_request("identity_fp32", "FP32", "fp32_contents", [1, 2], shape=[3]),
                                     "INPUT0")
    cases["typed wrong field"] = (_typed_request("identity_fp32", "FP32", "int64_contents", [1, 2, 3]), "INPUT0")
    cases["typed two fields"] = (_typed_request("identity_fp32", "FP32", "fp32_contents", [1, 2, 3]), "INPUT0")
    cases["typed two fields"][0].inputs[0].contents.int64_contents.extend([1, 2, 3])
    cases["typed FP16"] = (_typed_request("identity_fp16", "FP16", "fp32_contents", [1, 2]), "INPUT0")
    no_data = pb.ModelInferRequest(model_name="identity_fp32")
    no_data.inputs.add(name="INPUT0", datatype="FP32", shape=[3])
    cases["no data"] = (no_data, "INPUT0")
    extra_raw = _raw_request()
    extra_raw.raw_input_contents.append(b"\x00" * 12)
    cases["extra raw"] = (extra_raw, "INPUT0")
    cases["truncated bytes"] = (_raw_request("identity_bytes", datatype="BYTES", shape=(1,), raw=b"\x05\x00\x00\x00ab"),
                                "INPUT0")
    cases["bytes count vs shape"] = (_raw_request("identity_bytes", datatype="BYTES", shape=(2,),
                                                  raw=b"\x01\x00\x00\x00a"), "INPUT0")
    duplicate = _raw_request()
    duplicate.inputs.add(name="INPUT0", datatype="FP32", shape=[3])
    duplicate.raw_input_contents.append(SAMPLES["FP32"].tobytes())
    cases["duplicate input"] = (duplicate, "INPUT0")
    cases["shape vs config"] = (_raw_request("add_sub", shape=(1, 3)), "INPUT0")
    cases["unknown input"] = (_raw_request(name="BOGUS"), "BOGUS")
    shm = _raw_request()
    shm.inputs[0].parameters["shared_memory_region"].string_param = "region0"
    cases["shared memory"] = (shm, "INPUT0")
    bad_priority = _raw_request()
    bad_priority.parameters["priority"].string_param = "high"
    cases["priority type"] = (bad_priority, "priority")
    reserved = _raw_request()
    reserved.parameters["triton_something"].bool_param = True
    cases["reserved parameter"] = (reserved, "triton_")
    bad_class = _raw_request()
    bad_class.outputs.add(name="OUTPUT0").parameters["classification"].string_param = "two"
    cases["classification type"] = (bad_class, "OUTPUT0")
    return cases


BAD = _bad_requests()


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_invalid_argument(stub, client, case):
    request, named = BAD[case]
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert named in info.value.details()
    # the same request on a stream: an error message, and the stream stays usable
    results = _run_stream(client, [("bad", request), ("good", _raw_request())])
    assert named in results["bad"][0][1]
    assert results["good"][0][1] is None
    _assert_serving(client)


def test_duplicate_requested_outputs_are_rejected(client):
    """A request that names the same output twice is refused with INVALID_ARGUMENT, as Triton words it."""
    _, _, inputs = _add_sub_inputs()
    outputs = [grpcclient.InferRequestedOutput("OUTPUT0"), grpcclient.InferRequestedOutput("OUTPUT0")]
    with pytest.raises(InferenceServerException) as info:
        client.infer("add_sub", inputs, outputs=outputs)
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "output 'OUTPUT0' already exists in request" in info.value.message()
    _assert_serving(client)


def test_repeated_requests_of_one_form(stub, client):
    """Requests of one form (same model, inputs, outputs; any id and data) are read from their bytes after the
    first (codec.decode_request_bytes): every answer is still its own request's, on ModelInfer and on the stream,
    interleaved with other forms, and a request of that form with data of the wrong size is refused as before."""
    rng = np.random.default_rng(7)
    for i in range(20):
        batch = 1 + i % 3  # three forms, interleaved
        a = rng.standard_normal((batch, 4)).astype(np.float32)
        b = rng.standard_normal((batch, 4)).astype(np.float32)
        outputs = [grpcclient.InferRequestedOutput("OUTPUT0"), grpcclient.InferRequestedOutput("OUTPUT1")]
        result = client.infer("add_sub", [_input("INPUT0", a), _input("INPUT1", b)], outputs=outputs,
                              request_id=f"form-{i}" if i % 2 else "")
        assert result.get_response().id == (f"form-{i}" if i % 2 else "")
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    good = _raw_request()
    assert stub.ModelInfer(good, timeout=10).raw_output_contents[0] == SAMPLES["FP32"].tobytes()
    wrong = _raw_request(raw=b"\x00" * 16)  # the same form, one element too many
    for _ in range(2):
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(wrong, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "INPUT0" in info.value.details()
    samples = [rng.standard_normal(3).astype(np.float32) for _ in range(10)]
    requests = [(f"s{i}", _raw_request(raw=sample.tobytes())) for i, sample in enumerate(samples)]
    results = _run_stream(client, requests + [("bad", wrong)])
    for i, sample in enumerate(samples):
        (response, error), = results[f"s{i}"]
        assert error is None
        assert np.frombuffer(response.raw_output_contents[0], np.float32).tolist() == sample.tolist()
    assert "INPUT0" in results["bad"][0][1]
    # two forms that differ only in triton_enable_empty_final_response, interleaved: each keeps its own answer
    collector = StreamCollector()
    client.start_stream(callback=collector)
    try:
        for i in range(6):
            empty_final = i % 2 == 0
            client.async_stream_infer("repeat", [_input("IN", np.array([1], np.int32))], request_id=f"e{i}",
                                      enable_empty_final_response=empty_final)
            items = collector.take(2 if empty_final else 1)
            assert [e for _, e in items] == [None] * len(items)
            assert [_final(r) for r, _ in items] == ([False, True] if empty_final else [False])
            assert {r.get_response().id for r, _ in items} == {f"e{i}"}
    finally:
        client.stop_stream()


def test_unparsable_request_bytes_are_internal(tideserve, client):
    """ModelInfer and ModelStreamInfer read the request's bytes themselves: bytes that are no ModelInferRequest
    end the call with INTERNAL "Exception deserializing request!" (grpcio's answer when it parsed them), and the server goes on
    serving."""
    garbage = b"\x0a\xff\xff\xff"  # model_name (1) whose length runs past the message
    with grpc.insecure_channel(tideserve.grpc_url) as channel:
        unary = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as info:
            unary(garbage, timeout=10)
        assert info.value.code() == grpc.StatusCode.INTERNAL, info.value.details()
        assert info.value.details() == "Exception deserializing request!"
        stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
        with pytest.raises(grpc.RpcError) as info:
            list(stream(iter([garbage]), timeout=10))
        assert info.value.code() == grpc.StatusCode.INTERNAL, info.value.details()
        assert info.value.details() == "Exception deserializing request!"
        # the answers as bytes parse to the messages tritonclient reads
        request = _raw_request()
        answer = pb.ModelInferResponse.FromString(unary(request.SerializeToString(), timeout=10))
        assert [o.name for o in answer.outputs] == ["OUTPUT0"] and answer.model_name == "identity_fp32"
        assert answer.raw_output_contents == [SAMPLES["FP32"].tobytes()]
        streamed = [pb.ModelStreamInferResponse.FromString(m) for m in stream(iter([request.SerializeToString()]),
                                                                              timeout=10)]
        assert len(streamed) == 1 and not streamed[0].error_message
        assert streamed[0].infer_response.parameters["triton_final_response"].bool_param is True
        assert streamed[0].infer_response.raw_output_contents == answer.raw_output_contents
    _assert_serving(client)


# -- ModelStreamInfer -----------------------------------------------------------------------------------
class StreamCollector:
    def __init__(self) -> None:
        self.items: queue.Queue = queue.Queue()

    def __call__(self, result, error):
        self.items.put((result, error))

    def get(self, timeout=10):
        return self.items.get(timeout=timeout)

    def take(self, count, timeout=10):
        return [self.get(timeout) for _ in range(count)]


def _final(result) -> bool | None:
    params = result.get_response().parameters
    return params["triton_final_response"].bool_param if "triton_final_response" in params else None


def _run_stream(client, requests, expect=None, timeout=10):
    """Send raw ModelInferRequests on one stream; {key: [(response, error message)]} per request id."""
    responses = []
    done = threading.Event()
    expect = expect or len(requests)

    def requests_iter():
        for key, request in requests:
            request = pb.ModelInferRequest.FromString(request.SerializeToString())
            request.id = key
            yield request
        done.wait(timeout)

    call = client._client_stub.ModelStreamInfer(requests_iter(), timeout=timeout)
    results: dict[str, list] = {}
    try:
        for message in call:
            responses.append(message)
            results.setdefault(message.infer_response.id, []).append(
                (message.infer_response, message.error_message or None))
            if len(responses) >= expect:
                break
    finally:
        done.set()
        call.cancel()
    return results


def test_stream_decoupled_responses(client):
    collector = StreamCollector()
    client.start_stream(callback=collector)
    try:
        client.async_stream_infer("repeat", [_input("IN", np.array([3], np.int32))], request_id="r1")
        items = collector.take(3)
        assert [e for _, e in items] == [None] * 3
        assert [int(r.as_numpy("OUT")[0]) for r, _ in items] == [0, 1, 2]
        assert [r.get_response().id for r, _ in items] == ["r1"] * 3
        assert [_final(r) for r, _ in items] == [False, False, False]  # the bare FINAL flag is not sent
        time.sleep(0.2)
        assert collector.items.empty()

        client.async_stream_infer("repeat", [_input("IN", np.array([2], np.int32))], request_id="r2",
                                  enable_empty_final_response=True)
        items = collector.take(3)
        assert [_final(r) for r, _ in items] == [False, False, True]
        empty = items[2][0].get_response()
        assert empty.id == "r2" and empty.model_name == "repeat" and not empty.outputs

        client.async_stream_infer("repeat", [_input("IN", np.array([2], np.int32))], request_id="r3",
                                  parameters={"final_with_last": True}, enable_empty_final_response=True)
        items = collector.take(2)
        assert [_final(r) for r, _ in items] == [False, True]
        assert int(items[1][0].as_numpy("OUT")[0]) == 1

        client.async_stream_infer("repeat", [_input("IN", np.array([0], np.int32))], request_id="r4",
                                  enable_empty_final_response=True)
        (result, error), = collector.take(1)
        assert error is None and _final(result) is True and result.get_response().id == "r4"

        # a non-decoupled model on the stream: one response, marked final
        client.async_stream_infer("identity_fp32", [_input("INPUT0", SAMPLES["FP32"])], request_id="r5")
        (result, error), = collector.take(1)
        assert error is None and _final(result) is True
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), SAMPLES["FP32"])
    finally:
        client.stop_stream()


def test_stream_requests_run_concurrently(client):
    collector = StreamCollector()
    client.start_stream(callback=collector)
    try:
        client.async_stream_infer("identity_fp32", [_input("INPUT0", SAMPLES["FP32"])], request_id="slow",
                                  parameters={"sleep_ms": 800})
        client.async_stream_infer("identity_fp32", [_input("INPUT0", SAMPLES["FP32"])], request_id="fast")
        client.async_stream_infer("repeat", [_input("IN", np.array([2], np.int32))], request_id="rep",
                                  parameters={"delay_ms": 50})
        order = [r.get_response().id for r, _ in collector.take(4)]
        # the decoupled model's responses come as they are made, while 'slow' still runs; the responses of
        # models that are not decoupled are written in request order, as Triton's stream handler writes them
        assert order == ["rep", "rep", "slow", "fast"], order
    finally:
        client.stop_stream()


def test_stream_errors_keep_the_stream_open(client):
    collector = StreamCollector()
    client.start_stream(callback=collector)
    try:
        client.async_stream_infer("identity_fp32", [_input("INPUT0", np.zeros(2, np.int32))], request_id="e1")
        result, error = collector.get()
        assert result is None and "INPUT0" in error.message()
        client.async_stream_infer("no_such_model", [_input("INPUT0", SAMPLES["FP32"])], request_id="e2")
        result, error = collector.get()
        assert "no_such_model" in error.message()
        client.async_stream_infer("repeat", [_input("IN", np.array([-1], np.int32))], request_id="e3")
        result, error = collector.get()
        assert "repeat count must be >= 0" in error.message()
        client.async_stream_infer("identity_fp32", [_input("INPUT0", SAMPLES["FP32"])], request_id="e4",
                                  parameters={"fail": True})
        result, error = collector.get()
        assert "toy model failure" in error.message()
        client.async_stream_infer("repeat", [_input("IN", np.array([1], np.int32))], request_id="ok")
        result, error = collector.get()
        assert error is None and result.get_response().id == "ok"
    finally:
        client.stop_stream()


def test_stream_error_messages_carry_request_ids(client):
    request = _raw_request(datatype="INT32", raw=np.zeros(3, np.int32).tobytes())
    failing = _raw_request()
    failing.parameters["fail"].bool_param = True
    results = _run_stream(client, [("bad", request), ("boom", failing)])
    bad, = results["bad"]
    assert "INPUT0" in bad[1] and bad[0].id == "bad"
    boom, = results["boom"]
    assert boom[0].model_name == "identity_fp32"
    assert boom[0].parameters["triton_final_response"].bool_param is True


def test_stream_cancellation_reaches_the_backend(client):
    collector = StreamCollector()
    client.start_stream(callback=collector)
    try:
        client.async_stream_infer("endless", [_input("IN", np.array([0], np.int32))], request_id="cancel-me")
        client.async_stream_infer("endless", [_input("IN", np.array([0], np.int32))], request_id="cancel-me-too")
        collector.take(4)  # both are streaming
    finally:
        client.stop_stream(cancel_requests=True)
    assert _cancelled("cancel-me").wait(5), "the backend never saw the cancellation"
    assert _cancelled("cancel-me-too").wait(5)
    _assert_serving(client)


def test_stop_stream_with_cancel_gets_only_the_clients_cancellation(tideserve):
    """Triton's L0_backend_vllm request_cancellation, on a model that still answers the request it was
    cancelled from: the callback receives the client's CANCELLED once and nothing from the server."""
    received: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(tideserve.grpc_url) as client:
        client.start_stream(callback=lambda result, error: received.put((result, error)))
        client.async_stream_infer("identity_fp32", [_input("INPUT0", SAMPLES["FP32"])], request_id="cancel-unary",
                                  parameters={"sleep_ms": 30000})
        assert _started("cancel-unary").wait(10), "the model never started the request"
        client.stop_stream(cancel_requests=True)
        assert _cancelled("cancel-unary").wait(5), "the model never saw the cancellation"
        items = [received.get_nowait() for _ in range(received.qsize())]
        assert len(items) == 1, items
        result, error = items[0]
        assert result is None and error.status() == "StatusCode.CANCELLED"
        _assert_serving(client)


def test_stream_triton_grpc_error_mode(client):
    collector = StreamCollector()
    client.start_stream(callback=collector, headers={"triton_grpc_error": "true"})
    try:
        client.async_stream_infer("identity_fp32", [_input("INPUT0", np.zeros(2, np.int32))], request_id="g1")
        result, error = collector.get()
        assert result is None
        assert error.status() == "StatusCode.INVALID_ARGUMENT"
        assert "INPUT0" in error.message()
    finally:
        client.stop_stream()
    collector = StreamCollector()
    client.start_stream(callback=collector, headers={"triton_grpc_error": "true"})
    try:
        client.async_stream_infer("endless", [_input("IN", np.array([0], np.int32))], request_id="grpc-err-endless")
        client.async_stream_infer("repeat", [_input("IN", np.array([-1], np.int32))], request_id="g2")
        while True:
            result, error = collector.get()
            if error is not None:
                break
        assert error.status() == "StatusCode.INVALID_ARGUMENT"
        assert "repeat count" in error.message()
    finally:
        client.stop_stream()
    assert _cancelled("grpc-err-endless").wait(5)  # the failed call cancelled its other requests
    _assert_serving(client)


# -- the asyncio client ---------------------------------------------------------------------------------
async def test_aio_client(tideserve):
    async with aioclient.InferenceServerClient(tideserve.grpc_url) as client:
        assert await client.is_server_live()
        assert await client.is_server_ready()
        assert await client.is_model_ready("add_sub")
        meta = await client.get_model_metadata("add_sub")
        assert meta.name == "add_sub"

        a = np.arange(8, dtype=np.float32).reshape(2, 4)
        inputs = [aioclient.InferInput("INPUT0", [2, 4], "FP32"), aioclient.InferInput("INPUT1", [2, 4], "FP32")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(a)
        results = await asyncio.gather(*(client.infer("add_sub", inputs) for _ in range(20)))
        for result in results:
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a * 2)

        with pytest.raises(InferenceServerException) as info:
            await client.infer("no_such_model", inputs)
        assert info.value.status() == "StatusCode.NOT_FOUND"

        async def requests():
            for count in (2, 3):
                tensor = aioclient.InferInput("IN", [1], "INT32")
                tensor.set_data_from_numpy(np.array([count], np.int32))
                yield {"model_name": "repeat", "inputs": [tensor], "request_id": f"aio-{count}",
                       "parameters": {"final_with_last": True}}

        seen: dict[str, list] = {}
        finals = 0
        async for result, error in client.stream_infer(requests()):
            assert error is None
            response = result.get_response()
            seen.setdefault(response.id, []).append(int(result.as_numpy("OUT")[0]))
            if response.parameters["triton_final_response"].bool_param:
                finals += 1
                if finals == 2:
                    break
        assert seen == {"aio-2": [0, 1], "aio-3": [0, 1, 2]}


# -- shared memory, trace and log settings ----------------------------------------------------------------
def test_shared_memory_trace_and_log_rpcs(client):
    assert len(client.get_system_shared_memory_status().regions) == 0
    assert len(client.get_cuda_shared_memory_status().regions) == 0
    with pytest.raises(InferenceServerException, match="Unable to open shared memory region: '/key'") as info:
        client.register_system_shared_memory("region", "/key", 64)  # no such object under /dev/shm
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    client.unregister_system_shared_memory()
    client.unregister_cuda_shared_memory()

    trace = client.get_trace_settings(as_json=True)
    assert trace["settings"]["trace_level"]["value"] == ["OFF"]
    updated = client.update_trace_settings(settings={"trace_rate": "500"}, as_json=True)  # tests/e2e/test_tracing.py
    assert updated["settings"]["trace_rate"]["value"] == ["500"]
    client.update_trace_settings(settings={"trace_rate": []})  # cleared: back to the start-up value

    settings = client.get_log_settings(as_json=True)["settings"]
    assert {"log_info", "log_warning", "log_error", "log_verbose_level"} <= set(settings)
    verbose = settings["log_verbose_level"].get("uint32_param", 0)
    updated = client.update_log_settings({"log_verbose_level": verbose}, as_json=True)
    assert updated["settings"]["log_verbose_level"].get("uint32_param", 0) == verbose
    with pytest.raises(InferenceServerException) as info:
        client.update_log_settings({"no_such_setting": True})
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"


def test_stream_many_interleaved_requests(client):
    collector = StreamCollector()
    client.start_stream(callback=collector)
    try:
        for i in range(30):
            client.async_stream_infer("repeat", [_input("IN", np.array([3], np.int32))], request_id=f"m{i}",
                                      parameters={"final_with_last": True, "delay_ms": 2})
        seen: dict[str, list] = {}
        finals = 0
        while finals < 30:
            result, error = collector.get()
            assert error is None
            response = result.get_response()
            seen.setdefault(response.id, []).append(int(result.as_numpy("OUT")[0]))
            finals += _final(result)
        assert seen == {f"m{i}": [0, 1, 2] for i in range(30)}
    finally:
        client.stop_stream()


# -- shutdown ------------------------------------------------------------------------------------------
def test_shutdown_with_an_open_stream(tmp_path):
    _write_repository(tmp_path)
    registry = BackendRegistry()
    registry.register("toy", ToyBackend)
    options = ServerOptions(model_repositories=[tmp_path], grpc_port=free_port(), allow_http=False, allow_metrics=False,
                            model_control_mode=ControlMode.EXPLICIT, load_models=["endless", "add_sub"],
                            exit_timeout_secs=0.5)
    running = InProcessServer(options, registry)
    collector = StreamCollector()
    client = grpcclient.InferenceServerClient(running.grpc_url)
    try:
        client.start_stream(callback=collector)
        client.async_stream_infer("endless", [_input("IN", np.array([0], np.int32))], request_id="at-shutdown")
        collector.take(2)
        started = time.monotonic()
        running.stop()
        assert time.monotonic() - started < 10
        assert _cancelled("at-shutdown").wait(5), "the in-flight request was never cancelled"
        while True:  # the stream ends with an error once the server is gone
            _, error = collector.get()
            if error is not None:
                break
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
