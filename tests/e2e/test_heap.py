"""The garbage collector's heap is frozen once models are loaded, and again after repository changes."""

from __future__ import annotations

import gc
import shutil
from pathlib import Path

import pytest
from support import free_port
from in_process import InProcessServer

from tideserve import heap
from tideserve.app import ServerOptions
from tideserve.repository import ControlMode

MODELS = Path(__file__).resolve().parents[1] / "models"


def test_the_command_freezes_the_heap_after_loading(server):
    assert "garbage collector:" in server.log() and "objects frozen" in server.log()


@pytest.fixture()
def unfrozen():
    gc.unfreeze()
    threshold = gc.get_threshold()
    yield threshold
    gc.unfreeze()  # give the test process its heap back
    gc.set_threshold(*threshold)


def test_explicit_load_and_unload_freeze_again(tmp_path, unfrozen):
    shutil.copytree(MODELS / "add_sub", tmp_path / "add_sub")
    options = ServerOptions(model_repositories=[tmp_path], http_port=free_port(), grpc_port=free_port(),
                            allow_metrics=False, model_control_mode=ControlMode.EXPLICIT, exit_timeout_secs=2,
                            freeze_heap=True)
    running = InProcessServer(options)
    try:
        assert gc.get_freeze_count() > 0  # frozen at start-up, with no model loaded yet
        # the youngest generation collected less often (the requests in flight are not walked every few dozen)
        assert gc.get_threshold()[0] == max(unfrozen[0], heap.YOUNG_THRESHOLD)
        assert gc.get_threshold()[1:] == unfrozen[1:]
        for change in (running.server.dataplane.load_model, running.server.dataplane.unload_model):
            gc.unfreeze()
            running.call(change("add_sub"))
            assert gc.get_freeze_count() > 0, change.__name__
    finally:
        running.stop()


def test_embedded_servers_leave_the_heap_alone(tmp_path, unfrozen):
    options = ServerOptions(model_repositories=[tmp_path], http_port=free_port(), allow_grpc=False,
                            allow_metrics=False, exit_timeout_secs=2)
    running = InProcessServer(options)
    try:
        assert gc.get_freeze_count() == 0
        assert gc.get_threshold() == unfrozen
    finally:
        running.stop()
