"""Triton's generate extension (``/generate`` and ``/generate_stream``) over the HTTP frontend, end to end.

A real tideserve ``Server`` runs on 127.0.0.1 in a background thread with toy backends; raw HTTP
clients (``urllib``, ``http.client`` and ``aiohttp``) talk to it, since tritonclient has no generate
API. The last tests run the Python-backend ``repeat`` model of tests/models through the shared
``server`` process.
"""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from support import free_port
from toy_backends import instance_backend
from in_process import InProcessServer

from tideserve.app import ServerOptions
from tideserve.backend import BackendRegistry, ModelInstance
from tideserve.errors import InvalidArgument
from tideserve.types import InferenceResponse, Tensor

MAX_INPUT = 256 * 1024  # the test server's --http-max-input-size

CANCELLED: list[str] = []  # ids of the requests the toy models saw cancelled
STREAMING_FLAGS: dict[str, bool] = {}  # request id -> request.streaming as the model saw it


def _text(request, name: str = "text_input") -> str:
    return request.inputs[name].data.ravel()[0].decode()


def _bytes_tensor(name: str, text: str) -> Tensor:
    return Tensor.from_numpy(name, np.array([text.encode()], dtype=np.object_))


# -- toy backends ------------------------------------------------------------------------------
class WordsInstance(ModelInstance):
    """Decoupled text model: one ``text_output`` response per word of ``text_input``, then FINAL.

    With ``request.streaming`` False (``/generate``) it sends the whole text as one response, unless
    the parameter ``ignore_streaming`` is set. ``delay_ms`` (input or parameter) waits before each
    word; a cancelled request stops early and is noted in CANCELLED. The request parameters come back
    as response parameters of the first response.
    """

    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self.run, args=(request,), daemon=True).start()

    def run(self, request):
        sender = request.response_sender
        STREAMING_FLAGS[request.id] = request.streaming
        words = _text(request).split()
        delay = request.parameters.get("delay_ms", 0)
        if "delay_ms" in request.inputs:
            delay = int(request.inputs["delay_ms"].data.ravel()[0])
        params = dict(request.parameters)
        if request.streaming or request.parameters.get("ignore_streaming"):
            chunks = words
        else:
            chunks = [" ".join(words)] if words else []
            delay *= max(len(words), 1)
        for index, chunk in enumerate(chunks):
            deadline = time.monotonic() + delay / 1000
            while time.monotonic() < deadline and not request.is_cancelled():
                time.sleep(0.005)
            if request.is_cancelled():
                CANCELLED.append(request.id)
                break
            response = InferenceResponse(outputs=[_bytes_tensor("text_output", chunk)])
            if index == 0 and params:
                response.parameters = params
            sender.send(response)
        sender.send(None, final=True)


class TypedInstance(ModelInstance):
    """Every input X comes back as output X_out; response parameters X_shape / X_dtype describe it."""

    def execute(self, requests):
        responses = []
        for request in requests:
            outputs, params = [], {}
            for name, tensor in request.inputs.items():
                outputs.append(Tensor(name + "_out", tensor.datatype, tuple(tensor.data.shape), tensor.data))
                params[name + "_shape"] = "x".join(map(str, tensor.data.shape))
                params[name + "_dtype"] = str(tensor.data.dtype)
            responses.append(InferenceResponse(outputs=outputs, parameters=params))
        return responses


class FailMidInstance(ModelInstance):
    """Decoupled: streams the words of text_input, then fails. ``first``: fails at once; ``raise``: crashes."""

    def execute(self, requests):
        for request in requests:
            text = _text(request)
            if text == "raise":
                raise RuntimeError("toy model crashed")
            sender = request.response_sender
            if text != "first":
                for word in text.split():
                    sender.send(InferenceResponse(outputs=[_bytes_tensor("text_output", word)]))
            sender.send(InferenceResponse(error=InvalidArgument(f"toy model failed after '{text}'")), final=True)


_INSTANCES = {"words": WordsInstance, "typed": TypedInstance, "fail_mid": FailMidInstance}


ToyBackend = instance_backend(_INSTANCES, key="")  # by model name


CONFIGS = {
    "words": """
backend: "toy"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },
        { name: "delay_ms" data_type: TYPE_INT32 dims: [ 1 ] optional: true } ]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] } ]
""",
    "typed": """
backend: "toy"
max_batch_size: 4
input [ { name: "i32" data_type: TYPE_INT32 dims: [ 1 ] },
        { name: "f32" data_type: TYPE_FP32 dims: [ -1 ] },
        { name: "flag" data_type: TYPE_BOOL dims: [ 1 ] },
        { name: "u8" data_type: TYPE_UINT8 dims: [ 2 ] optional: true },
        { name: "i64" data_type: TYPE_INT64 dims: [ -1 ] optional: true },
        { name: "f64" data_type: TYPE_FP64 dims: [ 1 ] optional: true },
        { name: "grid" data_type: TYPE_INT16 dims: [ -1, 2 ] optional: true },
        { name: "words" data_type: TYPE_STRING dims: [ -1 ] optional: true } ]
output [ { name: "i32_out" data_type: TYPE_INT32 dims: [ 1 ] } ]
""",
    "fail_mid": """
backend: "toy"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ 1 ] } ]
""",
}


def write_repository(root: Path) -> Path:
    for name, text in CONFIGS.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(text)
    return root


def start_server(repo: Path) -> InProcessServer:
    registry = BackendRegistry()
    registry.register("toy", ToyBackend)
    options = ServerOptions(model_repositories=[repo], http_port=free_port(), allow_grpc=False,
                            allow_metrics=False, exit_timeout_secs=2, http_max_input_size=MAX_INPUT)
    return InProcessServer(options, registry)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    server = start_server(write_repository(tmp_path_factory.mktemp("generate_repo")))
    yield server
    server.stop()


# -- clients -----------------------------------------------------------------------------------
def post(srv, path: str, doc=None, body: bytes | None = None, headers: dict | None = None):
    """urllib POST: (status, headers, body bytes), errors included."""
    if body is None:
        body = json.dumps(doc).encode()
    request = urllib.request.Request(srv.base + path, data=body, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.headers, exc.read()


def generate(srv, model: str, doc, version: str = ""):
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/generate"
    status, headers, body = post(srv, path, doc)
    return status, headers, json.loads(body)


def error_of(body) -> str:
    doc = json.loads(body) if isinstance(body, bytes) else body
    assert set(doc) == {"error"}, doc
    return doc["error"]


def parse_events(body: bytes) -> list[dict]:
    """SSE body -> the JSON of each ``data:`` event; checks Triton's exact framing."""
    assert body == b"" or body.endswith(b"\n\n"), body
    events = []
    for block in body.split(b"\n\n")[:-1]:
        assert block.startswith(b"data: ") and b"\n" not in block, block
        events.append(json.loads(block[len(b"data: "):]))
    return events


def stream(srv, model: str, doc, version: str = ""):
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/generate_stream"
    return post(srv, path, doc)


# -- generate ----------------------------------------------------------------------------------
def test_server_metadata_lists_generate(srv):
    with urllib.request.urlopen(srv.base + "/v2", timeout=10) as response:
        assert "generate" in json.loads(response.read())["extensions"]


def test_generate_returns_the_whole_text(srv):
    doc = {"id": "42", "text_input": "the quick brown fox", "parameters": {"temperature": 0.5, "stream": False}}
    status, headers, body = generate(srv, "words", doc)
    assert status == 200, body
    assert headers["Content-Type"] == "application/json"
    assert body == {"id": "42", "model_name": "words", "model_version": "1", "text_output": "the quick brown fox",
                    "temperature": 0.5, "stream": False}
    assert STREAMING_FLAGS["42"] is False  # the model was asked for one response
    # no id: none in the answer; an explicit version works; top-level extra fields are parameters
    status, _, body = generate(srv, "words", {"text_input": "hi there", "max_tokens": 8, "top_p": 0.9,
                                              "stop": "x"}, version="1")
    assert status == 200, body
    assert body == {"model_name": "words", "model_version": "1", "text_output": "hi there", "max_tokens": 8,
                    "top_p": 0.9, "stop": "x"}


def test_generate_input_given_in_parameters(srv):
    status, _, body = generate(srv, "words", {"id": "p", "parameters": {"text_input": "from parameters",
                                                                         "delay_ms": 1}})
    assert status == 200, body
    assert body["text_output"] == "from parameters" and "delay_ms" not in body  # delay_ms became the input


def test_generate_model_and_version_errors(srv):
    status, headers, body = generate(srv, "nope", {"text_input": "x"})
    assert status == 404 and "nope" in error_of(body)
    assert headers["Content-Type"] == "application/json"
    status, _, body = generate(srv, "words", {"text_input": "x"}, version="9")
    assert status == 404 and "9" in error_of(body)
    status, _, body = generate(srv, "words", {"text_input": "x"}, version="x1")
    assert status == 400 and "x1" in error_of(body)
    status, _, _ = post(srv, "/v2/models/words/versions//generate", {"text_input": "x"})
    assert status == 404
    request = urllib.request.Request(srv.base + "/v2/models/words/generate", method="GET")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    info.value.close()
    assert info.value.code == 405


def test_generate_decoupled_answers(srv):
    status, _, body = generate(srv, "words", {"text_input": "a b c", "ignore_streaming": True})
    # Triton's words (qa L0_http generate_endpoint_test test_many_response / test_zero_response)
    many = "generate expects model to produce exactly 1 response, use generate stream for model that generates " \
           "various number of responses"
    assert status == 501 and many in error_of(body) and "sent 3)" in error_of(body)
    status, _, body = generate(srv, "words", {"text_input": "   "})
    assert status == 501 and many in error_of(body) and "sent 0)" in error_of(body)
    status, _, body = generate(srv, "words", {"text_input": "one", "ignore_streaming": True})
    assert status == 200 and body["text_output"] == "one"  # exactly one response is fine


def test_generate_model_errors(srv):
    status, headers, body = generate(srv, "fail_mid", {"text_input": "first"})
    assert status == 400 and error_of(body) == "toy model failed after 'first'"
    assert headers["Content-Type"] == "application/json"
    status, _, body = generate(srv, "fail_mid", {"text_input": "raise"})
    assert status == 500 and "toy model crashed" in error_of(body)
    status, _, body = generate(srv, "fail_mid", {"text_input": "a b"})
    assert status == 400 and error_of(body) == "toy model failed after 'a b'"


# -- JSON -> tensors ---------------------------------------------------------------------------
def test_typed_inputs(srv):
    doc = {"i32": 7, "f32": [1.5, 2, -3.25], "flag": True, "u8": [1, 255], "i64": [2 ** 40, -5], "f64": 0.1,
           "grid": [[1, 2], [3, 4], [5, 6]], "words": ["héllo", "wörld"]}
    status, _, body = generate(srv, "typed", doc)
    assert status == 200, body
    assert body["i32_out"] == 7 and body["i32_shape"] == "1x1" and body["i32_dtype"] == "int32"
    assert body["f32_out"] == [1.5, 2.0, -3.25] and body["f32_shape"] == "1x3" and body["f32_dtype"] == "float32"
    assert body["flag_out"] is True and body["flag_shape"] == "1x1" and body["flag_dtype"] == "bool"
    assert body["u8_out"] == [1, 255] and body["u8_shape"] == "1x2" and body["u8_dtype"] == "uint8"
    assert body["i64_out"] == [2 ** 40, -5] and body["i64_shape"] == "1x2" and body["i64_dtype"] == "int64"
    assert body["f64_out"] == 0.1 and body["f64_dtype"] == "float64"
    assert body["grid_out"] == [1, 2, 3, 4, 5, 6] and body["grid_shape"] == "1x3x2" and body["grid_dtype"] == "int16"
    assert body["words_out"] == ["héllo", "wörld"] and body["words_shape"] == "1x2"
    # a single-element list is unwrapped in the answer too; a flat list fills the inner dims
    status, _, body = generate(srv, "typed", {"i32": [9], "f32": [4], "flag": [False], "grid": [1, 2, 3, 4]})
    assert status == 200, body
    assert body["i32_out"] == 9 and body["f32_out"] == 4.0 and body["flag_out"] is False
    assert body["grid_shape"] == "1x2x2"
    # a nested array matching the batched shape keeps it: a batch of 2
    status, _, body = generate(srv, "typed", {"i32": [[1], [2]], "f32": [[1.0], [2.0]], "flag": [[True], [False]]})
    assert status == 200, body
    assert body["i32_out"] == [1, 2] and body["i32_shape"] == "2x1" and body["flag_out"] == [True, False]
    # an empty array for a variable dim
    status, _, body = generate(srv, "typed", {"i32": 1, "f32": [], "flag": True})
    assert status == 200, body
    assert body["f32_out"] == [] and body["f32_shape"] == "1x0"
    # a ragged nested array is flattened in row-major order
    status, _, body = generate(srv, "typed", {**_TYPED, "i64": [[1, 2], [3, 4], 5]})
    assert status == 200, body
    assert body["i64_out"] == [1, 2, 3, 4, 5] and body["i64_shape"] == "1x5"


_TYPED = {"i32": 1, "f32": 1.0, "flag": True}

BAD_REQUESTS = [
    # (body, status, text that must be in the error)
    (b"{not json", 400, "failed to parse the generate request JSON"),
    (b"[1, 2]", 400, "must be a JSON object, got array"),
    (b'"text"', 400, "must be a JSON object, got string"),
    ({**_TYPED, "i32": "seven"}, 400, "field 'i32': attempt to access JSON non-signed-integer as signed-integer: "
                                      "input 'i32' of model 'typed' is INT32 and takes integers"),
    ({**_TYPED, "i32": 1.5}, 400, "field 'i32'"),
    ({**_TYPED, "i32": True}, 400, "field 'i32'"),
    ({**_TYPED, "i32": None}, 400, "field 'i32'"),
    ({**_TYPED, "f32": [1.0, "2"]}, 400, "field 'f32': attempt to access JSON non-number as number: input 'f32'"),
    ({**_TYPED, "f32": True}, 400, "field 'f32'"),
    ({**_TYPED, "flag": 1}, 400, "field 'flag': attempt to access JSON non-boolean as boolean: input 'flag' of "
                                 "model 'typed' is BOOL and takes booleans"),
    ({**_TYPED, "words": [1]}, 400, "field 'words': attempt to access JSON non-string as string: input 'words' of "
                                    "model 'typed' is BYTES and takes strings"),
    ({**_TYPED, "u8": [300, 1]}, 400, "field 'u8': a value does not fit input 'u8' (UINT8)"),
    ({**_TYPED, "u8": [-1, 1]}, 400, "field 'u8'"),
    ({**_TYPED, "u8": [1, 2, 3]}, 400, "field 'u8': 3 value(s) do not fit the shape [-1, 2] of input 'u8'"),
    ({**_TYPED, "grid": [1, 2, 3]}, 400, "field 'grid': 3 value(s) do not fit"),
    ({**_TYPED, "bogus": [1, 2]}, 400, "parameter 'bogus' has invalid type. It should be a string, a number or a "
                                       "boolean: field 'bogus' is not an input of model 'typed'"),
    ({**_TYPED, "bogus": {"a": 1}}, 400, "field 'bogus' is not an input"),
    ({**_TYPED, "bogus": None}, 400, "field 'bogus' is not an input"),
    ({**_TYPED, "parameters": {"nested": {"a": 1}}}, 400,
     "Converting keyword: 'parameters': parameter 'nested' has invalid type."),
    ({"f32": 1.0, "flag": True, "parameters": {"i32": "x"}}, 400, "field 'parameters.i32': attempt to access JSON"),
    ({**_TYPED, "parameters": [1]}, 400, "Expected JSON object for keyword: 'parameters', got array"),
    ({**_TYPED, "parameters": {"i32": 2}}, 400, "input 'i32' is given both as a field and in 'parameters'"),
    ({**_TYPED, "seed": 1, "parameters": {"seed": 2}}, 400, "parameter 'seed' is given both"),
    ({**_TYPED, "id": 5}, 400, "field 'id' must be a string, got integer"),
    ({**_TYPED, "triton_x": 1}, 400, "'triton_x': keys starting with 'triton_' are reserved"),
    ({**_TYPED, "priority": -1}, 400, "parameter 'priority' must be a non-negative integer"),
    ({**_TYPED, "sequence_start": 1}, 400, "parameter 'sequence_start' must be a boolean"),
    ({"i32": 1, "f32": 1.0}, 400, "expected number of inputs between 3 and 8 but got 2 inputs for model 'typed'. Got "
                                  "input(s) ['f32','i32'], but missing required input(s) ['flag']"),
    (b"", 400, "missing required input(s)"),
]


@pytest.mark.parametrize("endpoint", ["generate", "generate_stream"])
def test_bad_requests(srv, endpoint):
    for index, (doc, expected, text) in enumerate(BAD_REQUESTS):
        body = doc if isinstance(doc, bytes) else None
        status, headers, response = post(srv, f"/v2/models/typed/{endpoint}", doc, body=body)
        assert status == expected, (index, response)
        assert headers["Content-Type"] == "application/json", (index, headers)
        assert text in error_of(response), (index, response)


def test_body_size_limits(srv):
    # a body over the limit
    big = json.dumps({"text_input": "x" * MAX_INPUT}).encode()
    status, _, body = post(srv, "/v2/models/words/generate", body=big)
    assert status == 400 and "exceeds the maximum allowed input size" in error_of(body)
    # a body within the limit whose tensors are not: 2 JSON bytes per value, 8 tensor bytes
    doc = json.dumps({**_TYPED, "i64": [0] * (MAX_INPUT // 4)}).encode()
    assert len(doc) < MAX_INPUT
    status, _, body = post(srv, "/v2/models/typed/generate", body=doc)
    assert status == 400 and "with input 'i64' of size" in error_of(body)
    assert "exceeds the maximum allowed input size" in error_of(body)
    # gzip bodies are accepted, and inflating past the limit is refused
    status, _, body = post(srv, "/v2/models/words/generate", body=gzip.compress(b'{"text_input": "zipped"}'),
                           headers={"Content-Encoding": "gzip"})
    assert status == 200 and json.loads(body)["text_output"] == "zipped"
    bomb = gzip.compress(b'{"text_input": "' + b"x" * (MAX_INPUT * 2) + b'"}')
    status, _, body = post(srv, "/v2/models/words/generate", body=bomb, headers={"Content-Encoding": "gzip"})
    assert status == 400 and "exceeds the maximum allowed input size" in error_of(body)


# -- generate_stream ---------------------------------------------------------------------------
def test_generate_stream_events(srv):
    status, headers, body = stream(srv, "words", {"id": "s1", "text_input": "one two three",
                                                  "parameters": {"temperature": 0.1}})
    assert status == 200, body
    assert headers["Content-Type"] == "text/event-stream; charset=utf-8"
    assert body == (b'data: {"id":"s1","model_name":"words","model_version":"1","temperature":0.1,'
                    b'"text_output":"one"}\n\n'
                    b'data: {"id":"s1","model_name":"words","model_version":"1","text_output":"two"}\n\n'
                    b'data: {"id":"s1","model_name":"words","model_version":"1","text_output":"three"}\n\n')
    assert STREAMING_FLAGS["s1"] is True
    # the bare FINAL flag of a model that sends nothing is no event
    status, _, body = stream(srv, "words", {"text_input": ""}, version="1")
    assert status == 200 and body == b""


async def test_generate_stream_is_incremental(srv):
    """Each event arrives when its response does, not when the request completes."""
    async with aiohttp.ClientSession() as session:
        start = time.monotonic()
        doc = {"id": "inc", "text_input": "a b c d", "delay_ms": 150}
        async with session.post(srv.base + "/v2/models/words/generate_stream", json=doc) as response:
            assert response.status == 200
            assert response.headers["Content-Type"] == "text/event-stream; charset=utf-8"
            arrivals, events = [], []
            while True:
                chunk = await response.content.readuntil(b"\n\n")
                if not chunk:
                    break
                arrivals.append(time.monotonic() - start)
                events.extend(parse_events(chunk))
    assert [e["text_output"] for e in events] == ["a", "b", "c", "d"]
    assert arrivals[0] < 0.45 and arrivals[-1] >= 0.55, arrivals


def test_generate_stream_error_after_start(srv):
    status, headers, body = stream(srv, "fail_mid", {"text_input": "a b"})
    assert status == 200 and headers["Content-Type"] == "text/event-stream; charset=utf-8"
    events = parse_events(body)
    assert events[:2] == [{"model_name": "fail_mid", "model_version": "1", "text_output": "a"},
                          {"model_name": "fail_mid", "model_version": "1", "text_output": "b"}]
    assert events[2:] == [{"error": "toy model failed after 'a b'"}]


def test_generate_stream_error_first(srv):
    """As in Triton, the first response sets the status: a model error there gives its code."""
    status, headers, body = stream(srv, "fail_mid", {"text_input": "first"})
    assert status == 400 and headers["Content-Type"] == "text/event-stream; charset=utf-8"
    assert parse_events(body) == [{"error": "toy model failed after 'first'"}]
    status, _, body = stream(srv, "fail_mid", {"text_input": "raise"})
    assert status == 500 and "toy model crashed" in parse_events(body)[0]["error"]


def test_generate_stream_errors_before_start(srv):
    status, headers, body = stream(srv, "nope", {"text_input": "x"})
    assert status == 404 and headers["Content-Type"] == "application/json" and "nope" in error_of(body)
    status, headers, body = stream(srv, "words", {"text_input": 3})
    assert status == 400 and headers["Content-Type"] == "application/json" and "'text_input'" in error_of(body)


async def _wait_cancelled(request_id: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while request_id not in CANCELLED:
        assert time.monotonic() < deadline, f"the model never saw request '{request_id}' cancelled"
        await asyncio.sleep(0.01)


async def test_generate_stream_disconnect_cancels(srv):
    async with aiohttp.ClientSession() as session:
        doc = {"id": "gone-mid", "text_input": " ".join(["w"] * 50), "delay_ms": 100}
        async with session.post(srv.base + "/v2/models/words/generate_stream", json=doc) as response:
            first = parse_events(await response.content.readuntil(b"\n\n"))
            assert first[0]["text_output"] == "w"
            response.close()  # drop the connection mid-stream
        start = time.monotonic()
        await _wait_cancelled("gone-mid")
        assert time.monotonic() - start < 1.0
        assert not srv.server.dataplane.active  # the InferenceStream was closed
        # gone before the first response (the status line is not sent yet)
        doc = {"id": "gone-early", "text_input": "slow start", "delay_ms": 2000}
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(session.post(srv.base + "/v2/models/words/generate_stream", json=doc), 0.3)
        await _wait_cancelled("gone-early")
        assert not srv.server.dataplane.active
        # the server keeps serving
        async with session.post(srv.base + "/v2/models/words/generate_stream", json={"text_input": "ok"}) as response:
            assert parse_events(await response.read()) == [{"model_name": "words", "model_version": "1",
                                                            "text_output": "ok"}]


async def test_generate_stream_during_shutdown(tmp_path):
    """Server stop drains, then ends a stream still running with an error event (not a cut connection)."""
    server = start_server(write_repository(tmp_path))
    try:
        async with aiohttp.ClientSession() as session:
            doc = {"id": "shutdown", "text_input": " ".join(["w"] * 100), "delay_ms": 100}
            async with session.post(server.base + "/v2/models/words/generate_stream", json=doc) as response:
                assert parse_events(await response.content.readuntil(b"\n\n"))[0]["text_output"] == "w"
                stopping = asyncio.get_running_loop().run_in_executor(None, server.stop)
                body = await asyncio.wait_for(response.content.read(), 15)
            await stopping
    finally:
        if not server.loop.is_closed():
            server.stop()
    events = parse_events(body)
    assert all(e.get("text_output") == "w" for e in events[:-1])
    assert "the server is shutting down" in events[-1]["error"]


def test_generate_disconnect_cancels(srv):
    doc = {"id": "gone-unary", "text_input": "a b c", "delay_ms": 2000}
    conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=10)
    conn.request("POST", "/v2/models/words/generate", json.dumps(doc).encode(), {"Content-Type": "application/json"})
    time.sleep(0.3)
    conn.close()
    deadline = time.monotonic() + 5
    while "gone-unary" not in CANCELLED and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "gone-unary" in CANCELLED


def test_statistics_count_generate(srv):
    with urllib.request.urlopen(srv.base + "/v2/models/fail_mid/stats", timeout=10) as response:
        stats = json.loads(response.read())["model_stats"][0]["inference_stats"]
    assert stats["fail"]["count"] > 0


# -- a Python-backend decoupled model (tests/models/repeat) in a real tideserve process --------
def test_generate_stream_python_repeat(server):
    def call(path, doc):
        request = urllib.request.Request(server.base_url + path, data=json.dumps(doc).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, response.headers["Content-Type"], response.read()
        except urllib.error.HTTPError as exc:
            with exc:
                return exc.code, exc.headers["Content-Type"], exc.read()

    status, content_type, body = call("/v2/models/repeat/generate_stream", {"id": "r", "IN": [4, 5, 6], "DELAY": 5})
    assert status == 200 and content_type.startswith("text/event-stream"), body
    assert parse_events(body) == [{"id": "r", "model_name": "repeat", "model_version": "1", "OUT": value, "IDX": i}
                                  for i, value in enumerate([4, 5, 6])]
    status, _, body = call("/v2/models/repeat/generate", {"IN": [7]})
    assert status == 200 and json.loads(body) == {"model_name": "repeat", "model_version": "1", "OUT": 7, "IDX": 0}
    status, _, body = call("/v2/models/repeat/generate", {"IN": [1, 2]})
    assert status == 501 and "exactly 1 response" in error_of(body) and "sent 2)" in error_of(body)
    status, _, body = call("/v2/models/repeat/generate_stream", {"IN": [1, 2], "DELAY": [1, 2, 3]})
    assert status == 400 and "expected DELAY to hold 1 or 2 values" in parse_events(body)[0]["error"]
