"""tideserve's vLLM general plugin: how the shared-memory queue's readers wait in the engines tideserve starts, and
nothing changed anywhere else."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tideserve.llm_backends import vllm_plugin
from vllm.distributed.device_communicators import shm_broadcast


@pytest.fixture()
def queue(monkeypatch):
    monkeypatch.setattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS", 5000)
    # vLLM's own wait, as before any plugin ran: an engine started in this process earlier (another test) ran the
    # plugin here with tideserve's variables set (the wrapper, installed once, stays)
    wait = shm_broadcast.SpinCondition.wait
    monkeypatch.setattr(shm_broadcast.SpinCondition, "wait", getattr(wait, "__wrapped__", wait))
    notify, enqueue = shm_broadcast.SpinCondition.notify, shm_broadcast.MessageQueue.enqueue
    monkeypatch.setattr(shm_broadcast.SpinCondition, "notify", getattr(notify, "__wrapped__", notify))
    monkeypatch.setattr(shm_broadcast.MessageQueue, "enqueue", getattr(enqueue, "__wrapped__", enqueue))
    monkeypatch.setattr(vllm_plugin, "_quiet_within_s", None)
    for name in (vllm_plugin.ENV, vllm_plugin.SPIN_ENV, vllm_plugin.WORKER_SPIN_ENV, vllm_plugin.QUIET_ENV):
        monkeypatch.setenv(name, "")  # (undone at the end: the variables as they were)
        monkeypatch.delenv(name)
    return monkeypatch


class _Reader:
    """What SpinCondition.wait reads of its instance, with vLLM's 1 s spin, its last read just now."""

    is_reader = True
    busy_loop_s = 1.0

    def __init__(self):
        import time

        self.last_read = time.monotonic()


def _busy_loop_after_a_wait() -> float:
    reader = _Reader()
    shm_broadcast.SpinCondition.wait(reader, timeout_ms=1)  # within the spin: one sched_yield, no socket
    return reader.busy_loop_s


def test_the_plugin_does_nothing_outside_a_tideserve_engine(queue):
    vllm_plugin.register()  # (vLLM's own api_server in the same environment runs it too)
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == 5000
    assert _busy_loop_after_a_wait() == 1.0
    queue.setenv(vllm_plugin.ENV, "not a number")
    vllm_plugin.register()
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == 5000


@pytest.mark.parametrize("in_worker", [True, False])
def test_a_tideserve_engine_gets_the_short_spins_recheck_and_quiet_notification(queue, in_worker):
    from tideserve.llm_backends.vllm import engine

    queue.setattr(vllm_plugin, "_in_worker", lambda: in_worker)
    engine._engine_environment()  # what the engine's processes inherit (this machine: a CPU platform)
    vllm_plugin.register()  # as vLLM runs it in each of them
    vllm_plugin.register()  # (more than once: no second wrapper)
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == int(engine.SHM_RECHECK_MS) < 5000
    spin_ms, worker_spin_ms = float(engine.SHM_SPIN_MS), float(engine.SHM_WORKER_SPIN_MS)
    assert _busy_loop_after_a_wait() == (worker_spin_ms if in_worker else spin_ms) / 1000 < 1
    # a writer's notification is left out within its reader's spin: a worker writes to the engine core, the engine
    # core to its workers; a reader asleep anyway finds the message at its next recheck (2 ms)
    reader_spin_ms = spin_ms if in_worker else worker_spin_ms
    assert vllm_plugin._quiet_within_s == pytest.approx(reader_spin_ms / 1000 - vllm_plugin.QUIET_MARGIN_S)
    assert getattr(shm_broadcast.SpinCondition.notify, "tideserve", False)


def test_values_set_before_the_server_starts_win(queue):
    from tideserve.llm_backends.vllm import engine

    queue.setenv(vllm_plugin.ENV, "5000")  # vLLM's own
    queue.setenv(vllm_plugin.SPIN_ENV, "1000")
    queue.setenv(vllm_plugin.WORKER_SPIN_ENV, "1000")
    queue.setenv(vllm_plugin.QUIET_ENV, "0")
    queue.setattr(vllm_plugin, "_in_worker", lambda: True)
    engine._engine_environment()
    vllm_plugin.register()
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == 5000
    assert _busy_loop_after_a_wait() == 1.0
    assert vllm_plugin._quiet_within_s is None
    assert not getattr(shm_broadcast.SpinCondition.notify, "tideserve", False)


@pytest.mark.parametrize("in_worker", [True, False])
def test_a_worker_spins_for_its_own_setting(queue, in_worker):
    queue.setenv(vllm_plugin.SPIN_ENV, "2")
    queue.setenv(vllm_plugin.WORKER_SPIN_ENV, "50")
    queue.setattr(vllm_plugin, "_in_worker", lambda: in_worker)
    vllm_plugin.register()
    assert _busy_loop_after_a_wait() == (0.05 if in_worker else 0.002)


class _Writer:
    """A queue whose write and notification are counted, its SpinCondition a writer's."""

    def __init__(self):
        self.sent = 0
        writer = self

        class Condition:
            is_reader = False

            def __init__(self):
                self.local_notify_socket = self

            def send(self, _):
                writer.sent += 1

        self._spin_condition = Condition()

    def write(self):  # MessageQueue.enqueue: the write, then the notification
        shm_broadcast.MessageQueue.enqueue(self, None)


@pytest.mark.parametrize("in_worker", [True, False])
def test_a_writer_leaves_out_the_notification_while_its_reader_spins(queue, in_worker):
    queue.setenv(vllm_plugin.ENV, "2")
    queue.setenv(vllm_plugin.SPIN_ENV, "2")
    queue.setenv(vllm_plugin.WORKER_SPIN_ENV, "50")
    queue.setenv(vllm_plugin.QUIET_ENV, "1")
    queue.setattr(vllm_plugin, "_in_worker", lambda: in_worker)
    # vLLM's write, without its shared memory: the notification after it
    queue.setattr(shm_broadcast.MessageQueue, "enqueue",
                  lambda self, obj, timeout=None: shm_broadcast.SpinCondition.notify(self._spin_condition))
    vllm_plugin.register()
    vllm_plugin.register()  # (no second wrapper)
    # an engine core's readers are its workers (50 ms), a worker's reader the engine core (2 ms)
    assert vllm_plugin._quiet_within_s == pytest.approx((0.002 if in_worker else 0.05) - vllm_plugin.QUIET_MARGIN_S)
    writer = _Writer()
    writer.write()  # the first message: notified
    writer.write()  # right after the previous one's start: the reader still spins
    assert writer.sent == 1
    writer._spin_condition.tideserve_began -= 0.06  # the previous message started 60 ms ago: the reader may sleep
    writer.write()
    assert writer.sent == 2


def test_notifications_stay_without_a_recheck_or_the_setting(queue):
    queue.setenv(vllm_plugin.SPIN_ENV, "2")
    queue.setenv(vllm_plugin.QUIET_ENV, "1")  # no recheck: a missed wake-up would wait for vLLM's 5 s
    vllm_plugin.register()
    assert vllm_plugin._quiet_within_s is None
    assert not getattr(shm_broadcast.SpinCondition.notify, "tideserve", False)
    queue.setenv(vllm_plugin.ENV, "2")
    queue.delenv(vllm_plugin.QUIET_ENV)
    vllm_plugin.register()
    assert not getattr(shm_broadcast.SpinCondition.notify, "tideserve", False)


def test_the_plugin_is_declared_for_vllm():
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    plugins = pyproject["project"]["entry-points"]["vllm.general_plugins"]
    assert plugins["tideserve"] == "tideserve.llm_backends.vllm_plugin:register"
