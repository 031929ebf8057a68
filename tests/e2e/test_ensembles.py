"""Ensembles (``platform: "ensemble"``): pipelines of Python-backend models written into a temporary
repository, served by a real tideserve process and driven with ``tritonclient``; a few in-process
tests (repository + DataPlane) cover what a client cannot observe.
"""

from __future__ import annotations

import http.client
import json
import queue
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from support import start_server
from tritonclient.utils import InferenceServerException
from toy_backends import instance_backend

from tideserve.backend import BackendRegistry, ModelInstance
from tideserve.dataplane import DataPlane
from tideserve.repository import ControlMode, ModelRepository
from tideserve.stats import Metrics
from tideserve.types import InferenceRequest, InferenceResponse, Tensor

# -- the composing models --------------------------------------------------------------------------
# One model.py for all of them; the config parameter "kind" picks the behaviour.
MODEL_PY = '''
import json
import os
import threading
import time

import numpy as np

import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def read(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def tensor(name, array, dtype):
    return pb_utils.Tensor(name, np.asarray(array, dtype))


def reply(*tensors):
    return pb_utils.InferenceResponse(output_tensors=list(tensors))


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.name = config["name"]
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.kind = params["kind"]
        self.delay = float(params.get("delay_s", "0"))
        self.markers = params.get("marker_dir", "")
        self.bare_final = params.get("bare_final") == "1"
        self.sums = {}

    def execute(self, requests):
        return getattr(self, "run_" + self.kind)(requests)

    def mark(self, what):
        if self.markers:
            open(os.path.join(self.markers, what + "-" + self.name), "w").close()

    def wait_cancelled(self, thing):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if thing.is_cancelled():
                self.mark("cancelled")
                return
            time.sleep(0.005)

    # -- classic models --
    def run_scale(self, requests):
        return [reply(tensor("OUT", read(r, "IN") * 2, np.float32)) for r in requests]

    def run_offset(self, requests):
        return [reply(tensor("OUT", read(r, "IN") + 1, np.float32)) for r in requests]

    def run_square(self, requests):
        return [reply(tensor("OUT", read(r, "IN") * read(r, "IN"), np.float32)) for r in requests]

    def run_add(self, requests):
        return [reply(tensor("OUT", read(r, "IN0") + read(r, "IN1"), np.float32)) for r in requests]

    def run_double(self, requests):
        time.sleep(self.delay)
        return [reply(tensor("OUT", read(r, "IN") * 2, np.int32)) for r in requests]

    def run_add_int(self, requests):
        return [reply(tensor("OUT", read(r, "IN0") + read(r, "IN1"), np.int32)) for r in requests]

    def run_nop(self, requests):
        return [reply(pb_utils.Tensor("OUT", read(r, "IN"))) for r in requests]

    def run_identity(self, requests):
        return [reply(tensor("OUT", read(r, "IN"), np.float32)) for r in requests]

    def run_sleepy(self, requests):
        responses = []
        for r in requests:
            start = time.time()
            time.sleep(self.delay)
            responses.append(reply(tensor("OUT", read(r, "IN"), np.float32), tensor("T0", [start], np.float64),
                                   tensor("T1", [time.time()], np.float64)))
        return responses

    def run_fail(self, requests):
        raise pb_utils.TritonModelException("intentional step failure")

    def run_slow_double(self, requests):
        # executions running now over all instances, each in a process of its own: one marker file per execution
        mine = os.path.join(self.markers, f"active-{self.name}-{os.getpid()}-{threading.get_ident()}")
        open(mine, "w").close()
        active = sum(1 for name in os.listdir(self.markers) if name.startswith(f"active-{self.name}-"))
        time.sleep(self.delay)
        os.remove(mine)
        return [reply(tensor("OUT", read(r, "IN") * 2, np.int32), tensor("ACTIVE", [active], np.int32))
                for r in requests]

    def run_accumulate(self, requests):
        """A stateful post-processor: a running sum per sequence, freed on sequence_end."""
        responses = []
        for r in requests:
            seq, flags = r.correlation_id(), r.flags()
            start = bool(flags & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START)
            end = bool(flags & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END)
            value = read(r, "IN")
            total = (0 if start else self.sums.get(seq, 0)) + (0 if value is None else int(value.reshape(-1)[0]))
            if end:
                self.sums.pop(seq, None)
            else:
                self.sums[seq] = total
            responses.append(reply(tensor("SUM", [total], np.int32), tensor("SEQ", [seq], np.uint64),
                                   tensor("START", [start], np.bool_), tensor("END", [end], np.bool_),
                                   tensor("LIVE", [len(self.sums)], np.int32)))
        return responses

    def run_hold(self, requests):
        """Runs until its request is cancelled."""
        self.mark("started")
        self.wait_cancelled(requests[0])
        return [reply(tensor("OUT", read(r, "IN"), np.int32)) for r in requests]

    # -- decoupled models (answer from threads of their own) --
    def run_stream(self, requests):
        for r in requests:
            delay = read(r, "DELAY_MS")
            delay = 0.0 if delay is None else float(delay.reshape(-1)[0]) / 1000
            args = (r.get_response_sender(), read(r, "IN").reshape(-1).copy(), delay)
            threading.Thread(target=self.stream, args=args, daemon=True).start()

    def stream(self, sender, values, delay):
        for index, value in enumerate(values):
            if delay:
                time.sleep(delay)
            if sender.is_cancelled():
                sender.send(flags=FINAL)
                return
            last = index == len(values) - 1 and not self.bare_final
            sender.send(reply(tensor("OUT", [value], np.int32), tensor("T", [time.time()], np.float64)),
                        flags=FINAL if last else 0)
        if self.bare_final or not len(values):
            sender.send(flags=FINAL)

    def run_fan(self, requests):
        """Two responses per request: 10 * IN and 10 * IN + 1."""
        for r in requests:
            sender, value = r.get_response_sender(), int(read(r, "IN").reshape(-1)[0])
            sender.send(reply(tensor("OUT", [10 * value], np.int32)))
            sender.send(reply(tensor("OUT", [10 * value + 1], np.int32)), flags=FINAL)

    def run_ticker(self, requests):
        for r in requests:
            threading.Thread(target=self.tick, args=(r.get_response_sender(),), daemon=True).start()

    def tick(self, sender):
        self.mark("started")
        sender.send(reply(tensor("OUT", [1], np.int32)))
        self.wait_cancelled(sender)
        sender.send(flags=FINAL)
'''


def tensors(items) -> str:
    parts = []
    for name, dtype, dims, *rest in items:
        extra = " optional: true" if rest and rest[0] == "optional" else ""
        parts.append(f'{{ name: "{name}" data_type: {dtype} dims: [ {dims} ]{extra} }}')
    return "[ " + ", ".join(parts) + " ]"


def write_model(repo: Path, name: str, kind: str, inputs, outputs, *, decoupled=False, count=1, max_batch_size=0,
                **params) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(MODEL_PY)
    text = f'backend: "python"\nmax_batch_size: {max_batch_size}\ninput {tensors(inputs)}\noutput {tensors(outputs)}\n'
    text += f"instance_group [ {{ kind: KIND_CPU count: {count} }} ]\n"
    if decoupled:
        text += "model_transaction_policy { decoupled: true }\n"
    for key, value in {"kind": kind, **params}.items():
        text += f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'
    (repo / name / "config.pbtxt").write_text(text)


def write_ensemble(repo: Path, name: str, inputs, outputs, steps, extra: str = "") -> None:
    (repo / name / "1").mkdir(parents=True)
    lines = [f'name: "{name}"', 'platform: "ensemble"', "max_batch_size: 0",
             f"input {tensors(inputs)}", f"output {tensors(outputs)}", "ensemble_scheduling {", extra]
    for model, input_map, output_map in steps:
        lines.append(f'  step {{ model_name: "{model}" model_version: -1')
        lines += [f'    input_map {{ key: "{k}" value: "{v}" }}' for k, v in input_map.items()]
        lines += [f'    output_map {{ key: "{k}" value: "{v}" }}' for k, v in output_map.items()]
        lines.append("  }")
    lines.append("}")
    (repo / name / "config.pbtxt").write_text("\n".join(lines) + "\n")


F = "TYPE_FP32"
I32 = "TYPE_INT32"
VEC = [("IN", F, "-1")], [("OUT", F, "-1")]
STATE_OUT = [("SUM", I32, "1"), ("SEQ", "TYPE_UINT64", "1"), ("START", "TYPE_BOOL", "1"),
             ("END", "TYPE_BOOL", "1"), ("LIVE", I32, "1")]
STATE_MAP = {name: name for name, *_ in STATE_OUT}
SLEEP_S = 0.4


def build_repository(repo: Path, markers: Path) -> None:
    for kind in ("scale", "offset", "square", "identity"):
        write_model(repo, kind, kind, *VEC)
    write_model(repo, "add", "add", [("IN0", F, "-1"), ("IN1", F, "-1")], [("OUT", F, "-1")])
    write_model(repo, "triple", "identity", [("IN", F, "3")], [("OUT", F, "3")])
    write_model(repo, "fail", "fail", *VEC)
    write_model(repo, "sleepy", "sleepy", [("IN", F, "-1")],
                [("OUT", F, "-1"), ("T0", "TYPE_FP64", "1"), ("T1", "TYPE_FP64", "1")], count=2, delay_s=SLEEP_S)
    stream_io = ([("IN", I32, "-1"), ("DELAY_MS", "TYPE_UINT32", "1", "optional")],
                 [("OUT", I32, "1"), ("T", "TYPE_FP64", "1")])
    write_model(repo, "stream_final", "stream", *stream_io, decoupled=True)
    write_model(repo, "stream_bare", "stream", *stream_io, decoupled=True, bare_final="1")
    write_model(repo, "accumulate", "accumulate", [("IN", I32, "1")], STATE_OUT)
    write_model(repo, "accumulate_opt", "accumulate", [("IN", I32, "1", "optional")], STATE_OUT)
    write_model(repo, "slow_double", "slow_double", [("IN", I32, "1")], [("OUT", I32, "1"), ("ACTIVE", I32, "1")],
                count=4, delay_s=0.1, marker_dir=markers)
    write_model(repo, "ticker", "ticker", [("IN", I32, "1")], [("OUT", I32, "1")], decoupled=True,
                marker_dir=markers)
    write_model(repo, "fan", "fan", [("IN", I32, "1")], [("OUT", I32, "1")], decoupled=True)
    write_model(repo, "add_int", "add_int", [("IN0", I32, "1"), ("IN1", I32, "1")], [("OUT", I32, "1")])
    write_model(repo, "slow_bias", "double", [("IN", I32, "1")], [("OUT", I32, "1")], delay_s=0.3)
    for name in ("hold", "hold_b"):
        write_model(repo, name, "hold", [("IN", I32, "1")], [("OUT", I32, "1")], marker_dir=markers)
    # Triton's nop_TYPE_INT32_-1: a batching model between steps that do not batch
    write_model(repo, "nop_batch", "nop", [("IN", I32, "-1")], [("OUT", I32, "-1")], max_batch_size=1024)

    write_ensemble(repo, "chain", *VEC, [("scale", {"IN": "IN"}, {"OUT": "a"}),
                                         ("offset", {"IN": "a"}, {"OUT": "b"}),
                                         ("square", {"IN": "b"}, {"OUT": "OUT"})])
    # Sorts before "chain" and "scale": loads only if the repository loads its steps first.
    write_ensemble(repo, "a_nested", *VEC, [("chain", {"IN": "IN"}, {"OUT": "c"}),
                                            ("scale", {"IN": "c"}, {"OUT": "OUT"})])
    write_ensemble(repo, "parallel", [("IN", F, "-1")],
                   [("SUM", F, "-1"), ("T0A", "TYPE_FP64", "1"), ("T1A", "TYPE_FP64", "1"),
                    ("T0B", "TYPE_FP64", "1"), ("T1B", "TYPE_FP64", "1")],
                   [("sleepy", {"IN": "IN"}, {"OUT": "a", "T0": "T0A", "T1": "T1A"}),
                    ("sleepy", {"IN": "IN"}, {"OUT": "b", "T0": "T0B", "T1": "T1B"}),
                    ("add", {"IN0": "a", "IN1": "b"}, {"OUT": "SUM"})])
    stream_in = [("IN", I32, "-1"), ("DELAY_MS", "TYPE_UINT32", "1", "optional")]
    write_ensemble(repo, "streaming", stream_in, STATE_OUT + [("T", "TYPE_FP64", "1")],
                   [("stream_final", {"IN": "IN", "DELAY_MS": "DELAY_MS"}, {"OUT": "x", "T": "T"}),
                    ("accumulate", {"IN": "x"}, STATE_MAP)])
    for name, post in (("bare_required", "accumulate"), ("bare_optional", "accumulate_opt")):
        write_ensemble(repo, name, stream_in, STATE_OUT,
                       [("stream_bare", {"IN": "IN", "DELAY_MS": "DELAY_MS"}, {"OUT": "x"}),
                        (post, {"IN": "x"}, STATE_MAP)])
    for name, extra in (("limited", "max_inflight_requests: 2"), ("unlimited", "")):
        write_ensemble(repo, name, [("IN", I32, "-1")], [("OUT", I32, "1"), ("ACTIVE", I32, "1")],
                       [("stream_final", {"IN": "IN"}, {"OUT": "x"}),
                        ("slow_double", {"IN": "x"}, {"OUT": "OUT", "ACTIVE": "ACTIVE"})], extra)
    # A stream step that also reads a static tensor, computed (slowly) alongside the stream.
    write_ensemble(repo, "mixed", [("IN", I32, "-1"), ("BIAS", I32, "1")], [("OUT", I32, "1")],
                   [("stream_final", {"IN": "IN"}, {"OUT": "x"}),
                    ("slow_bias", {"IN": "BIAS"}, {"OUT": "b"}),
                    ("add_int", {"IN0": "x", "IN1": "b"}, {"OUT": "OUT"})])
    # A stream of streams: each response of stream_final starts a fan request of two responses.
    write_ensemble(repo, "nested_streams", [("IN", I32, "-1")], STATE_OUT + [("T", "TYPE_FP64", "1")],
                   [("stream_final", {"IN": "IN"}, {"OUT": "x", "T": "T"}),
                    ("fan", {"IN": "x"}, {"OUT": "y"}),
                    ("accumulate", {"IN": "y"}, STATE_MAP)])
    # [1] from a step (or request) without a batch into a batching model ([1, 1]), and its [1, 1] back into
    # models and ensemble outputs declared [1]
    write_ensemble(repo, "batch_bridge", [("IN", I32, "1")], [("OUT", I32, "1"), ("COPY", I32, "1")],
                   [("nop_batch", {"IN": "IN"}, {"OUT": "x"}),
                    ("add_int", {"IN0": "x", "IN1": "IN"}, {"OUT": "OUT"}),
                    ("nop_batch", {"IN": "OUT"}, {"OUT": "COPY"})])
    write_ensemble(repo, "failing", *VEC, [("scale", {"IN": "IN"}, {"OUT": "a"}),
                                           ("fail", {"IN": "a"}, {"OUT": "OUT"})])
    write_ensemble(repo, "cancel_pipe", [("IN", I32, "1")], [("OUT", I32, "1"), ("OUT_B", I32, "1")],
                   [("ticker", {"IN": "IN"}, {"OUT": "t"}),
                    ("hold", {"IN": "t"}, {"OUT": "OUT"}),
                    ("hold_b", {"IN": "IN"}, {"OUT": "OUT_B"})])

    # Invalid ensembles: each is UNAVAILABLE with its reason, the rest serve.
    write_ensemble(repo, "bad_unknown", *VEC, [("no_such_model", {"IN": "IN"}, {"OUT": "OUT"})])
    write_ensemble(repo, "bad_unmapped", *VEC, [("add", {"IN0": "IN"}, {"OUT": "OUT"})])
    write_ensemble(repo, "bad_cycle", *VEC, [("add", {"IN0": "IN", "IN1": "b"}, {"OUT": "a"}),
                                             ("offset", {"IN": "a"}, {"OUT": "b"}),
                                             ("square", {"IN": "a"}, {"OUT": "OUT"})])
    write_ensemble(repo, "bad_dtype", [("IN", F, "-1")], [("SUM", I32, "1")],
                   [("scale", {"IN": "IN"}, {"OUT": "a"}), ("accumulate", {"IN": "a"}, {"SUM": "SUM"})])
    write_ensemble(repo, "bad_shape", [("IN", F, "2")], [("OUT", F, "3")], [("triple", {"IN": "IN"}, {"OUT": "OUT"})])
    write_ensemble(repo, "bad_output", [("IN", F, "-1")], [("OUT", F, "-1"), ("EXTRA", F, "-1")],
                   [("scale", {"IN": "IN"}, {"OUT": "OUT"})])
    write_ensemble(repo, "cycle_a", *VEC, [("cycle_b", {"IN": "IN"}, {"OUT": "OUT"})])
    write_ensemble(repo, "cycle_b", *VEC, [("cycle_a", {"IN": "IN"}, {"OUT": "OUT"})])


INVALID = {
    "bad_unknown": "ensemble 'bad_unknown' contains a model that is not available: step 0 (model 'no_such_model')",
    "bad_unmapped": "in ensemble 'bad_unmapped', input 'IN1' of model 'add' (step 0) is not mapped to any ensemble "
                    "tensor",
    "bad_cycle": "in ensemble 'bad_cycle', steps form a cycle: step 0 (model 'add') -> step 1 (model 'offset') -> "
                 "step 0 (model 'add')",
    "bad_dtype": "in ensemble 'bad_dtype', ensemble tensor 'a': inconsistent data type: TYPE_FP32 is inferred from "
                 "model 'scale' while TYPE_INT32 is inferred from model 'accumulate'",
    "bad_shape": "in ensemble 'bad_shape', ensemble tensor 'IN': inconsistent shape: [2] is inferred from ensemble "
                 "'bad_shape' (input) while [3] is inferred from model 'triple'",
    "bad_output": "output 'EXTRA' of ensemble 'bad_output' is not written by any step",
    "cycle_a": "circular dependency between ensembles: cycle_a -> cycle_b -> cycle_a",
    "cycle_b": "circular dependency between ensembles: cycle_b -> cycle_a -> cycle_b",
}


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ensembles")
    repo, markers = root / "models", root / "markers"
    repo.mkdir()
    markers.mkdir()
    build_repository(repo, markers)
    return repo, markers


@pytest.fixture(scope="module")
def server(repository, tmp_path_factory):
    running = start_server([repository[0]], "--strict-readiness", "false",
                           tmp_dir=tmp_path_factory.mktemp("ensemble-server"))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpclient.InferenceServerClient(server.http_url) as client:
        yield client


def infer(client, model: str, **inputs: np.ndarray):
    items = []
    for name, array in inputs.items():
        item = httpclient.InferInput(name, list(array.shape), _datatype(array))
        item.set_data_from_numpy(array)
        items.append(item)
    return client.infer(model, items)


def _datatype(array: np.ndarray) -> str:
    return {np.float32: "FP32", np.int32: "INT32", np.uint32: "UINT32"}[array.dtype.type]


def _grpc_inputs(**inputs: np.ndarray):
    items = []
    for name, array in inputs.items():
        item = grpcclient.InferInput(name, list(array.shape), _datatype(array))
        item.set_data_from_numpy(array)
        items.append(item)
    return items


class StreamCollector:
    """gRPC ModelStreamInfer: (arrival time, request id, outputs) per response, and the final flags."""

    def __init__(self, url: str) -> None:
        self.client = grpcclient.InferenceServerClient(url)
        self.results: queue.Queue = queue.Queue()
        self.client.start_stream(callback=self._on_result)

    def _on_result(self, result, error) -> None:
        self.results.put((time.time(), result, error))

    def send(self, model: str, request_id: str = "", **inputs: np.ndarray) -> None:
        self.client.async_stream_infer(model, _grpc_inputs(**inputs), request_id=request_id,
                                       enable_empty_final_response=True)

    def collect(self, requests: int = 1, timeout: float = 10) -> dict[str, list[tuple[float, dict]]]:
        """Responses per request id until each of ``requests`` requests sent its final flag."""
        found: dict[str, list] = {}
        finals = 0
        deadline = time.monotonic() + timeout
        while finals < requests:
            arrived, result, error = self.results.get(timeout=max(0.01, deadline - time.monotonic()))
            if error is not None:
                raise error
            response = result.get_response()
            outputs = {o.name: result.as_numpy(o.name) for o in response.outputs}
            if outputs:
                found.setdefault(response.id, []).append((arrived, outputs))
            if response.parameters["triton_final_response"].bool_param:
                finals += 1
        return found

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def scalar(outputs: dict, name: str):
    return outputs[name].reshape(-1)[0].item()


# -- load-time behaviour ---------------------------------------------------------------------------
def test_invalid_ensembles_are_unavailable_with_the_reason_while_the_rest_serve(client):
    index = {row["name"]: row for row in client.get_model_repository_index()}
    for name, reason in INVALID.items():
        assert index[name]["state"] == "UNAVAILABLE", name
        assert reason in index[name]["reason"], (name, index[name]["reason"])
        assert not client.is_model_ready(name)
    for name in ("chain", "a_nested", "parallel", "streaming", "limited", "failing", "cancel_pipe", "scale"):
        assert index[name]["state"] == "READY", (name, index[name])
    assert infer(client, "chain", IN=np.ones(2, np.float32)).as_numpy("OUT").tolist() == [9.0, 9.0]


def test_none_mode_loads_every_ensemble_after_its_steps(client):
    """``a_nested`` (an ensemble over the ensemble ``chain``) sorts first, yet it loaded and serves."""
    x = np.array([0.5, -1.0, 3.0], np.float32)
    out = infer(client, "a_nested", IN=x).as_numpy("OUT")
    np.testing.assert_array_equal(out, ((x * 2 + 1) ** 2) * 2)


def test_decoupled_flag_and_metadata(client):
    assert client.get_model_config("streaming")["model_transaction_policy"]["decoupled"] is True
    assert client.get_model_config("chain")["model_transaction_policy"].get("decoupled", False) is False
    metadata = client.get_model_metadata("chain")
    assert metadata["platform"] == "ensemble" and [i["name"] for i in metadata["inputs"]] == ["IN"]


def test_explicit_mode_loading_an_ensemble_loads_its_steps(repository, tmp_path):
    running = start_server([repository[0]], "--model-control-mode", "explicit", "--strict-readiness", "false",
                           tmp_dir=tmp_path)
    try:
        with httpclient.InferenceServerClient(running.http_url) as client:
            assert not client.is_model_ready("scale")
            client.load_model("a_nested")
            for name in ("a_nested", "chain", "scale", "offset", "square"):
                assert client.is_model_ready(name), name
            assert not client.is_model_ready("add")  # not part of it
            x = np.array([1.0, 2.0], np.float32)
            np.testing.assert_array_equal(infer(client, "a_nested", IN=x).as_numpy("OUT"), ((x * 2 + 1) ** 2) * 2)
            with pytest.raises(InferenceServerException, match="circular dependency between ensembles"):
                client.load_model("cycle_a")

            # a step that goes away takes its ensembles (at any depth) out of readiness, and back with it
            client.unload_model("square")
            index = {row["name"]: row for row in client.get_model_repository_index()}
            for name in ("chain", "a_nested"):
                assert not client.is_model_ready(name), name
                assert index[name]["state"] == "UNAVAILABLE" and "'square'" in index[name]["reason"], index[name]
            with pytest.raises(InferenceServerException) as info:
                infer(client, "a_nested", IN=x)
            assert info.value.status() == "503" and "step model 'chain'" in info.value.message()
            client.load_model("square")
            assert client.is_model_ready("a_nested") and client.is_model_ready("chain")
            np.testing.assert_array_equal(infer(client, "a_nested", IN=x).as_numpy("OUT"), ((x * 2 + 1) ** 2) * 2)

            # unload_dependents: the steps loaded only for the ensemble go with it (recursively); a step a client
            # loaded itself stays ('square' above, 'scale' here)
            client.load_model("scale")
            assert "model_repository(unload_dependents)" in client.get_server_metadata()["extensions"]
            client.unload_model("a_nested", unload_dependents=True)
            ready = {row["name"] for row in client.get_model_repository_index() if row["state"] == "READY"}
            assert ready == {"scale", "square"}, ready
    finally:
        running.stop()


# -- data flow -------------------------------------------------------------------------------------
def test_chain_of_three_steps_equals_running_the_steps_by_hand(client):
    x = np.random.default_rng(7).standard_normal(16).astype(np.float32)
    by_hand = x
    for model in ("scale", "offset", "square"):
        by_hand = infer(client, model, IN=by_hand).as_numpy("OUT")
    result = infer(client, "chain", IN=x)
    out = result.as_numpy("OUT")
    assert out.dtype == np.float32 and out.shape == (16,)
    np.testing.assert_array_equal(out, by_hand)
    assert result.get_response()["model_name"] == "chain"


def test_independent_steps_run_in_parallel(client):
    x = np.array([1.0, 2.0], np.float32)
    started = time.monotonic()
    result = infer(client, "parallel", IN=x)
    elapsed = time.monotonic() - started
    np.testing.assert_array_equal(result.as_numpy("SUM"), x * 2)
    t0a, t1a, t0b, t1b = (float(result.as_numpy(n)[0]) for n in ("T0A", "T1A", "T0B", "T1B"))
    assert max(t0a, t0b) < min(t1a, t1b), "the two sleepy steps did not overlap"
    assert elapsed < 2 * SLEEP_S, elapsed


def test_decoupled_step_streams_each_increment_to_the_client_as_produced(server):
    stream = StreamCollector(server.grpc_url)
    try:
        stream.send("streaming", "s1", IN=np.array([1, 2, 3, 4, 5], np.int32), DELAY_MS=np.array([150], np.uint32))
        responses = stream.collect()["s1"]
    finally:
        stream.close()
    assert [scalar(o, "SUM") for _, o in responses] == [1, 3, 6, 10, 15]
    arrivals = [arrived for arrived, _ in responses]
    produced = [scalar(o, "T") for _, o in responses]  # when the upstream step sent each one
    for index in range(len(responses) - 1):
        assert arrivals[index] < produced[index + 1], f"increment {index} waited for the next one"
    assert arrivals[-1] - arrivals[0] > 0.45  # they came one by one, not all at the end


def test_sequence_parameters_seen_by_the_downstream_step(server):
    stream = StreamCollector(server.grpc_url)
    try:
        stream.send("streaming", "a", IN=np.array([1, 2, 3], np.int32), DELAY_MS=np.array([20], np.uint32))
        stream.send("streaming", "b", IN=np.array([10, 20, 30, 40], np.int32), DELAY_MS=np.array([15], np.uint32))
        found = stream.collect(requests=2)
    finally:
        stream.close()
    sequences = {}
    for rid, expected in (("a", [1, 3, 6]), ("b", [10, 30, 60, 100])):
        outputs = [o for _, o in found[rid]]
        assert [scalar(o, "SUM") for o in outputs] == expected  # the state of one sequence only
        assert [scalar(o, "START") for o in outputs] == [True] + [False] * (len(expected) - 1)
        assert [scalar(o, "END") for o in outputs] == [False] * (len(expected) - 1) + [True]
        ids = {scalar(o, "SEQ") for o in outputs}
        assert len(ids) == 1 and 0 not in ids
        sequences[rid] = ids.pop()
    assert sequences["a"] != sequences["b"]


def test_generate_stream_sends_each_increment_as_an_event(server):
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
    body = json.dumps({"IN": [4, 5, 6], "DELAY_MS": 250})
    connection.request("POST", "/v2/models/streaming/generate_stream", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    events = []
    while True:
        line = response.readline()
        if not line:
            break
        if line.startswith(b"data:"):
            events.append((time.time(), json.loads(line[5:])))
    connection.close()
    assert [e["SUM"] for _, e in events] == [4, 9, 15]
    # streamed, not held to the end: the first increment reached the client before the model sent the last, 0.5 s
    # later (a bound a loaded machine's delivery keeps, where one step's 0.25 s was not always)
    assert events[0][0] < events[-1][1]["T"]


def test_a_stream_step_also_reads_static_tensors(server):
    stream = StreamCollector(server.grpc_url)
    try:
        stream.send("mixed", "m", IN=np.array([1, 2, 3], np.int32), BIAS=np.array([100], np.int32))
        outputs = [o for _, o in stream.collect()["m"]]
    finally:
        stream.close()
    assert sorted(scalar(o, "OUT") for o in outputs) == [201, 202, 203]


def test_a_stream_of_streams(server):
    stream = StreamCollector(server.grpc_url)
    try:
        stream.send("nested_streams", "n", IN=np.array([1, 2], np.int32))
        outputs = [o for _, o in stream.collect()["n"]]
    finally:
        stream.close()
    by_sequence: dict[int, list] = {}
    for o in outputs:
        by_sequence.setdefault(scalar(o, "SEQ"), []).append((scalar(o, "SUM"), scalar(o, "START"), scalar(o, "END")))
    # one sequence per fan request, each with its own running sum, start and end
    assert sorted(by_sequence.values()) == [[(10, True, False), (21, False, True)],
                                            [(20, True, False), (41, False, True)]]


def test_bare_final_ends_the_sequence_only_for_optional_stream_inputs(server):
    stream = StreamCollector(server.grpc_url)
    try:
        stream.send("bare_optional", "opt", IN=np.array([1, 2, 3], np.int32))
        stream.send("bare_required", "req", IN=np.array([1, 2, 3], np.int32))
        found = stream.collect(requests=2)
    finally:
        stream.close()
    optional = [o for _, o in found["opt"]]
    assert [scalar(o, "SUM") for o in optional] == [1, 3, 6, 6]  # + the sequence_end request without IN
    assert [scalar(o, "END") for o in optional] == [False, False, False, True]
    assert scalar(optional[-1], "LIVE") == 0  # the post-processor freed its state
    required = [o for _, o in found["req"]]
    assert [scalar(o, "SUM") for o in required] == [1, 3, 6]
    assert not any(scalar(o, "END") for o in required)  # nothing could carry sequence_end


def test_max_inflight_requests_bounds_requests_in_flight_at_a_step(server):
    """A fast stream feeds a slow step with 4 instances: at most 2 of its requests run with the limit."""
    values = np.arange(1, 13, dtype=np.int32)
    peaks = {}
    for model in ("limited", "unlimited"):
        stream = StreamCollector(server.grpc_url)
        try:
            stream.send(model, model, IN=values)
            outputs = [o for _, o in stream.collect()[model]]
        finally:
            stream.close()
        assert sorted(scalar(o, "OUT") for o in outputs) == [2 * v for v in values.tolist()]
        peaks[model] = max(scalar(o, "ACTIVE") for o in outputs)
    assert peaks == {"limited": 2, "unlimited": 4}


def test_a_step_that_does_not_batch_feeds_one_that_does(client, server):
    """Triton's shape rule between steps: [1] gains a batch dimension for a batching model ([1, 1]), a batch of
    one loses it for a model (or ensemble output) that does not batch; over HTTP and gRPC."""
    result = infer(client, "batch_bridge", IN=np.array([21], np.int32))
    assert result.as_numpy("OUT").tolist() == [42] and result.as_numpy("COPY").tolist() == [42]
    with grpcclient.InferenceServerClient(server.grpc_url) as grpc:
        result = grpc.infer("batch_bridge", _grpc_inputs(IN=np.array([5], np.int32)))
    assert result.as_numpy("OUT").tolist() == [10] and result.as_numpy("COPY").tolist() == [10]


def test_a_failing_step_fails_the_request_in_tritons_words(client, server):
    with pytest.raises(InferenceServerException) as info:
        infer(client, "failing", IN=np.ones(2, np.float32))
    message = str(info.value)
    assert message.startswith("[500] in ensemble 'failing', ")  # Triton's words: the ensemble, then the error
    assert "intentional step failure" in message and "step 1" not in message
    stream = StreamCollector(server.grpc_url)  # over a stream too, as an error response
    try:
        stream.send("failing", "f", IN=np.ones(2, np.float32))
        with pytest.raises(InferenceServerException, match="in ensemble 'failing', .*intentional step failure"):
            stream.collect()
    finally:
        stream.close()
    assert infer(client, "chain", IN=np.zeros(1, np.float32)).as_numpy("OUT").tolist() == [1.0]


def test_cancelling_the_stream_cancels_every_running_step(server, repository):
    markers = repository[1]
    stream = StreamCollector(server.grpc_url)
    try:
        stream.send("cancel_pipe", "c", IN=np.array([5], np.int32))
        wait_until(lambda: all((markers / f"started-{m}").exists() for m in ("ticker", "hold", "hold_b")))
    finally:
        stream.close(cancel=True)
    wait_until(lambda: all((markers / f"cancelled-{m}").exists() for m in ("ticker", "hold", "hold_b")))
    with httpclient.InferenceServerClient(server.http_url) as client:
        wait_until(lambda: _stat(client, "hold")["fail"]["count"] >= 1)
        assert _stat(client, "cancel_pipe")["fail"]["count"] == 1
    assert 'nv_inference_request_failure{model="cancel_pipe",reason="CANCELED",version="1"} 1' in server.metrics()


def wait_until(predicate, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def _stat(client, model: str) -> dict:
    (stats,) = client.get_inference_statistics(model)["model_stats"]
    return stats["inference_stats"]


def test_statistics_of_the_ensemble_and_its_steps(client, server):
    models = ("chain", "scale", "offset", "square")
    before = {m: client.get_inference_statistics(m)["model_stats"][0] for m in models}
    for _ in range(3):
        infer(client, "chain", IN=np.ones(4, np.float32))
    after = {m: client.get_inference_statistics(m)["model_stats"][0] for m in models}
    for model in models:
        assert int(after[model]["inference_stats"]["success"]["count"]) - \
            int(before[model]["inference_stats"]["success"]["count"]) == 3, model
        assert int(after[model]["inference_count"]) - int(before[model]["inference_count"]) == 3, model
        assert int(after[model]["execution_count"]) - int(before[model]["execution_count"]) == 3, model
    assert int(after["chain"]["inference_stats"]["compute_infer"]["ns"]) > 0
    metrics = server.metrics()
    for model in models:
        assert f'nv_inference_request_success{{model="{model}",version="1"}}' in metrics


# -- in process: non-streaming requests ------------------------------------------------------------
STREAMING_SEEN: list[bool] = []  # request.streaming of each request the tokens model ran


class _TokensInstance(ModelInstance):
    """Streams IN's values one response each, or (``request.streaming`` False) all in one response."""

    async def execute(self, requests):
        for request in requests:
            STREAMING_SEEN.append(request.streaming)
            values = request.inputs["IN"].data.reshape(-1)
            sender = request.response_sender
            if request.streaming:
                for index, value in enumerate(values):
                    sender.send(InferenceResponse(outputs=[Tensor.from_numpy("OUT", np.array([value], np.int32))]),
                                final=index == len(values) - 1)
            else:
                sender.send(InferenceResponse(outputs=[Tensor.from_numpy("OUT", values.astype(np.int32))]),
                            final=True)


_TokensBackend = instance_backend(_TokensInstance)


async def test_non_streaming_request_runs_the_steps_non_streaming(tmp_path):
    repo = tmp_path / "models"
    (repo / "tokens" / "1").mkdir(parents=True)
    (repo / "tokens" / "config.pbtxt").write_text(textwrap.dedent("""
        backend: "tokens"
        max_batch_size: 0
        model_transaction_policy { decoupled: true }
        input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
        output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]
    """))
    write_model(repo, "total", "double", [("IN", I32, "-1")], [("OUT", I32, "-1")])
    write_ensemble(repo, "pipe", [("IN", I32, "-1")], [("OUT", I32, "-1")],
                   [("tokens", {"IN": "IN"}, {"OUT": "t"}), ("total", {"IN": "t"}, {"OUT": "OUT"})])
    registry = BackendRegistry()
    registry.register("tokens", _TokensBackend)
    metrics = Metrics()
    repository = ModelRepository([repo], registry, metrics, ControlMode.NONE)
    dataplane = DataPlane(repository, metrics)
    repository.handles = dataplane.server_handles()
    await repository.start()
    try:
        values = np.array([3, 4, 5], np.int32)
        STREAMING_SEEN.clear()
        response = await dataplane.infer_unary(InferenceRequest("pipe", {"IN": Tensor.from_numpy("IN", values)}))
        assert response.output("OUT").data.tolist() == [6, 8, 10]  # one response with the whole result
        assert STREAMING_SEEN == [False]
        streamed = [r async for r in dataplane.infer(InferenceRequest("pipe", {"IN": Tensor.from_numpy("IN", values)}))]
        assert [r.output("OUT").data.tolist() for r in streamed] == [[6], [8], [10]]
        assert streamed[-1].final and STREAMING_SEEN == [False, True]
    finally:
        await repository.shutdown(drain_timeout=5)


async def test_poll_mode_loads_an_ensemble_once_its_step_appears(tmp_path):
    repo = tmp_path / "models"
    repo.mkdir()
    write_ensemble(repo, "pipe", *VEC, [("later", {"IN": "IN"}, {"OUT": "OUT"})])
    metrics = Metrics()
    repository = ModelRepository([repo], BackendRegistry(), metrics, ControlMode.POLL)
    dataplane = DataPlane(repository, metrics)
    repository.handles = dataplane.server_handles()
    await repository.start()
    try:
        assert "model 'later'" in repository.entries["pipe"].reason
        write_model(repo, "later", "scale", *VEC)
        await repository.poll()
        request = InferenceRequest("pipe", {"IN": Tensor.from_numpy("IN", np.array([1.5], np.float32))})
        assert (await dataplane.infer_unary(request)).output("OUT").data.tolist() == [3.0]
    finally:
        await repository.shutdown(drain_timeout=5)
