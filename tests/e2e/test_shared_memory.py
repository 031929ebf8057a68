"""Triton's system shared memory extension end to end: a real tideserve process, tritonclient's HTTP and gRPC
clients and ``tritonclient.utils.shared_memory`` unchanged (as Triton's qa/L0_shared_memory drives them).

Inputs are read from registered regions and outputs written into them, numbers and BYTES; the bad cases
(unknown region, a region too small, offsets and sizes outside the region, keys that are no POSIX shared
memory name, data given twice) answer 400 / 404 / INVALID_ARGUMENT naming what is wrong; registration falls
under the ``shared-memory`` restricted API group; CUDA shared memory says it is not supported here.
"""

from __future__ import annotations

import base64
import os
import textwrap
import time
import uuid

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from support import start_server
from tritonclient.utils import InferenceServerException, serialize_byte_tensor, serialized_byte_size

SIMPLE = """\
name: "simple"
backend: "python"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
        { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
         { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
parameters { key: "process_isolation" value { string_value: "false" } }
"""
SIMPLE_MODEL = '''\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", a + b),
                                                   pb_utils.Tensor("OUTPUT1", a - b)]))
        return out
'''
ECHO = """\
name: "echo_bytes"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_STRING dims: [ -1 ] } ]
parameters { key: "process_isolation" value { string_value: "false" } }
"""
ECHO_MODEL = '''\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0")
                                                            .as_numpy())]) for r in requests]
'''

# "simple" that holds each request until the test creates <marker_dir>/release (Triton's execute_delayed_model
# sleeps instead); it creates <marker_dir>/started while it holds one
HELD_MODEL = '''\
import json
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.dir = json.loads(args["model_config"])["parameters"]["marker_dir"]["string_value"]

    def execute(self, requests):
        started, release = os.path.join(self.dir, "started"), os.path.join(self.dir, "release")
        open(started, "w").close()
        deadline = time.monotonic() + 30
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.01)
        os.remove(started)
        out = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", a + b),
                                                   pb_utils.Tensor("OUTPUT1", a - b)]))
        return out
'''


def _write(repo, name, config, model):
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(config)
    (repo / name / "1" / "model.py").write_text(textwrap.dedent(model))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shm")
    repo = tmp / "models"
    _write(repo, "simple", SIMPLE, SIMPLE_MODEL)
    _write(repo, "echo_bytes", ECHO, ECHO_MODEL)
    markers = tmp / "markers"
    markers.mkdir()
    _write(repo, "held", SIMPLE.replace('"simple"', '"held"') + 'parameters { key: "marker_dir" value { '
           f'string_value: "{markers}" }} }}\n', HELD_MODEL)
    running = start_server([repo], tmp_dir=tmp)
    running.markers = markers
    yield running
    running.stop()


@pytest.fixture(params=["http", "grpc"])
def client(request, server):
    if request.param == "http":
        made = httpclient.InferenceServerClient(server.http_url)
    else:
        made = grpcclient.InferenceServerClient(server.grpc_url)
    made.protocol = request.param
    made.module = httpclient if request.param == "http" else grpcclient
    yield made
    made.unregister_system_shared_memory()
    made.close()


@pytest.fixture
def regions():
    """Shared memory objects made with tritonclient's helper; destroyed after the test."""
    made = []

    def create(size: int, name: str = ""):
        key = f"/tide_test_{uuid.uuid4().hex[:12]}"
        handle = shm.create_shared_memory_region(name or key[1:], key, size)
        made.append(handle)
        return key, handle

    yield create
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def _status_names(client) -> list[str]:
    status = client.get_system_shared_memory_status()
    if client.protocol == "http":
        return sorted(region["name"] for region in status)
    return sorted(status.regions)


def _shm_inputs(client, regions, a, b):
    key_in, handle_in = regions(a.nbytes + b.nbytes)
    shm.set_shared_memory_region(handle_in, [a])
    shm.set_shared_memory_region(handle_in, [b], offset=a.nbytes)
    client.register_system_shared_memory("inputs", key_in, a.nbytes + b.nbytes)
    inputs = [client.module.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
    inputs[0].set_shared_memory("inputs", a.nbytes)
    inputs[1].set_shared_memory("inputs", b.nbytes, offset=a.nbytes)
    return inputs


def test_inputs_and_outputs_in_shared_memory(client, regions):
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 3, dtype=np.int32)
    inputs = _shm_inputs(client, regions, a, b)
    key_out, handle_out = regions(128)
    client.register_system_shared_memory("outputs", key_out, 128)
    outputs = [client.module.InferRequestedOutput("OUTPUT0"), client.module.InferRequestedOutput("OUTPUT1")]
    outputs[0].set_shared_memory("outputs", 64)
    outputs[1].set_shared_memory("outputs", 64, offset=64)
    result = client.infer("simple", inputs, outputs=outputs)
    assert result.get_output("OUTPUT0") is not None
    np.testing.assert_array_equal(shm.get_contents_as_numpy(handle_out, np.int32, [1, 16]), a + b)
    np.testing.assert_array_equal(shm.get_contents_as_numpy(handle_out, np.int32, [1, 16], offset=64), a - b)
    assert _status_names(client) == ["inputs", "outputs"]


def test_shared_memory_inputs_with_outputs_in_the_response(client, regions):
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.arange(16, dtype=np.int32).reshape(1, 16) * 2
    result = client.infer("simple", _shm_inputs(client, regions, a, b))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


def test_bytes_tensors_through_shared_memory(client, regions):
    words = np.array([b"shared", b"", b"memory \xe2\x9c\x93"], dtype=np.object_)
    serialized = serialize_byte_tensor(words)
    size = serialized_byte_size(serialized)
    key, handle = regions(256)
    shm.set_shared_memory_region(handle, [serialized])
    client.register_system_shared_memory("words", key, 256)
    text = client.module.InferInput("INPUT0", [3], "BYTES")
    text.set_shared_memory("words", size)
    out = client.module.InferRequestedOutput("OUTPUT0")
    out.set_shared_memory("words", 128, offset=128)
    client.infer("echo_bytes", [text], outputs=[out])
    np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.object_, [3], offset=128), words)


def test_register_status_unregister(client, regions):
    key, _ = regions(64)
    client.register_system_shared_memory("r1", key, 32)
    client.register_system_shared_memory("r2", key, 32, offset=32)
    if client.protocol == "http":
        assert client.get_system_shared_memory_status("r2") == [{"name": "r2", "key": key, "offset": 32,
                                                                   "byte_size": 32}]
    else:
        region = client.get_system_shared_memory_status("r2").regions["r2"]
        assert (region.key, region.offset, region.byte_size) == (key, 32, 32)
    with pytest.raises(InferenceServerException, match="shared memory region 'r1' already in manager"):
        client.register_system_shared_memory("r1", key, 32)
    client.unregister_system_shared_memory("r1")
    client.unregister_system_shared_memory("never_registered")  # as Triton: nothing to do, no error
    assert _status_names(client) == ["r2"]
    with pytest.raises(InferenceServerException, match="Unable to find system shared memory region: 'r1'"):
        client.get_system_shared_memory_status("r1")
    client.unregister_system_shared_memory()
    assert _status_names(client) == []


@pytest.mark.parametrize("offset, byte_size", [(0, 65), (1, 64), (64, 1), (65, 0)])
def test_register_outside_the_object(client, regions, offset, byte_size):
    key, _ = regions(64)
    with pytest.raises(InferenceServerException, match="failed to register shared memory region.*invalid args"):
        client.register_system_shared_memory("outside", key, byte_size, offset=offset)


@pytest.mark.parametrize("key, message", [
    ("/", "invalid shm key '/'"),
    ("///", "invalid shm key '///'"),
    ("/../etc/passwd", "invalid shm key"),
    ("/dev/shm/x", "invalid shm key"),
    ("/triton_python_backend_shm_region_x", "reserved prefix 'triton_python_backend_shm_region_'"),
    ("/tide_test_does_not_exist", "Unable to open shared memory region"),
])
def test_register_refuses_keys_that_are_no_shared_memory_object(client, key, message):
    with pytest.raises(InferenceServerException, match=message) as info:
        client.register_system_shared_memory("bad", key, 8)
    assert info.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
    assert _status_names(client) == []


def test_register_refuses_a_link_out_of_dev_shm(client, tmp_path):
    target = tmp_path / "secret"
    target.write_bytes(b"x" * 64)
    link = f"tide_test_link_{uuid.uuid4().hex[:8]}"
    os.symlink(target, f"/dev/shm/{link}")
    try:
        with pytest.raises(InferenceServerException, match="Unable to open shared memory region"):
            client.register_system_shared_memory("link", f"/{link}", 8)
    finally:
        os.unlink(f"/dev/shm/{link}")


def _wait_for(path, present: bool = True) -> None:
    deadline = time.monotonic() + 20
    while path.exists() != present:
        assert time.monotonic() < deadline, f"{path} never {'appeared' if present else 'went'}"
        time.sleep(0.01)


def test_a_region_in_use_cannot_be_unregistered(client, regions, server):
    """As Triton 2.51 (qa/L0_shared_memory TestSharedMemoryUnregister): while a request reads its inputs from and
    writes its outputs to regions, unregistering them (from another client) is refused; after it, it works."""
    release = server.markers / "release"
    release.unlink(missing_ok=True)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 2, dtype=np.int32)
    names = ["input0_data", "input1_data", "output0_data", "output1_data"]
    handles = {}
    for name in names:
        key, handles[name] = regions(64)
        client.register_system_shared_memory(name, key, 64)
    shm.set_shared_memory_region(handles["input0_data"], [a])
    shm.set_shared_memory_region(handles["input1_data"], [b])
    inputs = [client.module.InferInput(f"INPUT{i}", [1, 16], "INT32") for i in (0, 1)]
    outputs = [client.module.InferRequestedOutput(f"OUTPUT{i}") for i in (0, 1)]
    for i in (0, 1):
        inputs[i].set_shared_memory(f"input{i}_data", 64)
        outputs[i].set_shared_memory(f"output{i}_data", 64)
    done = []
    if client.protocol == "http":
        pending = client.async_infer("held", inputs, outputs=outputs)
    else:
        client.async_infer("held", inputs, lambda result, error: done.append((result, error)), outputs=outputs)
    _wait_for(server.markers / "started")
    other = httpclient.InferenceServerClient(server.http_url)
    with pytest.raises(InferenceServerException) as info:
        other.unregister_system_shared_memory()
    assert ("Failed to unregister the following system shared memory regions: input0_data ,input1_data ,"
            "output0_data ,output1_data") in str(info.value)
    assert info.value.status() == "409"
    for name in names:
        with pytest.raises(InferenceServerException) as info:
            other.unregister_system_shared_memory(name)
        assert f"Cannot unregister shared memory region '{name}', it is currently in use." in str(info.value)
    with grpcclient.InferenceServerClient(server.grpc_url) as grpc_other:
        with pytest.raises(InferenceServerException, match="it is currently in use") as info:
            grpc_other.unregister_system_shared_memory("input0_data")
        assert info.value.status() == "StatusCode.UNAVAILABLE"
    assert sorted(r["name"] for r in other.get_system_shared_memory_status()) == names  # none was unregistered
    release.touch()
    if client.protocol == "http":
        pending.get_result()
    else:
        _wait_for_list(done)
        assert done[0][1] is None
    np.testing.assert_array_equal(shm.get_contents_as_numpy(handles["output0_data"], np.int32, [1, 16]), a + b)
    other.unregister_system_shared_memory()  # the request is done: the regions are free
    assert _status_names(client) == []
    other.close()


def _wait_for_list(items: list) -> None:
    deadline = time.monotonic() + 20
    while not items:
        assert time.monotonic() < deadline, "no answer"
        time.sleep(0.01)


def _infer_error(client, *args, **kwargs) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        client.infer(*args, **kwargs)
    return info.value


def test_bad_shared_memory_requests_are_clear_errors(client, regions):
    a = np.zeros((1, 16), dtype=np.int32)
    key, _ = regions(64)
    client.register_system_shared_memory("small", key, 64)
    bad = "400" if client.protocol == "http" else "StatusCode.INVALID_ARGUMENT"

    # an input whose region holds more bytes than the tensor needs
    inputs = [client.module.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
    inputs[0].set_shared_memory("small", 32)
    inputs[1].set_data_from_numpy(a)
    error = _infer_error(client, "simple", inputs)
    assert "input byte size mismatch for input 'INPUT0' for model 'simple'. Expected 64, got 32" in error.message()
    assert error.status() == bad

    # offsets and sizes outside the registered region
    inputs[0].set_shared_memory("small", 64, offset=64)
    assert "Invalid offset for shared memory region: 'small'" in _infer_error(client, "simple", inputs).message()
    inputs[0].set_shared_memory("small", 64, offset=8)
    error = _infer_error(client, "simple", inputs)
    assert "Invalid offset + byte size for shared memory region: 'small'" in error.message()
    assert error.status() == bad

    # an unknown region
    inputs[0].set_shared_memory("nowhere", 64)
    error = _infer_error(client, "simple", inputs)
    assert "Unable to find shared memory region: 'nowhere'" in error.message()
    assert error.status() in ("404", "StatusCode.NOT_FOUND")

    # an output region too small for the result
    inputs[0].set_data_from_numpy(a)
    out = client.module.InferRequestedOutput("OUTPUT0")
    out.set_shared_memory("small", 16)
    error = _infer_error(client, "simple", inputs, outputs=[out])
    assert "output 'OUTPUT0' (16 bytes) should be at least 64 bytes to hold the results" in error.message()
    assert error.status() == bad
    assert client.is_server_live()


def test_http_input_with_data_and_region_is_refused(server):
    body = {"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": [0] * 16,
                        "parameters": {"shared_memory_region": "x", "shared_memory_byte_size": 64}},
                       {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": [0] * 16}]}
    answer = requests.post(f"{server.base_url}/v2/models/simple/infer", json=body, timeout=10)
    assert answer.status_code == 400
    assert "must set only one of 'data'" in answer.json()["error"]
    body["inputs"][0] = {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16],
                         "parameters": {"shared_memory_region": "x", "shared_memory_byte_size": "64"}}
    answer = requests.post(f"{server.base_url}/v2/models/simple/infer", json=body, timeout=10)
    assert answer.status_code == 400
    assert "'shared_memory_byte_size' must be a non-negative integer" in answer.json()["error"]
    answer = requests.post(f"{server.base_url}/v2/systemsharedmemory/region/x/register",
                           json={"key": "/x", "offset": -1, "byte_size": 8}, timeout=10)
    assert answer.status_code == 400 and "'offset' must be a non-negative integer" in answer.json()["error"]


def test_cuda_shared_memory_is_not_supported_here(client):
    with pytest.raises(InferenceServerException, match="CUDA shared memory is not supported on this machine") as info:
        client.register_cuda_shared_memory("gpu", base64.b64encode(b"\x00" * 64), 0, 64)  # a raw IPC handle
    assert info.value.status() in ("400", "StatusCode.UNIMPLEMENTED")
    status = client.get_cuda_shared_memory_status()
    assert (status if client.protocol == "http" else list(status.regions)) == []
    client.unregister_cuda_shared_memory()


def test_server_metadata_lists_system_shared_memory(client):
    metadata = client.get_server_metadata()
    extensions = metadata["extensions"] if client.protocol == "http" else list(metadata.extensions)
    assert "system_shared_memory" in extensions and "cuda_shared_memory" not in extensions


def test_registration_is_a_restricted_api(tmp_path, regions):
    repo = tmp_path / "models"
    _write(repo, "simple", SIMPLE, SIMPLE_MODEL)
    running = start_server([repo], "--http-restricted-api", "shared-memory:admin-key=s3cret",
                           "--grpc-restricted-protocol", "shared-memory:admin-key=s3cret", tmp_dir=tmp_path)
    try:
        key, _ = regions(64)
        http = httpclient.InferenceServerClient(running.http_url)
        with pytest.raises(InferenceServerException, match="shared-memory") as info:
            http.register_system_shared_memory("r", key, 64)
        assert info.value.status() == "403"
        http.register_system_shared_memory("r", key, 64, headers={"admin-key": "s3cret"})
        grpc = grpcclient.InferenceServerClient(running.grpc_url)
        with pytest.raises(InferenceServerException) as info:
            grpc.get_system_shared_memory_status()
        assert info.value.status() == "StatusCode.PERMISSION_DENIED"
        status = grpc.get_system_shared_memory_status(headers={"triton-grpc-protocol-admin-key": "s3cret"})
        assert list(status.regions) == ["r"]
    finally:
        running.stop()
