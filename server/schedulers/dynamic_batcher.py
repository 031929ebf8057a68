"""Triton's dynamic batcher: gathers queued requests into batches for idle instances.

A batch grows, highest priority level first and oldest request first, while the rows fit in
``max_batch_size`` and each request's non-batch shapes match the first one's (inputs with
``allow_ragged_batch`` may differ; those of the ``pad_batch_inputs`` parameter only in their rank).
It runs at once when it is full, reaches the largest ``preferred_batch_size`` or cannot grow;
otherwise it waits up to ``max_queue_delay_microseconds`` from its oldest request for more. Queue
policies reject or delay requests that wait too long.

An instance whose batches run on its own thread (``ModelRuntime.execute``'s hand-over, ONNX Runtime) takes its
next batch itself at the end of a run (:meth:`DynamicBatcher.take_ready`) when one is ready by the rules above
and no other instance waits for it: the thread goes on to it at once while the event loop answers the batch
that ended, instead of idling until the loop has answered, formed the batch and handed it over.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass

from tritonclient.grpc import model_config_pb2 as mc

from ..batching import padded_inputs
from ..errors import QueueFull, Unavailable
from ..loops import running_loop
from ..types import InferenceRequest
from .base import DELAY_SCHEDULER_ENV, OrderGate, Scheduler, drop_cancelled, held_until


@dataclass(slots=True)
class _Entry:
    request: InferenceRequest
    deadline_ns: int  # 0: no timeout
    delay_on_timeout: bool
    signature: tuple | None = None  # what requests batched together must share (see _signature)


class _Level:
    """One priority level's queue and its policy."""

    def __init__(self, policy: mc.ModelQueuePolicy) -> None:
        self.queue: collections.deque[_Entry] = collections.deque()
        self.max_size = policy.max_queue_size
        self.timeout_us = policy.default_timeout_microseconds
        self.delay_on_timeout = policy.timeout_action == mc.ModelQueuePolicy.DELAY
        self.allow_override = policy.allow_timeout_override

    def entry(self, request: InferenceRequest) -> _Entry:
        timeout_us = self.timeout_us
        if self.allow_override and request.timeout_us > 0:
            timeout_us = request.timeout_us
        deadline = request.queue_start_ns + timeout_us * 1000 if timeout_us > 0 else 0
        return _Entry(request, deadline, self.delay_on_timeout)


class DynamicBatcher(Scheduler):
    def __init__(self, runtime) -> None:
        super().__init__(runtime)
        config = runtime.config
        batching = config.dynamic_batching
        self.max_batch_size = config.max_batch_size
        self.preferred = sorted(set(batching.preferred_batch_size))
        self.delay_ns = batching.max_queue_delay_microseconds * 1000
        self.ragged = {t.name for t in config.input if t.allow_ragged_batch}
        self.padded = padded_inputs(config)  # these batch across lengths (zero-padded when the batch runs)
        levels = batching.priority_levels
        if levels:
            policies = batching.priority_queue_policy
            self.levels = {
                level: _Level(policies[level] if level in policies else batching.default_queue_policy)
                for level in range(1, levels + 1)}
            self.default_level = batching.default_priority_level
        else:
            self.levels = {0: _Level(batching.default_queue_policy)}
            self.default_level = 0
        self._order = sorted(self.levels)
        self._delayed: collections.deque[_Entry] = collections.deque()  # timed out with DELAY
        self._has_deadlines = any(level.timeout_us or level.allow_override for level in self.levels.values())
        self._waiter: asyncio.Future | None = None  # set while batch formation waits for a request or a timer
        self._form_lock = asyncio.Lock()
        # the queues' guard: an instance's thread takes a batch from them (take_ready) while the loop queues
        self._mutex = threading.RLock()
        self._stopped = False
        self._gate = OrderGate() if batching.preserve_ordering else None
        self._hold = held_until(DELAY_SCHEDULER_ENV)  # Triton's test hook: no batch until this many are queued
        # offers of instances that run a batch and can take the next full one (offer): the earliest first
        self._ahead: collections.deque = collections.deque()

    # -- queueing ------------------------------------------------------------------------
    def enqueue(self, request: InferenceRequest) -> None:
        level = self.levels.get(request.priority) if request.priority else None
        if level is None:
            level = self.levels[self.default_level]
        if level.max_size and len(level.queue) >= level.max_size:
            raise QueueFull(f"exceeds maximum queue size for model '{self.runtime.name}'")
        entry = level.entry(request)
        entry.signature = self._signature(request)
        with self._mutex:
            level.queue.append(entry)
        if entry.deadline_ns:  # expire it on time even while every instance is busy
            delay = (entry.deadline_ns - time.monotonic_ns()) / 1e9
            running_loop().call_later(max(delay, 0.0), self._on_deadline)
        self._wake()
        if self._ahead and len(level.queue) >= self.max_batch_size:  # (as _may_fill)
            self._fill_ahead()

    def _on_deadline(self) -> None:
        with self._mutex:
            self._expire(time.monotonic_ns())
        self._wake()

    def _wake(self) -> None:
        """Batch formation looks again (a request arrived or a deadline passed)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _sleep(self, timeout: float | None) -> None:
        """Until the next ``_wake`` or ``timeout`` seconds: a future and a timer, no task (the hot path)."""
        loop = running_loop()
        waiter = self._waiter = loop.create_future()
        timer = None if timeout is None else loop.call_later(timeout, _resolve, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def pending(self) -> int:
        return sum(len(level.queue) for level in self.levels.values()) + len(self._delayed)

    def _queues(self):
        for key in self._order:
            yield self.levels[key].queue
        yield self._delayed

    def _expire(self, now: int) -> None:
        """Answer cancelled requests; reject or demote the ones past their queue timeout."""
        for key in self._order:
            queue = self.levels[key].queue
            if not queue:
                continue
            for entry in queue:  # the usual case: nothing to drop, nothing to copy
                if (entry.deadline_ns and now >= entry.deadline_ns) or entry.request.is_cancelled():
                    break
            else:
                continue
            kept = collections.deque()
            for entry in queue:
                if drop_cancelled(entry.request):
                    continue
                if entry.deadline_ns and now >= entry.deadline_ns:
                    if entry.delay_on_timeout:
                        entry.deadline_ns = 0
                        self._delayed.append(entry)
                    else:
                        entry.request.response_sender.send_error(
                            Unavailable("request timeout expired while the request was queued"))
                    continue
                kept.append(entry)
            if len(kept) != len(queue):
                queue.clear()
                queue.extend(kept)
        if self._delayed and any(e.request.is_cancelled() for e in self._delayed):
            kept = collections.deque(e for e in self._delayed if not drop_cancelled(e.request))
            self._delayed.clear()
            self._delayed.extend(kept)

    def _next_deadline(self) -> int:
        deadlines = [e.deadline_ns for key in self._order for e in self.levels[key].queue if e.deadline_ns]
        return min(deadlines) if deadlines else 0

    # -- batch formation -----------------------------------------------------------------
    def _candidate(self) -> tuple[list[_Entry], int, bool]:
        """(entries that would form the batch, rows, whether the batch cannot grow further)."""
        picked: list[_Entry] = []
        rows = 0
        signature = None
        for queue in self._queues():
            for entry in queue:
                request = entry.request
                if rows + request.batch_size > self.max_batch_size:
                    return picked, rows, True
                entry_signature = entry.signature
                if signature is None:
                    signature = entry_signature
                elif entry_signature != signature:
                    return picked, rows, True
                picked.append(entry)
                rows += request.batch_size
                if rows == self.max_batch_size:
                    return picked, rows, True
        return picked, rows, False

    def _signature(self, request: InferenceRequest):
        ragged, padded = self.ragged, self.padded
        found = []
        for name, tensor in request.inputs.items():  # a loop, not a generator: this runs for every request
            shape = tensor.shape
            found.append((name, tensor.datatype,
                          None if name in ragged else len(shape) if name in padded
                          else shape[1:] if type(shape) is tuple else tuple(shape[1:])))
        if len(found) > 1:
            found.sort()
        return tuple(found)

    def _ready(self, picked: list[_Entry], rows: int, blocked: bool, now: int) -> bool:
        if blocked:
            return True
        if self.preferred and rows >= self.preferred[-1]:
            return True
        oldest = min(e.request.queue_start_ns for e in picked)
        return now >= oldest + self.delay_ns

    def _take(self, picked: list[_Entry]) -> list[InferenceRequest]:
        if len(self.levels) == 1 and not self._delayed:  # one queue: the picked entries are its first ones
            popleft = self.levels[self._order[0]].queue.popleft
            for _ in picked:
                popleft()
            return [e.request for e in picked]
        chosen = {id(e) for e in picked}
        for queue in self._queues():
            while queue and id(queue[0]) in chosen:
                queue.popleft()
            if any(id(e) in chosen for e in queue):  # picked entries are always a queue prefix
                kept = [e for e in queue if id(e) not in chosen]
                queue.clear()
                queue.extend(kept)
        return [e.request for e in picked]

    async def next_batch(self) -> list[InferenceRequest]:
        async with self._form_lock:
            while self._hold:
                if self.pending() >= self._hold:
                    self._hold = 0
                    break
                await self._sleep(None)
            while True:
                with self._mutex:
                    now = time.monotonic_ns()
                    self._expire(now)
                    picked, rows, blocked = self._candidate()
                    if picked and self._ready(picked, rows, blocked, now):
                        batch = self._take(picked)
                        if self._gate is not None:
                            self._gate.admit(batch)
                        return batch
                    wait_until = 0
                    if picked:
                        wait_until = min(e.request.queue_start_ns for e in picked) + self.delay_ns
                    if self._has_deadlines:
                        deadline = self._next_deadline()
                        if deadline and (not wait_until or deadline < wait_until):
                            wait_until = deadline
                await self._sleep(max(0.0, (wait_until - now) / 1e9) if wait_until else None)

    def take_full(self) -> list[InferenceRequest] | None:
        """A batch that is ready and cannot grow (full, or the next queued request cannot join it), for an instance that
        runs one now and starts this one as soon as that one ends (:meth:`ModelInstance.submit`): with every instance
        busy, waiting could not change what the batch holds, only when it starts. None as :meth:`take_ready`."""
        return self.take_ready(full=True)

    def offer(self, send) -> None:
        """``send(batch)`` takes the next full batch (:meth:`take_full`) while its instance runs one: called at
        once if one is there, else when a request fills one, unless an instance takes it first; once."""
        if self._may_fill():
            batch = self.take_full()
            if batch:
                send(batch)
                return
        self._ahead.append(send)

    def _may_fill(self) -> bool:
        """Whether some queue holds at least ``max_batch_size`` requests: a full batch's rows at the least (a
        cheap test before :meth:`take_full`; a full batch of multi-row requests in fewer waits for a free instance)."""
        for level in self.levels.values():
            if len(level.queue) >= self.max_batch_size:
                return True
        return False

    def withdraw(self, send) -> None:
        """An offer (:meth:`offer`) not taken up, withdrawn (its instance's run ended)."""
        try:
            self._ahead.remove(send)
        except ValueError:
            pass

    def _fill_ahead(self) -> None:
        while self._ahead:
            batch = self.take_full()
            if not batch:
                return
            self._ahead.popleft()(batch)

    def take_ready(self, full: bool = False) -> list[InferenceRequest] | None:
        """The next batch for an instance's thread whose run just ended (any thread): the batch
        :meth:`next_batch` would form now, if it is ready now and no instance's worker waits in ``next_batch`` for
        one (an idle instance takes it there). None leaves the batching to the workers: none ready, an idle
        instance, a request cancelled or with a queue timeout among the picked (the loop answers those),
        ``preserve_ordering``, the scheduler's test hook, or the scheduler stopped."""
        if self._stopped or self._hold or self._gate is not None or self._form_lock.locked():
            return None
        with self._mutex:
            if self._form_lock.locked():
                return None
            picked, rows, blocked = self._candidate()
            if not picked or (not blocked if full else not self._ready(picked, rows, blocked, time.monotonic_ns())):
                return None
            for entry in picked:
                if entry.deadline_ns or entry.request.is_cancelled():
                    return None
            return self._take(picked)

    async def stop(self) -> None:
        self._stopped = True
        await super().stop()


def _resolve(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)
