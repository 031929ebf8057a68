"""Scheduler interface and the worker loop shared by the built-in schedulers."""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import re
import threading
from functools import partial
from typing import TYPE_CHECKING

from ..errors import Cancelled, ServerError
from ..types import InferenceRequest, InferenceResponse

if TYPE_CHECKING:
    from ..dataplane import GenerationStream
    from ..runtime import InstanceSlot, ModelRuntime

log = logging.getLogger(__name__)

# Triton's scheduler test hooks: a batcher starts only once this many requests are queued (its first batch
# then holds exactly what the test sent), and the sequence batcher also waits for this many backlogged requests.
DELAY_SCHEDULER_ENV = "TRITONSERVER_DELAY_SCHEDULER"
BACKLOG_DELAY_SCHEDULER_ENV = "TRITONSERVER_BACKLOG_DELAY_SCHEDULER"


def held_until(variable: str) -> int:
    """The request count a test hook asks a batcher to wait for (0: none), read as Triton reads it (atoi)."""
    match = re.match(r"\s*([+-]?\d+)", os.environ.get(variable, ""))
    count = max(int(match.group(1)), 0) if match else 0
    if count:
        log.info("%s: delaying the scheduler until %d requests are queued", variable, count)
    return count


class Scheduler:
    """Takes requests of one model version and runs them on its instances."""

    def __init__(self, runtime: "ModelRuntime") -> None:
        self.runtime = runtime
        self._workers: list[asyncio.Task] = []

    def enqueue(self, request: InferenceRequest) -> None:
        """Queue ``request``; raise a ServerError to reject it at once."""
        raise NotImplementedError

    def generate(self, stream: GenerationStream) -> None:
        """Start a typed LLM generation (``DataPlane.generate``; its GenerationStream is the request): scheduled as
        any request here, as the InferenceRequest the queue takes; the pass-through scheduler runs the model's own
        generation coroutine instead."""
        self.enqueue(generation_request(stream))

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

    def requeue(self, batch: list[InferenceRequest]) -> list[InferenceRequest]:
        """Put back a batch its instance cannot take now (``ModelInstance.hold``), for another instance; returns
        what could not go back (a full queue), which the instance runs when it is free again."""
        for i, request in enumerate(batch):
            try:
                self.enqueue(request)
            except ServerError:
                return batch[i:]
        return []

    async def _work(self, slot: "InstanceSlot") -> None:
        instance = slot.instance
        while True:
            if instance.hold is not None:
                await instance.hold.wait()
                continue
            batch = await self.next_batch()
            if instance.hold is not None and batch:  # it became busy while this worker waited for the batch
                batch = self.requeue(batch)
                if batch:
                    await instance.hold.wait()
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


def generation_request(stream: GenerationStream) -> InferenceRequest:
    """A typed generation as the InferenceRequest a scheduler's queue and a model's ``execute`` take: answered
    through the stream, cancelled with it."""
    request = InferenceRequest(stream.model_name, {}, model_version=stream.model_version, id=stream.id,
                               priority=stream.priority, timeout_us=stream.timeout_us, generation=stream.generation)
    request.arrival_ns = stream.arrival_ns
    request.queue_start_ns = stream.queue_start_ns
    request.trace = stream.trace
    request.response_sender = stream
    stream.on_cancel(request.cancellation.cancel)
    return request


def drop_cancelled(request: InferenceRequest) -> bool:
    """Answer a request cancelled while queued; True if it was."""
    if request.is_cancelled():
        request.response_sender.send_error(Cancelled("request was cancelled before it ran"))
        return True
    return False


class OrderGate:
    """``preserve_ordering``: hold each request's responses until every earlier request is done."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: collections.deque[list] = collections.deque()  # [buffer, done, sink]

    def admit(self, requests: list[InferenceRequest]) -> None:
        with self._lock:
            for request in requests:
                sender = request.response_sender
                entry = [[], False, sender._sink]
                sender._sink = partial(self._on_response, entry)
                self._entries.append(entry)

    def _on_response(self, entry: list, response: InferenceResponse) -> None:
        with self._lock:
            entry[0].append(response)
            if response.final:
                entry[1] = True
            while self._entries:
                head = self._entries[0]
                buffer, done, sink = head
                for item in buffer:
                    sink(item)
                buffer.clear()
                if not done:
                    break
                self._entries.popleft()
