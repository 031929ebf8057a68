"""The pass-through scheduler, for backends whose engine batches continuously (vLLM, TensorRT-LLM).

No queue and no batches: each request goes at once to an instance (round robin over the model's
instances) as one task that runs ``runtime.execute(slot, [request])`` to the request's end. The
instance's ``execute`` awaits the whole generation and answers through the request's
ResponseSender, so the statistics' compute time covers the request from its start to its last
response. The engine's own waiting count, when the model knows it (``Model.waiting_requests``), is
the model's pending count.

Admission: the config parameter ``max_queue_size`` (as TensorRT-LLM's Triton backend names it; 0 or
absent: no bound) bounds the requests waiting for the engine: those in flight beyond what the engine
runs at once (``Model.engine_capacity``, vLLM's ``max_num_seqs``; all of them when the model does not
say). A request past the bound is refused at once with :class:`~tideserve.errors.QueueFull` (503 with
``Retry-After``, gRPC UNAVAILABLE, counted as REJECTED), so a flood gets fast answers instead of
queueing without limit inside the engine.

Stopping: the repository drains a model (waits up to the unload or exit timeout for the requests in
flight) before it unloads it, so by :meth:`PassThroughScheduler.stop` that time is spent. ``stop``
waits at most ``stop_timeout_s`` more (requests whose end is already under way: an engine abort, a
last response), then cancels the tasks still running, each answered with UNAVAILABLE first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from ..errors import Cancelled, InternalError, InvalidArgument, QueueFull, Unavailable
from ..types import InferenceRequest
from .base import Scheduler, drop_cancelled, generation_request

if TYPE_CHECKING:
    from ..dataplane import GenerationStream
    from ..runtime import InstanceSlot, ModelRuntime

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 1.0
MAX_QUEUE_SIZE = "max_queue_size"  # the config parameter bounding the requests waiting for the engine


class PassThroughScheduler(Scheduler):
    """Runs every request at once, one task each; the backend's engine does the batching.

    ``stop_timeout_s``: how long :meth:`stop` waits, after the repository's drain, before it cancels
    the requests still running.
    """

    def __init__(self, runtime: ModelRuntime, stop_timeout_s: float = STOP_TIMEOUT_S) -> None:
        super().__init__(runtime)
        self.stop_timeout_s = stop_timeout_s
        self._next = 0
        # the requests' tasks, each with what answers it (a request's sender, a typed generation's stream): those it
        # starts and the typed generations DataPlane.generate starts for it
        self.running: dict[asyncio.Task, Any] = {}
        self.max_queue_size = queue_bound(runtime)

    async def start(self) -> None:  # no worker loop: nothing waits here
        if self.runtime.config.HasField("dynamic_batching"):
            log.info("model '%s': dynamic_batching is ignored, the backend's engine batches continuously",
                     self.runtime.name)

    def enqueue(self, request: InferenceRequest) -> None:
        if drop_cancelled(request):
            return
        if self.max_queue_size:
            self._admit()
        self._execute(request)

    def generate(self, stream: GenerationStream) -> None:
        """A typed LLM generation (its GenerationStream, the request): the model's own generation coroutine
        (``Model.generation``) as the request's task, with no instance ``execute`` around it; the statistics'
        execution and compute time are recorded when it ends, as ``execute`` records them."""
        if stream.is_cancelled():
            stream.send_error(Cancelled("request was cancelled before it ran"))
            return
        if self.max_queue_size:
            self._admit()
        coroutine = self.runtime.model.generation(stream)
        if coroutine is None:  # the model takes typed requests through execute: the request it needs
            self._execute(generation_request(stream))
            return
        if stream.trace is not None:
            stream.trace.compute = (time.monotonic_ns(), 0)
        task = asyncio.get_running_loop().create_task(coroutine)
        self.running[task] = stream
        task.add_done_callback(self._generated)

    def _generated(self, task: asyncio.Task) -> None:
        stream = self.running.pop(task, None)
        if stream is None:
            return
        end = time.monotonic_ns()
        stats = self.runtime.stats
        stats.record_queue(0, 1)
        stats.record_execution(1, 1, 0, end - stream.queue_start_ns, 0, 1)
        if stream.trace is not None:
            stream.trace.compute_done(end)
        if task.cancelled():
            stream.send_error(self._stopped_error())  # a no-op when the request is answered already
        elif (exc := task.exception()) is not None:
            log.error("model '%s': request generation failed", self.runtime.name, exc_info=exc)
            stream.send_error(InternalError(f"model '{self.runtime.name}' failed to run the request"))

    def _execute(self, request: InferenceRequest) -> None:
        slots = self.runtime.slots
        slot = slots[self._next % len(slots)]
        self._next += 1
        task = asyncio.get_running_loop().create_task(self._run(slot, request))
        self.running[task] = request.response_sender
        task.add_done_callback(self._finished)

    def _admit(self) -> None:
        """Refuse a request when ``max_queue_size`` requests already wait beyond the engine's capacity."""
        capacity = self.runtime.model.engine_capacity() or 0
        waiting = len(self.running) - capacity
        if waiting >= self.max_queue_size:
            raise QueueFull(f"model '{self.runtime.name}' is busy: {waiting} requests wait for its engine "
                            f"(max_queue_size {self.max_queue_size}); retry later or on another replica")

    def _finished(self, task: asyncio.Task) -> None:
        self.running.pop(task, None)

    async def _run(self, slot: InstanceSlot, request: InferenceRequest) -> None:
        sender = request.response_sender
        try:
            await self.runtime.execute(slot, [request])
        except asyncio.CancelledError:
            sender.send_error(self._stopped_error())  # a no-op when the request is answered already
            raise
        except Exception:  # the runtime answers a failing execute; this is what lies outside it
            log.exception("model '%s': request execution failed", self.runtime.name)
            sender.send_error(InternalError(f"model '{self.runtime.name}' failed to run the request"))

    def pending(self) -> int:
        """The engine's waiting requests when the model reports them; nothing waits in this scheduler."""
        return self.runtime.model.waiting_requests() or 0

    async def stop(self) -> None:
        """Wait up to ``stop_timeout_s`` for the running requests, then cancel the rest, each answered
        with UNAVAILABLE. The repository has already drained the model with its own timeout."""
        if not self.running:
            return
        _, late = await asyncio.wait(list(self.running), timeout=self.stop_timeout_s)
        late = [task for task in late if not task.done()]
        if not late:
            return
        log.warning("model '%s' version %s: cancelling %d request(s) still running at unload",
                    self.runtime.name, self.runtime.version, len(late))
        error = self._stopped_error()
        for task in late:
            sender = self.running.get(task)
            if sender is not None:
                sender.send_error(error)
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)

    def _stopped_error(self) -> Unavailable:
        return Unavailable(f"model '{self.runtime.name}' version {self.runtime.version} was unloaded "
                           f"before the request finished")


def queue_bound(runtime: ModelRuntime) -> int:
    """The model's ``max_queue_size`` config parameter (0 when absent); InvalidArgument when not an integer >= 0."""
    param = runtime.config.parameters.get(MAX_QUEUE_SIZE)
    if param is None or not param.string_value.strip():
        return 0
    text = param.string_value.strip()
    try:
        bound = int(text)
    except ValueError:
        bound = -1
    if bound < 0:
        raise InvalidArgument(f"model '{runtime.name}': config parameter '{MAX_QUEUE_SIZE}' must be an integer "
                              f">= 0 (0: no bound), got '{text}'")
    return bound
