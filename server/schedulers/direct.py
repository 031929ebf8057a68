"""The default scheduler: each request runs alone on the next free instance."""

from __future__ import annotations

import asyncio

from ..types import InferenceRequest
from .base import Scheduler, drop_cancelled


class DirectScheduler(Scheduler):
    def __init__(self, runtime) -> None:
        super().__init__(runtime)
        self._queue: asyncio.Queue[InferenceRequest] = asyncio.Queue()

    def enqueue(self, request: InferenceRequest) -> None:
        self._queue.put_nowait(request)

    async def next_batch(self) -> list[InferenceRequest]:
        request = await self._queue.get()
        return [] if drop_cancelled(request) else [request]

    def pending(self) -> int:
        return self._queue.qsize()
