"""A vLLM general plugin (entry point ``vllm.general_plugins`` in pyproject.toml): vLLM runs :func:`register` in each
of its processes (engine core, workers). It acts only in the engine a tideserve server starts, whose processes inherit
``TIDESERVE_VLLM_SHM_RECHECK_MS``, ``TIDESERVE_VLLM_SHM_SPIN_MS``, ``TIDESERVE_VLLM_SHM_WORKER_SPIN_MS`` and
``TIDESERVE_VLLM_SHM_QUIET_NOTIFY`` (set by ``llm_backends/vllm/engine.py``, the last three on a CPU platform);
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
that chain; a worker still spinning when the step arrives takes it from the ring without it, but the send still wakes
the I/O threads of both processes, which carry it to the worker's socket (measured: docs/performance.md, "the engine
core's wake-up of its worker").

``TIDESERVE_VLLM_SHM_QUIET_NOTIFY=1`` (with a recheck set) also leaves out a writer's notification where its reader
still spins: a message written less than the reader's spin (less a margin) after the start of the previous one
finds the reader spinning since it read that one (or still busy before its next wait), so the ZMQ send, which wakes
the I/O threads of both processes, changes nothing. A reader that went to sleep anyway (preempted between its last
look at the queue and its decision to sleep) finds the message at its next recheck. The readers of an engine core's
queue are its workers (the worker spin where set); the reader of a worker's queue is the engine core."""

from __future__ import annotations

import logging
import os
import time

ENV = "TIDESERVE_VLLM_SHM_RECHECK_MS"
SPIN_ENV = "TIDESERVE_VLLM_SHM_SPIN_MS"
WORKER_SPIN_ENV = "TIDESERVE_VLLM_SHM_WORKER_SPIN_MS"
QUIET_ENV = "TIDESERVE_VLLM_SHM_QUIET_NOTIFY"
IO_CPUS_ENV = "TIDESERVE_VLLM_ENGINE_IO_CPUS"  # an engine core running its worker: its socket threads' cores
QUIET_MARGIN_S = 0.0005  # a reader's spin is trusted up to this much before its end
_spin_s: float | None = None  # how long this process's readers spin, seconds (set by register)
_quiet_within_s: float | None = None  # a notification within this long of the previous message's start is left out


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
    global _spin_s, _quiet_within_s
    _engine_io_threads()
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
    in_worker = _in_worker()
    # the spin of this process's queues' readers: a worker writes to the engine core, an engine core to its workers
    reader_spin = spin if in_worker or worker_spin is None else worker_spin
    if (os.environ.get(QUIET_ENV) == "1" and recheck is not None and recheck >= 1 and reader_spin is not None
            and reader_spin / 1000 > QUIET_MARGIN_S):
        _quiet_within_s = reader_spin / 1000 - QUIET_MARGIN_S
        _quiet_notifications(shm_broadcast)
    if worker_spin is not None and in_worker:
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


def _engine_io_threads() -> None:
    """An engine core process that runs its model's worker (``llm_backends/vllm/engine.py`` ``_worker_in_core``) is
    bound to the worker's cores by its OpenMP environment, its main thread (the OpenMP master) to the first of them,
    and every thread it starts inherits that one core. Where the worker has more than one core, the engine core's
    socket threads (vLLM's ``process_input_sockets`` / ``process_output_sockets``: the outputs' serialization
    overlaps the next forward pass) would take the master's core from the forward pass while the other OpenMP threads
    wait at its barriers: they run on ``IO_CPUS_ENV``'s cores instead (the cores vLLM reserves beside its worker)."""
    value = os.environ.get(IO_CPUS_ENV)
    if not value or not hasattr(os, "sched_setaffinity"):
        return
    try:
        cpus = {int(cpu) for cpu in value.split(",")}
        from vllm.v1.engine import core
    except (ValueError, ImportError):
        return
    engine = getattr(core, "EngineCoreProc", None)
    for name in ("process_input_sockets", "process_output_sockets"):
        method = getattr(engine, name, None)
        if method is None or getattr(method, "tideserve", False):
            continue

        def off_the_worker_cores(self, *args, _method=method, **kwargs):
            try:
                os.sched_setaffinity(0, cpus)  # (Linux: 0 is the calling thread)
            except OSError:
                pass
            return _method(self, *args, **kwargs)

        off_the_worker_cores.tideserve = True
        off_the_worker_cores.__wrapped__ = method
        setattr(engine, name, off_the_worker_cores)


def _quiet_notifications(shm_broadcast) -> None:
    """A writer's queue notes when each message's write starts; its notification is left out within
    ``_quiet_within_s`` of the previous one's start (the reader read that one after it, and spins on from there)."""
    queue, condition = shm_broadcast.MessageQueue, shm_broadcast.SpinCondition
    if getattr(condition.notify, "tideserve", False):
        return
    enqueue, notify = queue.enqueue, condition.notify

    def enqueue_noting_start(self, obj, timeout=None):
        spin = self._spin_condition
        if spin is not None:
            spin.tideserve_previous = getattr(spin, "tideserve_began", None)
            spin.tideserve_began = time.monotonic()
        return enqueue(self, obj, timeout)

    def notify_unless_spinning(self):
        previous = getattr(self, "tideserve_previous", None)
        if _quiet_within_s is not None and previous is not None and time.monotonic() - previous < _quiet_within_s:
            return
        notify(self)

    enqueue_noting_start.__wrapped__ = enqueue
    notify_unless_spinning.tideserve = True
    notify_unless_spinning.__wrapped__ = notify
    queue.enqueue = enqueue_noting_start
    condition.notify = notify_unless_spinning
