"""Keeping the garbage collector off the loaded models.

A server with a vLLM engine (torch, transformers, the engine's client) holds about a million objects
that live as long as their model. Python's collector walks all of them on every oldest-generation
collection, which then pauses the event loop for tenths of a second in the middle of token streams.
:func:`freeze` collects once, then moves everything that exists into the permanent generation
(``gc.freeze``), so later collections walk only what requests allocate. It runs once the startup
models are loaded and again after each load, unload or poll that changed the repository (unfreezing
first, so what an unloaded model leaves behind is collected). vLLM's own API server freezes its heap
after start-up the same way.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def freeze() -> None:
    started = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    log.info("garbage collector: %d objects frozen in %.2f s", gc.get_freeze_count(), time.perf_counter() - started)
