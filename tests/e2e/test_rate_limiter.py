"""Triton's rate limiter end to end: ``--rate-limit execution_count`` and ``--rate-limit-resource`` on a real
tideserve process, instances' ``rate_limiter`` in config.pbtxt, driven by tritonclient over HTTP and gRPC.

The models answer with when their execute started and ended: two instances that need the one copy of a
resource never overlap, a model without ``rate_limiter`` is not held back, and a model needing more than
``--rate-limit-resource`` gives fails to load with 400 / INVALID_ARGUMENT.
"""

from __future__ import annotations

import textwrap
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from support import start_server
from tritonclient.utils import InferenceServerException

CONFIG = """\
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "SPAN" data_type: TYPE_FP64 dims: [ 2 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 2 {limiter} }} ]
parameters {{ key: "process_isolation" value {{ string_value: "false" }} }}
"""
MODEL = '''\
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        start = time.monotonic()
        time.sleep(0.3)
        span = np.array([start, time.monotonic()], dtype=np.float64)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("SPAN", span)]) for _ in requests]
'''


def _write(repo, name, limiter=""):
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(CONFIG.format(name=name, limiter=limiter))
    (repo / name / "1" / "model.py").write_text(textwrap.dedent(MODEL))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rate_limit")
    repo = tmp / "models"
    _write(repo, "limited", 'rate_limiter { resources [ { name: "R1" count: 1 } ] priority: 1 }')
    _write(repo, "free")
    _write(repo, "greedy", 'rate_limiter { resources [ { name: "R1" count: 2 } ] }')
    running = start_server([repo], "--rate-limit", "execution_count", "--rate-limit-resource", "R1:1",
                           "--model-control-mode", "explicit", "--load-model", "limited", "--load-model", "free",
                           tmp_dir=tmp)
    yield running
    running.stop()


def _spans(client, module, model, count=2):
    """(start, end) of ``count`` concurrent requests' executions, earliest first."""
    tensor = module.InferInput("INPUT0", [1], "FP32")
    tensor.set_data_from_numpy(np.zeros(1, dtype=np.float32))
    if module is httpclient:  # its client runs on gevent: concurrency through async_infer
        pending = [client.async_infer(model, [tensor]) for _ in range(count)]
        return sorted(tuple(p.get_result().as_numpy("SPAN")) for p in pending)
    with ThreadPoolExecutor(count) as pool:
        return sorted(pool.map(lambda _: tuple(client.infer(model, [tensor]).as_numpy("SPAN")), range(count)))


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_instances_needing_the_one_copy_never_overlap(server, protocol):
    module = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(server.http_url if protocol == "http" else server.grpc_url,
                                          **({"concurrency": 2} if protocol == "http" else {}))
    (_, end0), (start1, _) = _spans(client, module, "limited")
    assert start1 >= end0  # R1 has one copy: the second instance waited for the first
    (start0, end0), (start1, _) = _spans(client, module, "free")
    assert start1 < end0  # no rate_limiter: both instances ran at once
    client.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_model_needing_more_than_given_fails_to_load(server, protocol):
    module = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(server.http_url if protocol == "http" else server.grpc_url)
    with pytest.raises(InferenceServerException, match='Resource count for "R1" is limited to 1') as info:
        client.load_model("greedy")
    assert info.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
    assert client.is_model_ready("limited")
    client.close()
