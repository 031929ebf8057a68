"""Model files stay inside the model repository: a load request (or a config) naming a file elsewhere is
refused with 400 / INVALID_ARGUMENT naming the field, and the file is never run or read.

A real server (explicit model control) driven by tritonclient over HTTP and gRPC; the model that the
overrides try to run writes a marker file when imported, so a test can tell it never ran.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from support import free_port
from in_process import InProcessServer
from tritonclient.utils import InferenceServerException

from tideserve.app import ServerOptions
from tideserve.repository import ControlMode


# the repository and the files outside it: model_paths_layout (tests/conftest.py)
@pytest.fixture(scope="module")
def running(model_paths_layout):
    _root, repo, _outside, _marker = model_paths_layout
    server = InProcessServer(ServerOptions(model_repositories=[repo], http_port=free_port(), grpc_port=free_port(),
                                           metrics_port=free_port(), model_control_mode=ControlMode.EXPLICIT,
                                           load_models=["add_sub"]))
    yield server
    server.stop()


def _override(client, **fields) -> str:
    config = client.get_model_config("add_sub")
    config.update(fields)
    return json.dumps(config)


def _escapes(outside: Path) -> list[tuple[dict, str]]:
    """(config fields, field named in the error) for each way out of the repository."""
    return [
        ({"default_model_filename": str(outside / "evil.py")}, "default_model_filename"),
        ({"default_model_filename": "../../../outside/evil.py"}, "default_model_filename"),
        ({"default_model_filename": "linked.py"}, "default_model_filename"),
        ({"parameters": {"chat_template": {"string_value": str(outside / "template.jinja")}}}, "chat_template"),
        ({"parameters": {"tokenizer_dir": {"string_value": str(outside / "tokenizer")}}}, "tokenizer_dir"),
        ({"output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4],
                      "label_filename": "../../outside/secret.txt"}]}, "label_filename"),
    ]


def test_http_load_refuses_files_outside_the_repository(running, model_paths_layout):
    _root, _repo, outside, marker = model_paths_layout
    with httpclient.InferenceServerClient(running.http_url) as client:
        for fields, field in _escapes(outside):
            with pytest.raises(InferenceServerException) as info:
                client.load_model("add_sub", config=_override(client, **fields))
            assert info.value.status() == "400", (fields, info.value)
            assert field in info.value.message() and "outside the model repository" in info.value.message()
            assert client.is_model_ready("add_sub")  # the loaded version keeps serving
        assert not marker.exists()


def test_grpc_load_refuses_files_outside_the_repository(running, model_paths_layout):
    _root, _repo, outside, marker = model_paths_layout
    client = grpcclient.InferenceServerClient(running.grpc_url)
    config = client.get_model_config("add_sub", as_json=True)["config"]
    for fields, field in _escapes(outside)[:3]:
        with pytest.raises(InferenceServerException) as info:
            client.load_model("add_sub", config=json.dumps({**config, **fields}))
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT" and field in info.value.message()
    assert not marker.exists()
    assert client.is_model_ready("add_sub")
    client.close()


def test_overlong_model_name_is_a_clear_400(running):
    with httpclient.InferenceServerClient(running.http_url) as client:
        with pytest.raises(InferenceServerException) as info:
            client.load_model("m" * 5000)
        assert info.value.status() == "400" and "longer than 255 bytes" in info.value.message()
        assert client.is_server_live()


def test_a_file_inside_the_repository_still_loads(running):
    with httpclient.InferenceServerClient(running.http_url) as client:
        client.load_model("add_sub", config=_override(client, default_model_filename="model.py"))
        assert client.is_model_ready("add_sub")


def test_a_load_cannot_ask_for_unbounded_instances(running):
    with httpclient.InferenceServerClient(running.http_url) as client:
        override = _override(client, instance_group=[{"kind": "KIND_CPU", "count": 100000}])
        with pytest.raises(InferenceServerException) as info:
            client.load_model("add_sub", config=override)
        assert info.value.status() == "400" and "--model-max-instances" in info.value.message()
        assert client.is_model_ready("add_sub")
