"""Frontend worker processes (``--frontend-workers 2``): the HTTP and gRPC ports served by two processes
over one core. The protocol suites also run whole in this mode (``.ci/run`` sets
TIDESERVE_TEST_FRONTEND_WORKERS=2); these tests cover what only this mode has: the processes, one
statistics / metrics view over both, a worker that dies, and shutdown without orphans."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from frontend_processes import add_sub_inputs, children, cmdline, proc_stat, workers
from support import TEST_MODELS, start_server
from tideserve.workers import balance


def alive(pid: int) -> bool:
    fields = proc_stat(pid)
    return fields is not None and fields[0] != "Z"


def established(pid: int, port: int) -> int:
    """Established TCP connections on local ``port`` whose socket process ``pid`` holds."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "01" and cols[9] in inodes:
                count += 1
    return count



def success_count(server, model: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics").text
    for line in text.splitlines():
        if line.startswith("nv_inference_request_success{") and f'model="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = start_server([TEST_MODELS], "--frontend-workers", "2",
                           tmp_dir=tmp_path_factory.mktemp("frontend_workers"))
    yield running
    running.stop()


def _grpc_connections_by_worker(server, count: int = 16) -> dict[int, int]:
    """``count`` gRPC connections (one client each), each answering an inference: how many each worker holds."""
    pids = workers(server.process.pid)
    assert len(pids) == 2, pids
    clients = [grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}",
                                                channel_args=[("grpc.use_local_subchannel_pool", 1)])
               for _ in range(count)]
    try:
        for client in clients:
            result = client.infer("add_sub", add_sub_inputs(grpcclient))
            assert result.as_numpy("OUTPUT0").tolist() == [[1, 2, 3, 4]]
        held = {pid: established(pid, server.grpc_port) for pid in pids}
        assert sum(held.values()) == count, held
        return held
    finally:
        for client in clients:
            client.close()


def _dealt_evenly(held: dict[int, int]) -> None:
    """Where the kernel loads the eBPF program that deals the gRPC port's connections in turn, each worker holds
    half; else (bpf(2) refused to this user) a random pick put some on each."""
    fd = balance.deal_program(2)
    if fd is None:
        assert all(held.values()), held
    else:
        os.close(fd)
        assert sorted(held.values()) == [8, 8], held


def test_two_worker_processes_share_both_ports(server):
    """Both workers listen on the gRPC port (SO_REUSEPORT). Where every worker takes connections (fewer workers than
    cores) 16 connections are dealt to both in turn; with as many workers as cores or more (2 on 2 cores) every one
    goes to the first taker's listener, as the HTTP port's do (workers/balance.py)."""
    held = _grpc_connections_by_worker(server)
    if balance.takers(2, balance.cores()) == 2:
        _dealt_evenly(held)
    else:
        assert sorted(held.values()) == [0, 16], held


def test_with_the_even_spread_the_grpc_connections_go_to_both_workers(tmp_path):
    """TIDESERVE_HTTP_FILL_CONNECTIONS=0 (every worker takes its share from the first connection): the gRPC port's
    connections are dealt to both workers in turn, on any machine."""
    running = start_server([TEST_MODELS], "--frontend-workers", "2", tmp_dir=tmp_path,
                           env={"TIDESERVE_HTTP_FILL_CONNECTIONS": "0"})
    try:
        _dealt_evenly(_grpc_connections_by_worker(running))
    finally:
        running.stop()


def test_statistics_and_metrics_count_every_worker(server):
    before_metrics = success_count(server, "add_sub")
    with httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}") as http:
        before = http.get_inference_statistics("add_sub")["model_stats"][0]["inference_stats"]["success"]["count"]
    for _ in range(10):  # a new connection each time, over both protocols
        with httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}") as http:
            http.infer("add_sub", add_sub_inputs(httpclient))
        with grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}",
                                              channel_args=[("grpc.use_local_subchannel_pool", 1)]) as grpc:
            grpc.infer("add_sub", add_sub_inputs(grpcclient))
    with grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}") as grpc:
        stats = grpc.get_inference_statistics("add_sub", as_json=True)
    after = int(stats["model_stats"][0]["inference_stats"]["success"]["count"])
    assert after - before == 20
    assert success_count(server, "add_sub") - before_metrics == 20


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_large_tensors_cross_the_worker_link_in_shared_memory_exactly(server, module):
    """Tensors past the link's threshold go both ways through its arenas (a block reused once the last array over it
    is gone, request after request); what comes back is what went."""
    rng = np.random.default_rng(3)
    url = f"127.0.0.1:{server.grpc_port if module is grpcclient else server.http_port}"
    with module.InferenceServerClient(url) as client:
        for count in (1, 3, 8, 2) * 5:  # 64 KiB to 512 KiB per message, in blocks of changing sizes
            elements = [rng.bytes(64 * 1024 - 7 * i) for i in range(count)]
            data = np.array([elements], dtype=np.object_)
            tensor = module.InferInput("INPUT0", list(data.shape), "BYTES")
            tensor.set_data_from_numpy(data)
            out = client.infer("identity_bytes", [tensor]).as_numpy("OUTPUT0")
            assert out.shape == data.shape and list(out[0]) == elements


def test_a_worker_that_dies_is_replaced(server):
    first, second = workers(server.process.pid)
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        current = workers(server.process.pid)
        if len(current) == 2 and first not in current:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"no worker replaced pid {first}: {workers(server.process.pid)}")
    assert alive(server.process.pid) and second in current
    assert httpx.get(f"{server.base_url}/v2/health/live").status_code == 200
    for _ in range(6):  # answered, whichever worker takes the connection
        with httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}") as http:
            assert http.infer("add_sub", add_sub_inputs(httpclient)).as_numpy("OUTPUT1").tolist() == [[-1, 0, 1, 2]]
    assert "frontend worker" in server.log() and "starting another" in server.log()


def test_sigterm_finishes_in_flight_requests_and_leaves_no_process(tmp_path):
    running = start_server([TEST_MODELS], "--frontend-workers", "2", tmp_dir=tmp_path)
    core = running.process.pid
    family = children(core)
    assert len(workers(core)) == 2 and len(family) > 2  # workers and the Python models' processes
    body = {"IN": [1, 2, 3, 4], "DELAY": 400}  # four responses, 0.4 s apart
    outcome = {}
    under_way = threading.Event()

    def stream():
        lines = []
        with httpx.stream("POST", f"{running.base_url}/v2/models/repeat/generate_stream", json=body,
                          timeout=30) as response:
            outcome["status"] = response.status_code
            for line in response.iter_lines():
                if line.startswith("data:"):
                    lines.append(line)
                    under_way.set()
        outcome["events"] = lines

    thread = threading.Thread(target=stream)
    thread.start()
    assert under_way.wait(30)  # the first response came: the request is in flight
    running.process.send_signal(signal.SIGTERM)
    thread.join(30)
    assert running.process.wait(30) == 0
    assert outcome["status"] == 200 and len(outcome["events"]) == 4, outcome
    assert not any('"error"' in event for event in outcome["events"]), outcome
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in family) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in family if alive(pid)], [cmdline(pid) for pid in family if alive(pid)]
