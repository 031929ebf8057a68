"""Limits on what one connection or request can take (docs/security.md), end to end.

One real ``tideserve`` process on 127.0.0.1, started with small limits through its flags so the
slow-client cases take about a second each. Raw sockets play the clients no library would be (idle
connections, headers that never end, a body that stops); ``http.client``, ``tritonclient`` and a raw
gRPC stub send the oversized and malformed requests. Every case checks the answer (its status, the
KServe ``{"error": ...}`` body naming the flag) and that the server is still live afterwards.
"""

from __future__ import annotations

import gzip
import os
import http.client
import json
import shutil
import socket
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from limits_fixtures import (
    CONNECTIONS,
    DECOMPRESSED,
    GRPC_RECEIVE,
    GRPC_SEND,
    HEADER_COUNT,
    HEADER_SIZE,
    JSON_DEPTH,
    LIMIT_FLAGS,
    TENSOR_ELEMENTS,
    TENSOR_RANK,
    TIMEOUT_S,
)
from support import TEST_MODELS, start_server
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

OPENAI_MODELS = Path(__file__).resolve().parents[1] / "openai_models"
INFER = "/v2/models/add_sub/infer"
GOOD_INFER = {"inputs": [{"name": f"INPUT{i}", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}
                         for i in (0, 1)]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("limits")
    repository = tmp / "models"
    for name in ("add_sub", "identity_bytes"):
        shutil.copytree(TEST_MODELS / name, repository / name)
    (repository / "words" / "1").mkdir(parents=True)
    shutil.copy(OPENAI_MODELS / "words.py", repository / "words" / "1" / "model.py")
    (repository / "words" / "config.pbtxt").write_text('name: "words"\n' + (OPENAI_MODELS / "words.pbtxt").read_text())
    running = start_server([repository], *LIMIT_FLAGS, tmp_dir=tmp)
    yield running
    running.stop()


# -- helpers ---------------------------------------------------------------------------------
def request(server, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """(status, body) of one request on a fresh connection."""
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def assert_live(server) -> None:
    assert request(server, "GET", "/v2/health/live")[0] == 200


def error_of(body: bytes) -> str:
    doc = json.loads(body)
    assert set(doc) == {"error"}, doc
    return doc["error"]


def openai_error(body: bytes) -> str:
    return json.loads(body)["error"]["message"]


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.http_port), timeout=10)


def read_until_closed(sock: socket.socket) -> bytes:
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    sock.close()
    return b"".join(chunks)


def parse_response(raw: bytes) -> tuple[int, dict, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def nested(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


# -- connections and heads -------------------------------------------------------------------
def test_slow_and_idle_connections_are_closed_after_the_header_timeout(server):
    idle = [connect(server) for _ in range(10)]
    slow = [connect(server) for _ in range(10)]
    for sock in slow:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
    started = time.monotonic()
    for sock in idle:
        assert read_until_closed(sock) == b""  # closed without an answer
    for sock in slow:
        status, headers, body = parse_response(read_until_closed(sock))
        assert status == 408 and headers["connection"] == "close"
        assert "--http-header-timeout-secs" in error_of(body)
    assert time.monotonic() - started < TIMEOUT_S + 5
    assert_live(server)


def test_kept_alive_connection_waits_the_keep_alive_timeout_not_the_header_timeout(server):
    """After an answer the connection waits uvicorn's keep-alive timeout (5 s) for the next request, timed by the
    connection's own timer: a pause longer than the header timeout is fine, and the idle connection closes after it."""
    sock = connect(server)
    head = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
    for pause in (0.0, TIMEOUT_S + 0.5, TIMEOUT_S + 0.5):
        time.sleep(pause)
        sock.sendall(head)
        answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200"), answer
    answered = time.monotonic()
    assert read_until_closed(sock) == b""  # closed without a word
    assert time.monotonic() - answered > 4.0  # by the keep-alive timeout, not the header timeout
    assert_live(server)


def test_header_too_large_is_431(server):
    status, body = request(server, "GET", "/v2/health/live", headers={"X-Big": "a" * (2 * HEADER_SIZE)})
    assert status == 431 and "--http-max-header-size" in error_of(body)
    assert_live(server)


def test_header_that_never_ends_is_cut_at_the_limit(server):
    sock = connect(server)
    sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nX-Endless: ")
    sent = 0
    try:
        while sent < 64 * HEADER_SIZE:  # far past the limit, unless the server closes first
            sock.sendall(b"a" * 1024)
            sent += 1024
            time.sleep(0.001)
    except (BrokenPipeError, ConnectionResetError):
        pass
    status, _, body = parse_response(read_until_closed(sock))
    assert status == 431 and "--http-max-header-size" in error_of(body)
    assert sent < 64 * HEADER_SIZE
    assert_live(server)


def test_too_many_headers_is_431(server):
    headers = {f"X-Header-{i}": "1" for i in range(HEADER_COUNT + 5)}
    status, body = request(server, "GET", "/v2/health/live", headers=headers)
    assert status == 431 and "--http-max-header-count" in error_of(body)
    assert request(server, "GET", "/v2/health/live", headers=dict(list(headers.items())[:HEADER_COUNT - 5]))[0] == 200


def test_chunked_trailers_are_held_to_the_header_limits(server):
    sock = connect(server)
    trailers = b"".join(b"X-Trailer-%d: 1\r\n" % i for i in range(HEADER_COUNT + 5))
    sock.sendall(b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                 b"2\r\n{}\r\n0\r\n" + trailers)  # and never the blank line that ends them
    status, _, body = parse_response(read_until_closed(sock))
    assert status == 431 and "trailers" in error_of(body)
    assert_live(server)


def test_stalled_body_is_408(server):
    sock = connect(server)
    sock.sendall(b"POST " + INFER.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"inputs\"")
    started = time.monotonic()
    status, headers, body = parse_response(read_until_closed(sock))
    assert status == 408 and headers["connection"] == "close"
    assert "--http-body-timeout-secs" in error_of(body)
    assert TIMEOUT_S * 0.9 <= time.monotonic() - started < TIMEOUT_S + 5
    assert_live(server)


@pytest.mark.skipif(int(os.environ.get("TIDESERVE_TEST_FRONTEND_WORKERS") or 1) > 1,
                    reason="with frontend workers the limit holds per worker process, and the connections spread over "
                           "the workers (docs/architecture.md)")
def test_connections_past_the_limit_are_503(server):
    held = [connect(server) for _ in range(CONNECTIONS)]
    try:
        time.sleep(0.1)  # let the server accept them all
        status, _ = request(server, "GET", "/v2/health/live")
        assert status == 503
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 5
    while request(server, "GET", "/v2/health/live")[0] != 200:  # the closes reach the server
        assert time.monotonic() < deadline
        time.sleep(0.05)


# -- bodies ----------------------------------------------------------------------------------
BODY_ROUTES = [INFER, "/v2/models/words/generate", "/v1/completions", "/v2/repository/index"]


def _message(path: str, body: bytes) -> str:
    return openai_error(body) if path.startswith("/v1/") else error_of(body)


@pytest.mark.parametrize("path", BODY_ROUTES)
def test_gzip_bomb_stops_at_the_decompressed_limit(server, path):
    bomb = gzip.compress(b" " * (64 * DECOMPRESSED))  # 64 KiB on the wire, 64 MiB inflated
    status, body = request(server, "POST", path, bomb, {"Content-Encoding": "gzip"})
    assert status == 400 and "--http-max-decompressed-size" in _message(path, body)
    assert_live(server)


@pytest.mark.parametrize("path", BODY_ROUTES)
def test_unsupported_content_encoding_is_415(server, path):
    status, body = request(server, "POST", path, b"{}", {"Content-Encoding": "br"})
    assert status == 415 and "Content-Encoding 'br'" in _message(path, body)


def test_compressed_body_within_the_limit_is_served(server):
    status, body = request(server, "POST", INFER, gzip.compress(json.dumps(GOOD_INFER).encode()),
                           {"Content-Encoding": "gzip"})
    assert status == 200, body
    assert json.loads(body)["outputs"][0]["data"] == [2, 4, 6, 8]


@pytest.mark.parametrize("path, doc", [
    (INFER, '{"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": %s}]}'),
    (INFER, '{"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4], '
            '"parameters": {"x": %s}}]}'),
    (INFER, '{"inputs": [], "outputs": [{"name": "OUTPUT0", "parameters": {"x": %s}}]}'),
    ("/v2/models/words/generate", '{"text_input": "hi", "parameters": {"x": %s}}'),
    ("/v1/completions", '{"model": "words", "prompt": "hi", "logit_bias": %s}'),
    ("/v1/chat/completions", '{"model": "words", "messages": [{"role": "user", "content": %s}]}'),
    ("/v2/repository/index", '{"ready": %s}'),
], ids=["infer data", "infer input parameters", "infer output parameters", "generate", "completions", "chat",
        "repository index"])
def test_json_nested_past_the_depth_limit_is_400(server, path, doc):
    status, body = request(server, "POST", path, (doc % nested(JSON_DEPTH + 4)).encode())
    assert status == 400 and "--http-max-json-depth" in _message(path, body)
    status, body = request(server, "POST", path, (doc % nested(1100)).encode())  # past orjson's own limit
    assert status == 400 and _message(path, body)
    assert_live(server)


# -- tensors ---------------------------------------------------------------------------------
@pytest.mark.parametrize("shape, flag", [
    ([1] * 66, "--max-tensor-rank"),
    ([1] * (TENSOR_RANK + 1), "--max-tensor-rank"),
    ([1, TENSOR_ELEMENTS + 4], "--max-tensor-elements"),
    ([2**62, 2**62, 0], "--max-tensor-elements"),
])
def test_http_tensor_shape_past_the_limits_is_400(server, shape, flag):
    doc = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": shape, "data": [1]}]}
    status, body = request(server, "POST", INFER, json.dumps(doc).encode())
    message = error_of(body)
    assert status == 400 and flag in message and "input 'INPUT0'" in message
    assert_live(server)


@pytest.mark.parametrize("shape, flag", [
    ([1] * 66, "--max-tensor-rank"),
    ([1, TENSOR_ELEMENTS + 4], "--max-tensor-elements"),
    ([2**62, 2**62, 0], "--max-tensor-elements"),
])
def test_grpc_tensor_shape_past_the_limits_is_invalid_argument(server, shape, flag):
    request_message = pb.ModelInferRequest(model_name="add_sub")
    request_message.inputs.add(name="INPUT0", datatype="FP32", shape=shape)
    request_message.raw_input_contents.append(np.ones(4, np.float32).tobytes())
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(request_message, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert flag in info.value.details() and "input 'INPUT0'" in info.value.details()


# -- gRPC messages ---------------------------------------------------------------------------
def _bytes_request(size: int) -> list:
    data = np.array([[b"x" * size]], dtype=np.object_)
    tensor = grpcclient.InferInput("INPUT0", [1, 1], "BYTES")
    tensor.set_data_from_numpy(data)
    return [tensor]


def test_grpc_message_size_limits_are_resource_exhausted(server):
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        with pytest.raises(InferenceServerException) as info:
            client.infer("identity_bytes", _bytes_request(2 * GRPC_RECEIVE))
        assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        with pytest.raises(InferenceServerException) as info:
            client.infer("identity_bytes", _bytes_request(2 * GRPC_SEND))  # in under the limit, out over it
        assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        result = client.infer("identity_bytes", _bytes_request(GRPC_SEND // 2))
        assert result.as_numpy("OUTPUT0")[0][0] == b"x" * (GRPC_SEND // 2)
        assert client.is_server_live()


def test_server_still_serves_after_all_of_it(server):
    assert_live(server)
    status, body = request(server, "POST", INFER, json.dumps(GOOD_INFER).encode())
    assert status == 200 and json.loads(body)["outputs"][1]["data"] == [0, 0, 0, 0]
