"""Model warmup against a real tideserve process: ``model_warmup`` samples run on every instance before
the model turns READY (zero, random and file data, ``batch_size``, ``count``), and a sample that does
not fit the model, names a missing or short file, or makes the model fail, fails the load with the
reason in the repository index (and a clear 400 / INVALID_ARGUMENT to the load call)."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from support import start_server
from tritonclient.utils import InferenceServerException

from tideserve.config import parse_text, to_json

# counts the requests it has run and the batches; refuses an input of all 7s (a failing warmup)
COUNTING = textwrap.dedent("""
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def initialize(self, args):
            self.requests = 0
            self.batches = 0

        def execute(self, requests):
            self.batches += 1
            responses = []
            for request in requests:
                x = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
                if x.size and np.all(x == 7):
                    raise pb_utils.TritonModelException("sevens are not allowed")
                self.requests += 1
                seen = np.array([[self.requests, self.batches, int(x.sum())]], dtype=np.int64)
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("SEEN", seen)]))
            return responses
""")


def config(warmup: str, instances: int = 1) -> str:
    return f"""
name: "counting" backend: "python" max_batch_size: 4
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 3 ] }} ]
output [ {{ name: "SEEN" data_type: TYPE_INT64 dims: [ 3 ] }} ]
instance_group [ {{ count: {instances} kind: KIND_CPU }} ]
{warmup}
"""


GOOD = """
model_warmup [
  { name: "zeros" batch_size: 2 count: 3
    inputs { key: "INPUT" value { data_type: TYPE_INT32 dims: [ 3 ] zero_data: true } } },
  { name: "file" batch_size: 1
    inputs { key: "INPUT" value { data_type: TYPE_INT32 dims: [ 3 ] input_data_file: "ones" } } },
  { name: "random" batch_size: 4
    inputs { key: "INPUT" value { data_type: TYPE_INT32 dims: [ 3 ] random_data: true } } },
  { name: "skipped" batch_size: 0
    inputs { key: "INPUT" value { data_type: TYPE_INT32 dims: [ 3 ] zero_data: true } } }
]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("warmup_models")
    model = root / "counting"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.py").write_text(COUNTING)
    (model / "config.pbtxt").write_text(config(GOOD))
    (model / "warmup").mkdir()
    (model / "warmup" / "ones").write_bytes(np.ones(3, dtype=np.int32).tobytes())
    (model / "warmup" / "short").write_bytes(np.ones(2, dtype=np.int32).tobytes())
    (model / "warmup" / "sevens").write_bytes(np.full(3, 7, dtype=np.int32).tobytes())
    running = start_server([root], "--model-control-mode", "explicit", "--load-model", "counting",
                           "--log-verbose", "1", tmp_dir=tmp_path_factory.mktemp("warmup_logs"))
    yield running
    running.stop()


def seen(url: str) -> list[int]:
    client = httpclient.InferenceServerClient(url)
    tensor = httpclient.InferInput("INPUT", [1, 3], "INT32")
    tensor.set_data_from_numpy(np.array([[1, 2, 3]], dtype=np.int32))
    return [int(v) for v in client.infer("counting", [tensor]).as_numpy("SEEN")[0]]


def test_samples_run_before_ready(server):
    # zeros: 3 batches of 2, file: 1 batch of 1, random: 1 batch of 4, skipped: none -> 11 requests, 5 batches
    assert seen(server.http_url) == [12, 6, 6]
    statistics = httpclient.InferenceServerClient(server.http_url).get_inference_statistics("counting")
    assert statistics["model_stats"][0]["inference_count"] == 1  # warmup is not counted


def test_each_run_is_logged_as_triton_logs_it(server):
    """qa/L0_warmup greps the server log for these lines (at --log-verbose 1)."""
    log = server.log()
    for iteration in (1, 2, 3):
        assert f"model 'counting' instance counting_0_0 is running warmup sample 'zeros' for iteration {iteration}" \
            in log
    assert "is running warmup sample 'file' for iteration 1" in log
    assert "warmup sample 'skipped'" not in log  # batch_size 0
    assert "failed to run warmup" not in log


def test_every_instance_is_warmed(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.load_model("counting", config=to_json(parse_text(config(GOOD, instances=2))))
    counts = set()
    for _ in range(6):
        counts.add(seen(server.http_url)[0] > 11)
    assert counts == {True}  # both instances ran the 11 warmup requests first


BAD = {
    "wrong shape": ('inputs { key: "INPUT" value { data_type: TYPE_INT32 dims: [ 4 ] zero_data: true } }',
                    "unexpected shape for input 'INPUT'"),
    "wrong datatype": ('inputs { key: "INPUT" value { data_type: TYPE_FP32 dims: [ 3 ] zero_data: true } }',
                       "data-type is 'FP32'"),
    "variable dims": ('inputs { key: "INPUT" value { data_type: TYPE_INT32 dims: [ -1 ] zero_data: true } }',
                      "all variable-size dimensions are specified"),
    "missing file": ('inputs { key: "INPUT" value { data_type: TYPE_INT32 dims: [ 3 ] input_data_file: "absent" } }',
                     "input_data_file 'absent' is not a file"),
    "short file": ('inputs { key: "INPUT" value { data_type: TYPE_INT32 dims: [ 3 ] input_data_file: "short" } }',
                   "expects 12 bytes for input 'INPUT', but the data provided from 'short' only has 8 bytes"),
    "file outside": ('inputs { key: "INPUT" value { data_type: TYPE_INT32 dims: [ 3 ] '
                     'input_data_file: "../../../../etc/hostname" } }', "outside the model repository"),
    "model fails": ('inputs { key: "INPUT" value { data_type: TYPE_INT32 dims: [ 3 ] input_data_file: "sevens" } }',
                    "sevens are not allowed"),
    "no data": ('inputs { key: "INPUT" value { data_type: TYPE_INT32 dims: [ 3 ] } }',
                "must set zero_data, random_data or input_data_file"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_sample_fails_the_load(server, case):
    inputs, reason = BAD[case]
    warmup = f'model_warmup [ {{ name: "bad" batch_size: 1 {inputs} }} ]'
    client = grpcclient.InferenceServerClient(server.grpc_url)
    http = httpclient.InferenceServerClient(server.http_url)
    client.unload_model("counting")
    with pytest.raises(InferenceServerException) as caught:
        client.load_model("counting", config=to_json(parse_text(config(warmup))))
    assert reason in caught.value.message() and "warmup sample 'bad'" in caught.value.message()
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    if case == "model fails":  # Triton's words, in the answer and in the log
        assert "failed to run warmup sample 'bad': " in caught.value.message()
        assert caught.value.message().endswith("sevens are not allowed;")
        assert "failed to run warmup sample 'bad': " in server.log()
    with pytest.raises(InferenceServerException) as caught:
        http.load_model("counting", config=to_json(parse_text(config(warmup))))
    assert reason in caught.value.message() and caught.value.status() == "400"
    index = {m["name"]: m for m in http.get_model_repository_index()}
    assert index["counting"]["state"] == "UNAVAILABLE" and reason in index["counting"]["reason"]
    http.load_model("counting")  # the model's own config loads again
    assert http.is_model_ready("counting")
