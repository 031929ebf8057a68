"""A backend written against ``tideserve.backend_api`` alone, in a real server, driven by tritonclient."""

from __future__ import annotations

from pathlib import Path

import api_backend
import numpy as np
import pytest
import tritonclient.http as httpclient
from support import free_port
from in_process import InProcessServer

from tideserve.app import ServerOptions
from tideserve.backend import BackendRegistry

CONFIG = """
backend: "{backend}"
max_batch_size: 4
input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 3 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 3 ] }} ]
{extra}
"""


def _model(root: Path, name: str, backend: str, extra: str = "") -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(CONFIG.format(backend=backend, extra=extra))


@pytest.fixture
def server(tmp_path):
    root = tmp_path / "models"
    _model(root, "triple", "scale", 'parameters { key: "factor" value: { string_value: "3" } }')
    _model(root, "chain", "chain", 'parameters { key: "next" value: { string_value: "triple" } }')
    registry = BackendRegistry()
    registry.register("scale", api_backend.ScaleBackend)
    registry.register("chain", api_backend.ChainBackend)
    running = InProcessServer(ServerOptions(model_repositories=[root], http_port=free_port(), grpc_port=free_port(),
                                            allow_metrics=False, exit_timeout_secs=2), registry)
    yield running
    running.stop()


def _infer(client: httpclient.InferenceServerClient, model: str, values: np.ndarray) -> np.ndarray:
    tensor = httpclient.InferInput("IN", list(values.shape), "FP32")
    tensor.set_data_from_numpy(values)
    return client.infer(model, [tensor]).as_numpy("OUT")


def test_a_backend_written_against_the_api_serves_and_calls_another_model(server):
    values = np.array([[1, 2, 3]], np.float32)
    with httpclient.InferenceServerClient(server.http_url) as client:
        assert _infer(client, "triple", values).tolist() == [[3, 6, 9]]
        assert _infer(client, "chain", values).tolist() == [[4, 7, 10]]  # triple's answer, plus one
        stats = client.get_inference_statistics("triple")["model_stats"][0]["inference_stats"]
        assert int(stats["success"]["count"]) == 2  # the call through the infer handle counts as a request
