"""``--frontend-workers 2 --frontend-direct on``: the workers send plain requests to Python models straight to the
models' instance processes (server/workers/direct.py, general_backends/python/direct.py). Batching across
workers, one statistics and metrics view, the core's errors, decoupled streams, cancellation, unload / reload
and a dying instance process, with tritonclient over HTTP and gRPC."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import struct
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from support import TEST_MODELS, start_server
from tideserve.workers.direct import DIRECT_EXECUTING, DIRECT_QUEUED_MASK, DIRECT_SHORT_RUNS
from tritonclient.utils import InferenceServerException

SLOW = """
import json, os, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.sleep = float(config["parameters"]["sleep"]["string_value"])
        marker = config["parameters"].get("marker")
        if marker:
            with open(marker["string_value"], "w") as f:
                f.write(str(os.getpid()))

    def execute(self, requests):
        time.sleep(self.sleep)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                                                            .as_numpy() * 2)]) for r in requests]
"""

SLOW_CONFIG = """
backend: "python"
max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
dynamic_batching { }
"""

# calls itself through BLS DEPTH times, each call on another instance (Triton's bls_parameters test does the same)
RECURSIVE = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            depth = pb_utils.get_input_tensor_by_name(request, "DEPTH").as_numpy()
            calls = np.ones(1, dtype=np.int32)
            if depth[0] > 0:
                inner = pb_utils.InferenceRequest(model_name="recursive", requested_output_names=["CALLS"],
                                                  inputs=[pb_utils.Tensor("DEPTH", depth - 1)]).exec()
                if inner.has_error():
                    raise pb_utils.TritonModelException(inner.error().message())
                calls = pb_utils.get_output_tensor_by_name(inner, "CALLS").as_numpy() + 1
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("CALLS", calls)]))
        return responses
"""

RECURSIVE_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "DEPTH" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "CALLS" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 4 } ]
"""


WARMUP = """
model_warmup [ { name: "zeros" batch_size: 2 count: 2
  inputs { key: "INPUT0" value { data_type: TYPE_FP32 dims: [ 4 ] zero_data: true } }
  inputs { key: "INPUT1" value { data_type: TYPE_FP32 dims: [ 4 ] zero_data: true } } } ]
"""


def _parameters(**values: str) -> str:
    return "".join(f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}\n' for k, v in values.items())


def _add_sub_copy(repo: Path, name: str, tail: str) -> None:
    shutil.copytree(TEST_MODELS / "add_sub", repo / name)
    config = (TEST_MODELS / "add_sub" / "config.pbtxt").read_text().replace('name: "add_sub"', f'name: "{name}"')
    config = re.sub(r"instance_group.*\n", "", config)
    config = re.sub(r"dynamic_batching.*\n", "", config)
    (repo / name / "config.pbtxt").write_text(config + tail)


def _slow(repo: Path, name: str, **params: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(textwrap.dedent(SLOW))
    (repo / name / "config.pbtxt").write_text(SLOW_CONFIG + _parameters(**params))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("direct-models")
    shutil.copytree(TEST_MODELS / "repeat", repo / "repeat")
    _add_sub_copy(repo, "add_sub", "instance_group [ { kind: KIND_CPU count: 2 } ]\n"
                                   "dynamic_batching { max_queue_delay_microseconds: 100 }\n")
    # a batch of 4 runs as soon as 4 are queued; fewer wait for up to 5 s
    _add_sub_copy(repo, "batcher", "instance_group [ { kind: KIND_CPU count: 1 } ]\n"
                                   "dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 5000000 }\n")
    _add_sub_copy(repo, "checked", "instance_group [ { kind: KIND_CPU count: 1 } ]\n")
    # waits shorter than the loop's timers can time: the instance process's batcher uses its fine timer
    _add_sub_copy(repo, "burst", "instance_group [ { kind: KIND_CPU count: 2 } ]\n"
                                 "dynamic_batching { max_queue_delay_microseconds: 300 }\n")
    marker = tmp_path_factory.mktemp("direct-marker") / "victim.pid"
    _slow(repo, "victim", sleep="3", marker=str(marker))
    _slow(repo, "slow", sleep="0.3")
    _slow(repo, "queued", sleep="1.5")
    config = (repo / "queued" / "config.pbtxt").read_text()
    (repo / "queued" / "config.pbtxt").write_text(config.replace(
        "dynamic_batching { }", "dynamic_batching { default_queue_policy { max_queue_size: 1 } }"))
    (repo / "recursive" / "1").mkdir(parents=True)
    (repo / "recursive" / "1" / "model.py").write_text(textwrap.dedent(RECURSIVE))
    (repo / "recursive" / "config.pbtxt").write_text(RECURSIVE_CONFIG)
    shutil.copytree(TEST_MODELS / "repeat", repo / "orphaned")
    config = (repo / "orphaned" / "config.pbtxt").read_text()
    (repo / "orphaned" / "config.pbtxt").write_text(config.replace('name: "repeat"', 'name: "orphaned"'))
    running = start_server([repo], "--frontend-workers", "2", "--frontend-direct", "on", "--log-verbose", "1",
                           "--model-control-mode", "explicit", "--load-model", "*",
                           tmp_dir=tmp_path_factory.mktemp("direct-server"))
    running.victim_marker = marker
    yield running
    running.stop()


def _add_sub_inputs(module, rows: int = 1, width: int = 4, offset: float = 0.0):
    a = (np.arange(rows * width, dtype=np.float32) + offset).reshape(rows, width)
    inputs = [module.InferInput("INPUT0", [rows, width], "FP32"), module.InferInput("INPUT1", [rows, width], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(np.ones_like(a))
    return inputs, a


def _stats(server, name: str) -> dict:
    with httpclient.InferenceServerClient(server.http_url) as client:
        return client.get_inference_statistics(name)["model_stats"][0]


def _metric(text: str, family: str, model: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(family + "{") and f'model="{model}"' in line and all(
                f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _metrics(server) -> str:
    with urllib.request.urlopen(f"{server.base_url}/metrics", timeout=10) as response:
        return response.read().decode()


def _core_metrics(server) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as response:
        return response.read().decode()


def _live(server) -> int:
    with urllib.request.urlopen(f"{server.base_url}/v2/health/live", timeout=10) as response:
        return response.status


def test_requests_from_both_workers_batch_in_the_instance_process(server):
    with httpclient.InferenceServerClient(server.http_url, concurrency=4, network_timeout=60) as client:
        sent = []
        for i in range(4):
            inputs, a = _add_sub_inputs(httpclient, offset=10 * i)
            sent.append((client.async_infer("batcher", inputs), a))
        for pending, a in sent:
            result = pending.get_result()
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + 1)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - 1)
    stats = _stats(server, "batcher")
    assert stats["inference_stats"]["success"]["count"] == 4
    assert stats["inference_count"] == 4
    assert stats["execution_count"] == 1, stats
    assert [b["batch_size"] for b in stats["batch_stats"]] == [4]
    assert "a frontend worker linked directly" in server.log()


def test_grpc_and_http_requests_are_counted_once_in_statistics_and_metrics(server):
    with grpcclient.InferenceServerClient(server.grpc_url) as grpc_client:
        for i in range(5):
            inputs, a = _add_sub_inputs(grpcclient, offset=i)
            result = grpc_client.infer("add_sub", inputs)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + 1)
        stats = grpc_client.get_inference_statistics("add_sub", as_json=True)["model_stats"][0]
    assert int(stats["inference_stats"]["success"]["count"]) == 5
    with httpclient.InferenceServerClient(server.http_url) as client:
        for i in range(3):
            inputs, _ = _add_sub_inputs(httpclient, rows=2)
            client.infer("add_sub", inputs)
    stats = _stats(server, "add_sub")
    assert stats["inference_stats"]["success"]["count"] == 8
    assert stats["inference_count"] == 11  # 5 of one row, 3 of two
    text = _metrics(server)
    assert _metric(text, "nv_inference_request_success", "add_sub") == 8
    assert _metric(text, "nv_inference_count", "add_sub") == 11
    assert _metric(text, "nv_inference_exec_count", "add_sub") == stats["execution_count"]
    assert _metric(text, "nv_inference_request_duration_histogram_ms_count", "add_sub") == 8


def test_a_burst_over_both_protocols_batches_and_each_request_gets_its_own_answer(server):
    """Requests of one loop turn leave a worker in one message to one instance process, and a batch's answers come
    back in one message: each must still reach its own request (distinct inputs, checked one by one)."""
    sent = []
    with httpclient.InferenceServerClient(server.http_url, concurrency=8, network_timeout=60) as client, \
            grpcclient.InferenceServerClient(server.grpc_url) as grpc_client:
        for i in range(24):
            inputs, a = _add_sub_inputs(httpclient, rows=1 + i % 2, offset=100 * i)
            sent.append((client.async_infer("burst", inputs).get_result, a))
        for i in range(24):
            inputs, a = _add_sub_inputs(grpcclient, rows=1 + i % 2, offset=-100 * (i + 1))
            done = threading.Event()
            box = {}

            def callback(result, error, box=box, done=done):
                box["result"], box["error"] = result, error
                done.set()

            grpc_client.async_infer("burst", inputs, callback)
            sent.append((lambda box=box, done=done: done.wait(60) and box["error"] is None and box["result"], a))
        for get, a in sent:
            result = get()
            assert result, "no answer (or an error)"
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + 1)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - 1)
    stats = _stats(server, "burst")
    assert stats["inference_stats"]["success"]["count"] == 48
    assert stats["inference_count"] == 72  # half of them with two rows
    assert 1 <= stats["execution_count"] <= 48
    # and one at a time, each alone in its batch: the sub-millisecond wait ends on the fine timer
    with httpclient.InferenceServerClient(server.http_url) as client:
        for i in range(3):
            inputs, a = _add_sub_inputs(httpclient, offset=i)
            np.testing.assert_array_equal(client.infer("burst", inputs).as_numpy("OUTPUT0"), a + 1)


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            with contextlib.suppress(OSError):
                children = [int(c) for c in (task / "children").read_text().split()]
                found += children
                todo += children
    return found


def test_each_instance_process_shares_its_queue_count_and_the_workers_read_it(server):
    with httpclient.InferenceServerClient(server.http_url) as client:
        for i in range(4):
            inputs, a = _add_sub_inputs(httpclient, offset=i)
            np.testing.assert_array_equal(client.infer("add_sub", inputs).as_numpy("OUTPUT0"), a + 1)
    writers, readers = {}, {}
    for pid in _descendants(server.process.pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                fields = line.split()
                if fields[-1].endswith(".sock.queue"):
                    (writers if fields[1].startswith("rw") else readers).setdefault(fields[-1], pid)
    # each instance process of a model with a dynamic batcher writes one; a worker that sent there reads it
    assert len(writers) >= 2, writers
    shared = set(readers) & set(writers)
    assert shared, (readers, writers)
    for path in shared:  # nothing queued now, no batch running: the instance took its requests into batches
        # (its answer can reach the client before the instance marks its batch's end: wait for that, briefly)
        deadline = time.monotonic() + 10
        while True:
            (word,) = struct.unpack("q", Path(path).read_bytes())
            if not word & DIRECT_EXECUTING or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert word & DIRECT_QUEUED_MASK == 0 and not word & DIRECT_EXECUTING, hex(word)
        assert word & ~DIRECT_SHORT_RUNS == 0, hex(word)  # at most the bit that says its batches ran short


def test_a_bad_input_gets_the_core_paths_error_and_is_counted(server):
    expected = "unexpected shape for input 'INPUT0' for model 'checked'. Expected [-1, 4], got [1, 3]"
    before = _stats(server, "checked")["inference_stats"]["fail"]["count"]
    inputs, _ = _add_sub_inputs(httpclient, width=3)
    with httpclient.InferenceServerClient(server.http_url) as client, \
            pytest.raises(InferenceServerException) as caught:
        client.infer("checked", inputs)
    assert caught.value.status() == "400" and expected in caught.value.message()
    inputs, _ = _add_sub_inputs(grpcclient, width=3)
    with grpcclient.InferenceServerClient(server.grpc_url) as grpc_client, \
            pytest.raises(InferenceServerException) as caught:
        grpc_client.infer("checked", inputs)
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT" and expected in caught.value.message()
    assert _stats(server, "checked")["inference_stats"]["fail"]["count"] == before + 2


def test_a_model_warmed_up_through_the_core_keeps_answering_the_core_once_its_links_open(tmp_path):
    """Warmup runs batches through the core (the instance's thread reading the process's socket between them)
    before the model is READY; the workers' links open after it, and the instance's thread then runs their loop.
    The process still reads the core's messages: statistics (its counters of direct requests), unload, load."""
    _add_sub_copy(tmp_path / "models", "warmed", "instance_group [ { kind: KIND_CPU count: 1 } ]\n" + WARMUP)
    running = start_server([tmp_path / "models"], "--frontend-workers", "2", "--frontend-direct", "on",
                           "--model-control-mode", "explicit", "--load-model", "warmed", tmp_dir=tmp_path)
    try:
        inputs, a = _add_sub_inputs(httpclient)
        with httpclient.InferenceServerClient(running.http_url, network_timeout=60) as client:
            for count in (1, 2, 3):
                assert np.array_equal(client.infer("warmed", inputs).as_numpy("OUTPUT0"), a + 1)
                assert _stats(running, "warmed")["inference_count"] == count  # the warmup's batches are not counted
                client.unload_model("warmed")
                assert not client.is_model_ready("warmed")
                client.load_model("warmed")
    finally:
        running.stop()


def _repeat_inputs(values, delay_ms: int = 0):
    tensor = grpcclient.InferInput("IN", [len(values)], "INT32")
    tensor.set_data_from_numpy(np.array(values, np.int32))
    inputs = [tensor]
    if delay_ms:
        delay = grpcclient.InferInput("DELAY", [1], "UINT32")
        delay.set_data_from_numpy(np.array([delay_ms], np.uint32))
        inputs.append(delay)
    return inputs


def test_a_decoupled_model_streams_its_responses_and_a_closed_stream_cancels(server):
    received: list = []
    done = threading.Event()

    def callback(result, error):
        received.append(error if error is not None else result)
        if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
            done.set()

    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback)
        client.async_stream_infer("repeat", _repeat_inputs([5, 6, 7]), enable_empty_final_response=True)
        assert done.wait(30)
        client.stop_stream()
    outs = [r.as_numpy("OUT")[0] for r in received if r.as_numpy("OUT") is not None]
    assert outs == [5, 6, 7]
    assert _stats(server, "repeat")["inference_stats"]["success"]["count"] == 1

    first = threading.Event()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(lambda result, error: first.set())
        client.async_stream_infer("repeat", _repeat_inputs(list(range(20)), delay_ms=200))
        assert first.wait(30)
        client.stop_stream(cancel_requests=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if _metric(_metrics(server), "nv_inference_request_failure", "repeat", reason="CANCELED") == 1:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the cancelled request was not counted")
    assert _stats(server, "repeat")["inference_stats"]["fail"]["count"] == 1


def test_unload_and_reload_while_requests_run(server):
    results: list = []

    def send(i):
        with httpclient.InferenceServerClient(server.http_url, network_timeout=60) as client:
            tensor = httpclient.InferInput("IN", [1, 1], "FP32")
            tensor.set_data_from_numpy(np.array([[i]], np.float32))
            try:
                results.append(bool(client.infer("slow", [tensor]).as_numpy("OUT")[0][0] == 2 * i))
            except InferenceServerException as exc:
                results.append(exc)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
        time.sleep(0.05)
    with httpclient.InferenceServerClient(server.http_url, network_timeout=60) as client:
        client.unload_model("slow")
        for thread in threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in threads)
        assert len(results) == 6
        for result in results:  # answered in full before the unload, or refused plainly
            assert result is True or (isinstance(result, InferenceServerException)
                                      and result.status() in ("400", "404", "503")), result
        assert any(result is True for result in results)
        client.load_model("slow")
        tensor = httpclient.InferInput("IN", [1, 1], "FP32")
        tensor.set_data_from_numpy(np.array([[21]], np.float32))
        deadline = time.monotonic() + 30
        while True:
            try:
                assert client.infer("slow", [tensor]).as_numpy("OUT")[0][0] == 42
                break
            except InferenceServerException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


def test_a_killed_instance_process_fails_its_direct_requests_and_the_server_serves_on(server):
    pid = int(server.victim_marker.read_text())
    errors: list = []
    with httpclient.InferenceServerClient(server.http_url, concurrency=2, network_timeout=60) as client:
        pending = []
        for i in range(2):
            tensor = httpclient.InferInput("IN", [1, 1], "FP32")
            tensor.set_data_from_numpy(np.array([[i]], np.float32))
            pending.append(client.async_infer("victim", [tensor]))
        time.sleep(1.0)
        os.kill(pid, signal.SIGKILL)
        for request in pending:
            try:
                request.get_result()
            except InferenceServerException as exc:
                errors.append(exc)
        assert len(errors) == 2
        for error in errors:
            assert error.status() == "500"
            assert "Failed to process the request(s) for model 'victim'" in error.message()
            assert "SIGKILL" in error.message()
        assert _live(server) == 200
        inputs, a = _add_sub_inputs(httpclient)
        np.testing.assert_array_equal(client.infer("add_sub", inputs).as_numpy("OUTPUT0"), a + 1)
    assert _stats(server, "victim")["inference_stats"]["fail"]["count"] == 2


def test_a_full_queue_refuses_with_the_core_paths_error(server):
    results: list = []

    def send(i):
        with httpclient.InferenceServerClient(server.http_url, network_timeout=60) as client:
            tensor = httpclient.InferInput("IN", [1, 1], "FP32")
            tensor.set_data_from_numpy(np.array([[i]], np.float32))
            try:
                client.infer("queued", [tensor])
                results.append(None)
            except InferenceServerException as exc:
                results.append(exc)

    threads = []
    for i, pause in enumerate((0.5, 0.2, 0.0)):  # one runs, one waits in the queue, the third finds it full
        threads.append(threading.Thread(target=send, args=(i,)))
        threads[-1].start()
        time.sleep(pause)
    for thread in threads:
        thread.join(60)
    errors = [r for r in results if r is not None]
    assert len(results) == 3 and len(errors) == 1, results
    assert errors[0].status() == "503"
    assert "exceeds maximum queue size for model 'queued'" in errors[0].message()
    text = _metrics(server)
    assert _metric(text, "nv_inference_request_failure", "queued", reason="REJECTED") == 1
    assert _metric(text, "nv_inference_request_success", "queued") == 2


def _worker_pids(server) -> list[int]:
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int(Path(entry, "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = Path(entry, "cmdline").read_bytes()
        except OSError:
            continue
        # a frontend worker, or the gRPC frontend's Envoy (TIDESERVE_TEST_GRPC_FRONTEND=pyvoy)
        if ppid == server.process.pid and (b"tideserve.workers.main" in cmdline or b"envoy" in cmdline):
            found.append(int(entry.name))
    return found


def test_the_instance_process_cancels_the_requests_of_a_worker_that_died(server):
    first = threading.Event()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(lambda result, error: first.set())
    client.async_stream_infer("orphaned", _repeat_inputs(list(range(50)), delay_ms=200))
    assert first.wait(30)
    for pid in _worker_pids(server):  # whichever took the stream
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(Exception):  # its server end is gone
        client.stop_stream()
        client.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if _metric(_core_metrics(server), "nv_inference_request_failure", "orphaned", reason="CANCELED") == 1:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the orphaned request was not cancelled")
    deadline = time.monotonic() + 60  # the core starts other workers
    while True:
        try:
            with httpclient.InferenceServerClient(server.http_url) as http:
                inputs, a = _add_sub_inputs(httpclient)
                np.testing.assert_array_equal(http.infer("add_sub", inputs).as_numpy("OUTPUT0"), a + 1)
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_a_model_that_calls_itself_through_other_instances_is_not_sent_to_its_own_busy_instance(server):
    # The first call runs in an instance the core did not send it to; the core must not hand that instance the
    # model's BLS call to itself (it would wait behind the batch that waits for it), but a free one
    depth = np.array([3], dtype=np.int32)
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        for _ in range(4):  # each worker's next request goes to another instance
            inputs = [grpcclient.InferInput("DEPTH", [1], "INT32")]
            inputs[0].set_data_from_numpy(depth)
            result = client.infer("recursive", inputs, client_timeout=30)
            assert result.as_numpy("CALLS").tolist() == [4]
    assert _stats(server, "recursive")["inference_stats"]["success"]["count"] == 16


def test_one_worker_with_direct_instances_serves_both_protocols_without_the_core(tmp_path_factory):
    """``--frontend-workers 1 --frontend-direct on``: one worker process serves the ports and sends add_sub's
    requests straight to its instance processes (the core runs no request of theirs), as two workers do."""
    repo = tmp_path_factory.mktemp("one-worker-models")
    _add_sub_copy(repo, "add_sub", "instance_group [ { kind: KIND_CPU count: 2 } ]\n"
                                   "dynamic_batching { max_queue_delay_microseconds: 100 }\n")
    running = start_server([repo], "--frontend-workers", "1", "--frontend-direct", "on", "--log-verbose", "1",
                           tmp_dir=tmp_path_factory.mktemp("one-worker-server"))
    try:
        with httpclient.InferenceServerClient(running.http_url) as client:
            inputs, a = _add_sub_inputs(httpclient, rows=2)
            np.testing.assert_array_equal(client.infer("add_sub", inputs).as_numpy("OUTPUT0"), a + 1)
        with grpcclient.InferenceServerClient(running.grpc_url) as grpc_client:
            inputs, a = _add_sub_inputs(grpcclient)
            np.testing.assert_array_equal(grpc_client.infer("add_sub", inputs).as_numpy("OUTPUT1"), a - 1)
        assert _stats(running, "add_sub")["inference_count"] == 3
        log = running.log()
        assert "1 frontend worker processes" in log and "a frontend worker linked directly" in log
        _http_bodies_are_decoded_in_the_instance_process(running)
    finally:
        running.stop()


def _http_bodies_are_decoded_in_the_instance_process(running) -> None:
    """An HTTP infer body goes to the instance process as it came, which decodes it and answers with the HTTP body
    (JSON or binary tensors, the request's id); one it does not take whole goes the frontend's way, with its words:
    a bad shape (the core's error, counted once), classification (the frontend's labels)."""
    before = _stats(running, "add_sub")
    with httpclient.InferenceServerClient(running.http_url) as client:
        for binary in (False, True):
            a = np.arange(8, dtype=np.float32).reshape(2, 4)
            inputs = [httpclient.InferInput(name, [2, 4], "FP32") for name in ("INPUT0", "INPUT1")]
            inputs[0].set_data_from_numpy(a, binary_data=binary)
            inputs[1].set_data_from_numpy(np.ones_like(a), binary_data=binary)
            outputs = [httpclient.InferRequestedOutput(name, binary_data=binary) for name in ("OUTPUT0", "OUTPUT1")]
            result = client.infer("add_sub", inputs, outputs=outputs, request_id=f"body-{binary}")
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + 1)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - 1)
            assert result.get_response()["id"] == f"body-{binary}"
            assert result.get_response()["model_version"] == "1"
        inputs, a = _add_sub_inputs(httpclient)
        labelled = client.infer("add_sub", inputs, outputs=[httpclient.InferRequestedOutput("OUTPUT0", class_count=2)])
        assert labelled.as_numpy("OUTPUT0").tolist() == [[b"4.000000:3", b"3.000000:2"]]
        inputs, _ = _add_sub_inputs(httpclient, width=3)
        with pytest.raises(InferenceServerException) as caught:
            client.infer("add_sub", inputs)
    assert caught.value.status() == "400"
    assert "unexpected shape for input 'INPUT0' for model 'add_sub'. Expected [-1, 4], got [1, 3]" in \
        caught.value.message()
    after = _stats(running, "add_sub")
    assert after["inference_stats"]["success"]["count"] == before["inference_stats"]["success"]["count"] + 3
    assert after["inference_stats"]["fail"]["count"] == before["inference_stats"]["fail"]["count"] + 1
    assert "HTTP infer bodies are decoded here" in running.log()
