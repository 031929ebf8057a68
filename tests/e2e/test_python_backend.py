"""The ``python`` backend: Triton Python-backend models running unchanged.

First in-process (repository + DataPlane, no frontends) over ``tests/models`` and over small
models written for a test; then end to end with ``tritonclient`` against a real server process.
"""

from __future__ import annotations

import asyncio
import json
import queue
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from support import TEST_MODELS

import triton_python_backend_utils as pb_utils
from tideserve.backend import BackendRegistry
from tideserve.dataplane import DataPlane
from tideserve.errors import InternalError, InvalidArgument, Status
from tideserve.repository import ControlMode, ModelRepository
from tideserve.stats import Metrics
from tideserve.types import InferenceRequest, RequestedOutput, Tensor


# -- helpers ---------------------------------------------------------------------------------------
class Core:
    """A repository and DataPlane in this process, without frontends."""

    def __init__(self, paths: list[Path], load: list[str] | None = None) -> None:
        self.metrics = Metrics()
        mode = ControlMode.EXPLICIT if load is not None else ControlMode.NONE
        self.repository = ModelRepository(paths, BackendRegistry(), self.metrics, mode, load)
        self.dataplane = DataPlane(self.repository, self.metrics)
        self.repository.handles = self.dataplane.server_handles()

    async def infer(self, model: str, outputs: list[str] | None = None, parameters: dict | None = None,
                    **inputs: np.ndarray):
        request = InferenceRequest(model, {k: Tensor.from_numpy(k, v) for k, v in inputs.items()},
                                   outputs=[RequestedOutput(n) for n in outputs or []], parameters=parameters)
        return await self.dataplane.infer_unary(request)

    async def stream(self, model: str, **inputs: np.ndarray) -> list:
        request = InferenceRequest(model, {k: Tensor.from_numpy(k, v) for k, v in inputs.items()})
        return [r async for r in self.dataplane.infer(request)]

    def instance(self, model: str, index: int = 0):
        return self.dataplane.model(model).slots[index].instance


@pytest.fixture
async def core():
    running = Core([TEST_MODELS])
    await running.repository.start()
    yield running
    await running.repository.shutdown(drain_timeout=5)


@pytest.fixture
async def make_core():
    """Build a Core over a repository of models written by the test."""
    started = []

    async def make(path: Path | list[Path], load: list[str] | None = None) -> Core:
        running = Core(path if isinstance(path, list) else [path], load)
        await running.repository.start()
        started.append(running)
        return running

    yield make
    for running in started:
        await running.repository.shutdown(drain_timeout=5)


def write_model(repo: Path, name: str, model_py: str, config: str = "", version: int = 1,
                filename: str = "model.py", files: dict[str, str] | None = None) -> Path:
    version_dir = repo / name / str(version)
    version_dir.mkdir(parents=True, exist_ok=True)
    (version_dir / filename).write_text(textwrap.dedent(model_py))
    for file, text in (files or {}).items():
        (version_dir / file).write_text(textwrap.dedent(text))
    (repo / name / "config.pbtxt").write_text(textwrap.dedent(config) or 'backend: "python"\n')
    return version_dir


FP32_IO = """
    backend: "python"
    max_batch_size: 0
    input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
    output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""


IN_PROCESS = 'parameters { key: "process_isolation" value { string_value: "false" } }\n'


def add_sub_inputs(rows: int = 1, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"INPUT0": rng.random((rows, 4), dtype=np.float32), "INPUT1": rng.random((rows, 4), dtype=np.float32)}


# -- the test repository in-process ------------------------------------------------------------------
async def test_add_sub_values_and_requested_outputs(core):
    inputs = add_sub_inputs(rows=3)
    response = await core.infer("add_sub", **inputs)
    np.testing.assert_allclose(response.output("OUTPUT0").data, inputs["INPUT0"] + inputs["INPUT1"])
    np.testing.assert_allclose(response.output("OUTPUT1").data, inputs["INPUT0"] - inputs["INPUT1"])
    assert response.output("OUTPUT0").datatype == "FP32" and response.output("OUTPUT0").shape == (3, 4)
    only = await core.infer("add_sub", outputs=["OUTPUT1"], **inputs)
    assert [t.name for t in only.outputs] == ["OUTPUT1"]


async def test_add_sub_batches_concurrent_requests(core):
    requests = [add_sub_inputs(seed=i) for i in range(64)]
    responses = await asyncio.gather(*(core.infer("add_sub", **r) for r in requests))
    for inputs, response in zip(requests, responses):
        np.testing.assert_allclose(response.output("OUTPUT0").data, inputs["INPUT0"] + inputs["INPUT1"])
    (stats,) = await core.dataplane.statistics("add_sub")
    assert stats["inference_count"] == 64
    assert stats["execution_count"] < stats["inference_count"]


async def test_repeat_streams_one_response_per_element_then_final(core):
    responses = await core.stream("repeat", IN=np.array([4, 5, 6], np.int32))
    assert [int(r.output("OUT").data[0]) for r in responses[:-1]] == [4, 5, 6]
    assert [int(r.output("IDX").data[0]) for r in responses[:-1]] == [0, 1, 2]
    assert all(not r.final for r in responses[:-1])
    assert responses[-1].final and responses[-1].empty and responses[-1].error is None


async def test_repeat_stops_early_when_cancelled(core):
    request = InferenceRequest("repeat", {"IN": Tensor.from_numpy("IN", np.arange(50, dtype=np.int32)),
                                          "DELAY": Tensor.from_numpy("DELAY", np.array([20], np.uint32))})
    stream = core.dataplane.infer(request)
    first = await stream.__anext__()
    assert int(first.output("OUT").data[0]) == 0
    await stream.aclose()
    instance = core.instance("repeat")  # the model's process answers FINAL once its thread sees the cancellation
    deadline = time.monotonic() + 2
    while instance.requests_in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert not instance.requests_in_flight  # 50 x 20 ms would take a second


async def test_repeat_reports_bad_delay_as_error_response(core):
    (response,) = await core.stream("repeat", IN=np.array([1, 2, 3], np.int32), DELAY=np.array([1, 2], np.uint32))
    assert response.final and response.error.status is Status.INVALID_ARG
    assert "DELAY" in response.error.message


async def test_raise_error_fails_the_request_and_the_model_keeps_serving(core):
    for _ in range(2):
        with pytest.raises(InternalError, match="raise_error: intentional failure in execute") as info:
            await core.infer("raise_error", INPUT0=np.ones(2, np.float32))
        assert "TritonModelException" in info.value.message and "raise_error_0_0" in info.value.message
    with pytest.raises(InvalidArgument, match="intentional error response"):
        await core.infer("raise_error", parameters={"mode": "response"}, INPUT0=np.ones(2, np.float32))
    assert (await core.infer("add_sub", **add_sub_inputs())).error is None


async def test_bls_sync_exec(core):
    inputs = add_sub_inputs(rows=2)
    response = await core.infer("bls_add_sub", **inputs)
    np.testing.assert_allclose(response.output("OUTPUT0").data, inputs["INPUT0"] + inputs["INPUT1"])
    np.testing.assert_allclose(response.output("OUTPUT1").data, inputs["INPUT0"] - inputs["INPUT1"])


async def test_bls_async_exec_with_a_decoupled_call(core):
    inputs = add_sub_inputs(rows=1)
    response = await core.infer("bls_async", REPEAT_IN=np.array([3, 4, 5], np.int32), **inputs)
    np.testing.assert_allclose(response.output("OUTPUT0").data, inputs["INPUT0"] + inputs["INPUT1"])
    assert int(response.output("REPEAT_SUM").data[0]) == 12
    assert int(response.output("REPEAT_COUNT").data[0]) == 3
    plain = await core.infer("bls_async", **inputs)
    assert plain.output("REPEAT_SUM") is None


async def test_bls_blocking_decoupled_exec(core):
    response = await core.infer("bls_repeat", IN=np.array([1, 2, 3, 4], np.int32))
    assert int(response.output("SUM").data[0]) == 10 and int(response.output("COUNT").data[0]) == 4


async def test_concurrent_bls_calls_do_not_block_each_other(core):
    inputs = add_sub_inputs(rows=1)
    responses = await asyncio.gather(*(core.infer("bls_async", REPEAT_IN=np.array([i], np.int32), **inputs)
                                       for i in range(10)))
    assert [int(r.output("REPEAT_SUM").data[0]) for r in responses] == list(range(10))


async def test_identity_bytes_round_trip(core):
    data = np.array([[b"hello", "ünïcode".encode(), b"", b"\x00\xff"]], dtype=np.object_)
    response = await core.infer("identity_bytes", INPUT0=data)
    out = response.output("OUTPUT0")
    assert out.datatype == "BYTES" and out.shape == (1, 4)
    assert out.data.tolist() == data.tolist()


async def test_auto_complete_fills_the_config_and_initialize_gets_tritons_args(core):
    config = core.dataplane.model_config("auto_complete")
    assert config.max_batch_size == 4 and config.HasField("dynamic_batching")
    assert [t.name for t in config.input] == ["INPUT0"]
    assert [t.name for t in config.output] == ["OUTPUT0", "ARGS"]
    response = await core.infer("auto_complete", INPUT0=np.array([[1, 2, 3]], np.int32))
    assert response.output("OUTPUT0").data.tolist() == [[2, 4, 6]]  # helpers.SCALE of its own helpers.py
    args = json.loads(response.output("ARGS").data[0, 0])
    assert all(isinstance(v, str) for v in args.values())
    assert args["model_name"] == "auto_complete" and args["model_version"] == "1"
    assert args["model_instance_kind"] == "CPU" and args["model_instance_device_id"] == "0"
    assert args["model_instance_name"] == "auto_complete_0_0"
    assert Path(args["model_repository"]) == TEST_MODELS / "auto_complete"
    assert Path(args["model_dir"]) == TEST_MODELS / "auto_complete" / "1"
    model_config = json.loads(args["model_config"])
    assert model_config["max_batch_size"] == 4 and model_config["input"][0]["dims"] == [-1]
    assert model_config["instance_group"][0]["count"] == 1  # int64 fields as numbers, as Triton gives them


def _countdown(responses) -> tuple[list[int], list[int], set[int]]:
    """OUT, FLAGS and the correlation ids of iterative_countdown's responses."""
    def values(name: str) -> list[int]:
        return [int(r.output(name).data[0]) for r in responses]
    return values("OUT"), values("FLAGS"), set(values("CORRID"))


async def test_iterative_sequence_reschedules_a_request_until_it_is_done(core):
    """iterative_sequence: a request with no correlation id starts a sequence of its own (an id, START); each
    execution reschedules it (RELEASE_RESCHEDULE) until the last response; the next runs with neither flag."""
    out, flags, ids = _countdown(await core.stream("iterative_countdown", IN=np.array([3], np.int32)))
    assert out == [2, 1, 0] and flags == [1, 0, 0] and len(ids) == 1 and 0 not in ids
    first, second = await asyncio.gather(core.stream("iterative_countdown", IN=np.array([4], np.int32)),
                                         core.stream("iterative_countdown", IN=np.array([2], np.int32)))
    assert _countdown(first)[0] == [3, 2, 1, 0] and _countdown(second)[0] == [1, 0]
    assert _countdown(first)[2] != _countdown(second)[2]


async def test_iterative_sequence_takes_a_given_correlation_id(core):
    request = InferenceRequest("iterative_countdown", {"IN": Tensor.from_numpy("IN", np.array([2], np.int32))},
                               parameters={"sequence_id": 77, "sequence_start": True})
    out, flags, ids = _countdown([r async for r in core.dataplane.infer(request)])
    assert out == [1, 0] and flags == [1, 0] and ids == {77}


async def test_rescheduled_request_of_a_non_decoupled_model_is_answered_once(core):
    inputs = add_sub_inputs()
    inputs = {name: array[0] for name, array in inputs.items()}
    response = await core.infer("iterative_add_sub", **inputs)
    np.testing.assert_allclose(response.output("OUTPUT0").data, inputs["INPUT0"] + inputs["INPUT1"])
    np.testing.assert_allclose(response.output("OUTPUT1").data, inputs["INPUT0"] - inputs["INPUT1"])
    assert response.output("EXECUTIONS").data.tolist() == [2]


async def test_iterative_sequence_in_the_servers_process(tmp_path, make_core):
    source = TEST_MODELS / "iterative_countdown"
    write_model(tmp_path, "iterative_countdown", (source / "1" / "model.py").read_text(),
                (source / "config.pbtxt").read_text() + IN_PROCESS)
    core = await make_core(tmp_path)
    out, flags, _ = _countdown(await core.stream("iterative_countdown", IN=np.array([3], np.int32)))
    assert out == [2, 1, 0] and flags == [1, 0, 0]


# -- behaviours, with models written for the test ---------------------------------------------------
async def test_every_model_gets_its_own_module_and_sibling_imports(tmp_path, make_core):
    model_py = """
        import numpy as np
        import triton_python_backend_utils as pb_utils
        import helper
        CALLS = []

        class TritonPythonModel:
            def execute(self, requests):
                CALLS.append(len(requests))
                return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.full(1, helper.VALUE + len(CALLS),
                        np.float32))]) for r in requests]
    """
    for name, value in (("first", 10), ("second", 20)):
        write_model(tmp_path, name, model_py, FP32_IO, files={"helper.py": f"VALUE = {value}\n"})
    core = await make_core(tmp_path)
    ones = np.ones(1, np.float32)
    assert (await core.infer("first", IN=ones)).output("OUT").data[0] == 11
    assert (await core.infer("first", IN=ones)).output("OUT").data[0] == 12
    assert (await core.infer("second", IN=ones)).output("OUT").data[0] == 21  # its own helper and CALLS


async def test_unloading_a_model_forgets_its_modules_and_paths(tmp_path, make_core):
    """In the server's process (process_isolation false), where models share sys.modules and sys.path."""
    import sys
    version_dir = write_model(tmp_path, "forgettable", """
        import triton_python_backend_utils as pb_utils
        from . import local_helper

        class TritonPythonModel:
            def execute(self, requests):
                return [pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "IN")]) for r in requests]
    """, FP32_IO.replace("OUT", "IN") + IN_PROCESS, files={"local_helper.py": "X = 1\n"})
    core = await make_core(tmp_path, load=["forgettable"])
    package = core.dataplane.model("forgettable").model.module.package
    assert f"{package}.local_helper" in sys.modules and str(version_dir) in sys.path
    await core.dataplane.unload_model("forgettable")
    assert not [name for name in sys.modules if name.startswith(package)]
    assert str(version_dir) not in sys.path and str(version_dir.parent) not in sys.path


async def test_versions_and_default_model_filename(tmp_path, make_core):
    model_py = """
        import numpy as np
        import triton_python_backend_utils as pb_utils

        class TritonPythonModel:
            def initialize(self, args):
                self.version = float(args["model_version"])

            def execute(self, requests):
                return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([self.version], np.float32))])
                        for _ in requests]
    """
    config = FP32_IO + 'default_model_filename: "entry.py"\nversion_policy: { all: {} }\n'
    for version in (1, 2):
        write_model(tmp_path, "versioned", model_py, config, version=version, filename="entry.py")
    core = await make_core(tmp_path)
    request = InferenceRequest("versioned", {"IN": Tensor.from_numpy("IN", np.ones(1, np.float32))},
                               model_version="1")
    assert (await core.dataplane.infer_unary(request)).output("OUT").data[0] == 1
    assert (await core.infer("versioned", IN=np.ones(1, np.float32))).output("OUT").data[0] == 2


async def test_load_failures_stay_local(tmp_path, make_core):
    write_model(tmp_path, "init_fails", """
        class TritonPythonModel:
            def initialize(self, args):
                raise ValueError("cannot find my weights")
            def execute(self, requests):
                return []
    """, FP32_IO)
    (tmp_path / "no_file" / "1").mkdir(parents=True)
    (tmp_path / "no_file" / "config.pbtxt").write_text(FP32_IO)
    write_model(tmp_path, "no_class", "X = 1\n", FP32_IO)
    write_model(tmp_path, "bad_auto_complete", """
        class TritonPythonModel:
            @staticmethod
            def auto_complete_config(config):
                config.add_input({"name": "IN", "data_type": "TYPE_INT32", "dims": [-1]})
                return config
    """, FP32_IO)
    write_model(tmp_path, "good", """
        import triton_python_backend_utils as pb_utils
        class TritonPythonModel:
            def execute(self, requests):
                return [pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "IN")]) for r in requests]
    """, FP32_IO.replace("OUT", "IN"))
    core = await make_core(tmp_path)
    reasons = {row["name"]: row["reason"] for row in core.dataplane.repository_index()}
    assert "cannot find my weights" in reasons["init_fails"]
    assert "Python model file not found" in reasons["no_file"]
    assert "TritonPythonModel" in reasons["no_class"]
    assert "configuration expects datatype TYPE_FP32 for input 'IN'" in reasons["bad_auto_complete"]
    assert (await core.infer("good", IN=np.ones(2, np.float32))).output("IN").data.tolist() == [1, 1]


async def test_execute_return_checks_fail_the_batch(tmp_path, make_core):
    write_model(tmp_path, "wrong_count", """
        class TritonPythonModel:
            def execute(self, requests):
                return []
    """, FP32_IO)
    write_model(tmp_path, "wrong_type", """
        class TritonPythonModel:
            def execute(self, requests):
                return ["not a response" for _ in requests]
    """, FP32_IO)
    write_model(tmp_path, "decoupled_returns", """
        class TritonPythonModel:
            def execute(self, requests):
                return [None for _ in requests]
    """, FP32_IO + "model_transaction_policy { decoupled: true }\n")
    core = await make_core(tmp_path)
    ones = np.ones(1, np.float32)
    with pytest.raises(InternalError, match="Number of InferenceResponse objects do not match"):
        await core.infer("wrong_count", IN=ones)
    with pytest.raises(InternalError, match="Expected an 'InferenceResponse' object"):
        await core.infer("wrong_type", IN=ones)
    (response,) = await core.stream("decoupled_returns", IN=ones)
    assert "decoupled mode and the execute function must return None" in response.error.message


async def test_response_sender_rules(tmp_path, make_core, caplog):
    write_model(tmp_path, "default_mode_sender", """
        import json
        import numpy as np
        import triton_python_backend_utils as pb_utils
        FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

        class TritonPythonModel:
            def execute(self, requests):
                for request in requests:
                    sender = request.get_response_sender()
                    out = pb_utils.Tensor("OUT", np.array([1.0], np.float32))
                    problems = []
                    try:
                        sender.send(flags=FINAL)
                    except pb_utils.TritonModelException as e:
                        problems.append(str(e))
                    sender.send(pb_utils.InferenceResponse([out]))  # held until FINAL
                    try:
                        sender.send(pb_utils.InferenceResponse([out]))
                    except pb_utils.TritonModelException as e:
                        problems.append(str(e))
                    sender.send(flags=FINAL)
                    try:
                        sender.send(flags=FINAL)
                    except pb_utils.TritonModelException as e:
                        problems.append(str(e))
                    pb_utils.Logger.log_info(json.dumps(problems))
                    self.problems = problems
                return None
    """, FP32_IO)
    caplog.set_level("INFO", logger="tideserve.python_model.default_mode_sender")
    core = await make_core(tmp_path)
    response = await core.infer("default_mode_sender", IN=np.ones(1, np.float32))
    assert response.output("OUT").data.tolist() == [1.0]
    for _ in range(500):  # the response is out before execute logs its problems (from the model's process)
        logged = [r.getMessage() for r in caplog.records if r.name == "tideserve.python_model.default_mode_sender"]
        if logged:
            break
        await asyncio.sleep(0.01)
    problems = json.loads(logged[0])
    assert "cannot send complete final before sending a response" in problems[0]
    assert "cannot send more than one response" in problems[1]
    assert "Response sender has been closed" in problems[2]


async def test_async_decoupled_execute_runs_requests_concurrently(tmp_path, make_core):
    write_model(tmp_path, "async_stream", """
        import asyncio
        import numpy as np
        import triton_python_backend_utils as pb_utils

        class TritonPythonModel:
            async def execute(self, requests):
                for request in requests:
                    sender = request.get_response_sender()
                    for i in range(3):
                        await asyncio.sleep(0.1)
                        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([i], np.float32))]))
                    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    """, FP32_IO + "model_transaction_policy { decoupled: true }\n")
    core = await make_core(tmp_path)
    start = time.monotonic()
    streams = await asyncio.gather(*(core.stream("async_stream", IN=np.ones(1, np.float32)) for _ in range(5)))
    assert time.monotonic() - start < 1.0  # 5 x 0.3 s one after the other would take 1.5 s
    for responses in streams:
        assert [r.output("OUT").data[0] for r in responses[:-1]] == [0, 1, 2] and responses[-1].final


async def test_async_execute_failure_in_background_answers_with_error(tmp_path, make_core):
    write_model(tmp_path, "async_fails", """
        import asyncio

        class TritonPythonModel:
            async def execute(self, requests):
                await asyncio.sleep(0.01)
                raise RuntimeError("async failure")
    """, FP32_IO + "model_transaction_policy { decoupled: true }\n")
    core = await make_core(tmp_path)
    (response,) = await core.stream("async_fails", IN=np.ones(1, np.float32))
    assert "RuntimeError: async failure" in response.error.message


async def test_request_accessors_and_parameters(tmp_path, make_core):
    write_model(tmp_path, "introspect", """
        import json
        import numpy as np
        import triton_python_backend_utils as pb_utils

        class TritonPythonModel:
            def execute(self, requests):
                out = []
                for r in requests:
                    info = {"id": r.request_id(), "params": json.loads(r.parameters()), "flags": r.flags(),
                            "correlation_id": r.correlation_id(), "outputs": r.requested_output_names(),
                            "timeout": r.timeout(), "cancelled": r.is_cancelled(),
                            "inputs": [(t.name(), t.shape(), int(t.triton_dtype())) for t in r.inputs()]}
                    out.append(pb_utils.InferenceResponse(
                        [pb_utils.Tensor("OUT", np.array([json.dumps(info)], dtype=np.object_))],
                        parameters={"answered": True}))
                return out
    """, FP32_IO.replace('name: "OUT" data_type: TYPE_FP32', 'name: "OUT" data_type: TYPE_STRING'))
    core = await make_core(tmp_path)
    request = InferenceRequest("introspect", {"IN": Tensor.from_numpy("IN", np.ones(3, np.float32))}, id="req-7",
                               outputs=[RequestedOutput("OUT")], timeout_us=5000,
                               parameters={"temperature": 0.5, "name": "x", "sequence_id": 42,
                                           "sequence_start": True})
    response = await core.dataplane.infer_unary(request)
    info = json.loads(response.output("OUT").data[0])
    assert info["id"] == "req-7" and info["outputs"] == ["OUT"] and info["timeout"] == 5000
    assert info["params"] == {"temperature": 0.5, "name": "x"}  # reserved keys are not passed on
    assert info["correlation_id"] == 42 and info["flags"] == pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
    assert info["inputs"] == [["IN", [3], 11]] and info["cancelled"] is False
    assert response.parameters == {"answered": True}


async def test_bls_errors_come_back_as_error_responses(tmp_path, make_core):
    write_model(tmp_path, "caller", """
        import json
        import numpy as np
        import triton_python_backend_utils as pb_utils

        class TritonPythonModel:
            def execute(self, requests):
                out = []
                for r in requests:
                    tensor = pb_utils.get_input_tensor_by_name(r, "IN")
                    results = {}
                    for target, timeout in (("nonexistent", 0), ("slow", 50_000), ("slow", 0)):
                        response = pb_utils.InferenceRequest(model_name=target, inputs=[tensor],
                                                             requested_output_names=["IN"], timeout=timeout).exec()
                        results[f"{target}/{timeout}"] = ([response.error().message(), int(response.error().code())]
                                                          if response.has_error() else "ok")
                    out.append(pb_utils.InferenceResponse(
                        [pb_utils.Tensor("OUT", np.array([json.dumps(results)], dtype=np.object_))]))
                return out
    """, FP32_IO.replace('name: "OUT" data_type: TYPE_FP32', 'name: "OUT" data_type: TYPE_STRING'))
    write_model(tmp_path, "slow", """
        import time
        import triton_python_backend_utils as pb_utils

        class TritonPythonModel:
            def execute(self, requests):
                time.sleep(0.3)
                return [pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "IN")]) for r in requests]
    """, FP32_IO.replace("OUT", "IN"))
    core = await make_core(tmp_path)
    response = await core.infer("caller", IN=np.ones(1, np.float32))
    results = json.loads(response.output("OUT").data[0])
    message, code = results["nonexistent/0"]
    assert "nonexistent" in message and code == pb_utils.TritonError.NOT_FOUND
    assert results["slow/50000"] == ["Request timeout expired", pb_utils.TritonError.UNAVAILABLE]
    assert results["slow/0"] == "ok"


async def test_custom_metrics_are_exported(tmp_path, make_core):
    write_model(tmp_path, "metered", """
        import triton_python_backend_utils as pb_utils

        class TritonPythonModel:
            def initialize(self, args):
                family = pb_utils.MetricFamily(name="metered_requests", description="requests seen",
                                               kind=pb_utils.MetricFamily.COUNTER)
                self.counter = family.Metric(labels={"model": args["model_name"]})
                self.gauge = pb_utils.MetricFamily("metered_last", "last size", pb_utils.MetricFamily.GAUGE).Metric()
                self.histogram = pb_utils.MetricFamily("metered_size", "sizes",
                                                       pb_utils.MetricFamily.HISTOGRAM).Metric(buckets=[1, 5])

            def execute(self, requests):
                for r in requests:
                    size = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy().size
                    self.counter.increment(1)
                    self.gauge.set(size)
                    self.histogram.observe(size)
                return [pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "IN")]) for r in requests]
    """, FP32_IO.replace("OUT", "IN"))
    core = await make_core(tmp_path)
    for size in (1, 3):
        await core.infer("metered", IN=np.ones(size, np.float32))
    from prometheus_client import generate_latest
    text = generate_latest(core.metrics.registry).decode()
    assert 'metered_requests_total{model="metered"} 2.0' in text
    assert "metered_last 3.0" in text
    assert 'metered_size_bucket{le="1.0"} 1.0' in text and 'metered_size_bucket{le="5.0"} 2.0' in text


async def test_bls_model_control(tmp_path, make_core):
    write_model(tmp_path, "target", """
        import triton_python_backend_utils as pb_utils
        class TritonPythonModel:
            def execute(self, requests):
                return [pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "IN")]) for r in requests]
    """, FP32_IO.replace("OUT", "IN"))
    write_model(tmp_path, "controller", """
        import numpy as np
        import triton_python_backend_utils as pb_utils
        class TritonPythonModel:
            def execute(self, requests):
                before = pb_utils.is_model_ready("target")
                pb_utils.load_model(model_name="target")
                after = pb_utils.is_model_ready("target")
                return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([before, after], np.float32))])
                        for r in requests]
    """, FP32_IO)
    core = await make_core(tmp_path, load=["controller"])
    response = await core.infer("controller", IN=np.ones(1, np.float32))
    assert response.output("OUT").data.tolist() == [0.0, 1.0]


async def test_triton_async_bls_patterns(tmp_path, make_core):
    """Blocking exec() and 'for' over async_exec(decoupled=True) inside async def execute, as Triton's
    bls_decoupled example does: the model's own event loop may block, the server's never does."""
    write_model(tmp_path, "stream3", """
        import numpy as np
        import triton_python_backend_utils as pb_utils

        class TritonPythonModel:
            def execute(self, requests):
                for request in requests:
                    sender = request.get_response_sender()
                    value = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
                    for i in range(3):
                        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", value + i)]))
                    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    """, FP32_IO + "model_transaction_policy { decoupled: true }\n")
    write_model(tmp_path, "patterns", """
        import asyncio
        import numpy as np
        import triton_python_backend_utils as pb_utils

        class TritonPythonModel:
            async def execute(self, requests):
                responses = []
                for request in requests:
                    tensor = pb_utils.get_input_tensor_by_name(request, "IN")
                    bls = pb_utils.InferenceRequest(model_name="stream3", inputs=[tensor],
                                                    requested_output_names=["OUT"])
                    iterators = await asyncio.gather(*[bls.async_exec(decoupled=True) for _ in range(2)])
                    total = 0.0
                    for iterator in iterators:
                        for response in iterator:
                            if response.output_tensors():
                                total += float(pb_utils.get_output_tensor_by_name(response, "OUT").as_numpy()[0])
                    replay = [len(r.output_tensors()) for r in iterators[0]]
                    blocking = bls.exec(decoupled=True)
                    total += sum(float(r.output_tensors()[0].as_numpy()[0]) for r in blocking if r.output_tensors())
                    responses.append(pb_utils.InferenceResponse([
                        pb_utils.Tensor("OUT", np.array([total, len(replay)], np.float32))]))
                return responses
    """, FP32_IO)
    core = await make_core(tmp_path)
    response = await core.infer("patterns", IN=np.array([1.0], np.float32))
    assert response.output("OUT").data.tolist() == [18.0, 4.0]  # 3 streams of 1+2+3; the replay has 4 responses


async def test_cancelling_a_decoupled_bls_call_stops_the_called_model(tmp_path, make_core):
    write_model(tmp_path, "cancel_caller", """
        import numpy as np
        import triton_python_backend_utils as pb_utils

        class TritonPythonModel:
            def execute(self, requests):
                responses = []
                for request in requests:
                    bls = pb_utils.InferenceRequest(
                        model_name="repeat", requested_output_names=["OUT"],
                        inputs=[pb_utils.Tensor("IN", np.arange(100, dtype=np.int32)),
                                pb_utils.Tensor("DELAY", np.array([20], np.uint32))])
                    iterator = bls.exec(decoupled=True)
                    first = next(iterator)
                    iterator.cancel()  # as Triton: the stream goes on to the called model's final response
                    rest = [r for r in iterator if r.output_tensors()]
                    responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array(
                        [first.output_tensors()[0].as_numpy()[0], len(rest)], np.float32))]))
                return responses
    """, FP32_IO)
    core = await make_core([TEST_MODELS, tmp_path], load=["repeat", "cancel_caller"])
    response = await core.infer("cancel_caller", IN=np.ones(1, np.float32))
    first, more = response.output("OUT").data.tolist()
    assert first == 0.0 and more <= 1  # at most the response in flight when the cancel came
    repeat = core.instance("repeat")
    deadline = time.monotonic() + 2
    while repeat.requests_in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert not repeat.requests_in_flight  # 100 x 20 ms would take two seconds


WAITER = """
    import threading, time
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def initialize(self, args):
            self.thread = threading.get_ident()

        def execute(self, requests):
            responses = []
            for request in requests:
                seconds = float(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
                deadline = time.monotonic() + seconds
                while time.monotonic() < deadline and not request.is_cancelled():
                    time.sleep(0.001)
                if seconds < 0:  # a BLS call from execute, whose responses the process reads meanwhile
                    bls = pb_utils.InferenceRequest(model_name="echo", requested_output_names=["OUT"],
                                                    inputs=[pb_utils.Tensor("IN", np.array([0.01], np.float32))])
                    assert not bls.exec().has_error()
                same = threading.get_ident() == self.thread
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array(
                    [float(request.is_cancelled()), float(same)], np.float32))]))
            return responses
"""


async def test_a_model_process_reads_its_messages_while_execute_runs(tmp_path, make_core):
    """The instance's thread reads its process's socket between batches and runs them inline: execute still runs
    on the thread that ran initialize, a BLS call from execute gets its responses, and a request cancelled while
    a batch runs long is seen cancelled there."""
    write_model(tmp_path, "waiter", WAITER, FP32_IO)
    write_model(tmp_path, "echo", """
        import triton_python_backend_utils as pb_utils

        class TritonPythonModel:
            def execute(self, requests):
                return [pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "IN")]) for r in requests]
    """, FP32_IO)
    core = await make_core(tmp_path, load=["waiter", "echo"])
    for seconds in (0.0, 0.03, -1.0, 0.0, 0.0):  # short and longer batches, one with a BLS call, in turn
        response = await core.infer("waiter", IN=np.array([seconds], np.float32))
        assert response.output("OUT").data.tolist() == [0.0, 1.0]
    many = await asyncio.gather(*(core.infer("waiter", IN=np.array([0.002], np.float32)) for _ in range(16)))
    assert all(r.output("OUT").data.tolist() == [0.0, 1.0] for r in many)
    request = InferenceRequest("waiter", {"IN": Tensor.from_numpy("IN", np.array([30.0], np.float32))})
    stream = core.dataplane.infer(request)
    task = asyncio.ensure_future(stream.__anext__())
    instance = core.instance("waiter")
    deadline = time.monotonic() + 5
    while not instance.requests_in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # the batch runs, nobody reading its process's socket but for the cancellation
    started = time.monotonic()
    request.cancellation.cancel()
    try:
        await asyncio.wait_for(task, 5)
    except Exception:  # noqa: BLE001 - how a cancelled request ends is not what this test asks
        pass
    await stream.aclose()
    while instance.requests_in_flight and time.monotonic() < started + 5:
        await asyncio.sleep(0.01)
    assert not instance.requests_in_flight and time.monotonic() - started < 2  # not the 30 s it asked for
    response = await core.infer("waiter", IN=np.array([0.0], np.float32))  # and it serves on
    assert response.output("OUT").data.tolist() == [0.0, 1.0]


async def test_inputs_are_writable_and_reload_runs_the_new_code(tmp_path, make_core):
    model_py = """
        import triton_python_backend_utils as pb_utils

        class TritonPythonModel:
            def execute(self, requests):
                out = []
                for r in requests:
                    data = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
                    data *= FACTOR  # in place, as models written for Triton may do
                    out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", data)]))
                return out
    """
    version_dir = write_model(tmp_path, "inplace", "FACTOR = 2\n" + textwrap.dedent(model_py), FP32_IO)
    core = await make_core(tmp_path, load=["inplace"])
    read_only = np.frombuffer(np.array([1.0, 2.0], np.float32).tobytes(), np.float32)  # as a binary body gives
    assert (await core.infer("inplace", IN=read_only)).output("OUT").data.tolist() == [2.0, 4.0]
    (version_dir / "model.py").write_text("FACTOR = 3\n" + textwrap.dedent(model_py))
    await core.dataplane.load_model("inplace")
    assert (await core.infer("inplace", IN=read_only)).output("OUT").data.tolist() == [3.0, 6.0]
    assert not (version_dir / "__pycache__").exists()


# -- end to end: tritonclient against a tideserve process over tests/models ---------------------------
def client_inputs(client_module, arrays: dict[str, np.ndarray], binary: bool = True) -> list:
    inputs = []
    for name, array in arrays.items():
        datatype = "BYTES" if array.dtype == np.object_ else client_module.np_to_triton_dtype(array.dtype)
        tensor = client_module.InferInput(name, list(array.shape), datatype)
        if client_module.__name__.endswith("http"):
            tensor.set_data_from_numpy(array, binary_data=binary)
        else:
            tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


@pytest.fixture(scope="module")
def http_client(server):
    import tritonclient.http as httpclient
    client = httpclient.InferenceServerClient(server.http_url, concurrency=16)
    yield client
    client.close()


@pytest.fixture(scope="module")
def grpc_client(server):
    import tritonclient.grpc as grpcclient
    client = grpcclient.InferenceServerClient(server.grpc_url)
    yield client
    client.close()


def test_e2e_every_test_model_is_ready(http_client):
    for name in ("add_sub", "repeat", "raise_error", "bls_add_sub", "bls_async", "bls_repeat", "identity_bytes",
                 "auto_complete", "iterative_countdown", "iterative_add_sub"):
        assert http_client.is_model_ready(name), name


@pytest.mark.parametrize("binary", [True, False])
def test_e2e_add_sub_http(http_client, binary):
    import tritonclient.http as httpclient
    arrays = add_sub_inputs(rows=2)
    result = http_client.infer("add_sub", client_inputs(httpclient, arrays, binary))
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), arrays["INPUT0"] + arrays["INPUT1"])
    np.testing.assert_allclose(result.as_numpy("OUTPUT1"), arrays["INPUT0"] - arrays["INPUT1"])


def test_e2e_add_sub_grpc(grpc_client):
    import tritonclient.grpc as grpcclient
    arrays = add_sub_inputs(rows=1)
    result = grpc_client.infer("add_sub", client_inputs(grpcclient, arrays),
                               outputs=[grpcclient.InferRequestedOutput("OUTPUT1")])
    np.testing.assert_allclose(result.as_numpy("OUTPUT1"), arrays["INPUT0"] - arrays["INPUT1"])
    assert result.as_numpy("OUTPUT0") is None


def test_e2e_add_sub_batches_under_concurrent_load(grpc_client):
    import tritonclient.grpc as grpcclient

    def counts():
        (stats,) = grpc_client.get_inference_statistics("add_sub", as_json=True)["model_stats"]
        return int(stats.get("inference_count", 0)), int(stats.get("execution_count", 0))

    inferences_before, executions_before = counts()
    arrays = [add_sub_inputs(seed=i) for i in range(256)]
    results: queue.Queue = queue.Queue()
    for index, a in enumerate(arrays):  # all in flight at once
        grpc_client.async_infer("add_sub", client_inputs(grpcclient, a), request_id=str(index),
                                callback=lambda result, error: results.put((result, error)))
    for _ in arrays:
        result, error = results.get(timeout=30)
        assert error is None
        a = arrays[int(result.get_response().id)]
        np.testing.assert_allclose(result.as_numpy("OUTPUT0"), a["INPUT0"] + a["INPUT1"])
    inferences, executions = counts()
    assert inferences - inferences_before == 256
    assert executions - executions_before < 256  # the dynamic batcher put requests together


def test_e2e_decoupled_repeat_over_grpc_stream(server):
    import tritonclient.grpc as grpcclient
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for request_id, values in (("a", [3, 1, 4]), ("b", [1, 5])):
            client.async_stream_infer("repeat", client_inputs(grpcclient, {"IN": np.array(values, np.int32)}),
                                      request_id=request_id, enable_empty_final_response=True)
        seen: dict[str, list] = {"a": [], "b": []}
        finals = 0
        while finals < 2:
            result, error = results.get(timeout=10)
            assert error is None
            response = result.get_response()
            if response.parameters["triton_final_response"].bool_param:
                finals += 1
                continue
            seen[response.id].append(int(result.as_numpy("OUT")[0]))
        assert seen == {"a": [3, 1, 4], "b": [1, 5]}
    finally:
        client.stop_stream()
        client.close()


def test_e2e_iterative_sequence_over_grpc_stream(server):
    """Triton's request_rescheduling test_grpc_decoupled, two requests at once on one stream."""
    import tritonclient.grpc as grpcclient
    client = grpcclient.InferenceServerClient(server.grpc_url)

    def counts():
        (stats,) = client.get_inference_statistics("iterative_countdown", as_json=True)["model_stats"]
        return int(stats.get("inference_count", 0)), int(stats.get("execution_count", 0))

    before = counts()
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for request_id, count in (("a", 3), ("b", 2)):
            client.async_stream_infer("iterative_countdown",
                                      client_inputs(grpcclient, {"IN": np.array([count], np.int32)}),
                                      request_id=request_id)
        seen: dict[str, list] = {"a": [], "b": []}
        for _ in range(5):
            result, error = results.get(timeout=30)
            assert error is None
            seen[result.get_response().id].append(int(result.as_numpy("OUT")[0]))
        assert seen == {"a": [2, 1, 0], "b": [1, 0]}
        # one execution per response; the last one is counted as its execution ends, just after it is sent
        deadline = time.monotonic() + 10
        while counts()[1] - before[1] < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert counts()[1] - before[1] == 5
    finally:
        client.stop_stream()
        client.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_e2e_rescheduled_request_of_a_non_decoupled_model(http_client, grpc_client, protocol):
    """Triton's request_rescheduling test_grpc_non_decoupled: the model reschedules the request once."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    client, module = (http_client, httpclient) if protocol == "http" else (grpc_client, grpcclient)
    arrays = {name: array[0] for name, array in add_sub_inputs(seed=3).items()}
    result = client.infer("iterative_add_sub", client_inputs(module, arrays))
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), arrays["INPUT0"] + arrays["INPUT1"])
    np.testing.assert_allclose(result.as_numpy("OUTPUT1"), arrays["INPUT0"] - arrays["INPUT1"])
    assert result.as_numpy("EXECUTIONS").tolist() == [2]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_e2e_raise_error_reports_the_message_and_the_server_keeps_serving(server, http_client, grpc_client,
                                                                           protocol):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException
    client, module = (http_client, httpclient) if protocol == "http" else (grpc_client, grpcclient)
    with pytest.raises(InferenceServerException, match="raise_error: intentional failure in execute"):
        client.infer("raise_error", client_inputs(module, {"INPUT0": np.ones(3, np.float32)}))
    arrays = add_sub_inputs()
    result = client.infer("add_sub", client_inputs(module, arrays))
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), arrays["INPUT0"] + arrays["INPUT1"])
    assert http_client.is_server_ready()


def test_e2e_bls_models(http_client, grpc_client):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    arrays = add_sub_inputs(rows=2)
    result = http_client.infer("bls_add_sub", client_inputs(httpclient, arrays))
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), arrays["INPUT0"] + arrays["INPUT1"])
    single = add_sub_inputs(rows=1)
    repeat_in = np.array([2, 3], np.int32)
    result = grpc_client.infer("bls_async", client_inputs(grpcclient, {**single, "REPEAT_IN": repeat_in}))
    np.testing.assert_allclose(result.as_numpy("OUTPUT1"), single["INPUT0"] - single["INPUT1"])
    assert result.as_numpy("REPEAT_SUM").tolist() == [5] and result.as_numpy("REPEAT_COUNT").tolist() == [2]
    result = http_client.infer("bls_repeat", client_inputs(httpclient, {"IN": np.array([4, 5, 6], np.int32)}))
    assert result.as_numpy("SUM").tolist() == [15] and result.as_numpy("COUNT").tolist() == [3]


@pytest.mark.parametrize("protocol", ["http-binary", "http-json", "grpc"])
def test_e2e_bytes_round_trip(http_client, grpc_client, protocol):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    data = np.array([[b"hello", "ünïcode".encode(), b"", b"a b"]], dtype=np.object_)
    if protocol == "grpc":
        result = grpc_client.infer("identity_bytes", client_inputs(grpcclient, {"INPUT0": data}))
    else:
        binary = protocol == "http-binary"
        result = http_client.infer("identity_bytes", client_inputs(httpclient, {"INPUT0": data}, binary),
                                   outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)])
    out = result.as_numpy("OUTPUT0")
    assert out.shape == (1, 4)
    assert [x if isinstance(x, bytes) else x.encode() for x in out.ravel()] == data.ravel().tolist()


def test_e2e_auto_completed_config_is_served(http_client):
    import tritonclient.http as httpclient
    config = http_client.get_model_config("auto_complete")
    assert config["max_batch_size"] == 4 and "dynamic_batching" in config
    assert [t["name"] for t in config["input"]] == ["INPUT0"]
    metadata = http_client.get_model_metadata("auto_complete")
    assert metadata["inputs"] == [{"name": "INPUT0", "datatype": "INT32", "shape": [-1, -1]}]
    result = http_client.infer("auto_complete", client_inputs(httpclient, {"INPUT0": np.array([[5]], np.int32)}))
    assert result.as_numpy("OUTPUT0").tolist() == [[10]]
