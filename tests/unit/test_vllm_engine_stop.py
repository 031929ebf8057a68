"""The vLLM engine's stop: its processes get a short grace (the model is drained by then), not vLLM's 5 s."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tideserve.llm_backends.vllm import engine as vllm_engine


def test_stop_engine_gives_the_processes_a_short_grace():
    calls = []

    class Engine:
        def shutdown(self, timeout=None):
            calls.append(timeout)

    vllm_engine.stop_engine(Engine())
    assert calls == [vllm_engine.ENGINE_STOP_GRACE_S]
    assert 0 < vllm_engine.ENGINE_STOP_GRACE_S < 5  # vLLM's own default grace is 5 s
