"""Python-backend and generate-endpoint semantics as Triton's own tests pin them (qa/L0_backend_python
decoupled, lifecycle, async_execute, parameters, response_sender; qa/L0_http/generate_endpoint_test.py),
on a real tideserve process (Python models in their own processes, the default) driven by tritonclient:

- ``cancel()`` on a BLS response iterator cancels the called model's request: the model's CANCELLED error
  ends the stream; a model that ignores cancellation keeps streaming (sync ``exec`` and ``async_exec``), and
  ``cancel()`` after the stream ended is harmless;
- async ``execute`` requests and the async-BLS requests they make run concurrently;
- a ``TritonError`` of each code reaches the gRPC client with that code and the model's message;
- async ``execute`` requests whose BLS calls are iterated with a plain ``for`` are in flight together;
- a non-decoupled model that sends its response through the response sender and then returns a response,
  raises or sends a second response delivers the response it sent (and only it); FINAL with no response is
  an error; a decoupled model whose execute returns responses gets Triton's error;
- request rescheduling outside an ``iterative_sequence`` model, or with a returned response, is an error;
- response parameters take only bool, int and str values and str keys;
- a generate request naming an input twice is refused.
"""

from __future__ import annotations

import json
import queue
import time

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from support import start_server
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.timeout(300)

UNTIL_CANCELLED_CONFIG = """\
name: "until_cancelled"
backend: "python"
model_transaction_policy { decoupled: true }
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "MAX_RESPONSE_COUNT" data_type: TYPE_INT32 dims: [ 1 ] },
        { name: "DELAY" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "IGNORE_CANCEL" data_type: TYPE_BOOL dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 2 } ]
"""
UNTIL_CANCELLED = '''\
import time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Sends INPUT again and again until cancelled (unless IGNORE_CANCEL) or MAX_RESPONSE_COUNT is reached."""

    def execute(self, requests):
        request = requests[0]
        value = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()[0]
        most = pb_utils.get_input_tensor_by_name(request, "MAX_RESPONSE_COUNT").as_numpy()[0]
        delay = pb_utils.get_input_tensor_by_name(request, "DELAY").as_numpy()[0]
        ignore = pb_utils.get_input_tensor_by_name(request, "IGNORE_CANCEL").as_numpy()[0]
        sender = request.get_response_sender()
        sent = 0
        while True:
            if not ignore and request.is_cancelled():
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    "request has been cancelled", pb_utils.TritonError.CANCELLED)),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return None
            response = pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", np.array([value], np.int32))])
            sent += 1
            if sent == most:
                sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return None
            sender.send(response)
            time.sleep(delay / 1000)
'''
BLS_CANCEL_CONFIG = """\
name: "{name}"
backend: "python"
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }}, {{ name: "MAX_SUM" data_type: TYPE_INT32 dims: [ 1 ] }},
        {{ name: "IGNORE_CANCEL" data_type: TYPE_BOOL dims: [ 1 ] }} ]
output [ {{ name: "SUM" data_type: TYPE_INT32 dims: [ 1 ] }}, {{ name: "IS_CANCELLED" data_type: TYPE_BOOL dims: [ 1 ] }} ]
"""
BLS_CANCEL = '''\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Sums the responses of a decoupled BLS call to until_cancelled and cancels it once MAX_SUM is reached."""

    def request(self, request):
        tensors = [pb_utils.get_input_tensor_by_name(request, "INPUT"),
                   pb_utils.get_input_tensor_by_name(request, "IGNORE_CANCEL"),
                   pb_utils.Tensor("DELAY", np.array([50], np.int32)),
                   pb_utils.Tensor("MAX_RESPONSE_COUNT", np.array([20], np.int32))]
        return pb_utils.InferenceRequest(model_name="until_cancelled", inputs=tensors,
                                         requested_output_names=["OUTPUT"])

    def consume(self, request, stream):
        most = pb_utils.get_input_tensor_by_name(request, "MAX_SUM").as_numpy()[0]
        total, cancelled, error = 0, False, None
        for response in stream:
            if response.has_error():
                if response.error().code() == pb_utils.TritonError.CANCELLED:
                    cancelled = True
                else:
                    error = response.error()
                break
            output = pb_utils.get_output_tensor_by_name(response, "OUTPUT")
            if output is None:  # the bare FINAL flag
                continue
            total += output.as_numpy()[0]
            if total >= most:
                stream.cancel()
        if error is None:
            stream.cancel()  # after the end: does nothing
        return pb_utils.InferenceResponse([pb_utils.Tensor("SUM", np.array([total], np.int32)),
                                           pb_utils.Tensor("IS_CANCELLED", np.array([cancelled]))], error=error)

{execute}
'''
BLS_CANCEL_SYNC = BLS_CANCEL.format(execute="""\
    def execute(self, requests):
        stream = self.request(requests[0]).exec(decoupled=True)
        return [self.consume(requests[0], stream)]""")
BLS_CANCEL_ASYNC = BLS_CANCEL.format(execute="""\
    async def execute(self, requests):
        stream = await self.request(requests[0]).async_exec(decoupled=True)
        return [self.consume(requests[0], stream)]""")
SLEEPER_CONFIG = """\
name: "sleeper"
backend: "python"
max_batch_size: 8
model_transaction_policy { decoupled: true }
input [ { name: "WAIT_SECONDS" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "DUMMY_OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""
SLEEPER = '''\
import asyncio
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        waits = []
        for request in requests:
            seconds = pb_utils.get_input_tensor_by_name(request, "WAIT_SECONDS").as_numpy()
            waits += [asyncio.sleep(float(s[0])) for s in seconds]
        await asyncio.gather(*waits)
        for request in requests:
            rows = pb_utils.get_input_tensor_by_name(request, "WAIT_SECONDS").as_numpy().shape[0]
            request.get_response_sender().send(
                pb_utils.InferenceResponse([pb_utils.Tensor("DUMMY_OUT", np.zeros((rows, 1), np.float32))]),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''
SLEEPER_BLS_CONFIG = SLEEPER_CONFIG.replace('"sleeper"', '"sleeper_bls"')
SLEEPER_BLS = '''\
import asyncio
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def one(self, request):
        seconds = pb_utils.get_input_tensor_by_name(request, "WAIT_SECONDS").as_numpy()
        call = pb_utils.InferenceRequest(model_name="sleeper", inputs=[pb_utils.Tensor("WAIT_SECONDS", seconds)],
                                         requested_output_names=["DUMMY_OUT"])
        sender = request.get_response_sender()
        for response in await call.async_exec(decoupled=True):
            out = pb_utils.get_output_tensor_by_name(response, "DUMMY_OUT")
            if out is not None:
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("DUMMY_OUT", out.as_numpy())]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    async def execute(self, requests):
        await asyncio.gather(*[self.one(r) for r in requests])
        return None
'''
GATE_CONFIG = """\
name: "gate"
backend: "python"
max_batch_size: 8
model_transaction_policy { decoupled: true }
input [ { name: "WAIT_SECONDS" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "DUMMY_OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""
GATE = '''\
import asyncio
import numpy as np
import triton_python_backend_utils as pb_utils

GROUP = 4


class TritonPythonModel:
    """Answers nothing until GROUP requests are waiting, then all of them: it only ever answers requests that
    are in flight together."""

    def initialize(self, args):
        self.waiting = []

    async def execute(self, requests):
        opened = asyncio.get_running_loop().create_future()
        self.waiting.append(opened)
        if len(self.waiting) == GROUP:
            for waiter in self.waiting:
                waiter.set_result(None)
            self.waiting = []
        await opened
        for request in requests:
            rows = pb_utils.get_input_tensor_by_name(request, "WAIT_SECONDS").as_numpy().shape[0]
            request.get_response_sender().send(
                pb_utils.InferenceResponse([pb_utils.Tensor("DUMMY_OUT", np.zeros((rows, 1), np.float32))]),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''
GATE_BLS_CONFIG = SLEEPER_CONFIG.replace('"sleeper"', '"gate_bls"')
GATE_BLS = SLEEPER_BLS.replace('model_name="sleeper"', 'model_name="gate"')
DECOUPLED_RETURNS_CONFIG = """\
name: "{name}"
backend: "python"
model_transaction_policy {{ decoupled: true }}
input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
"""
DECOUPLED_RETURNS = '''\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """A decoupled model that returns its responses instead of sending them."""

    {prefix}def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "IN")]) for r in requests]
'''
RESCHEDULE_CONFIG = """\
name: "{name}"
backend: "python"
input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
{batching}
"""
RESCHEDULE = '''\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Releases every request with RESCHEDULE; RETURN: returns a response for it too (which is wrong)."""

    def execute(self, requests):
        for request in requests:
            request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
        if {returns}:
            return [pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "IN")]) for r in requests]
        return [None for _ in requests]
'''
ERROR_CODE_CONFIG = """\
name: "error_code"
backend: "python"
max_batch_size: 8
input [ { name: "ERROR_CODE" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_STRING dims: [ 1 ] } ]
"""
ERROR_CODE = '''\
import triton_python_backend_utils as pb_utils

CODES = {name: getattr(pb_utils.TritonError, name) for name in (
    "UNKNOWN", "INTERNAL", "NOT_FOUND", "INVALID_ARG", "UNAVAILABLE", "UNSUPPORTED", "ALREADY_EXISTS", "CANCELLED")}


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            name = pb_utils.get_input_tensor_by_name(request, "ERROR_CODE").as_numpy()[0][0].decode()
            if name in CODES:
                error = pb_utils.TritonError("error code: " + name, CODES[name])
            else:
                error = pb_utils.TritonError("unrecognized error code: " + name)
            responses.append(pb_utils.InferenceResponse(error=error))
        return responses
'''
SENDER_CONFIG = """\
name: "sender"
backend: "python"
input [ { name: "MODE" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""
SENDER = '''\
import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def answer(value):
    return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([value], np.int32))])


class TritonPythonModel:
    """A non-decoupled model that answers through its response sender, then does something more."""

    def execute(self, requests):
        request = requests[0]
        mode = pb_utils.get_input_tensor_by_name(request, "MODE").as_numpy()[0].decode()
        sender = request.get_response_sender()
        if mode == "final_only":
            sender.send(flags=FINAL)
            return None
        if mode == "send_twice":  # the second send raises: the client gets the first response only
            sender.send(answer(1))
            sender.send(answer(2))
            sender.send(flags=FINAL)
            return None
        sender.send(answer(1), flags=FINAL)
        if mode == "then_return":
            return [answer(2)]
        if mode == "then_raise":
            raise RuntimeError("raised after the response was sent")
        if mode == "then_send":
            sender.send(answer(3), flags=FINAL)
        return None
'''
PARAMS_CONFIG = """\
name: "response_parameters"
backend: "python"
input [ { name: "RESPONSE_PARAMETERS" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_STRING dims: [ 1 ] } ]
"""
PARAMS = '''\
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "RESPONSE_PARAMETERS").as_numpy()[0].decode()
            params = json.loads(text)
            if isinstance(params, dict):
                params = {int(k) if k.isdigit() else k: v for k, v in params.items()}
            try:
                response = pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUTPUT", np.array([text], np.object_))], parameters=params)
                if (json.loads(response.parameters()) if response.parameters() else {}) != params:
                    raise Exception("the response parameters differ from those given")
            except Exception as exc:
                response = pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG))
            responses.append(response)
        return responses
'''
GENERATE_CONFIG = """\
name: "echo_prompt"
backend: "python"
input [ { name: "PROMPT" data_type: TYPE_STRING dims: [ 1 ] }, { name: "STREAM" data_type: TYPE_BOOL dims: [ 1 ] } ]
output [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
parameters { key: "process_isolation" value { string_value: "false" } }
"""
GENERATE = '''\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "TEXT", pb_utils.get_input_tensor_by_name(r, "PROMPT").as_numpy())]) for r in requests]
'''
MODELS = {
    "until_cancelled": (UNTIL_CANCELLED_CONFIG, UNTIL_CANCELLED),
    "bls_cancel": (BLS_CANCEL_CONFIG.format(name="bls_cancel"), BLS_CANCEL_SYNC),
    "bls_cancel_async": (BLS_CANCEL_CONFIG.format(name="bls_cancel_async"), BLS_CANCEL_ASYNC),
    "sleeper": (SLEEPER_CONFIG, SLEEPER),
    "sleeper_bls": (SLEEPER_BLS_CONFIG, SLEEPER_BLS),
    "gate": (GATE_CONFIG, GATE),
    "gate_bls": (GATE_BLS_CONFIG, GATE_BLS),
    "decoupled_returns": (DECOUPLED_RETURNS_CONFIG.format(name="decoupled_returns"),
                          DECOUPLED_RETURNS.format(prefix="")),
    "decoupled_returns_async": (DECOUPLED_RETURNS_CONFIG.format(name="decoupled_returns_async"),
                                DECOUPLED_RETURNS.format(prefix="async ")),
    "reschedule_not_iterative": (RESCHEDULE_CONFIG.format(name="reschedule_not_iterative", batching=""),
                                 RESCHEDULE.format(returns=False)),
    "reschedule_returns": (RESCHEDULE_CONFIG.format(name="reschedule_returns",
                                                    batching="sequence_batching { iterative_sequence: true }"),
                           RESCHEDULE.format(returns=True)),
    "error_code": (ERROR_CODE_CONFIG, ERROR_CODE),
    "sender": (SENDER_CONFIG, SENDER),
    "response_parameters": (PARAMS_CONFIG, PARAMS),
    "echo_prompt": (GENERATE_CONFIG, GENERATE),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("python_semantics")
    repo = root / "models"
    for name, (config, code) in MODELS.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(config)
        (repo / name / "1" / "model.py").write_text(code)
    running = start_server([repo], tmp_dir=root, ready_timeout=180)
    yield running
    running.stop()


@pytest.fixture
def grpc(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    yield client
    client.close()


def _tensor(name, array, datatype):
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


# -- BLS cancellation --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["bls_cancel", "bls_cancel_async"])
@pytest.mark.parametrize("ignore", [False, True], ids=["honours-cancel", "ignores-cancel"])
def test_bls_iterator_cancel(grpc, model, ignore):
    inputs = [_tensor("INPUT", np.array([1], np.int32), "INT32"), _tensor("MAX_SUM", np.array([10], np.int32), "INT32"),
              _tensor("IGNORE_CANCEL", np.array([ignore]), "BOOL")]
    result = grpc.infer(model, inputs, client_timeout=60)
    total, cancelled = result.as_numpy("SUM")[0], result.as_numpy("IS_CANCELLED")[0]
    if ignore:  # the called model streams on to its MAX_RESPONSE_COUNT
        assert not cancelled and total == 20
    else:  # its CANCELLED error ends the stream right after the cancel
        assert cancelled and total == 10


# -- async execute concurrency -----------------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["sleeper", "sleeper_bls"])
def test_async_execute_requests_run_concurrently(grpc, model):
    answers: queue.Queue = queue.Queue()
    grpc.start_stream(callback=lambda result, error: answers.put((result, error)))
    started = time.monotonic()
    for _ in range(4):  # one instance: 4 s if they ran one after another
        grpc.async_stream_infer(model, [_tensor("WAIT_SECONDS", np.full((1, 1), 1.0, np.float32), "FP32")])
    got = [answers.get(timeout=30) for _ in range(4)]
    elapsed = time.monotonic() - started
    grpc.stop_stream()
    assert all(error is None and result.as_numpy("DUMMY_OUT").shape == (1, 1) for result, error in got)
    assert elapsed < 3.0, f"4 requests of 1 s took {elapsed:.1f}s: not concurrent"


def test_async_execute_bls_calls_are_in_flight_together(grpc):
    """Triton's async_execute test_concurrent_execute_multi_request_bls: each request's async execute awaits a BLS
    call and iterates its responses with a plain ``for``; the called model answers only once all four calls are in
    flight together, so a request that blocked the others would leave every one unanswered."""
    answers: queue.Queue = queue.Queue()
    grpc.start_stream(callback=lambda result, error: answers.put((result, error)))
    inputs = [_tensor("WAIT_SECONDS", np.full((1, 1), 1.0, np.float32), "FP32")]
    grpc.async_stream_infer("gate_bls", inputs)
    time.sleep(0.5)  # the first request is already waiting on its call when the others come
    for _ in range(3):
        grpc.async_stream_infer("gate_bls", inputs)
    got = [answers.get(timeout=30) for _ in range(4)]
    grpc.stop_stream()
    assert all(error is None and result.as_numpy("DUMMY_OUT").shape == (1, 1) for result, error in got)


# -- decoupled models must return None -----------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["decoupled_returns", "decoupled_returns_async"])
def test_decoupled_execute_returning_responses_is_an_error(grpc, model):
    answers: queue.Queue = queue.Queue()
    grpc.start_stream(callback=lambda result, error: answers.put((result, error)))
    grpc.async_stream_infer(model, [_tensor("IN", np.array([7], np.int32), "INT32")])
    result, error = answers.get(timeout=30)
    grpc.stop_stream()
    assert result is None
    assert (f"Python model '{model}_0_0' is using the decoupled mode and the execute function must return None."
            in error.message())


# -- request rescheduling: the errors ----------------------------------------------------------------------------
def test_rescheduling_a_request_of_a_model_that_is_not_iterative_is_an_error(grpc):
    with pytest.raises(InferenceServerException) as info:
        grpc.infer("reschedule_not_iterative", [_tensor("IN", np.array([1], np.int32), "INT32")], client_timeout=30)
    assert str(info.value) == ("[StatusCode.INVALID_ARGUMENT] Request is released with "
                               "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE, while the model is not configured to handle "
                               "such a flag.")


def test_a_rescheduled_request_must_have_no_returned_response(grpc):
    with pytest.raises(InferenceServerException) as info:
        grpc.infer("reschedule_returns", [_tensor("IN", np.array([1], np.int32), "INT32")], client_timeout=30)
    assert ("Expected a None object in the execute function return list for reschduled request, found type"
            in str(info.value))
    assert grpc.is_model_ready("reschedule_returns")


# -- error codes ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("code, status", [
    ("UNKNOWN", "UNKNOWN"), ("INTERNAL", "INTERNAL"), ("NOT_FOUND", "NOT_FOUND"), ("INVALID_ARG", "INVALID_ARGUMENT"),
    ("UNAVAILABLE", "UNAVAILABLE"), ("UNSUPPORTED", "UNIMPLEMENTED"), ("ALREADY_EXISTS", "ALREADY_EXISTS"),
    ("CANCELLED", "CANCELLED"), ("(default)", "INTERNAL")])
def test_triton_error_code_reaches_grpc_client(grpc, code, status):
    with pytest.raises(InferenceServerException) as info:
        grpc.infer("error_code", [_tensor("ERROR_CODE", np.array([[code]], np.object_), "BYTES")])
    message = ("unrecognized error code: " if code == "(default)" else "error code: ") + code
    assert str(info.value) == f"[StatusCode.{status}] {message}"


def test_unknown_error_code_over_http_is_400(server):
    body = {"inputs": [{"name": "ERROR_CODE", "datatype": "BYTES", "shape": [1, 1], "data": ["UNKNOWN"]}]}
    response = httpx.post(f"{server.base_url}/v2/models/error_code/infer", json=body)
    assert response.status_code == 400 and response.json()["error"] == "error code: UNKNOWN"


# -- non-decoupled models answering through the response sender --------------------------------------------------
@pytest.mark.parametrize("mode", ["then_return", "then_raise", "then_send"])
def test_non_decoupled_sent_response_is_delivered(grpc, mode):
    result = grpc.infer("sender", [_tensor("MODE", np.array([mode], np.object_), "BYTES")])
    assert result.as_numpy("OUT").tolist() == [1]


def test_non_decoupled_second_response_is_refused_and_the_first_delivered(server, grpc):
    """Triton's response_sender test_non_decoupled_two_response_pre_return: the second send raises in the model;
    the client gets the first response and nothing after it, on a stream as on a unary call."""
    inputs = [_tensor("MODE", np.array(["send_twice"], np.object_), "BYTES")]
    assert grpc.infer("sender", inputs).as_numpy("OUT").tolist() == [1]
    answers: queue.Queue = queue.Queue()
    grpc.start_stream(callback=lambda result, error: answers.put((result, error)))
    grpc.async_stream_infer("sender", inputs)
    grpc.async_stream_infer("sender", [_tensor("MODE", np.array(["then_return"], np.object_), "BYTES")])
    got = [answers.get(timeout=30) for _ in range(2)]
    grpc.stop_stream()
    assert answers.empty()
    assert [(result.as_numpy("OUT").tolist(), error) for result, error in got] == [([1], None), ([1], None)]
    assert "Non-decoupled model cannot send more than one response" in server.log()


def test_non_decoupled_final_without_response_is_an_error(grpc):
    with pytest.raises(InferenceServerException) as info:
        grpc.infer("sender", [_tensor("MODE", np.array(["final_only"], np.object_), "BYTES")])
    assert "Non-decoupled model cannot send complete final before sending a response" in str(info.value)


# -- response parameters ---------------------------------------------------------------------------------------
def _parameters(grpc, params):
    text = json.dumps(params)
    return grpc.infer("response_parameters", [_tensor("RESPONSE_PARAMETERS", np.array([text], np.object_), "BYTES")])


@pytest.mark.parametrize("params", [{}, {"many_elements": False}, {"bool": True, "str": "Hello World!", "int": 1024},
                                    {"a": "1", "b": "2", "c": 3, "d": False, "e": 5, "f": ""}])
def test_response_parameters_of_triton_types(grpc, params):
    result = _parameters(grpc, params)
    got = {}
    for key, value in result.get_response().parameters.items():
        got[key] = getattr(value, value.WhichOneof("parameter_choice"))
    assert got == params


@pytest.mark.parametrize("params, message", [
    ([], ", got <class 'list'>"),
    ({"1": "int key"}, "Expect parameters keys to have type str, found type <class 'int'>"),
    ({"int": 2, "float": 0.5}, "Expect parameters values to have type bool/int/str, found type <class 'float'>"),
    ({"bool": True, "null": None}, "Expect parameters values to have type bool/int/str, found type <class 'NoneType'>"),
    ({"str": "", "list": ["variable"]}, "Expect parameters values to have type bool/int/str, found type <class 'list'>"),
])
def test_response_parameters_of_other_types_are_refused(grpc, params, message):
    with pytest.raises(InferenceServerException) as info:
        _parameters(grpc, params)
    assert "[StatusCode.INVALID_ARGUMENT] " in str(info.value) and message in str(info.value)


# -- generate: duplicate inputs --------------------------------------------------------------------------------------
@pytest.mark.parametrize("body, name", [
    ('{"PROMPT": "hello", "STREAM": false, "PROMPT": "duplicate"}', "PROMPT"),
    ('{"PROMPT": "hello", "STREAM": false, "STREAM": false}', "STREAM"),
    ('{"PROMPT": "hello", "STREAM": false, "PROMPT": "duplicate", "STREAM": true}', "PROMPT"),
    ('{"PROMPT": "hello", "STREAM": false, "STREAM": true, "PROMPT": "duplicate"}', "STREAM"),
])
@pytest.mark.parametrize("route", ["generate", "generate_stream"])
def test_generate_duplicate_inputs_are_refused(server, body, name, route):
    response = httpx.post(f"{server.base_url}/v2/models/echo_prompt/{route}", content=body)
    assert response.status_code == 400
    assert f"input '{name}' already exists in request" in response.json()["error"]
    ok = httpx.post(f"{server.base_url}/v2/models/echo_prompt/generate", json={"PROMPT": "hi", "STREAM": False})
    assert ok.status_code == 200 and ok.json()["TEXT"] == "hi"
