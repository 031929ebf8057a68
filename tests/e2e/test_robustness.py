"""The robustness suite (docs/reliability.md): the OpenAPI document, schemathesis over it, boofuzz at the
HTTP protocol level, a disconnect storm, and SIGTERM with streams in flight - all against real servers
over the toy repository (bench/toy_repository.py: no engine, so thousands of requests take seconds).

The longer runs are the bench scripts: bench/fuzz_api.py, bench/fuzz_http.py, bench/soak.py.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import urllib.request

import aiohttp
import grpc
import pytest
import schemathesis
from support import free_port, start_server
from in_process import InProcessServer
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from tideserve import openapi
from tideserve.app import ServerOptions
from tideserve.bench import fuzz_api, fuzz_http, toy_repository
from tideserve.http import create_app
from tideserve.repository import ControlMode

TEXT_WORDS = 100  # words per stream in the storm and the SIGTERM test (20 ms apart: 2 s)


@pytest.fixture(scope="module")
def toy_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("robustness")
    server = start_server([toy_repository.write(tmp)], *toy_repository.SERVER_ARGS, tmp_dir=tmp)
    yield server
    assert server.stop() == 0


# -- the OpenAPI document -------------------------------------------------------------------------
def test_openapi_document_is_served_and_loads(toy_server):
    with urllib.request.urlopen(f"{toy_server.base_url}/openapi.json", timeout=10) as response:
        assert response.headers["content-type"] == "application/json"
        served = json.loads(response.read())
    assert served == json.loads(json.dumps(openapi.document()))
    assert served["openapi"] == "3.1.0"
    operations = list(schemathesis.openapi.from_dict(served).get_all_operations())
    assert len(operations) == sum(len(item) for item in served["paths"].values())


def test_openapi_document_describes_every_route(tmp_path):
    """Every route of the HTTP app is in the document, and nothing else is."""
    running = InProcessServer(ServerOptions(model_repositories=[toy_repository.write(tmp_path)], allow_http=False,
                                            allow_grpc=False, allow_metrics=False))
    try:
        app = create_app(running.server.dataplane)
    finally:
        running.stop()
    served = {(route.path.replace(":path}", "}"), method.lower()) for route in app.routes
              for method in (route.methods or ()) if method != "HEAD"}
    described = {(path, method) for path, item in openapi.document()["paths"].items() for method in item}
    assert served == described


# -- schemathesis and boofuzz ----------------------------------------------------------------------
def _report(capsys, text: str) -> None:
    """The counts in the test output, captured or not."""
    with capsys.disabled():
        print(f"\n{text}")


def test_schemathesis_finds_no_server_error(toy_server, tmp_path, capsys):
    """Examples, coverage and fuzzing phases over every operation (~25 s on two cores; 20 examples per operation
    and phase: 5,566 requests, 40 made 6,566 in twice the time, docs/reliability.md)."""
    result = fuzz_api.run(toy_server.base_url, tmp_path / "schemathesis", max_examples=20, seed=1, workers=1,
                          timeout=240)
    _report(capsys, result.summary())
    assert result.requests >= 1000, result.output[-3000:]
    assert result.server_errors == 0 and not result.failures and not result.errors, \
        result.summary() + "\n" + result.output[-6000:]
    assert toy_server.process.poll() is None
    assert toy_repository.health_problem(toy_server.base_url) is None
    assert fuzz_http.log_problems(toy_server.log_path) == []


def test_boofuzz_http_protocol_fuzzing(toy_server, capsys):
    """1,545 mutated requests (every 60th mutation of each template), the server checked every 250."""
    result = asyncio.run(fuzz_http.fuzz(toy_server.base_url, stride=60, timeout=2.0, log_path=toy_server.log_path,
                                        alive=lambda: toy_server.process.poll() is None))
    _report(capsys, result.summary())
    assert result.requests >= 1000
    assert result.server_errors == [] and result.problems == [], result.summary()
    assert result.outcomes["2xx"] >= len(fuzz_http.TEMPLATES)  # the unmutated requests are answered
    assert result.health_checks >= 4


# -- disconnect storm ------------------------------------------------------------------------------
@pytest.fixture()
def storm_server(tmp_path):
    # the words models in the server's process: the test sees their threads (one per request answered)
    repository = toy_repository.write(tmp_path, delay_ms=20, max_words=1000, words_in_server=True)
    running = InProcessServer(ServerOptions(model_repositories=[repository], http_port=free_port(),
                                            grpc_port=free_port(), metrics_port=free_port(),
                                            model_control_mode=ControlMode.EXPLICIT, load_models=["*"],
                                            exit_timeout_secs=5))
    yield running
    running.stop()


def _grpc_words_request(request_id: str, words: int) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="words", id=request_id)
    for name, datatype, field, value in (("text_input", "BYTES", "bytes_contents", b"storm"),
                                         ("stream", "BOOL", "bool_contents", True),
                                         ("max_tokens", "INT32", "int_contents", words)):
        tensor = request.inputs.add(name=name, datatype=datatype, shape=[1])
        getattr(tensor.contents, field).append(value)
    return request


async def _sse_then_leave(session: aiohttp.ClientSession, url: str, body: dict, events: int) -> int:
    """Read ``events`` SSE events of a stream, then drop the connection."""
    seen = 0
    async with session.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if line.startswith(b"data: "):
                seen += 1
                if seen == events:
                    break
        response.close()  # not released to the pool: the connection is closed mid-stream
    return seen


async def _leave_before_answer(host: str, port: int, path: str, body: dict) -> None:
    """Send a whole request and close the connection at once."""
    data = json.dumps(body).encode()
    _reader, writer = await asyncio.open_connection(host, port)
    writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    await writer.drain()
    writer.close()


async def _grpc_then_cancel(stub, request_id: str, responses: int) -> int:
    async def requests():
        yield _grpc_words_request(request_id, TEXT_WORDS)
        await asyncio.sleep(60)  # the stream stays open until it is cancelled

    call = stub.ModelStreamInfer(requests())
    seen = 0
    async for message in call:
        assert not message.error_message, message.error_message
        seen += 1
        if seen == responses:
            break
    call.cancel()
    return seen


def _answering_threads() -> list[threading.Thread]:
    """The words model's threads still answering a request (one per request, named after their target)."""
    return [t for t in threading.enumerate() if t.name.endswith("(answer)")]


def test_disconnect_storm_leaves_nothing_in_flight(storm_server):
    """60 clients leave mid-stream at once (generate_stream, /v1 streaming, gRPC stream cancel, and before
    any answer); afterwards no request is in flight, no model thread still answers, and the server serves."""
    base, host, port = storm_server.base, storm_server.host, storm_server.http_port
    runtime = storm_server.server.repository.get("words")
    dataplane = storm_server.server.dataplane
    succeeded_before, failed_before = runtime.stats.success.count, runtime.stats.fail.count

    most_threads = 0  # the threads seen answering at once during the storm: the check below can see them

    async def count_threads():
        nonlocal most_threads
        while True:
            most_threads = max(most_threads, len(_answering_threads()))
            await asyncio.sleep(0.01)

    async def storm():
        counter = asyncio.create_task(count_threads())
        channel = grpc.aio.insecure_channel(storm_server.grpc_url)
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        generate = {"text_input": "storm", "max_tokens": TEXT_WORDS, "stream": True}
        completion = {"model": "words", "prompt": "storm", "max_tokens": TEXT_WORDS, "stream": True}
        chat = {"model": "words_chat", "messages": [{"role": "user", "content": "storm"}], "max_tokens": TEXT_WORDS,
                "stream": True}
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            clients = [_sse_then_leave(session, f"{base}/v2/models/words/generate_stream", generate, 2)
                       for _ in range(20)]
            clients += [_sse_then_leave(session, f"{base}/v1/completions", completion, 3) for _ in range(10)]
            clients += [_sse_then_leave(session, f"{base}/v1/chat/completions", chat, 3) for _ in range(5)]
            clients += [_grpc_then_cancel(stub, f"storm-{i}", 2) for i in range(15)]
            clients += [_leave_before_answer(host, port, "/v2/models/words/generate_stream", generate)
                        for _ in range(10)]
            results = await asyncio.wait_for(asyncio.gather(*clients), 60)
        await channel.close()
        counter.cancel()
        return results

    results = asyncio.run(storm())
    assert len(results) == 60 and all(r is None or r >= 2 for r in results)
    assert most_threads >= 20
    deadline = time.monotonic() + 10
    while runtime.inflight or dataplane.active or _answering_threads():
        assert time.monotonic() < deadline, (f"after the storm: {runtime.inflight} in flight, "
                                             f"{len(dataplane.active)} active streams, "
                                             f"{len(_answering_threads())} model threads answering")
        time.sleep(0.05)
    assert runtime.stats.success.count == succeeded_before  # none finished: each was cancelled
    # a client gone before its body was read leaves no request behind; every other one counts as cancelled
    assert 50 <= runtime.stats.fail.count - failed_before <= 60
    assert toy_repository.health_problem(base) is None


# -- SIGTERM with streams in flight ----------------------------------------------------------------
def test_sigterm_lets_streams_in_flight_finish(tmp_path):
    """SIGTERM while generate_stream, /v1 and gRPC streams run: each gets every word, the process exits 0."""
    server = start_server([toy_repository.write(tmp_path, delay_ms=20, max_words=1000)], "--exit-timeout-secs",
                          "30", tmp_dir=tmp_path)
    started = threading.Event()
    running = 12
    lock = threading.Lock()

    def one_started():
        nonlocal running
        with lock:
            running -= 1
            if running == 0:
                started.set()

    async def sse_text(session, url: str, body: dict, piece) -> str:
        text = []
        async with session.post(url, json=body) as response:
            assert response.status == 200
            async for line in response.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                if not text:
                    one_started()
                text.append(piece(json.loads(line[6:])))
        return "".join(text)

    async def grpc_text(stub, request_id: str) -> str:
        async def requests():
            yield _grpc_words_request(request_id, TEXT_WORDS)

        text = []
        async for message in stub.ModelStreamInfer(requests()):
            assert not message.error_message, message.error_message
            if not text:
                one_started()
            raw = message.infer_response.raw_output_contents[0]
            text.append(raw[4:].decode())  # one BYTES element: 4-byte length, then the text
        return "".join(text)

    async def streams():
        channel = grpc.aio.insecure_channel(server.grpc_url)
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        base = server.base_url
        async with aiohttp.ClientSession() as session:
            clients = [sse_text(session, f"{base}/v2/models/words/generate_stream",
                                {"text_input": "x", "max_tokens": TEXT_WORDS, "stream": True},
                                lambda doc: doc["text_output"]) for _ in range(4)]
            clients += [sse_text(session, f"{base}/v1/completions",
                                 {"model": "words", "prompt": "x", "max_tokens": TEXT_WORDS, "stream": True},
                                 lambda doc: doc["choices"][0]["text"] if doc["choices"] else "") for _ in range(4)]
            clients += [grpc_text(stub, f"term-{i}") for i in range(4)]
            results = await asyncio.wait_for(asyncio.gather(*clients), 60)
        await channel.close()
        return results

    def signal_when_streaming():
        assert started.wait(30)
        server.process.send_signal(signal.SIGTERM)

    signaller = threading.Thread(target=signal_when_streaming)
    signaller.start()
    try:
        results = asyncio.run(streams())
    finally:
        signaller.join(35)
    expected = " ".join(f"w{i}" for i in range(TEXT_WORDS))
    assert results == [expected] * 12
    assert server.process.wait(30) == 0
    assert "shutting down: draining" in server.log()
