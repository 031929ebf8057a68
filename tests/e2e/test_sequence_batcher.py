"""The sequence batcher with implicit state, against a real tideserve process, over tritonclient HTTP and gRPC.

Accumulator models keep a running sum of a sequence's inputs in Triton's implicit state (the model
reads last step's ``OUTPUT_STATE`` as this step's ``INPUT_STATE``): Python-backend models (in their
own process and in the server's) with both scheduling strategies, and an ONNX model built with the
``onnx`` helper API. Also: the control inputs the model sees (START / END / READY / CORRID, integer
and string correlation ids, padding rows of a ``direct`` batch), idle sequences released, and the
errors of Triton's sequence batcher (no correlation id, no START, a batch of 2, bad control config).
"""

from __future__ import annotations

import textwrap
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from support import start_server
from tritonclient.utils import InferenceServerException

ACCUMULATOR = textwrap.dedent("""
    import numpy as np
    import triton_python_backend_utils as pb_utils

    def _get(request, name):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()

    class TritonPythonModel:
        def execute(self, requests):
            responses = []
            for row, request in enumerate(requests):
                x = _get(request, "INPUT")
                state = _get(request, "INPUT_STATE")
                start, end, ready = (_get(request, n) for n in ("START", "END", "READY"))
                corrid = _get(request, "CORRID")
                total = (x + state).astype(np.int32)
                controls = np.array([float(start.ravel()[0]), float(end.ravel()[0]), float(ready.ravel()[0]),
                                     row, len(requests)], dtype=np.float32).reshape(x.shape[:-1] + (5,))
                if corrid.dtype == np.object_:
                    corrid = np.array([corrid.ravel()[0]], dtype=np.object_)
                else:
                    corrid = np.array([str(int(corrid.ravel()[0])).encode()], dtype=np.object_)
                responses.append(pb_utils.InferenceResponse([
                    pb_utils.Tensor("OUTPUT", total), pb_utils.Tensor("OUTPUT_STATE", total),
                    pb_utils.Tensor("CONTROLS", controls),
                    pb_utils.Tensor("CORRID_SEEN", corrid.reshape(x.shape[:-1] + (1,)))]))
            return responses
""")


def python_config(name: str, strategy: str, *, corrid_type: str = "TYPE_UINT64", idle_us: int = 0,
                  isolation: bool = True, initial: str = "zero_data: true", state_output: bool = False) -> str:
    state_out = ('{ name: "OUTPUT_STATE" data_type: TYPE_INT32 dims: [ 1 ] },' if state_output else "")
    return f"""
name: "{name}"
backend: "python"
max_batch_size: 4
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }}, {state_out}
         {{ name: "CONTROLS" data_type: TYPE_FP32 dims: [ 5 ] }},
         {{ name: "CORRID_SEEN" data_type: TYPE_STRING dims: [ 1 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
parameters {{ key: "process_isolation" value {{ string_value: "{str(isolation).lower()}" }} }}
sequence_batching {{
  {strategy}
  max_sequence_idle_microseconds: {idle_us}
  control_input [
    {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "END" control [ {{ kind: CONTROL_SEQUENCE_END fp32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "READY" control [ {{ kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] }} ] }},
    {{ name: "CORRID" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: {corrid_type} }} ] }}
  ]
  state [ {{ input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_INT32 dims: [ 1 ]
            initial_state {{ name: "init" data_type: TYPE_INT32 dims: [ 1 ] {initial} }} }} ]
}}
"""


ONNX_CONFIG = """
name: "acc_onnx"
backend: "onnxruntime"
max_batch_size: 4
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
sequence_batching {
  direct { }
  control_input [ { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] } ]
  state [ { input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_INT32 dims: [ 1 ] } ]
}
model_warmup [ { name: "step" batch_size: 2 inputs [
  { key: "INPUT" value { data_type: TYPE_INT32 dims: [ 1 ] random_data: true } },
  { key: "START" value { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true } },
  { key: "INPUT_STATE" value { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true } } ] } ]
"""


def make_onnx_accumulator(path: Path) -> None:
    """OUTPUT = OUTPUT_STATE = INPUT on START, else INPUT + INPUT_STATE (all [batch, 1] INT32)."""
    from onnx import TensorProto, helper, save

    def io(name):
        return helper.make_tensor_value_info(name, TensorProto.INT32, ["batch", 1])

    nodes = [helper.make_node("Cast", ["START"], ["is_start"], to=TensorProto.BOOL),
             helper.make_node("Add", ["INPUT", "INPUT_STATE"], ["sum"]),
             helper.make_node("Where", ["is_start", "INPUT", "sum"], ["OUTPUT"]),
             helper.make_node("Identity", ["OUTPUT"], ["OUTPUT_STATE"])]
    graph = helper.make_graph(nodes, "accumulator", [io("INPUT"), io("INPUT_STATE"), io("START")],
                              [io("OUTPUT"), io("OUTPUT_STATE")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    save(model, str(path))


def write_model(root: Path, name: str, config: str, model_py: str | None = None) -> Path:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(config)
    if model_py is not None:
        (root / name / "1" / "model.py").write_text(model_py)
    return root / name


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("onnx")
    root = tmp_path_factory.mktemp("sequence_models")
    write_model(root, "acc_direct", python_config("acc_direct", "direct { }", state_output=True), ACCUMULATOR)
    write_model(root, "acc_inprocess", python_config("acc_inprocess", "direct { }", isolation=False), ACCUMULATOR)
    write_model(root, "acc_idle", python_config("acc_idle", "direct { }", idle_us=300_000), ACCUMULATOR)
    oldest = write_model(root, "acc_oldest", python_config(
        "acc_oldest", "oldest { max_candidate_sequences: 4 max_queue_delay_microseconds: 20000 }",
        corrid_type="TYPE_STRING", initial='data_file: "hundred"'), ACCUMULATOR)
    (oldest / "initial_state").mkdir()
    (oldest / "initial_state" / "hundred").write_bytes(np.array([100], dtype=np.int32).tobytes())
    onnx_dir = write_model(root, "acc_onnx", ONNX_CONFIG)
    make_onnx_accumulator(onnx_dir / "1" / "model.onnx")
    write_model(root, "bad_sequence", python_config("bad_sequence", "direct { }"), ACCUMULATOR)  # loaded by tests
    loads = [arg for name in ("acc_direct", "acc_inprocess", "acc_idle", "acc_oldest", "acc_onnx")
             for arg in ("--load-model", name)]
    running = start_server([root], "--model-control-mode", "explicit", *loads,
                           tmp_dir=tmp_path_factory.mktemp("sequence_logs"))
    yield running
    running.stop()


def client_for(server, protocol: str):
    if protocol == "http":
        return httpclient.InferenceServerClient(server.http_url, concurrency=8), httpclient
    return grpcclient.InferenceServerClient(server.grpc_url), grpcclient


def step(client, module, model: str, value: int, sequence_id, *, start=False, end=False, outputs=None):
    tensor = module.InferInput("INPUT", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.array([[value]], dtype=np.int32))
    requested = [module.InferRequestedOutput(name) for name in outputs] if outputs else None
    return client.infer(model, [tensor], outputs=requested, sequence_id=sequence_id, sequence_start=start,
                        sequence_end=end)


def run_sequence(client, module, model: str, values: list[int], sequence_id) -> list[int]:
    sums = []
    for index, value in enumerate(values):
        result = step(client, module, model, value, sequence_id, start=index == 0, end=index == len(values) - 1)
        sums.append(int(result.as_numpy("OUTPUT")[0, 0]))
    return sums


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("model", ["acc_direct", "acc_inprocess", "acc_onnx"])
def test_accumulates_across_interleaved_sequences(server, protocol, model):
    client, module = client_for(server, protocol)
    base = 1000 if protocol == "http" else 2000
    results: dict[int, list[int]] = {}

    def one(offset: int) -> None:
        own, own_module = client_for(server, protocol)
        results[offset] = run_sequence(own, own_module, model, [offset, 1, 2, 3, 4], base + offset)

    threads = [threading.Thread(target=one, args=(offset,)) for offset in (10, 20, 30, 40, 50, 60)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for offset, sums in results.items():
        assert sums == [offset, offset + 1, offset + 3, offset + 6, offset + 10], (offset, sums)
    assert len(results) == 6
    # the same id starts a fresh sequence (state reset) once the previous one ended
    assert run_sequence(client, module, model, [5, 5], base + 10) == [5, 10]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_oldest_with_string_ids_and_initial_state_from_file(server, protocol):
    results: dict[str, list[int]] = {}

    def one(name: str) -> None:
        client, module = client_for(server, protocol)
        results[name] = run_sequence(client, module, "acc_oldest", [1, 2, 3], f"{protocol}-{name}")

    threads = [threading.Thread(target=one, args=(name,)) for name in ("a", "b", "c", "d", "e")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == {name: [101, 103, 106] for name in ("a", "b", "c", "d", "e")}
    client, module = client_for(server, protocol)
    result = step(client, module, "acc_oldest", 7, f"{protocol}-ctl", start=True, end=True)
    assert result.as_numpy("CORRID_SEEN")[0, 0] == f"{protocol}-ctl".encode()
    assert list(result.as_numpy("CONTROLS")[0, :3]) == [1.0, 1.0, 1.0]  # START, END, READY


def test_controls_and_padding_rows_of_direct(server):
    client, module = client_for(server, "grpc")
    first = step(client, module, "acc_direct", 1, 501, start=True)
    assert list(first.as_numpy("CONTROLS")[0]) == [1.0, 0.0, 1.0, 0.0, 1.0]  # START, slot 0, batch of 1
    assert first.as_numpy("CORRID_SEEN")[0, 0] == b"501"
    second = step(client, module, "acc_direct", 1, 502, start=True)
    assert list(second.as_numpy("CONTROLS")[0]) == [1.0, 0.0, 1.0, 1.0, 2.0]  # slot 1 below a padding row
    ended = step(client, module, "acc_direct", 1, 501, end=True)
    assert list(ended.as_numpy("CONTROLS")[0]) == [0.0, 1.0, 1.0, 0.0, 1.0]  # slot 0: no padding needed
    middle = step(client, module, "acc_direct", 2, 502)
    assert list(middle.as_numpy("CONTROLS")[0]) == [0.0, 0.0, 1.0, 1.0, 2.0]  # slot 0 free: padded
    assert int(middle.as_numpy("OUTPUT")[0, 0]) == 3
    step(client, module, "acc_direct", 0, 502, end=True)


def test_state_output_only_when_asked(server):
    client, module = client_for(server, "http")
    plain = step(client, module, "acc_direct", 4, 601, start=True)
    assert plain.as_numpy("OUTPUT_STATE") is not None  # listed in the config's outputs: returned by default
    chosen = step(client, module, "acc_direct", 4, 601, outputs=["OUTPUT"])
    assert chosen.as_numpy("OUTPUT_STATE") is None and int(chosen.as_numpy("OUTPUT")[0, 0]) == 8
    asked = step(client, module, "acc_direct", 4, 601, end=True, outputs=["OUTPUT_STATE"])
    assert int(asked.as_numpy("OUTPUT_STATE")[0, 0]) == 12 and asked.as_numpy("OUTPUT") is None
    hidden = step(client, module, "acc_inprocess", 4, 602, start=True, end=True)
    assert hidden.as_numpy("OUTPUT_STATE") is None  # not a configured output: never returned


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_idle_sequence_is_released(server, protocol):
    client, module = client_for(server, protocol)
    step(client, module, "acc_idle", 1, 701, start=True)
    assert int(step(client, module, "acc_idle", 1, 701).as_numpy("OUTPUT")[0, 0]) == 2
    time.sleep(0.8)
    with pytest.raises(InferenceServerException) as caught:
        step(client, module, "acc_idle", 1, 701)
    assert "must specify the START flag on the first request of the sequence" in caught.value.message()
    assert caught.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
    assert run_sequence(client, module, "acc_idle", [3, 4], 701) == [3, 7]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_sequence_errors(server, protocol):
    client, module = client_for(server, protocol)
    invalid = ("400", "StatusCode.INVALID_ARGUMENT")
    with pytest.raises(InferenceServerException) as caught:
        step(client, module, "acc_direct", 1, 0, start=True)
    assert "must specify a non-zero or non-empty correlation ID" in caught.value.message()
    assert caught.value.status() in invalid
    with pytest.raises(InferenceServerException) as caught:
        step(client, module, "acc_direct", 1, 999_999)
    assert ("inference request for sequence 999999 to model 'acc_direct' must specify the START flag"
            in caught.value.message())
    assert caught.value.status() in invalid
    with pytest.raises(InferenceServerException) as caught:  # a string id for a UINT64 CORRID
        step(client, module, "acc_direct", 1, "text-id", start=True)
    assert "CONTROL_SEQUENCE_CORRID" in caught.value.message() and caught.value.status() in invalid
    tensor = module.InferInput("INPUT", [2, 1], "INT32")
    tensor.set_data_from_numpy(np.array([[1], [2]], dtype=np.int32))
    with pytest.raises(InferenceServerException) as caught:
        client.infer("acc_direct", [tensor], sequence_id=5, sequence_start=True)
    assert "must specify batch-size 1 due to requirements of sequence batcher" in caught.value.message()
    assert caught.value.status() in invalid
    # the server serves on
    assert run_sequence(client, module, "acc_direct", [1, 1], 5) == [1, 2]


def test_bad_sequence_flag_types_over_http(server):
    body = {"inputs": [{"name": "INPUT", "datatype": "INT32", "shape": [1, 1], "data": [1]}],
            "parameters": {"sequence_id": 9, "sequence_start": "yes"}}
    answer = httpx.post(f"{server.base_url}/v2/models/acc_direct/infer", json=body)
    assert answer.status_code == 400 and "sequence_start" in answer.json()["error"]
    body["parameters"] = {"sequence_id": [9], "sequence_start": True}
    answer = httpx.post(f"{server.base_url}/v2/models/acc_direct/infer", json=body)
    assert answer.status_code == 400 and "sequence_id" in answer.json()["error"]


BAD_CONTROLS = {
    "two value kinds": ('{ name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] '
                        'fp32_false_true: [ 0, 1 ] } ] }', "exactly one of int32_false_true"),
    "three values": ('{ name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1, 2 ] } ] }',
                     "exactly 2 values"),
    "float corrid": ('{ name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_FP32 } ] }',
                     "has data_type TYPE_FP32"),
    "corrid without type": ('{ name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID } ] }',
                            "has data_type TYPE_INVALID"),
    "control is an input": ('{ name: "INPUT" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] }',
                            "is also a model input"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONTROLS))
def test_bad_control_config_fails_the_load(server, case):
    control, reason = BAD_CONTROLS[case]
    config = f"""
name: "acc_direct" backend: "python" max_batch_size: 4
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
sequence_batching {{ control_input [ {control} ] }}
"""
    from tideserve.config import parse_text, to_json

    client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException) as caught:
        client.load_model("bad_sequence", config=to_json(parse_text(config)).replace('"acc_direct"', '"bad_sequence"'))
    assert reason in caught.value.message()
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    index = {m["name"]: m for m in httpclient.InferenceServerClient(server.http_url).get_model_repository_index()}
    assert index["bad_sequence"]["state"] == "UNAVAILABLE" and reason in index["bad_sequence"]["reason"]
    assert httpclient.InferenceServerClient(server.http_url).is_model_ready("acc_direct")
