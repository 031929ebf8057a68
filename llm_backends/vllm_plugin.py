"""A vLLM general plugin (entry point ``vllm.general_plugins`` in pyproject.toml): vLLM runs :func:`register` in each
of its processes (engine core, workers). It acts only in the engine a tideserve server starts, whose processes inherit
``TIDESERVE_VLLM_SHM_RECHECK_MS`` (set by ``llm_backends/vllm/engine.py``); anywhere else (vLLM's own api_server in
the same environment) it does nothing. Kept outside ``tideserve.llm_backends.vllm``, whose import brings the backend.

What it sets: how often an idle reader of vLLM's shared-memory message queue (the worker waiting for the engine
core's next step, the engine core waiting for the worker's output) rechecks the queue while it waits for the writer's
wake-up. vLLM wakes such a reader with a best-effort ZMQ notification (a PUB socket with a high-water mark of 1: a
notification can be dropped) and rechecks every 5 s (``SHM_READER_RECHECK_INTERVAL_MS``) in case one was: a reader
goes idle after 1 s without a message (``SpinCondition.busy_loop_s``), so the first step of a burst after a pause
could wait up to 5 s with its work already written, every process idle, and all the burst's first tokens then came
at once (docs/performance.md, "first-token stalls"). At 20 ms a lost wake-up costs at most that; an idle worker then
wakes 50 times a second to read a flag in shared memory."""

from __future__ import annotations

import os

ENV = "TIDESERVE_VLLM_SHM_RECHECK_MS"


def register() -> None:
    value = os.environ.get(ENV, "")
    if not value.isdigit() or int(value) <= 0:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = int(value)
