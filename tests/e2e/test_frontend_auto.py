"""``--frontend-workers auto`` where it means one worker (under 4 cores): the layout follows the models loaded at start.
Every one a Python model a frontend worker reaches directly: one worker with direct instances (measured faster for
them: docs/performance.md); anything else among them (here a sequence-batched model): the core serves the ports
itself. The server runs on at most two of this machine's cores (its affinity, inherited from the test while it
starts), so ``auto`` means one worker on any machine."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from support import TEST_MODELS, start_server

DIRECT = "--frontend-workers auto: one frontend worker process"
IN_CORE = "--frontend-workers auto: the ports served in the core process"


def workers(pid: int) -> list[int]:
    """The server's frontend worker processes (its children running ``tideserve.workers.main``)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            with contextlib.suppress(OSError):
                if b"tideserve.workers.main" in Path(f"/proc/{child}/cmdline").read_bytes():
                    found.append(int(child))
    return sorted(found)


def add_sub_inputs(module):
    a = np.arange(4, dtype=np.float32).reshape(1, 4)
    inputs = [module.InferInput("INPUT0", [1, 4], "FP32"), module.InferInput("INPUT1", [1, 4], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(np.ones_like(a))
    return inputs


@contextlib.contextmanager
def _two_cores():
    """This process's CPU affinity cut to (at most) two cores while a server starts: its processes inherit it."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(sorted(before)[:2]))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _repository(tmp_path, *names):
    for name in names:
        shutil.copytree(TEST_MODELS / name, tmp_path / "models" / name)
    return tmp_path / "models"


def _served(server) -> None:
    with httpclient.InferenceServerClient(server.http_url) as client:
        assert client.infer("add_sub", add_sub_inputs(httpclient)).as_numpy("OUTPUT0").tolist() == [[1, 2, 3, 4]]
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    try:
        assert client.infer("add_sub", add_sub_inputs(grpcclient)).as_numpy("OUTPUT1").tolist() == [[-1, 0, 1, 2]]
    finally:
        client.close()
    deadline = time.monotonic() + 10  # counted in the core's one view either way (the instances' counts: at once)
    while True:
        stats = httpx.get(f"{server.base_url}/v2/models/add_sub/stats", timeout=30).json()["model_stats"][0]
        if stats["inference_stats"]["success"]["count"] >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert stats["inference_stats"]["success"]["count"] == 2, stats


def test_python_models_only_get_one_worker_with_direct_instances(tmp_path):
    with _two_cores():
        server = start_server([_repository(tmp_path, "add_sub", "bls_add_sub")], "--frontend-workers", "auto",
                              tmp_dir=tmp_path)
    try:
        log = server.log()
        assert DIRECT in log and IN_CORE not in log, log[-3000:]
        assert len(workers(server.process.pid)) == 1, log[-3000:]
        _served(server)
        # a BLS model's own calls (from its instance process) reach add_sub as from the core
        with httpclient.InferenceServerClient(server.http_url) as client:
            result = client.infer("bls_add_sub", add_sub_inputs(httpclient))
        assert result.as_numpy("OUTPUT0").tolist() == [[1, 2, 3, 4]]
    finally:
        server.stop()


def test_a_model_the_workers_cannot_reach_directly_keeps_the_ports_in_the_core(tmp_path):
    with _two_cores():
        server = start_server([_repository(tmp_path, "add_sub", "iterative_add_sub")], "--frontend-workers", "auto",
                              tmp_dir=tmp_path)
    try:
        log = server.log()
        assert IN_CORE in log and DIRECT not in log, log[-3000:]
        assert workers(server.process.pid) == [], log[-3000:]
        _served(server)
    finally:
        server.stop()


@pytest.mark.parametrize("flags", [("--frontend-workers", "1"), ("--frontend-workers", "auto", "--frontend-direct", "off")])
def test_a_named_layout_is_kept(tmp_path, flags):
    """``--frontend-workers 1``, or ``--frontend-direct`` named: no choice is made."""
    with _two_cores():
        server = start_server([_repository(tmp_path, "add_sub")], *flags, tmp_dir=tmp_path)
    try:
        log = server.log()
        assert DIRECT not in log and IN_CORE not in log, log[-3000:]
        assert workers(server.process.pid) == [], log[-3000:]
        _served(server)
    finally:
        server.stop()


def test_tracing_on_from_the_start_keeps_the_ports_in_the_core(tmp_path):
    """Traced requests go through the core: with tracing on from the start a worker would relay every one."""
    with _two_cores():
        server = start_server([_repository(tmp_path, "add_sub")], "--frontend-workers", "auto",
                              "--trace-config", "level=TIMESTAMPS", "--trace-config",
                              f"triton,file={tmp_path / 'trace.json'}", tmp_dir=tmp_path)
    try:
        log = server.log()
        assert IN_CORE in log and DIRECT not in log, log[-3000:]
        assert workers(server.process.pid) == [], log[-3000:]
        _served(server)
    finally:
        server.stop()
