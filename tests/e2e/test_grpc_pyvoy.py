"""``--grpc-frontend pyvoy``: the gRPC port served by Envoy (pyvoy) running server/grpc/asgi_transport.py, a frontend
process of its own linked to the core. The gRPC suites run on it too (TIDESERVE_TEST_GRPC_FRONTEND=pyvoy, the
Makefile's pass); this file covers what only this transport has: the Envoy process's life, compression, deadlines,
large messages, the port taken."""

from __future__ import annotations

import os
import queue
import signal
import socket
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from support import TEST_MODELS, PortTaken, free_port, start_server
from tritonclient.utils import InferenceServerException


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = start_server([TEST_MODELS], "--grpc-frontend", "pyvoy", "--frontend-workers", "1",
                           "--model-control-mode", "explicit", "--load-model", "add_sub", "--load-model", "repeat",
                           "--load-model", "identity_bytes", tmp_dir=tmp_path_factory.mktemp("pyvoy"))
    yield running
    running.stop()


def _envoys(server) -> list[int]:
    """The server's Envoy processes (its children running the envoy binary)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int(Path(entry, "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = Path(entry, "cmdline").read_bytes()
        except OSError:
            continue
        if ppid == server.process.pid and b"envoy" in cmdline.split(b"\0", 1)[0]:
            found.append(int(entry.name))
    return found


def _add_sub(client, offset: float = 0.0, **kwargs):
    a = np.arange(4, dtype=np.float32).reshape(1, 4) + offset
    inputs = [grpcclient.InferInput("INPUT0", [1, 4], "FP32"), grpcclient.InferInput("INPUT1", [1, 4], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(a)
    result = client.infer("add_sub", inputs, **kwargs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + a)


def _wait_serving(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with grpcclient.InferenceServerClient(url) as client:
                if client.is_server_ready():
                    return
        except InferenceServerException:
            pass
        assert time.monotonic() < deadline, "the gRPC port did not come back"
        time.sleep(0.2)


def test_grpc_port_is_served_by_envoy_http_by_the_core(server):
    assert len(_envoys(server)) == 1
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        _add_sub(client)
        for algorithm in ("gzip", "deflate"):  # compressed request messages are inflated
            _add_sub(client, 1.0, compression_algorithm=algorithm)
        assert client.get_model_metadata("add_sub").name == "add_sub"
    import tritonclient.http as httpclient
    with httpclient.InferenceServerClient(server.http_url) as client:
        assert client.is_model_ready("add_sub")


def test_large_message_round_trip(server):
    data = np.array([[b"z" * (8 << 20)]], dtype=np.object_)
    tensor = grpcclient.InferInput("INPUT0", [1, 1], "BYTES")
    tensor.set_data_from_numpy(data)
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        assert client.infer("identity_bytes", [tensor]).as_numpy("OUTPUT0")[0][0] == data[0][0]


def test_deadline_ends_a_stream_and_the_server_serves_on(server):
    results: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(lambda result, error: results.put((result, error)), stream_timeout=1.0)
        values = grpcclient.InferInput("IN", [5], "INT32")
        values.set_data_from_numpy(np.arange(5, dtype=np.int32))
        delay = grpcclient.InferInput("DELAY", [1], "UINT32")
        delay.set_data_from_numpy(np.array([2000], np.uint32))
        client.async_stream_infer("repeat", [values, delay])
        _, error = results.get(timeout=30)
        assert error is not None and "DEADLINE_EXCEEDED" in str(error.status())
        client.stop_stream()
        _add_sub(client)


def test_unknown_method_is_unimplemented(server):
    with grpc.insecure_channel(server.grpc_url) as channel:
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary("/inference.GRPCInferenceService/NoSuchMethod")(b"")
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_envoy_death_is_reported_and_it_is_replaced(server):
    (pid,) = _envoys(server)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not [p for p in _envoys(server) if p != pid]:
        assert time.monotonic() < deadline, "no new Envoy process"
        time.sleep(0.2)
    _wait_serving(server.grpc_url)
    assert f"(pid {pid}) exited" in server.log()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        _add_sub(client)


def test_stop_ends_envoy_and_a_taken_port_fails_the_start(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        with pytest.raises(PortTaken):
            start_server([TEST_MODELS], "--grpc-frontend", "pyvoy", "--model-control-mode", "explicit",
                         tmp_dir=tmp_path, ports=(free_port(), taken, free_port()), ready_timeout=60).stop()
    running = start_server([TEST_MODELS], "--grpc-frontend", "pyvoy", "--model-control-mode", "explicit",
                           tmp_dir=tmp_path)
    envoys = _envoys(running)
    assert envoys
    assert running.stop() == 0
    for pid in envoys:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_envoy_exits_when_the_core_dies(tmp_path):
    running = start_server([TEST_MODELS], "--grpc-frontend", "pyvoy", "--model-control-mode", "explicit",
                           tmp_dir=tmp_path)
    envoys = _envoys(running)
    assert envoys
    running.stop(signal.SIGKILL)
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() for pid in envoys):
        assert time.monotonic() < deadline, "Envoy outlived the core"
        time.sleep(0.1)
    assert "the core process is gone; exiting" in running.log()
