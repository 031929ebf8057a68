"""tideserve's vLLM general plugin: the shared-memory queue's recheck interval in the engines tideserve starts, and
nothing anywhere else."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tideserve.llm_backends import vllm_plugin
from vllm.distributed.device_communicators import shm_broadcast


@pytest.fixture()
def recheck(monkeypatch):
    monkeypatch.setattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS", 5000)
    monkeypatch.setenv(vllm_plugin.ENV, "")  # (undone at the end: the variable as it was)
    monkeypatch.delenv(vllm_plugin.ENV)
    return monkeypatch


def test_the_plugin_does_nothing_outside_a_tideserve_engine(recheck):
    vllm_plugin.register()  # (vLLM's own api_server in the same environment runs it too)
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == 5000
    recheck.setenv(vllm_plugin.ENV, "not a number")
    vllm_plugin.register()
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == 5000


def test_a_tideserve_engine_gets_the_short_recheck(recheck):
    from tideserve.llm_backends.vllm import engine

    engine._engine_environment()  # what the engine's processes inherit
    vllm_plugin.register()  # as vLLM runs it in each of them
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == int(engine.SHM_RECHECK_MS) < 5000
    recheck.setenv(vllm_plugin.ENV, "250")  # set before the server started: it wins
    engine._engine_environment()
    vllm_plugin.register()
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == 250


def test_the_plugin_is_declared_for_vllm():
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    plugins = pyproject["project"]["entry-points"]["vllm.general_plugins"]
    assert plugins["tideserve"] == "tideserve.llm_backends.vllm_plugin:register"
