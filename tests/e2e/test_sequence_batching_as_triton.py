"""What Triton's qa/L0_sequence_batcher and L0_implicit_state pin about sequence batching, against a real tideserve
process with tritonclient: requests whose shapes (implicit state included) differ never share a direct batch,
backlogged sequences honour request timeouts, responses on one gRPC stream come back in request order, and
Triton's scheduler test hooks (TRITONSERVER_DELAY_SCHEDULER) give the exact batches and counts Triton reports.
"""

from __future__ import annotations

import queue
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from support import start_server

# OUTPUT = INPUT_STATE ++ INPUT along the row, OUTPUT_STATE = INPUT: each request sees the previous input
STRING_STATE_CONFIG = """
name: "string_state"
backend: "onnxruntime"
max_batch_size: 2
input [ { name: "INPUT" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_STRING dims: [ -1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
sequence_batching {
  direct { max_queue_delay_microseconds: 1000000 minimum_slot_utilization: 1.0 }
  state [ { input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_STRING dims: [ -1 ] } ]
}
"""

SLOW_CONFIG = """
name: "slow_sequence"
backend: "python"
max_batch_size: 1
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
sequence_batching { max_sequence_idle_microseconds: 50000000 }
"""

SLOW_MODEL = textwrap.dedent("""
    import time
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            time.sleep(0.6)
            return [pb_utils.InferenceResponse([pb_utils.Tensor(
                "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())]) for r in requests]
""")

ORDERED_CONFIG = """
name: "ordered_oldest"
backend: "python"
max_batch_size: 2
input [ { name: "SLEEP_MS" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "SLEPT_MS" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
sequence_batching {
  oldest { max_candidate_sequences: 2 preserve_ordering: true }
  max_sequence_idle_microseconds: 10000000
}
"""

SLEEPER = textwrap.dedent("""
    import time
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            responses = []
            for r in requests:
                sleep = pb_utils.get_input_tensor_by_name(r, "SLEEP_MS").as_numpy()
                time.sleep(int(sleep.ravel()[0]) / 1000)
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("SLEPT_MS", sleep)]))
            return responses
""")

HELD_CONFIG = """
name: "held_direct"
backend: "python"
max_batch_size: 2
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "BATCH" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
sequence_batching {
  control_input [ { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] } ]
}
"""

BATCH_SIZE_MODEL = textwrap.dedent("""
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            rows = np.array([[len(requests)]], dtype=np.int32)
            return [pb_utils.InferenceResponse([pb_utils.Tensor("BATCH", rows)]) for _ in requests]
""")


def write_model(root: Path, name: str, config: str, model_py: str | None = None) -> Path:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(config)
    if model_py is not None:
        (root / name / "1" / "model.py").write_text(model_py)
    return root / name


def make_string_state_model(path: Path) -> None:
    from onnx import TensorProto, helper, save

    def io(name, width):
        return helper.make_tensor_value_info(name, TensorProto.STRING, ["batch", width])

    nodes = [helper.make_node("Concat", ["INPUT_STATE", "INPUT"], ["OUTPUT"], axis=1),
             helper.make_node("Identity", ["INPUT"], ["OUTPUT_STATE"])]
    graph = helper.make_graph(nodes, "string_state", [io("INPUT", "n"), io("INPUT_STATE", "s")],
                              [io("OUTPUT", "m"), io("OUTPUT_STATE", "n")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    save(model, str(path))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("onnx")
    root = tmp_path_factory.mktemp("triton_sequence_models")
    make_string_state_model(write_model(root, "string_state", STRING_STATE_CONFIG) / "1" / "model.onnx")
    write_model(root, "slow_sequence", SLOW_CONFIG, SLOW_MODEL)
    write_model(root, "ordered_oldest", ORDERED_CONFIG, SLEEPER)
    running = start_server([root], tmp_dir=tmp_path_factory.mktemp("triton_sequence_logs"))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def held_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("held_models")
    write_model(root, "held_direct", HELD_CONFIG, BATCH_SIZE_MODEL)
    running = start_server([root], tmp_dir=tmp_path_factory.mktemp("held_logs"),
                           env={"TRITONSERVER_DELAY_SCHEDULER": "4", "TRITONSERVER_BACKLOG_DELAY_SCHEDULER": "0"})
    yield running
    running.stop()


def strings(*values: str) -> np.ndarray:
    return np.array([[v.encode() for v in values]], dtype=np.object_)


def infer_strings(server, values, sequence_id, **flags):
    client = httpclient.InferenceServerClient(server.http_url)
    tensor = httpclient.InferInput("INPUT", [1, len(values)], "BYTES")
    tensor.set_data_from_numpy(strings(*values))
    result = client.infer("string_state", [tensor], sequence_id=sequence_id, **flags)
    return [v.decode() for v in result.as_numpy("OUTPUT").ravel()]


def batch_counts(server, model: str) -> tuple[int, int, dict[int, int]]:
    stats = httpclient.InferenceServerClient(server.http_url).get_inference_statistics(model)["model_stats"][0]
    batches = {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in stats["batch_stats"]}
    return int(stats["execution_count"]), int(stats["inference_count"]), batches


def test_requests_whose_state_shapes_differ_never_share_a_direct_batch(server):
    # 11's state holds two strings after its first request; 12 starts from the one-string initial state
    assert infer_strings(server, ("a1", "a2"), 11, sequence_start=True) == ["", "a1", "a2"]
    results = {}
    threads = [threading.Thread(target=lambda: results.__setitem__(11, infer_strings(server, ("a3", "a4"), 11))),
               threading.Thread(target=lambda: results.__setitem__(12, infer_strings(
                   server, ("b1", "b2"), 12, sequence_start=True)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert results == {11: ["a1", "a2", "a3", "a4"], 12: ["", "b1", "b2"]}
    # 11 alone (one row), then 11 beside a padding row, then 12 below a padding row: padding is no inference
    assert batch_counts(server, "string_state") == (3, 3, {1: 1, 2: 2})


class Stream:
    """One gRPC stream; ``take(n)`` returns the next n (request id, output or error text) in arrival order."""

    def __init__(self, server) -> None:
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.results: queue.Queue = queue.Queue()
        self.client.start_stream(callback=self._collect)

    def _collect(self, result, error) -> None:
        if error is not None:
            self.results.put((None, error.message()))
        else:
            self.results.put((result.get_response().id, result))

    def send(self, model: str, name: str, value: int, sequence_id: int, request_id: str = "", **kw) -> None:
        tensor = grpcclient.InferInput(name, [1, 1], "INT32")
        tensor.set_data_from_numpy(np.array([[value]], dtype=np.int32))
        self.client.async_stream_infer(model, [tensor], sequence_id=sequence_id, request_id=request_id, **kw)

    def take(self, count: int) -> list:
        return [self.results.get(timeout=30) for _ in range(count)]

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def test_a_backlogged_sequence_is_rejected_when_its_request_timeout_expires(server):
    running, waiting = Stream(server), Stream(server)
    try:
        for flags in ({"sequence_start": True}, {}, {"sequence_end": True}):  # 1.8 s on the only slot
            running.send("slow_sequence", "INPUT0", 1, 21, timeout=200_000, **flags)
        time.sleep(0.1)
        waiting.send("slow_sequence", "INPUT0", 1, 22, sequence_start=True, timeout=200_000)
        waiting.send("slow_sequence", "INPUT0", 1, 22, timeout=200_000)
        for _, error in waiting.take(2):
            assert error == "timeout of the corresponding sequence has been expired"
        waiting.send("slow_sequence", "INPUT0", 1, 22, sequence_end=True)
        ((_, error),) = waiting.take(1)
        assert "must specify the START flag on the first request of the sequence" in error
        for _, result in running.take(3):  # a sequence holding a slot is never timed out
            assert not isinstance(result, str), result
            assert result.as_numpy("OUTPUT0").tolist() == [[1]]
    finally:
        running.close()
        waiting.close()


def test_responses_on_one_stream_come_back_in_request_order(server):
    stream = Stream(server)
    try:
        # two sequences on two instances: 31's requests sleep, 32's do not, yet the answers keep request order
        sends = [(31, 400, {"sequence_start": True}), (32, 0, {"sequence_start": True}), (31, 200, {}),
                 (32, 0, {}), (31, 0, {"sequence_end": True}), (32, 0, {"sequence_end": True})]
        for number, (sequence, sleep_ms, flags) in enumerate(sends):
            stream.send("ordered_oldest", "SLEEP_MS", sleep_ms, sequence, request_id=str(number), **flags)
        answers = stream.take(len(sends))
        assert [request_id for request_id, _ in answers] == [str(n) for n in range(len(sends))]
        assert [int(r.as_numpy("SLEPT_MS")[0, 0]) for _, r in answers] == [s for _, s, _ in sends]
    finally:
        stream.close()


def test_delay_scheduler_hook_gives_the_batches_triton_asserts(held_server):
    stream = Stream(held_server)
    try:
        # held until 4 requests are queued: both STARTs run as one batch, then both ENDs
        for sequence, flags in ((41, {"sequence_start": True}), (42, {"sequence_start": True}),
                                (41, {"sequence_end": True}), (42, {"sequence_end": True})):
            stream.send("held_direct", "INPUT0", 1, sequence, **flags)
        assert [int(r.as_numpy("BATCH")[0, 0]) for _, r in stream.take(4)] == [2, 2, 2, 2]
    finally:
        stream.close()
    assert batch_counts(held_server, "held_direct") == (2, 4, {2: 2})
