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

import httpx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from frontend_processes import add_sub_inputs, workers
from support import TEST_MODELS, start_server

DIRECT = "--frontend-workers auto: one frontend worker process"
IN_CORE = "--frontend-workers auto: the ports served in the core process"


@contextlib.contextmanager
def _serving(tmp_path, models: tuple[str, ...], *flags: str):
    """A server over a repository of ``models`` (copied from the test models) with ``flags``, started on at most two
    of this machine's cores (the affinity its processes inherit from this one while it starts), answering add_sub
    over HTTP and gRPC: yields (the server, its log at ready, its frontend worker processes)."""
    for name in models:
        shutil.copytree(TEST_MODELS / name, tmp_path / "models" / name)
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(sorted(before)[:2]))
    try:
        server = start_server([tmp_path / "models"], *flags, tmp_dir=tmp_path)
    finally:
        os.sched_setaffinity(0, before)
    try:
        log = server.log()
        found = workers(server.process.pid)
        _served(server)
        yield server, log, found
    finally:
        server.stop()


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
    with _serving(tmp_path, ("add_sub", "bls_add_sub"), "--frontend-workers", "auto") as (server, log, found):
        assert DIRECT in log and IN_CORE not in log, log[-3000:]
        assert len(found) == 1, log[-3000:]
        # a BLS model's own calls (from its instance process) reach add_sub as from the core
        with httpclient.InferenceServerClient(server.http_url) as client:
            result = client.infer("bls_add_sub", add_sub_inputs(httpclient))
        assert result.as_numpy("OUTPUT0").tolist() == [[1, 2, 3, 4]]


def test_a_model_the_workers_cannot_reach_directly_keeps_the_ports_in_the_core(tmp_path):
    with _serving(tmp_path, ("add_sub", "iterative_add_sub"), "--frontend-workers", "auto") as (_, log, found):
        assert IN_CORE in log and DIRECT not in log, log[-3000:]
        assert found == [], log[-3000:]


@pytest.mark.parametrize("flags", [("--frontend-workers", "1"),
                                   ("--frontend-workers", "auto", "--frontend-direct", "off")])
def test_a_named_layout_is_kept(tmp_path, flags):
    """``--frontend-workers 1``, or ``--frontend-direct`` named: no choice is made."""
    with _serving(tmp_path, ("add_sub",), *flags) as (_, log, found):
        assert DIRECT not in log and IN_CORE not in log, log[-3000:]
        assert found == [], log[-3000:]


def test_tracing_on_from_the_start_keeps_the_ports_in_the_core(tmp_path):
    """Traced requests go through the core: with tracing on from the start a worker would relay every one."""
    with _serving(tmp_path, ("add_sub",), "--frontend-workers", "auto", "--trace-config", "level=TIMESTAMPS",
                  "--trace-config", f"triton,file={tmp_path / 'trace.json'}") as (_, log, found):
        assert IN_CORE in log and DIRECT not in log, log[-3000:]
        assert found == [], log[-3000:]
