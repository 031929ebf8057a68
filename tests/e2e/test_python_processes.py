"""Python-backend instances in processes of their own (the default), against a real tideserve process.

A model that aborts, segfaults or calls ``sys.exit`` in execute fails only itself (its request gets
INTERNAL naming the model and the cause, the model turns UNAVAILABLE with that reason, a load brings
it back); a model spinning in Python does not hold up others; every instance is a process; tensors
cross in shared memory exactly; custom metrics and logs of the processes reach the server's; and
nothing outlives the server, whether it stops on SIGTERM (after finalize) or is killed.
"""

from __future__ import annotations

import json
import os
import signal
import textwrap
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from support import start_server
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process trees from /proc")

FP32_IO = """
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""
PID_IO = """
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "PID" data_type: TYPE_INT64 dims: [ 1 ] } ]
"""

CRASH = """
import ctypes, json, os, resource, sys
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        how = json.loads(requests[0].parameters()).get("how", "")
        if how in ("abort", "segfault"):
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the crash, without a core file in the working folder
        if how == "abort":
            os.abort()
        if how == "segfault":
            ctypes.string_at(0)
        if how == "exit":
            sys.exit(3)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                                                            .as_numpy())]) for r in requests]
"""
ECHO = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                                                            .as_numpy())]) for r in requests]
"""
SPIN = """
import json, time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        deadline = time.monotonic() + float(json.loads(requests[0].parameters()).get("seconds", 0))
        spins = 0
        while time.monotonic() < deadline:  # pure Python: holds its process's GIL all along
            spins += 1
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                                                            .as_numpy())]) for r in requests]
"""
WHOAMI = """
import os, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        pb_utils.Logger.log_info(f"{args['model_instance_name']} initialized in pid {os.getpid()}")
        self.requests = pb_utils.MetricFamily("whoami_requests", "requests executed",
                                              pb_utils.MetricFamily.COUNTER).Metric(labels={"model": args["model_name"]})

    def execute(self, requests):
        time.sleep(0.3)
        self.requests.increment(len(requests))
        return [pb_utils.InferenceResponse([pb_utils.Tensor("PID", np.array([os.getpid()], np.int64))])
                for _ in requests]
"""
BUSY = """
import time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.5)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                                                            .as_numpy())]) for r in requests]
"""
BUSY_IO = """
backend: "python"
max_batch_size: 1
input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
dynamic_batching { default_queue_policy { max_queue_size: 1 } }
"""
BLS_TO_BUSY = """
import asyncio
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            calls = [pb_utils.InferenceRequest(model_name="busy", inputs=[pb_utils.Tensor("IN", x[None])],
                                               requested_output_names=["OUT"]).async_exec() for _ in range(4)]
            failed = [answer for answer in await asyncio.gather(*calls) if answer.has_error()]
            responses.append(pb_utils.InferenceResponse(error=failed[0].error()) if failed
                             else pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]))
        return responses
"""
FINALIZER = """
import json, os, time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.marker = config["parameters"]["marker"]["string_value"] + "-" + args["model_instance_name"]

    def execute(self, requests):
        time.sleep(1.0)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                                                            .as_numpy())]) for r in requests]

    def finalize(self):
        with open(self.marker, "w") as f:
            f.write(str(os.getpid()))
"""


def parameters(**values: str) -> str:
    return "".join(f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}\n' for k, v in values.items())


def write_model(repo: Path, name: str, model_py: str, config: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(textwrap.dedent(model_py))
    (repo / name / "config.pbtxt").write_text(config)


def fp32(client_module, array: np.ndarray, name: str = "IN"):
    tensor = client_module.InferInput(name, list(array.shape), "FP32")
    tensor.set_data_from_numpy(array, binary_data=True)
    return [tensor]


# -- the process tree -------------------------------------------------------------------------------------
def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()  # [state, ppid, ...]
    except (FileNotFoundError, ProcessLookupError):
        return None


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            children.setdefault(int(stat[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [pid for pid in pids if alive(pid)]
        if not left:
            return []
        time.sleep(0.05)
    return [pid for pid in pids if alive(pid)]


# -- one server over models that crash, spin and report who they are ---------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("process-models")
    write_model(repo, "crash", CRASH, FP32_IO)
    write_model(repo, "crash_in_server", CRASH, FP32_IO + parameters(process_isolation="false"))
    write_model(repo, "echo", ECHO, FP32_IO)
    write_model(repo, "echo_small_arena", ECHO, FP32_IO + parameters(shm_arena_bytes=str(1 << 20)))
    write_model(repo, "spin", SPIN, FP32_IO)
    write_model(repo, "whoami", WHOAMI, PID_IO + "instance_group [ { kind: KIND_CPU count: 2 } ]\n")
    write_model(repo, "whoami_in_server", WHOAMI, PID_IO + parameters(process_isolation="false"))
    write_model(repo, "busy", BUSY, BUSY_IO)
    write_model(repo, "bls_to_busy", BLS_TO_BUSY, FP32_IO)
    running = start_server([repo], "--model-control-mode", "explicit", "--load-model", "*",
                           tmp_dir=tmp_path_factory.mktemp("process-server"))
    yield running
    running.stop()


@pytest.fixture()
def client(server):
    with httpclient.InferenceServerClient(server.http_url, network_timeout=60) as client:
        yield client


def health(server, path: str = "/v2/health/live") -> int:
    with urllib.request.urlopen(f"{server.base_url}{path}", timeout=10) as response:
        return response.status


def index_row(client, name: str) -> dict:
    return next(row for row in client.get_model_repository_index() if row["name"] == name)


@pytest.mark.parametrize(("how", "cause"), [("abort", "was killed by SIGABRT"), ("segfault", "was killed by SIGSEGV"),
                                            ("exit", "called sys.exit(3) in execute")])
def test_a_dying_model_process_fails_only_that_model_until_it_is_loaded_again(server, client, how, cause):
    ones = np.ones(3, np.float32)
    with pytest.raises(InferenceServerException) as info:
        client.infer("crash", fp32(httpclient, ones), parameters={"how": how})
    assert info.value.status() == "500"
    assert "model 'crash'" in info.value.message() and cause in info.value.message()
    # the server and every other model serve on
    assert health(server) == 200
    np.testing.assert_array_equal(client.infer("echo", fp32(httpclient, ones)).as_numpy("OUT"), ones)
    row = index_row(client, "crash")
    assert row["state"] == "UNAVAILABLE" and cause in row["reason"]
    assert not client.is_model_ready("crash")
    with pytest.raises(InferenceServerException) as info:
        client.infer("crash", fp32(httpclient, ones))
    assert info.value.status() == "503" and cause in info.value.message()
    client.load_model("crash")
    assert client.is_model_ready("crash") and index_row(client, "crash")["state"] == "READY"
    np.testing.assert_array_equal(client.infer("crash", fp32(httpclient, ones)).as_numpy("OUT"), ones)
    if how == "exit":
        assert "exited with code 3" in row["reason"]


def test_sys_exit_in_a_model_in_the_servers_process_fails_that_model_not_the_server(server, client):
    ones = np.ones(3, np.float32)
    with pytest.raises(InferenceServerException) as info:
        client.infer("crash_in_server", fp32(httpclient, ones), parameters={"how": "exit"})
    assert info.value.status() == "500" and "called sys.exit(3) in execute" in info.value.message()
    assert health(server) == 200 and server.process.poll() is None
    row = index_row(client, "crash_in_server")
    assert row["state"] == "UNAVAILABLE" and "called sys.exit(3)" in row["reason"]
    client.load_model("crash_in_server")
    np.testing.assert_array_equal(client.infer("crash_in_server", fp32(httpclient, ones)).as_numpy("OUT"), ones)


def test_poll_mode_loads_a_model_whose_process_died_again(tmp_path):
    repo = tmp_path / "models"
    write_model(repo, "crash", CRASH, FP32_IO)
    running = start_server([repo], "--model-control-mode", "poll", "--repository-poll-secs", "0.5", tmp_dir=tmp_path)
    ones = np.ones(2, np.float32)
    try:
        with httpclient.InferenceServerClient(running.http_url, network_timeout=60) as client:
            with pytest.raises(InferenceServerException, match="SIGABRT"):
                client.infer("crash", fp32(httpclient, ones), parameters={"how": "abort"})
            deadline = time.monotonic() + 20
            while not client.is_model_ready("crash") and time.monotonic() < deadline:
                time.sleep(0.1)
            np.testing.assert_array_equal(client.infer("crash", fp32(httpclient, ones)).as_numpy("OUT"), ones)
    finally:
        running.stop()


def test_a_model_spinning_in_python_does_not_hold_up_other_models_or_health(server, client):
    ones = np.ones(2, np.float32)
    spun: list = []
    with httpclient.InferenceServerClient(server.http_url, network_timeout=60) as spinner:
        thread = threading.Thread(target=lambda: spun.append(
            spinner.infer("spin", fp32(httpclient, ones), parameters={"seconds": "3"}).as_numpy("OUT")))
        started = time.monotonic()
        thread.start()
        time.sleep(0.3)
        for _ in range(3):
            begin = time.monotonic()
            np.testing.assert_array_equal(client.infer("echo", fp32(httpclient, ones)).as_numpy("OUT"), ones)
            assert health(server) == 200 and health(server, "/v2/health/ready") == 200
            assert time.monotonic() - begin < 1.0  # a generous bound: it takes milliseconds
        assert time.monotonic() - started < 2.5  # all of that while the other model was still spinning
        thread.join(30)
    np.testing.assert_array_equal(spun[0], ones)


def test_every_instance_is_a_process_of_its_own(server, client):
    pids: set[int] = set()
    with httpclient.InferenceServerClient(server.http_url, concurrency=4, network_timeout=60) as parallel:
        for _ in range(5):  # two requests at once keep both instances busy
            pending = [parallel.async_infer("whoami", fp32(httpclient, np.ones(1, np.float32))) for _ in range(2)]
            pids |= {int(p.get_result().as_numpy("PID")[0]) for p in pending}
            if len(pids) == 2:
                break
    assert len(pids) == 2 and server.process.pid not in pids
    model_processes = set(descendants(server.process.pid))
    assert pids <= model_processes
    # process_isolation "false" keeps the old mode: the model runs in the server's own process
    in_server = client.infer("whoami_in_server", fp32(httpclient, np.ones(1, np.float32)))
    assert int(in_server.as_numpy("PID")[0]) == server.process.pid


def test_custom_metrics_and_logs_of_the_processes_reach_the_server(server, client):
    before = _counter(server.metrics(), 'whoami_requests_total{model="whoami"}')
    with httpclient.InferenceServerClient(server.http_url, concurrency=4, network_timeout=60) as parallel:
        pending = [parallel.async_infer("whoami", fp32(httpclient, np.ones(1, np.float32))) for _ in range(4)]
        pids = {int(p.get_result().as_numpy("PID")[0]) for p in pending}
    assert _counter(server.metrics(), 'whoami_requests_total{model="whoami"}') == before + 4  # summed over processes
    log = server.log()
    for pid in pids:
        assert f"initialized in pid {pid}" in log


def _counter(text: str, series: str) -> float:
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(series)), 0.0)


@pytest.mark.parametrize("model", ["echo", "echo_small_arena"])  # the request arena, then files of their own
def test_a_large_tensor_crosses_shared_memory_exactly(client, model):
    data = np.random.default_rng(7).standard_normal(8 * 1024 * 1024).astype(np.float32)  # 32 MiB
    for _ in range(2):  # the second time reuses what the first freed
        result = client.infer(model, fp32(httpclient, data),
                              outputs=[httpclient.InferRequestedOutput("OUT", binary_data=True)])
        out = result.as_numpy("OUT")
        assert out.dtype == np.float32 and out.shape == data.shape
        assert out.tobytes() == data.tobytes()


def test_a_bls_error_reaches_the_client_with_its_status_and_retry_after(server, client):
    """A BLS call refused by a full queue (503 + Retry-After, gRPC UNAVAILABLE) comes back to the calling model
    with its codes and advice, and the model's response with that error reaches the client the same way."""
    data = np.ones(4, np.float32)
    with pytest.raises(InferenceServerException) as refused:
        client.infer("bls_to_busy", fp32(httpclient, data))
    assert refused.value.status() == "503"
    assert "exceeds maximum queue size for model 'busy'" in refused.value.message()
    body = json.dumps({"inputs": [{"name": "IN", "shape": [4], "datatype": "FP32", "data": data.tolist()}]})
    request = urllib.request.Request(f"{server.base_url}/v2/models/bls_to_busy/infer", body.encode(),
                                     {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as answered:
        urllib.request.urlopen(request, timeout=30)
    assert answered.value.code == 503 and answered.value.headers["Retry-After"] == "1"
    assert "exceeds maximum queue size for model 'busy'" in json.loads(answered.value.read())["error"]
    tensor = grpcclient.InferInput("IN", [4], "FP32")
    tensor.set_data_from_numpy(data)
    with grpcclient.InferenceServerClient(server.grpc_url) as grpc:
        with pytest.raises(InferenceServerException) as refused:
            grpc.infer("bls_to_busy", [tensor])
    assert refused.value.status() == "StatusCode.UNAVAILABLE"


# -- stopping the server ----------------------------------------------------------------------------------
def _stop_repository(tmp_path: Path) -> tuple[Path, Path]:
    repo, markers = tmp_path / "models", tmp_path / "markers"
    markers.mkdir()
    write_model(repo, "finalizer", FINALIZER, FP32_IO + parameters(marker=str(markers / "finalized"))
                + "instance_group [ { kind: KIND_CPU count: 2 } ]\n")
    write_model(repo, "echo", ECHO, FP32_IO)
    return repo, markers


def test_sigterm_finishes_in_flight_requests_finalizes_and_leaves_no_process(tmp_path):
    repo, markers = _stop_repository(tmp_path)
    running = start_server([repo], tmp_dir=tmp_path)
    processes = descendants(running.process.pid)
    assert len(processes) >= 4  # the zygote, the processes of finalizer (2) and echo
    answered: list = []
    with httpclient.InferenceServerClient(running.http_url, network_timeout=60) as client:
        thread = threading.Thread(target=lambda: answered.append(
            client.infer("finalizer", fp32(httpclient, np.full(2, 5, np.float32))).as_numpy("OUT")))
        thread.start()
        time.sleep(0.3)  # the request is in execute (1 s)
        assert running.stop(signal.SIGTERM) == 0
        thread.join(10)
    assert answered and answered[0].tolist() == [5.0, 5.0]
    finalized = sorted(p.name for p in markers.iterdir())
    assert finalized == ["finalized-finalizer_0_0", "finalized-finalizer_0_1"]
    assert not wait_gone(processes)


def test_a_killed_server_leaves_no_process(tmp_path):
    repo, _ = _stop_repository(tmp_path)
    running = start_server([repo], tmp_dir=tmp_path)
    processes = descendants(running.process.pid)
    assert len(processes) >= 4
    running.stop(signal.SIGKILL)
    assert not wait_gone(processes)


def test_in_flight_requests_of_a_dead_process_get_the_error(tmp_path):
    """Several requests wait on one process; it is killed from outside: each gets INTERNAL naming the cause."""
    repo, _ = _stop_repository(tmp_path)
    running = start_server([repo], "--model-control-mode", "explicit", "--load-model", "finalizer",
                           tmp_dir=tmp_path)
    try:
        before = set(descendants(running.process.pid))
        errors: list = []
        with httpclient.InferenceServerClient(running.http_url, concurrency=4, network_timeout=60) as client:
            pending = [client.async_infer("finalizer", fp32(httpclient, np.ones(1, np.float32))) for _ in range(4)]
            time.sleep(0.3)
            for pid in before:  # the two instance processes (not the zygote, whose children they are)
                if _stat(pid) is not None and int(_stat(pid)[1]) != running.process.pid:
                    os.kill(pid, signal.SIGKILL)
            for request in pending:
                try:
                    request.get_result()
                except InferenceServerException as exc:
                    errors.append(exc)
            assert errors and all(e.status() == "500" and "SIGKILL" in e.message() for e in errors)
            index = {row["name"]: row for row in client.get_model_repository_index()}
            assert index["finalizer"]["state"] == "UNAVAILABLE" and "SIGKILL" in index["finalizer"]["reason"]
            assert health(running) == 200
    finally:
        running.stop()
