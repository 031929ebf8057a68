"""bench/deadlines.py's summary: the way in split by what came with each request (alone, in a retry burst) and the
client's own share of each refusal's lateness, from synthetic requests (no server)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "deadlines.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_deadlines", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _refusal(sent: float, to_server_ms: float, back_ms: float, deadline_ms: float = 1000.0) -> dict:
    written = sent + 0.001  # the client's send: 1 ms
    received = written + to_server_ms / 1000
    answer_ms = 2.0  # the server's own lateness
    at = received + (deadline_ms + answer_ms) / 1000
    return {"sent": sent, "written": written, "status": 503, "error": "... within its deadline of 1000 ms ...",
            "answered": at + back_ms / 1000, "first": None, "complete": False, "role": "flood",
            "retry_after": "1", "server_late": (1.0, answer_ms, 0.5, at)}


def test_the_way_in_is_split_by_bursts_and_the_clients_share_is_its_send_and_read():
    bench = _bench()
    lone = [_refusal(10.0 + i, 1.0, 3.0) for i in range(3)]  # a second apart: alone
    # 12 within 6 ms, each read later than the one before (the server's loop takes them in turn)
    burst = [_refusal(20.0 + i * 0.0005, 1.0 + i, 3.0) for i in range(12)]
    row = bench.summarize(lone + burst, [0.1], [(1, 0)], 15.0, 1000.0, 2.0)
    # alone: the lone three and the burst's first three (at most 2 before them)
    assert row["way_in_to_server_alone"] == 6 and math.isclose(row["way_in_to_server_alone_max_ms"], 3.0)
    assert row["way_in_to_server_burst"] == 4  # the 9th to 12th of the burst: 8 or more before them
    assert math.isclose(row["way_in_to_server_burst_max_ms"], 12.0)
    assert math.isclose(min(row["way_in_to_server_burst_p50_ms"], 9.0), 9.0)
    assert math.isclose(row["client_own_max_ms"], 4.0)  # 1 ms send + 3 ms way back
    # lateness = send 1 + way in + server 2 + back 3; without the client's 4: way in + 2
    assert math.isclose(row["lateness_without_client_max_ms"], 14.0)
    assert math.isclose(row["lateness_max_ms"], 18.0)


def test_the_observers_refusals_are_timed_by_the_kernels_stamps_apart_from_the_clients():
    bench = _bench()
    clients = [_refusal(10.0 + i, 1.0, 3.0) for i in range(3)]
    observed = []
    for i in range(4):
        r = _refusal(30.0 + i, 1.0, 3.0)
        at = r["server_late"][3]
        # the kernel: the last byte sent 0.2 ms after the clock read before the send, the answer's first byte
        # received 0.1 ms after the server wrote it; the thread read it 9 ms later still (starved)
        r.update(role="observer", kernel_sent=r["sent"] + 0.0002, kernel_answered=at + 0.0001,
                 answered=at + 0.0091)
        observed.append(r)
    row = bench.summarize(clients + observed, [0.1], [(1, 0)], 15.0, 1000.0, 2.0)
    assert row["refused_deadline"] == 7 and row["refused_deadline_clients"] == 3
    assert row["refused_deadline_observer"] == 4 and row["observer_stamped"] == 4
    assert math.isclose(row["lateness_max_ms"], 1 + 1 + 2 + 3)  # the clients' measure: theirs alone
    # TX stamp to RX stamp less the deadline: the way in after the stamp (1.8: the write 1 ms after the send, the
    # way to the server 1 ms), the server's 2 ms, the way back 0.1 ms
    assert math.isclose(row["kernel_lateness_max_ms"], 0.8 + 1 + 2 + 0.1, rel_tol=1e-6)
    assert math.isclose(row["kernel_lateness_from_send_max_ms"], 1 + 1 + 2 + 0.1, rel_tol=1e-6)
    assert math.isclose(row["observer_read_lateness_max_ms"], 1 + 1 + 2 + 9.1, rel_tol=1e-6)
    assert math.isclose(row["kernel_way_in_max_ms"], 1.8, rel_tol=1e-6)
    assert math.isclose(row["kernel_way_in_min_ms"], 1.8, rel_tol=1e-6)
    assert math.isclose(row["kernel_server_max_ms"], 2.0)
    assert math.isclose(row["kernel_way_back_max_ms"], 0.1, rel_tol=1e-4)
    assert row["kernel_early_refusals"] == 0


def test_an_observers_request_carries_the_kernels_send_and_receive_stamps():
    """``timed_request`` against a socket server on 127.0.0.1 that answers 503 late: the stamps bracket the wait,
    and the answer is parsed as the client processes parse theirs."""
    import socket
    import threading
    import time

    bench = _bench()
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            time.sleep(0.05)
            body = b'{"error": "the request did not start within its deadline of 40 ms"}'
            conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nretry-after: 1\r\ncontent-length: "
                         + str(len(body)).encode() + b"\r\ntideserve-deadline-late-us: timer=1,answer=2\r\n\r\n")
            time.sleep(0.02)  # the body in a segment of its own: the stamp stays the status line's
            conn.sendall(body)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    mono_less_real = time.monotonic() - time.clock_gettime(time.CLOCK_REALTIME)
    r = bench.timed_request("127.0.0.1", port, "openai", "a prompt", 4, 40, mono_less_real)
    thread.join(5)
    listener.close()
    assert r["status"] == 503 and "deadline" in r["error"] and r["retry_after"] == "1"
    assert r["server_late"] == (0.001, 0.002, None, None)
    assert r["kernel_sent"] is not None and r["kernel_answered"] is not None
    assert r["sent"] - 0.005 <= r["kernel_sent"] <= r["written"] + 0.005
    assert 0.045 <= r["kernel_answered"] - r["kernel_sent"] < r["answered"] - r["sent"] + 0.005
    assert r["answered"] - r["kernel_answered"] < 0.015  # the status line's segment, not the body's 20 ms later
