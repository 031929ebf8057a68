"""The vLLM engine's stop: its processes get a short grace (the model is drained by then), not vLLM's 5 s, and none
of them outlives the stop."""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

import psutil
import pytest

pytest.importorskip("vllm")

from tideserve.llm_backends.vllm import engine as vllm_engine


def _engine(processes=(), on_shutdown=lambda: None):
    """What stop_engine reads of vLLM's AsyncLLM: shutdown(timeout) and its client's engine manager's processes."""
    calls = []

    def shutdown(timeout=None):
        calls.append(timeout)
        on_shutdown()

    manager = SimpleNamespace(processes=list(processes))
    engine = SimpleNamespace(shutdown=shutdown, engine_core=SimpleNamespace(resources=SimpleNamespace(
        engine_manager=manager)))
    return engine, calls


def test_stop_engine_gives_the_processes_a_short_grace():
    engine, calls = _engine()
    vllm_engine.stop_engine(engine)
    assert calls == [vllm_engine.ENGINE_STOP_GRACE_S]
    assert 0 < vllm_engine.ENGINE_STOP_GRACE_S < 5  # vLLM's own default grace is 5 s


def test_a_worker_that_outlives_its_engine_core_is_killed_before_the_stop_returns():
    # an "engine core" whose "worker" (its child) ignores SIGTERM and would run on for a minute; the engine's
    # shutdown ends the engine core only, as one that got the signal itself does
    worker_code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    core_code = (f"import subprocess, sys, time; w = subprocess.Popen([sys.executable, '-c', {worker_code!r}]); "
                 "print(w.pid, flush=True); time.sleep(60)")
    core = subprocess.Popen([sys.executable, "-c", core_code], stdout=subprocess.PIPE, text=True)
    try:
        worker_pid = int(core.stdout.readline())
        deadline = time.monotonic() + 30
        while not psutil.Process(core.pid).children() and time.monotonic() < deadline:
            time.sleep(0.02)
        worker = psutil.Process(worker_pid)
        engine, _ = _engine([core], on_shutdown=lambda: (core.kill(), core.wait()))
        started = time.monotonic()
        vllm_engine.stop_engine(engine)
        assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
        assert time.monotonic() - started < vllm_engine.ENGINE_KILL_WAIT_S
    finally:
        core.kill()
        core.wait()
        try:
            psutil.Process(worker_pid).kill()
        except (psutil.Error, NameError):
            pass
