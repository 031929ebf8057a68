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
