"""``--frontend-direct on``: an instance process runs its direct links, its scheduler and its batches on the
instance's own thread (general_backends/python/direct.py, ``InstanceThread.serve``). What a model sees of that:
``execute`` on the thread that ran ``initialize``, no running event loop (``asyncio.run`` works in it), a blocking
BLS call from it; and a decoupled model's responses leave while it still executes. With tritonclient over HTTP
and gRPC."""

from __future__ import annotations

import shutil
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from support import TEST_MODELS, start_server

THREADED = """
import asyncio, threading
import numpy as np
import triton_python_backend_utils as pb_utils


async def _twice(x):
    await asyncio.sleep(0)
    return x * 2


class TritonPythonModel:
    def initialize(self, args):
        self.thread = threading.get_ident()

    def execute(self, requests):
        try:
            asyncio.get_running_loop()
            running = 1.0
        except RuntimeError:
            running = 0.0
        same = 1.0 if threading.get_ident() == self.thread else 0.0
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            flags = np.tile(np.array([[same, running]], np.float32), (x.shape[0], 1))
            out = np.concatenate([asyncio.run(_twice(x)), flags], axis=1).astype(np.float32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", out)]))
        return responses
"""

THREADED_CONFIG = """
backend: "python"
max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 3 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
dynamic_batching { max_queue_delay_microseconds: 100 }
"""

STREAMER = """
import json, os, time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.marker = json.loads(args["model_config"])["parameters"]["marker"]["string_value"]

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([1], np.float32))]))
            deadline = time.monotonic() + 30  # the client writes the marker once it read the first response
            while not os.path.exists(self.marker) and time.monotonic() < deadline:
                time.sleep(0.01)
            second = 2 if os.path.exists(self.marker) else -1
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([second], np.float32))]),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

STREAMER_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
model_transaction_policy { decoupled: true }
"""


def _model(repo: Path, name: str, code: str, config: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(textwrap.dedent(code))
    (repo / name / "config.pbtxt").write_text(config)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("direct-thread-models")
    _model(repo, "threaded", THREADED, THREADED_CONFIG)
    marker = tmp_path_factory.mktemp("direct-thread-marker") / "read"
    _model(repo, "streamer", STREAMER, STREAMER_CONFIG
           + f'parameters {{ key: "marker" value {{ string_value: "{marker}" }} }}\n')
    shutil.copytree(TEST_MODELS / "add_sub", repo / "add_sub")
    shutil.copytree(TEST_MODELS / "bls_add_sub", repo / "bls_add_sub")
    running = start_server([repo], "--frontend-workers", "2", "--frontend-direct", "on", "--log-verbose", "1",
                           tmp_dir=tmp_path_factory.mktemp("direct-thread-server"))
    running.marker = marker
    yield running
    running.stop()


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_execute_runs_on_the_instances_thread_with_no_running_loop(server, module):
    url = server.http_url if module is httpclient else server.grpc_url
    with module.InferenceServerClient(url) as client:
        for value in (1.0, 2.5, -4.0):
            x = np.array([[value]], np.float32)
            inputs = [module.InferInput("IN", [1, 1], "FP32")]
            inputs[0].set_data_from_numpy(x)
            out = client.infer("threaded", inputs).as_numpy("OUT")
            # doubled by asyncio.run inside execute; on initialize's thread; no running loop seen
            np.testing.assert_array_equal(out, [[2 * value, 1.0, 0.0]])
    assert "instance 'threaded_0_0': a frontend worker linked directly" in server.log()


def test_a_burst_batches_on_the_instances_thread(server):
    with httpclient.InferenceServerClient(server.http_url, concurrency=16) as client:
        pending = []
        for i in range(32):
            inputs = [httpclient.InferInput("IN", [1, 1], "FP32")]
            inputs[0].set_data_from_numpy(np.array([[i]], np.float32))
            pending.append((i, client.async_infer("threaded", inputs)))
        for i, result in pending:
            np.testing.assert_array_equal(result.get_result().as_numpy("OUT"), [[2 * i, 1.0, 0.0]])


def test_a_blocking_bls_call_from_a_direct_request(server):
    a = np.arange(4, dtype=np.float32).reshape(1, 4)
    with httpclient.InferenceServerClient(server.http_url) as client:
        inputs = [httpclient.InferInput("INPUT0", [1, 4], "FP32"), httpclient.InferInput("INPUT1", [1, 4], "FP32")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(np.ones_like(a))
        result = client.infer("bls_add_sub", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + 1)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - 1)
    assert "instance 'bls_add_sub_0_0': a frontend worker linked directly" in server.log()


def test_a_decoupled_models_response_leaves_while_it_executes(server):
    received: list = []
    done = threading.Event()

    def callback(result, error):
        received.append(error if error is not None else result)
        if error is not None:
            done.set()
            return
        value = result.as_numpy("OUT")
        if value is not None and value[0] == 1:
            server.marker.write_text("read")  # the model waits for this before its final response
        if result.get_response().parameters["triton_final_response"].bool_param:
            done.set()

    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback)
        inputs = [grpcclient.InferInput("IN", [1], "FP32")]
        inputs[0].set_data_from_numpy(np.array([0], np.float32))
        client.async_stream_infer("streamer", inputs, enable_empty_final_response=True)
        assert done.wait(60)
        client.stop_stream()
    outs = [r.as_numpy("OUT")[0] for r in received if not isinstance(r, Exception) and r.as_numpy("OUT") is not None]
    assert outs == [1, 2], received
