"""A scheduler for postprocess models with several instances: a sequence always runs on one instance.

The pieces of a stream must be decoded in order. With one instance the default schedulers keep
arrival order; with several, two pieces of a sequence could run at once on two instances and finish
out of order. So each instance gets its own queue: a request with ``sequence_id`` goes to the queue
its id hashes to, any other to the shortest queue. An instance runs whatever its queue holds (up to
``MAX_BATCH`` requests) as one batch.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import Hashable
from typing import TYPE_CHECKING

from tideserve.backend_api import InferenceRequest, Scheduler, drop_cancelled

if TYPE_CHECKING:
    from tideserve.backend_api import InstanceSlot, ModelRuntime

log = logging.getLogger(__name__)

MAX_BATCH = 64


def route(key: Hashable, count: int) -> int:
    """The instance index of sequence ``key``: stable across calls and processes."""
    if isinstance(key, int):
        return key % count
    return zlib.crc32(str(key).encode()) % count


class SequenceRouter(Scheduler):
    def __init__(self, runtime: ModelRuntime) -> None:
        super().__init__(runtime)
        self._queues: list[asyncio.Queue[InferenceRequest]] = [asyncio.Queue() for _ in runtime.slots]

    def enqueue(self, request: InferenceRequest) -> None:
        key = request.parameters.get("sequence_id")
        if key is None:
            index = min(range(len(self._queues)), key=lambda i: self._queues[i].qsize())
        else:
            index = route(key, len(self._queues))
        self._queues[index].put_nowait(request)

    def pending(self) -> int:
        return sum(q.qsize() for q in self._queues)

    async def start(self) -> None:
        self._workers = [asyncio.create_task(self._serve(slot, queue), name=f"{slot.instance.ctx.name}-worker")
                         for slot, queue in zip(self.runtime.slots, self._queues)]

    async def _serve(self, slot: InstanceSlot, queue: asyncio.Queue[InferenceRequest]) -> None:
        while True:
            batch = [await queue.get()]
            while len(batch) < MAX_BATCH and not queue.empty():
                batch.append(queue.get_nowait())
            batch = [r for r in batch if not drop_cancelled(r)]
            if batch:
                try:
                    await self.runtime.execute(slot, batch)
                except Exception:  # keep the worker alive whatever happens
                    log.exception("model '%s': batch execution failed", self.runtime.name)
