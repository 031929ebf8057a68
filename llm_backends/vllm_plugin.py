"""A vLLM general plugin (entry point ``vllm.general_plugins`` in pyproject.toml): vLLM runs :func:`register` in each
of its processes (engine core, workers). It acts only in the engine a tideserve server starts, whose processes inherit
``TIDESERVE_VLLM_SHM_RECHECK_MS`` and ``TIDESERVE_VLLM_SHM_SPIN_MS`` (set by ``llm_backends/vllm/engine.py``);
anywhere else (vLLM's own api_server in the same environment) it does nothing. Kept outside
``tideserve.llm_backends.vllm``, whose import brings the backend.

What it sets: how a reader of vLLM's shared-memory message queue waits (the worker for the engine core's next step,
the engine core for the worker's output). vLLM's reader spins on ``sched_yield`` for 1 s after its last message
(``SpinCondition.busy_loop_s``), then sleeps until the writer's ZMQ notification (best-effort: a PUB socket with a
high-water mark of 1 can drop it), rechecking the queue every 5 s (``SHM_READER_RECHECK_INTERVAL_MS``). On a CPU
both cost the first tokens of a burst (docs/performance.md, "first-token stalls"): while the worker (pinned to one
core) computes a step, the engine core spins on the other core and takes the CPU the server and its clients need;
and a dropped notification left an idle worker asleep for up to 5 s with its step written. Here a reader spins for
``TIDESERVE_VLLM_SHM_SPIN_MS`` and rechecks every ``TIDESERVE_VLLM_SHM_RECHECK_MS``; a worker's reader (vLLM's
``VllmWorker-*`` processes, each pinned to a core of its own on a CPU) spins for ``TIDESERVE_VLLM_SHM_WORKER_SPIN_MS``
where that is set. A worker that sleeps between steps is woken by the engine core's ZMQ notification: the engine
core's send then wakes its ZMQ I/O thread (a context switch on the core the server shares), and the worker waits for
that chain; a worker still spinning when the step arrives takes it from the ring, and the notification, whose pipe it
has not drained, is dropped at the sender."""

from __future__ import annotations

import logging
import os

ENV = "TIDESERVE_VLLM_SHM_RECHECK_MS"
SPIN_ENV = "TIDESERVE_VLLM_SHM_SPIN_MS"
WORKER_SPIN_ENV = "TIDESERVE_VLLM_SHM_WORKER_SPIN_MS"
_spin_s: float | None = None  # how long this process's readers spin, seconds (set by register)


def _milliseconds(name: str) -> float | None:
    try:
        value = float(os.environ.get(name, ""))
    except ValueError:
        return None
    return value if value >= 0 else None


def _in_worker() -> bool:
    import multiprocessing

    return multiprocessing.current_process().name.startswith("VllmWorker")


def register() -> None:
    global _spin_s
    recheck, spin, worker_spin = _milliseconds(ENV), _milliseconds(SPIN_ENV), _milliseconds(WORKER_SPIN_ENV)
    if recheck is None and spin is None and worker_spin is None:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    if not hasattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS") or not hasattr(shm_broadcast, "SpinCondition"):
        # a vLLM whose queue waits otherwise than the one this was written for: its own waits, and a word in the log
        logging.getLogger(__name__).warning("vLLM's shared-memory queue has no reader recheck or spin to set; "
                                            "the engine keeps its own")
        return
    if recheck is not None and recheck >= 1:
        shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = int(recheck)
    if worker_spin is not None and _in_worker():
        spin = worker_spin
    if spin is None:
        return
    _spin_s = spin / 1000
    if not getattr(shm_broadcast.SpinCondition.wait, "tideserve", False):
        wait = shm_broadcast.SpinCondition.wait

        def spin_then_wait(self, timeout_ms=None):  # (the worker's queues exist before vLLM runs the plugin)
            if self.is_reader and _spin_s is not None:
                self.busy_loop_s = _spin_s
            return wait(self, timeout_ms)

        spin_then_wait.tideserve = True
        spin_then_wait.__wrapped__ = wait  # vLLM's own
        shm_broadcast.SpinCondition.wait = spin_then_wait
