"""Scheduler interface and the worker loop shared by the built-in schedulers."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from ..errors import Cancelled
from ..types import InferenceRequest

if TYPE_CHECKING:
    from ..runtime import InstanceSlot, ModelRuntime

log = logging.getLogger(__name__)


class Scheduler:
    """Takes requests of one model version and runs them on its instances."""

    def __init__(self, runtime: "ModelRuntime") -> None:
        self.runtime = runtime
        self._workers: list[asyncio.Task] = []

    def enqueue(self, request: InferenceRequest) -> None:
        """Queue ``request``; raise a ServerError to reject it at once."""
        raise NotImplementedError

    async def next_batch(self) -> list[InferenceRequest]:
        """Wait for the next batch an idle instance should run."""
        raise NotImplementedError

    def pending(self) -> int:
        """Requests queued and not yet running."""
        return 0

    async def start(self) -> None:
        self._workers = [asyncio.create_task(self._work(slot), name=f"{slot.instance.ctx.name}-worker")
                         for slot in self.runtime.slots]

    async def stop(self) -> None:
        for worker in self._workers:
            worker.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []

    async def _work(self, slot: "InstanceSlot") -> None:
        while True:
            batch = await self.next_batch()
            if batch:
                try:
                    await self.run(slot, batch)
                except Exception:  # keep the worker alive whatever happens
                    log.exception("model '%s': batch execution failed", self.runtime.name)

    async def run(self, slot: "InstanceSlot", batch: list[InferenceRequest]) -> None:
        limiter = self.runtime.rate_limiter
        if limiter is None or slot.limits is None:
            await self.runtime.execute(slot, batch)
            return
        await limiter.acquire(slot.limits)  # the instance's turn and resources (--rate-limit execution_count)
        try:
            await self.runtime.execute(slot, batch)
        finally:
            limiter.release(slot.limits)


def drop_cancelled(request: InferenceRequest) -> bool:
    """Answer a request cancelled while queued; True if it was."""
    if request.is_cancelled():
        request.response_sender.send_error(Cancelled("request was cancelled before it ran"))
        return True
    return False
