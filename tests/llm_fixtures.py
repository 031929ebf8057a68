"""Helpers for the LLM-backend tests: vLLM model repositories, the engine's environment, stream clients."""

from __future__ import annotations

import json
import queue
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# the models of the session's vLLM server (``vllm_server`` in tests/conftest.py: one engine shared by
# tests/e2e/test_vllm.py, test_vllm_generate_typed.py, test_bench_tool.py and test_openai.py)
VLLM_MODEL = "vllm_model"
VLLM_BAD_MODEL = "vllm_bad_path"  # its engine fails to start
VLLM_MAX_MODEL_LEN = 512
# A random model loops on whitespace inside JSON (tests/e2e/test_openai.py's structured outputs); vLLM 0.32 takes
# this as an engine argument only.
COMPACT_JSON_ENGINE = {"structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}}


_SESSION_VLLM_CACHE: list[Path] = []


def session_vllm_cache() -> Path:
    """vLLM's cache for every engine of this test session (made at the first call, removed at the session's end).
    Shared, an engine start finds the model class's facts (``modelinfos/``) that the first engine start wrote:
    without them vLLM inspects the class in a fresh Python process (torch and vLLM imported again, seconds)."""
    if not _SESSION_VLLM_CACHE:
        import atexit
        import shutil
        import tempfile

        _SESSION_VLLM_CACHE.append(Path(tempfile.mkdtemp(prefix="tideserve-tests-vllm-cache-")))
        atexit.register(shutil.rmtree, _SESSION_VLLM_CACHE[0], ignore_errors=True)
    return _SESSION_VLLM_CACHE[0]


def vllm_env(tmp_dir: Path) -> dict[str, str]:
    """The environment a vLLM engine needs on a CPU-only machine, caches kept under ``tmp_dir`` (vLLM's own:
    the session's, :func:`session_vllm_cache`)."""
    cache = tmp_dir / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    return {
        "VLLM_CPU_KVCACHE_SPACE": "1",   # GiB; without it the CPU worker asks for most of the RAM
        "HF_HUB_OFFLINE": "1",
        "VLLM_CACHE_ROOT": str(session_vllm_cache()),
        "HF_HOME": str(cache / "hf"),
        "TRITON_CACHE_DIR": str(cache / "triton"),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


def write_vllm_model(repository: Path, name: str, engine_args: dict, config: str = 'backend: "vllm"\n') -> Path:
    """``<repository>/<name>/config.pbtxt`` and ``1/model.json`` (the engine arguments)."""
    model_dir = repository / name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(config)
    (model_dir / "1" / "model.json").write_text(json.dumps(engine_args))
    return model_dir


def load_model(server, name: str) -> None:
    """Load ``name`` through the repository API; an error is kept in ``server.load_errors[name]``."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"{server.base_url}/v2/repository/models/{name}/load", data=b"{}", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=240):
            pass
    except urllib.error.HTTPError as exc:
        server.load_errors[name] = (exc.code, json.loads(exc.read())["error"])


def wait_engine_idle(server, model: str = VLLM_MODEL, timeout: float = 60) -> None:
    """Wait until ``model``'s engine runs and queues nothing (a module sharing the session's engine starts where
    a module with an engine of its own would: no request of an earlier module still in a batch)."""
    import time

    labels = {"model_name": model, "version": "1"}
    deadline = time.monotonic() + timeout
    while True:
        text = server.metrics()
        busy = sum(metric_value(text, f"tideserve:num_requests_{state}", **labels) or 0.0
                   for state in ("running", "waiting"))
        if not busy:
            return
        assert time.monotonic() < deadline, f"the engine of {model} still runs {busy} requests"
        time.sleep(0.1)


# A sitecustomize module (imported at the server's start-up through PYTHONPATH) that makes vLLM's
# AsyncLLM.check_health raise while a flag file exists, as Triton's L0_check_health_vllm patches vLLM.
_CHECK_HEALTH_MOCK = """
import importlib.util
import os
import sys

FLAG = os.environ["TIDESERVE_TEST_UNHEALTHY_FLAG"]
TARGET = "vllm.v1.engine.async_llm"


class _PatchCheckHealth:
    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            original = module.AsyncLLM.check_health

            async def check_health(self):
                if os.path.exists(FLAG):
                    raise RuntimeError("Simulated vLLM check_health() failure")
                await original(self)

            module.AsyncLLM.check_health = check_health

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchCheckHealth())
"""


def failing_check_health_env(tmp_dir: Path, flag: Path) -> dict[str, str]:
    """The environment of a server whose engines' ``check_health`` fails while ``flag`` exists."""
    site = tmp_dir / "check_health_mock"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(_CHECK_HEALTH_MOCK)
    return {"PYTHONPATH": str(site), "TIDESERVE_TEST_UNHEALTHY_FLAG": str(flag)}


# -- tritonclient helpers ---------------------------------------------------------------------------
def llm_inputs(module, prompt: str | list[int], *, stream: bool | None = None, sampling: dict | None = None,
               exclude_input: bool | None = None, **flags: bool) -> list:
    """Input tensors of Triton's vLLM interface for ``tritonclient.grpc`` or ``tritonclient.http``."""
    inputs = []

    def add(name, datatype, array):
        tensor = module.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)

    if isinstance(prompt, str):
        add("text_input", "BYTES", np.array([prompt.encode()], dtype=np.object_))
    else:
        add("input_ids", "INT32", np.asarray(prompt, dtype=np.int32))
    if stream is not None:
        add("stream", "BOOL", np.array([stream]))
    if sampling is not None:
        add("sampling_parameters", "BYTES", np.array([json.dumps(sampling).encode()], dtype=np.object_))
    if exclude_input is not None:
        add("exclude_input_in_output", "BOOL", np.array([exclude_input]))
    for name, value in flags.items():
        add(name, "BOOL", np.array([value]))
    return inputs


@dataclass
class StreamResult:
    """The responses of one request on a gRPC stream, in arrival order."""

    texts: list[str] = field(default_factory=list)
    finals: list[bool] = field(default_factory=list)
    results: list = field(default_factory=list)
    error: Exception | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def done(self) -> bool:
        return self.error is not None or (bool(self.finals) and self.finals[-1])


class GrpcStream:
    """One ``tritonclient.grpc`` stream; responses are gathered per request id, with their arrival order."""

    def __init__(self, url: str) -> None:
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(url)
        self.arrivals: queue.Queue = queue.Queue()
        self.results: dict[str, StreamResult] = {}
        self.events: list[tuple[str, bool]] = []  # (request id, final) of each response, in arrival order
        self.client.start_stream(callback=self._on_response)

    def _on_response(self, result, error) -> None:
        self.arrivals.put((result, error))

    def send(self, model: str, request_id: str, inputs: list) -> None:
        self.results[request_id] = StreamResult()
        self.client.async_stream_infer(model, inputs, request_id=request_id)

    def poll(self, timeout: float) -> str:
        """Take one response (wait up to ``timeout``); returns its request id."""
        result, error = self.arrivals.get(timeout=timeout)
        if error is not None:
            request_id = _error_request_id(error, self.results)
            self.results[request_id].error = error
            return request_id
        response = result.get_response()
        entry = self.results[response.id]
        text = result.as_numpy("text_output")
        entry.texts.append(text[0].decode() if text is not None else "")
        entry.finals.append(response.parameters["triton_final_response"].bool_param)
        entry.results.append(result)
        self.events.append((response.id, entry.finals[-1]))
        return response.id

    def wait_all(self, timeout: float = 120) -> dict[str, StreamResult]:
        while not all(r.done for r in self.results.values()):
            self.poll(timeout)
        return self.results

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def _error_request_id(error, results: dict[str, StreamResult]) -> str:
    pending = [rid for rid, r in results.items() if not r.done]
    return pending[0] if len(pending) == 1 else (pending or list(results))[0]


def cancel_a_running_generation(server, model: str, prompt: str = "Write an original and creative poem.") -> list:
    """Triton's ``L0_backend_vllm/request_cancellation``: a long generation that is not streamed, sent on a gRPC
    stream and cancelled by the client (``stop_stream(cancel_requests=True)``) once the engine runs it; returns
    what the stream's callback received by the time the engine has aborted the request."""
    import time

    import tritonclient.grpc as grpcclient

    labels = {"model_name": model, "version": "1"}
    aborted_before = metric_value(server.metrics(), "tideserve:request_aborted_total", **labels) or 0.0
    received: list = []
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: received.append((result, error)))
        # max_tokens beyond the context (as Triton's test asks of its model): the engine stops at the context
        sampling = {"temperature": "0", "top_p": "1", "max_tokens": "1500", "ignore_eos": True}
        client.async_stream_infer(model, llm_inputs(grpcclient, prompt, stream=False, sampling=sampling),
                                  request_id="1", parameters={"temperature": "0", "top_p": "1"})
        deadline = time.monotonic() + 60
        while not received and metric_value(server.metrics(), "tideserve:num_requests_running", **labels) != 1:
            assert time.monotonic() < deadline, "the engine never ran the request"
            time.sleep(0.05)
        client.stop_stream(cancel_requests=True)
        deadline = time.monotonic() + 30
        while True:
            text = server.metrics()
            if ((metric_value(text, "tideserve:request_aborted_total", **labels) or 0.0) > aborted_before
                    and metric_value(text, "tideserve:num_requests_running", **labels) == 0):
                break
            assert time.monotonic() < deadline, f"the engine never aborted the request; received {received}"
            time.sleep(0.05)
    finally:
        client.close()
    return received


# -- /metrics -------------------------------------------------------------------------------------
def metric_value(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample of a Prometheus text exposition (``None`` when absent)."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        found = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', line.split("}")[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None
