"""Keeping the garbage collector off the loaded models.

A server with a vLLM engine (torch, transformers, the engine's client) holds about a million objects
that live as long as their model. Python's collector walks all of them on every oldest-generation
collection, which then pauses the event loop for tenths of a second in the middle of token streams.
:func:`freeze` collects once, then moves everything that exists into the permanent generation
(``gc.freeze``), so later collections walk only what requests allocate. It runs once the startup
models are loaded and again after each load, unload or poll that changed the repository (unfreezing
first, so what an unloaded model leaves behind is collected). vLLM's own API server freezes its heap
after start-up the same way.

It also raises the youngest generation's threshold (:data:`YOUNG_THRESHOLD`): at Python's 700 the collector ran
every few dozen requests under load only to walk the objects of the requests in flight (add_sub at 32 clients: one
young collection per ~44 requests, ~2 µs of the event loop's time per request, next to no garbage found); at 10,000
it ran once in 20,000 such requests, and the most it walks is still a few milliseconds' worth.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)

YOUNG_THRESHOLD = 10_000  # container allocations (net of deallocations) before a youngest-generation collection


def freeze() -> None:
    started = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    young, *older = gc.get_threshold()
    if 0 < young < YOUNG_THRESHOLD:  # (0: the collector is off; a higher one was set on purpose)
        gc.set_threshold(YOUNG_THRESHOLD, *older)
    log.info("garbage collector: %d objects frozen in %.2f s", gc.get_freeze_count(), time.perf_counter() - started)
