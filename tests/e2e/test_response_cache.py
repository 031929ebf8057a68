"""Triton's response cache end to end: ``--cache-config local,size=N`` and ``response_cache { enable: true }``
on a real tideserve process, driven by tritonclient over HTTP and gRPC (as Triton's qa/L0_response_cache).

The model answers with how many times it has run, so an answer from the cache is the one stored, not a new
run. Checked: identical requests hit (inputs, datatypes, shapes and requested outputs all count), statistics
``cache_hit`` / ``cache_miss`` and the ``nv_cache_*`` metrics, LRU eviction within the size, models without
``enable`` never cached, and decoupled models refused at load as Triton refuses them.
"""

from __future__ import annotations

import re
import textwrap

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from support import start_server
from tritonclient.utils import InferenceServerException

COUNTER = """\
name: "{name}"
backend: "python"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }}, {{ name: "RUNS" data_type: TYPE_INT64 dims: [ 1 ] }} ]
parameters {{ key: "process_isolation" value {{ string_value: "false" }} }}
{extra}
"""
COUNTER_MODEL = '''\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.runs = 0

    def execute(self, requests):
        responses = []
        for request in requests:
            self.runs += 1
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            runs = np.full((x.shape[0], 1), self.runs, dtype=np.int64)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x * 2),
                                                         pb_utils.Tensor("RUNS", runs)]))
        return responses
'''
DECOUPLED = """\
name: "decoupled_cache"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
response_cache { enable: true }
"""


# Triton's ensemble_cache_composing_decoupled: the cache is enabled on an ensemble whose step is decoupled
ENSEMBLE = """\
name: "ensemble_cache_composing_decoupled"
platform: "ensemble"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
ensemble_scheduling { step [ { model_name: "decoupled_step" model_version: -1
  input_map { key: "INPUT0" value: "INPUT0" } output_map { key: "OUTPUT0" value: "OUTPUT0" } } ] }
response_cache { enable: true }
"""


def _write(repo, name, config):
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(config)
    (repo / name / "1" / "model.py").write_text(textwrap.dedent(COUNTER_MODEL))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cache")
    repo = tmp / "models"
    _write(repo, "cached", COUNTER.format(name="cached", extra="response_cache { enable: true }"))
    _write(repo, "uncached", COUNTER.format(name="uncached", extra=""))
    _write(repo, "decoupled_cache", DECOUPLED)
    _write(repo, "decoupled_step", DECOUPLED.replace("decoupled_cache", "decoupled_step").replace(
        "response_cache { enable: true }", ""))
    (repo / "ensemble_cache_composing_decoupled" / "1").mkdir(parents=True)
    (repo / "ensemble_cache_composing_decoupled" / "config.pbtxt").write_text(ENSEMBLE)
    # 4 KiB: a 1000-float answer (4 KiB) does not fit, a few small ones do
    running = start_server([repo], "--cache-config", "local,size=4096", "--model-control-mode", "explicit",
                           "--load-model", "cached", "--load-model", "uncached", tmp_dir=tmp)
    yield running
    running.stop()


@pytest.fixture(params=["http", "grpc"])
def client(request, server):
    module = httpclient if request.param == "http" else grpcclient
    made = module.InferenceServerClient(server.http_url if request.param == "http" else server.grpc_url)
    made.module = module
    made.protocol = request.param
    yield made
    made.close()


def _infer(client, model, values, datatype="FP32", outputs=("OUTPUT0", "RUNS")):
    array = np.asarray(values, dtype=np.float32 if datatype == "FP32" else np.float64).reshape(1, -1)
    tensor = client.module.InferInput("INPUT0", list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    result = client.infer(model, [tensor], outputs=[client.module.InferRequestedOutput(o) for o in outputs])
    return result


def _runs(result) -> int:
    return int(result.as_numpy("RUNS")[0, 0])


def _cache_stats(client, model):
    stats = client.get_inference_statistics(model)
    if client.protocol == "http":
        inference = stats["model_stats"][0]["inference_stats"]
        return inference["cache_hit"]["count"], inference["cache_miss"]["count"], stats["model_stats"][0]
    inference = stats.model_stats[0].inference_stats
    return inference.cache_hit.count, inference.cache_miss.count, stats.model_stats[0]


def test_identical_requests_are_answered_from_the_cache(client):
    values = np.random.default_rng().random(4) + {"http": 10, "grpc": 20}[client.protocol]
    hits, misses, _ = _cache_stats(client, "cached")
    first = _infer(client, "cached", values)
    again = _infer(client, "cached", values)
    assert _runs(again) == _runs(first)  # the model did not run again
    np.testing.assert_array_equal(again.as_numpy("OUTPUT0"), first.as_numpy("OUTPUT0"))
    other = _infer(client, "cached", values + 1)
    assert _runs(other) == _runs(first) + 1
    new_hits, new_misses, model_stats = _cache_stats(client, "cached")
    assert (new_hits - hits, new_misses - misses) == (1, 2)


def test_the_key_takes_shape_datatype_and_requested_outputs(client):
    base = _infer(client, "cached", [1, 2, 3, 4])
    assert _runs(_infer(client, "cached", [1, 2, 3, 4])) == _runs(base)
    assert _runs(_infer(client, "cached", [1, 2, 3, 4], outputs=("RUNS",))) > _runs(base)
    # the same values as two rows: another shape, another answer
    array = np.asarray([1, 2, 3, 4], dtype=np.float32).reshape(2, 2)
    tensor = client.module.InferInput("INPUT0", [2, 2], "FP32")
    tensor.set_data_from_numpy(array)
    assert int(client.infer("cached", [tensor]).as_numpy("RUNS")[0, 0]) > _runs(base)


def test_models_without_enable_are_never_cached(client):
    first = _infer(client, "uncached", [5, 6])
    assert _runs(_infer(client, "uncached", [5, 6])) == _runs(first) + 1
    hits, misses, _ = _cache_stats(client, "uncached")
    assert (hits, misses) == (0, 0)


def test_least_recently_used_entries_go_first(client, server):
    tag = {"http": 100, "grpc": 200}[client.protocol]
    big = _infer(client, "cached", np.full(1000, tag, dtype=np.float32))  # larger than the whole cache
    assert _runs(_infer(client, "cached", np.full(1000, tag, dtype=np.float32))) == _runs(big) + 1
    # logged as Triton logs it (qa/L0_response_cache greps "Failed to insert key")
    assert re.search(r"Failed to insert key \[[0-9a-f]+\] into response cache: Requested byte_size: \d+ is greater "
                     r"than total cache size: 4096", server.log())
    first = _runs(_infer(client, "cached", [tag, 1]))
    for i in range(40):  # ~150 bytes each: pushes [tag, 1] out of 4 KiB
        _infer(client, "cached", [tag, 2, i])
    assert _runs(_infer(client, "cached", [tag, 1])) > first


def test_statistics_and_metrics(client, server):
    _infer(client, "cached", [42.0])
    _infer(client, "cached", [42.0])
    hits, misses, model_stats = _cache_stats(client, "cached")
    assert hits >= 1 and misses >= 1
    if client.protocol == "http":
        assert model_stats["inference_stats"]["cache_hit"]["ns"] > 0
        assert model_stats["inference_stats"]["cache_miss"]["ns"] > 0
    metrics = server.metrics()
    for name in ("nv_cache_num_hits_per_model", "nv_cache_hit_duration_per_model", "nv_cache_num_misses_per_model",
                 "nv_cache_miss_duration_per_model"):
        assert f'{name}{{model="cached",version="1"}}' in metrics
        assert f'{name}{{model="uncached"' not in metrics
    line = next(l for l in metrics.splitlines() if l.startswith('nv_cache_num_hits_per_model{model="cached"'))
    assert float(line.split()[-1]) == hits


def test_decoupled_model_with_a_cache_is_refused_at_load(client):
    message = "Response Cache does not currently support model decoupled_cache with 'decoupled'"
    with pytest.raises(InferenceServerException, match=message) as info:
        client.load_model("decoupled_cache")
    assert info.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")


def test_ensemble_with_a_decoupled_step_and_a_cache_is_refused_at_load(client):
    """The ensemble is decoupled because its step is; Triton refuses the cache on it with the same message."""
    message = ("Response Cache does not currently support model ensemble_cache_composing_decoupled with "
               "'decoupled' transaction policy. Please disable the response cache.")
    with pytest.raises(InferenceServerException) as info:
        client.load_model("ensemble_cache_composing_decoupled")
    assert message in str(info.value)
    assert not client.is_model_ready("ensemble_cache_composing_decoupled")
