"""Helpers for the tests of the example deployment (``model_repository/``): preparing it, a server over it,
SSE reading."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from support import RunningServer, start_server
from llm_fixtures import vllm_env

ROOT = Path(__file__).resolve().parent.parent
REPOSITORY = ROOT / "model_repository"
EXAMPLE_MODELS = ["llm", "llm_ensemble", "llm_postprocess", "llm_preprocess", "tabular", "text_classifier",
                  "text_classifier_head", "text_embedder", "text_encoder", "text_tokenizer"]
README = (ROOT / "README.md").read_text()
TALKING = README.split("## Talking to it", 1)[1].split("\n## ", 1)[0]  # the README's part on the example server


def prepare_repository() -> None:
    """Make the repository's generated files, as ``make serve`` does (a no-op once they exist). In its own
    process: importing transformers here would leave lazy modules behind for the other tests."""
    done = subprocess.run([sys.executable, "-m", "tideserve.bench.examples.prepare", str(REPOSITORY), "--no-progress"],
                          capture_output=True, text=True, timeout=900, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-4000:]


def repository_index(server: RunningServer) -> dict[str, dict]:
    request = urllib.request.Request(f"{server.base_url}/v2/repository/index", data=b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=30) as r:
        return {row["name"]: row for row in json.loads(r.read())}


def start_example_server(tmp_dir: Path, extra_repositories: tuple[Path, ...] = (),
                         ready_timeout: float = 420) -> RunningServer:
    """A server over the (prepared) example repository, and ``extra_repositories``. Like Triton, the server
    listens once every model has loaded or failed (the vLLM engine takes 40 s or more to start on a CPU);
    an example model that failed is an error here."""
    server = start_server([REPOSITORY, *extra_repositories], "--strict-readiness", "false", tmp_dir=tmp_dir,
                          env=vllm_env(tmp_dir), ready_timeout=ready_timeout)
    index = repository_index(server)
    states = {name: (index.get(name, {}).get("state"), index.get(name, {}).get("reason")) for name in EXAMPLE_MODELS}
    if any(state != "READY" for state, _ in states.values()):
        server.stop()
        raise RuntimeError(f"example models not ready: {states}\n{server.log()[-6000:]}")
    return server


def sse_events(server: RunningServer, model: str, body: dict, timeout: float = 120) -> list[dict]:
    """The events of one ``generate_stream`` request (a non-200 answer raises with its body)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=timeout)
    try:
        connection.request("POST", f"/v2/models/{model}/generate_stream", json.dumps(body),
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise AssertionError(f"generate_stream answered {response.status}: {response.read().decode()}")
        events = []
        for line in response:
            if line.startswith(b"data:"):
                events.append(json.loads(line[5:]))
        return events
    finally:
        connection.close()


def post_json(server: RunningServer, path: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    request = urllib.request.Request(f"{server.base_url}{path}", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# -- the temporary repository: ensembles over the example models that go wrong --------------------
ENCODER_STEPS = """
    { model_name: "text_tokenizer" model_version: -1 input_map { key: "text" value: "text" }
      output_map { key: "input_ids" value: "ids" } output_map { key: "attention_mask" value: "mask" } },
    { model_name: "text_encoder" model_version: -1 input_map { key: "%s" value: "ids" }
      input_map { key: "attention_mask" value: "mask" } output_map { key: "sentence_embedding" value: "%s" } }
"""
BROKEN = {
    # the encoder has no input 'token_ids'
    "broken_missing_input": ("""
name: "broken_missing_input"
platform: "ensemble"
max_batch_size: 16
input [ { name: "text" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "embedding" data_type: TYPE_FP32 dims: [ 384 ] } ]
ensemble_scheduling { step [ %s ] }
""" % (ENCODER_STEPS % ("token_ids", "embedding")),
        "ensemble tensor 'ids' is mapped to input 'token_ids', which model 'text_encoder' does not have"),
    # the ensemble says INT32 where the encoder makes FP32
    "broken_datatype": ("""
name: "broken_datatype"
platform: "ensemble"
max_batch_size: 16
input [ { name: "text" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "embedding" data_type: TYPE_INT32 dims: [ 384 ] } ]
ensemble_scheduling { step [ %s ] }
""" % (ENCODER_STEPS % ("input_ids", "embedding")), "inconsistent data type"),
    # a step of a model that does not exist
    "broken_unknown_model": ("""
name: "broken_unknown_model"
platform: "ensemble"
input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] } ]
ensemble_scheduling { step [ { model_name: "no_such_llm" model_version: -1
  input_map { key: "text_input" value: "text_input" } output_map { key: "text_output" value: "text_output" } } ] }
""", "no_such_llm"),
}
FAILING_HEAD_CONFIG = """
name: "failing_head"
backend: "python"
max_batch_size: 16
input [ { name: "embedding" data_type: TYPE_FP32 dims: [ 384 ] } ]
output [ { name: "scores" data_type: TYPE_FP32 dims: [ 3 ] } ]
"""
FAILING_HEAD_PY = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        raise pb_utils.TritonModelException("the head is broken")
'''
FAILING_CLASSIFIER = """
name: "failing_classifier"
platform: "ensemble"
max_batch_size: 16
input [ { name: "text" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "scores" data_type: TYPE_FP32 dims: [ 3 ] } ]
ensemble_scheduling { step [ %s,
    { model_name: "failing_head" model_version: -1 input_map { key: "embedding" value: "embedding" }
      output_map { key: "scores" value: "scores" } } ] }
""" % (ENCODER_STEPS % ("input_ids", "embedding"))


def write_extra_repository(root: Path) -> Path:
    """The broken ensembles (and the failing head they use) beside the example repository."""
    for name, (config, _) in BROKEN.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(config)
    (root / "failing_head" / "1").mkdir(parents=True)
    (root / "failing_head" / "config.pbtxt").write_text(FAILING_HEAD_CONFIG)
    (root / "failing_head" / "1" / "model.py").write_text(FAILING_HEAD_PY)
    (root / "failing_classifier" / "1").mkdir(parents=True)
    (root / "failing_classifier" / "config.pbtxt").write_text(FAILING_CLASSIFIER)
    return root
