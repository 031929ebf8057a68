"""KServe infer answered straight from the HTTP protocol (server/http/limits.py ``_start_direct``): the requests it
takes and the ones it leaves to uvicorn's ASGI path answer alike, with one frontend process and with two.

Raw sockets play the clients whose framing matters (keep-alive, pipelining, a chunked body, ``Expect:
100-continue``, a body that arrives after its head, HTTP/1.0); tritonclient's HTTP client sends the ordinary
requests. Every error is KServe's ``{"error": ...}``, and the server stays live.
"""

from __future__ import annotations

import json
import shutil
import socket
import time

import numpy as np
import pytest
import tritonclient.http as httpclient
from support import TEST_MODELS, start_server
from tritonclient.utils import InferenceServerException

INFER = "/v2/models/add_sub/infer"
DOC = {"inputs": [{"name": f"INPUT{i}", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4 + i]}
                  for i in (0, 1)],
       "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": False}}]}
BODY = json.dumps(DOC).encode()


@pytest.fixture(scope="module", params=["1", "2"], ids=["w1", "w2"])
def server(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("direct")
    repository = tmp / "models"
    shutil.copytree(TEST_MODELS / "add_sub", repository / "add_sub")
    running = start_server([repository], "--frontend-workers", request.param, tmp_dir=tmp)
    yield running
    running.stop()


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.http_port), timeout=10)


def head(path: str = INFER, body: bytes = BODY, extra: str = "", version: str = "1.1") -> bytes:
    return (f"POST {path} HTTP/{version}\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode()


class Reader:
    """Answers read off one connection, one at a time (Content-Length framed)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def _fill(self) -> bool:
        chunk = self.sock.recv(65536)
        self.buffer += chunk
        return bool(chunk)

    def answer(self) -> tuple[int, dict, bytes]:
        while b"\r\n\r\n" not in self.buffer:
            if not self._fill():
                raise AssertionError(f"connection closed before an answer: {self.buffer!r}")
        raw, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:])}
        length = int(headers.get("content-length", "0"))
        while len(self.buffer) < length:
            if not self._fill():
                raise AssertionError("connection closed in a body")
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return int(lines[0].split()[1]), headers, body

    def closed(self) -> bool:
        self.sock.settimeout(5)
        try:
            return not self.buffer and not self.sock.recv(1)
        except ConnectionResetError:
            return True


def output0(body: bytes) -> list:
    doc = json.loads(body)
    (out,) = [o for o in doc["outputs"] if o["name"] == "OUTPUT0"]
    return out["data"]


def test_keep_alive_serves_many_answers_on_one_connection(server):
    with connect(server) as sock:
        reader = Reader(sock)
        for _ in range(5):
            sock.sendall(head() + BODY)
            status, headers, body = reader.answer()
            assert status == 200, body
            assert headers["content-type"] == "application/json"
            assert output0(body) == [2, 4, 6, 9]
            assert "connection" not in headers


def test_pipelined_requests_answer_in_order(server):
    bad = b'{"inputs": 3}'
    with connect(server) as sock:
        sock.sendall(head() + BODY + head(body=bad) + bad + b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n"
                     + head() + BODY)
        reader = Reader(sock)
        first, second, third, fourth = (reader.answer() for _ in range(4))
    assert first[0] == 200 and output0(first[2]) == [2, 4, 6, 9]
    assert second[0] == 400 and "'inputs' must be an array" in json.loads(second[2])["error"]
    assert third[0] == 200
    assert fourth[0] == 200 and output0(fourth[2]) == [2, 4, 6, 9]


def test_body_that_arrives_after_its_head(server):
    with connect(server) as sock:
        sock.sendall(head())
        time.sleep(0.2)
        sock.sendall(BODY[:10])
        time.sleep(0.2)
        sock.sendall(BODY[10:])
        status, _, body = Reader(sock).answer()
    assert status == 200 and output0(body) == [2, 4, 6, 9]


def test_chunked_body(server):
    chunks = [BODY[:25], BODY[25:]]
    wire = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    with connect(server) as sock:
        sock.sendall(f"POST {INFER} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".encode() + wire[:30])
        time.sleep(0.2)
        sock.sendall(wire[30:])
        status, _, body = Reader(sock).answer()
    assert status == 200 and output0(body) == [2, 4, 6, 9]


def test_expect_100_continue(server):
    with connect(server) as sock:
        sock.sendall(head(extra="Expect: 100-continue\r\n"))
        reader = Reader(sock)
        while b"\r\n\r\n" not in reader.buffer:
            assert reader._fill()
        assert reader.buffer.startswith(b"HTTP/1.1 100 ")
        reader.buffer = reader.buffer.partition(b"\r\n\r\n")[2]
        sock.sendall(BODY)
        status, _, body = reader.answer()
    assert status == 200 and output0(body) == [2, 4, 6, 9]


def test_http_1_0_is_answered_and_closed(server):
    with connect(server) as sock:
        sock.sendall(head(version="1.0") + BODY)
        reader = Reader(sock)
        status, headers, body = reader.answer()
        assert status == 200 and output0(body) == [2, 4, 6, 9]
        assert headers.get("connection") == "close"
        assert reader.closed()


def test_connection_close_is_honoured(server):
    with connect(server) as sock:
        sock.sendall(head(extra="Connection: close\r\n") + BODY)
        reader = Reader(sock)
        status, headers, _ = reader.answer()
        assert status == 200 and headers.get("connection") == "close"
        assert reader.closed()


@pytest.mark.parametrize("path", [INFER + "?x=1", "/v2/models/add%5Fsub/infer", "/v2/models/add_sub/versions/1/infer"])
def test_paths_the_protocol_leaves_to_the_router(server, path):
    with connect(server) as sock:
        sock.sendall(head(path) + BODY)
        status, _, body = Reader(sock).answer()
    assert status == 200 and output0(body) == [2, 4, 6, 9]


@pytest.mark.parametrize(("path", "body", "status", "text"), [
    (INFER, b"{not json", 400, "failed to parse the request JSON"),
    (INFER, json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": ["a"] * 4}]})
     .encode(), 400, "FP32 'data' must hold numbers"),
    ("/v2/models/nope/infer", BODY, 404, "nope"),
    ("/v2/models/add_sub/versions/7/infer", BODY, 404, "unknown version 7"),
])
def test_errors_are_kserve_errors_and_the_connection_stays(server, path, body, status, text):
    with connect(server) as sock:
        reader = Reader(sock)
        sock.sendall(head(path, body) + body)
        got, headers, answer = reader.answer()
        assert got == status, answer
        assert headers["content-type"] == "application/json"
        assert text in json.loads(answer)["error"]
        sock.sendall(head() + BODY)  # the connection still serves
        assert reader.answer()[0] == 200


def test_client_that_leaves_before_its_body(server):
    with connect(server) as sock:
        sock.sendall(head() + BODY[:5])
    with connect(server) as sock:
        sock.sendall(head() + BODY)
        assert Reader(sock).answer()[0] == 200


def test_tritonclient_http(server):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}", concurrency=4)
    try:
        a = np.arange(4, dtype=np.float32).reshape(1, 4)
        inputs = [httpclient.InferInput("INPUT0", [1, 4], "FP32"), httpclient.InferInput("INPUT1", [1, 4], "FP32")]
        inputs[0].set_data_from_numpy(a, binary_data=True)
        inputs[1].set_data_from_numpy(a, binary_data=False)
        pending = [client.async_infer("add_sub", inputs) for _ in range(16)]
        for handle in pending:
            result = handle.get_result()
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + a)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - a)
        with pytest.raises(InferenceServerException, match="unknown_model|not found|unavailable|nope"):
            client.infer("nope", inputs)
    finally:
        client.close()
