"""One ensemble request flowing through its steps.

Tensors live in *contexts*. The root context holds the ensemble's inputs and what steps compute
from them once. Every response of a decoupled step opens a child context holding that response's
tensors; the steps downstream of the stream run once in each child, reading the rest of their
inputs from the enclosing contexts. A step runs as soon as all its inputs exist in a context, so
independent steps run in parallel and a stream's responses flow on one by one, as they arrive.

Requests made from a stream carry the sequence parameters (see :mod:`ensembles`): ``sequence_id``
(the upstream step request's id, unique in the server), ``sequence_start`` on the first response
of the upstream request and ``sequence_end`` on its final one. A bare FINAL flag (no tensors) opens
an *end marker* context where the stream's tensors are absent: a downstream step runs there only
if every input it misses is optional, so a stateful step that declares them optional still sees
``sequence_end``.

All of this runs on the event loop: each step request has a reader task, the rest is callbacks.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from tideserve.backend_api import (
    Cancelled,
    InferenceRequest,
    InferenceResponse,
    InternalError,
    RequestedOutput,
    ServerError,
    Status,
    Tensor,
    conform_shape,
)

from .plan import Label, Step

if TYPE_CHECKING:
    from tideserve.backend_api import InferStream

    from .scheduler import EnsembleScheduler


log = logging.getLogger(__name__)


class _Absent:
    """A tensor known not to come (an omitted optional input, an output a model did not send)."""

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT: Any = _Absent()


class Context:
    """Tensors of one stream position: the root (the request), or one response of a decoupled step."""

    __slots__ = ("batches", "children", "emitted", "end_marker", "fired", "label", "parameters", "parent",
                 "sequence", "tensors")

    def __init__(self, label: Label, parent: Context | None, sequence: dict | None = None,
                 end_marker: bool = False) -> None:
        self.label = label
        self.parent = parent
        self.tensors: dict[str, Tensor | _Absent] = {}
        self.batches: dict[str, int] = {}  # tensor -> the batch it was made in (0: by no batch), as Triton keeps it
        self.parameters: dict[str, Any] = {}  # of the step responses whose tensors are here
        self.children: list[Context] = []
        self.fired: set[int] = set()  # steps already run (or skipped) here
        self.emitted = False  # the ensemble response of this context went out
        self.sequence = sequence  # the sequence parameters of requests made here
        self.end_marker = end_marker

    def lookup(self, tensor: str):
        context = self
        while context is not None:
            value = context.tensors.get(tensor)
            if value is not None:
                return value
            context = context.parent
        return None

    def batch_of(self, tensor: str) -> int:
        context = self
        while context is not None:
            batch = context.batches.get(tensor)
            if batch is not None:
                return batch
            context = context.parent
        return 0

    def within(self, label: Label):
        """This context and its descendants of stream ``label``."""
        stack = [self]
        while stack:
            context = stack.pop()
            if context.label == label:
                yield context
            else:
                stack.extend(context.children)

    def merged_parameters(self) -> dict[str, Any]:
        chain = []
        context = self
        while context is not None:
            chain.append(context.parameters)
            context = context.parent
        merged: dict[str, Any] = {}
        for parameters in reversed(chain):
            merged.update(parameters)
        return merged


class EnsembleRun:
    def __init__(self, scheduler: EnsembleScheduler, request: InferenceRequest) -> None:
        self.scheduler = scheduler
        self.plan = scheduler.plan
        self.request = request
        self.sender = request.response_sender
        self.wanted = tuple(request.requested_output_names()) or self.plan.outputs
        self.output_label = self.plan.label_of(self.wanted)
        self.root = Context(None, None)
        self.active = 0  # step requests started or waiting for a slot and not finished
        self.readers: set[asyncio.Task] = set()
        self.waiting: dict[int, collections.deque] = {}  # step -> requests waiting for a slot
        self.dispatchers: dict[int, asyncio.Task] = {}
        self.outbox: list[InferenceResponse] = []  # ensemble responses made by the current event
        self.held: list[InferenceResponse] = []  # a non-decoupled ensemble answers once, at the end
        self.closed = False
        self.started_ns = 0
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        if self.closed:
            return
        request = self.request
        self.started_ns = time.monotonic_ns()
        self.scheduler.runtime.stats.record_queue(self.started_ns - request.queue_start_ns)
        request.cancellation.add_callback(self._on_cancel)
        if self.closed:  # it was cancelled already
            return
        tensors = {name: request.inputs.get(name, ABSENT) for name in self.plan.inputs}
        self._add(self.root, tensors, {}, request.batch_size if self.plan.batching else 0)
        self._flush()

    def abort(self, error: ServerError) -> None:
        """End the request with ``error`` now and cancel every running step."""
        if self.closed:
            return
        self.closed = True
        self.sender.send_error(error)
        for task in (*self.readers, *self.dispatchers.values()):
            task.cancel()
        self.waiting.clear()
        self.scheduler.finished(self, ok=False)

    def _on_cancel(self) -> None:
        error = Cancelled("the ensemble request was cancelled")
        if threading.get_ident() == self._loop_thread:
            self.abort(error)
        else:
            self._loop.call_soon_threadsafe(self.abort, error)

    def _fail(self, step: Step, error: ServerError) -> None:
        if self.closed:
            return
        log.debug("ensemble '%s': %s failed: %s", self.plan.name, step.describe(), error.message)
        # Triton's words: the ensemble's name, then the step's own message
        self.abort(ServerError(f"in ensemble '{self.plan.name}', {error.message}", error.status))

    def _flush(self) -> None:
        """Send what the last event produced; finish when no step request is left."""
        if self.closed:
            return
        done = self.active == 0
        outbox, self.outbox = self.outbox, []
        if self.plan.decoupled:
            for position, response in enumerate(outbox):
                self.sender.send(response, final=done and position == len(outbox) - 1)
            if done and not outbox:
                self.sender.send(None, final=True)
        else:
            self.held.extend(outbox)
            if done and len(self.held) != 1:
                self.abort(InternalError(f"ensemble '{self.plan.name}' made {len(self.held)} responses for one "
                                         f"request from the requested outputs {list(self.wanted)}"))
                return
            if done:
                self.sender.send(self.held[0], final=True)
        if done:
            self.closed = True
            self.scheduler.finished(self, ok=True)

    # -- data flow -------------------------------------------------------------------------------
    def _add(self, context: Context, tensors: dict[str, Any], parameters: dict[str, Any], batch: int = 0) -> None:
        """Put ``tensors`` (made in a batch of ``batch``) in ``context``, run the steps that became ready,
        collect the response."""
        context.tensors.update(tensors)
        context.batches.update(dict.fromkeys(tensors, batch))
        context.parameters.update(parameters)
        ready = sorted({i for name in tensors for i in self.plan.consumers.get(name, ())})
        for index in ready:
            step = self.plan.steps[index]
            for target in list(context.within(step.label)):
                if index not in target.fired and not self.closed:
                    self._try_step(step, target)
        if not self.closed and any(name in tensors for name in self.wanted):
            for target in list(context.within(self.output_label)):
                self._try_emit(target)

    def _try_step(self, step: Step, context: Context) -> None:
        inputs: dict[str, Tensor] = {}
        for model_input, tensor in step.inputs.items():
            value = context.lookup(tensor)
            if value is None:
                return  # not yet
            if value is ABSENT:
                if context.end_marker and model_input not in step.optional:
                    context.fired.add(step.index)  # nothing to send it: skip it, and what it would write
                    if not step.decoupled:
                        self._add(context, dict.fromkeys(step.outputs.values(), ABSENT), {})
                    return
                continue  # omitted: optional, or the model will say it is missing (as in Triton)
            inputs[model_input] = _conformed(model_input, value, step.input_dims.get(model_input, ()), step.batching,
                                             context.batch_of(tensor))
        context.fired.add(step.index)
        self._submit(step, context, inputs)

    def _try_emit(self, context: Context) -> None:
        if context.emitted:
            return
        values = {}
        for name in self.wanted:
            value = context.lookup(name)
            if value is None:
                return
            values[name] = value
        context.emitted = True
        plan = self.plan
        outputs = [_conformed(name, t, plan.output_dims.get(name, ()), plan.batching, context.batch_of(name),
                              dict(t.parameters))
                   for name, t in values.items() if t is not ABSENT]
        if outputs:
            self.outbox.append(InferenceResponse(outputs=outputs, parameters=context.merged_parameters()))

    # -- step requests ---------------------------------------------------------------------------
    def _submit(self, step: Step, context: Context, inputs: dict[str, Tensor]) -> None:
        parent = self.request
        parameters = dict(parent.parameters)
        if context.sequence is not None:
            parameters.update(context.sequence)
        request = InferenceRequest(
            step.model_name, inputs, model_version=step.version, id=parent.id,
            outputs=[RequestedOutput(name) for name in step.outputs], parameters=parameters,
            priority=parent.priority, timeout_us=parent.timeout_us)
        request.streaming = parent.streaming
        request.trace_context = parent.trace  # a traced ensemble request traces its steps under it
        self.active += 1
        limiter = self.scheduler.limiters.get(step.index)
        if limiter is None:
            self._start(step, context, request, None)
            return
        self.waiting.setdefault(step.index, collections.deque()).append((context, request))
        if step.index not in self.dispatchers:
            self.dispatchers[step.index] = asyncio.get_running_loop().create_task(
                self._dispatch(step, limiter), name=f"{self.plan.name}-step{step.index}-dispatch")

    async def _dispatch(self, step: Step, limiter: asyncio.Semaphore) -> None:
        """Start the step's waiting requests in order, each once ``max_inflight_requests`` allows."""
        queue = self.waiting[step.index]
        try:
            while queue and not self.closed:
                await limiter.acquire()
                if self.closed or not queue:
                    limiter.release()
                    return
                context, request = queue.popleft()
                self._start(step, context, request, limiter)
                self._flush()
        finally:
            self.dispatchers.pop(step.index, None)

    def _start(self, step: Step, context: Context, request: InferenceRequest,
               limiter: asyncio.Semaphore | None) -> None:
        try:
            stream = self.scheduler.infer(request)
        except ServerError as exc:
            self.active -= 1
            if limiter is not None:
                limiter.release()
            self._fail(step, exc)
            return
        task = asyncio.get_running_loop().create_task(
            self._read(step, context, stream, limiter), name=f"{self.plan.name}-step{step.index}")
        self.readers.add(task)
        task.add_done_callback(self.readers.discard)

    async def _read(self, step: Step, context: Context, stream: InferStream,
                    limiter: asyncio.Semaphore | None) -> None:
        finished = False
        sent = 0  # responses with tensors so far (for sequence_start)
        try:
            async for response in stream:
                if response.final:
                    finished = True
                    self.active -= 1
                    if limiter is not None:
                        limiter.release()
                if not self.closed:
                    self._on_response(step, context, stream.request, response, sent)
                    self._flush()
                if not response.empty:
                    sent += 1
        except asyncio.CancelledError:
            stream.cancel()  # also when cancelled before the first read
            raise
        finally:
            if not finished:
                self.active -= 1
                if limiter is not None:
                    limiter.release()

    def _on_response(self, step: Step, context: Context, request: InferenceRequest,
                     response: InferenceResponse, sent: int) -> None:
        if response.error is not None:
            if response.error.status is Status.CANCELLED and self.request.is_cancelled():
                return
            self._fail(step, response.error)
            return
        tensors = {tensor: ABSENT for tensor in step.outputs.values()}
        batch = request.batch_size if step.batching else 0
        if not response.empty:
            for model_output, tensor in step.outputs.items():
                found = response.output(model_output)
                if found is not None:
                    tensors[tensor] = Tensor(tensor, found.datatype, found.shape, found.data, found.parameters)
        if not step.decoupled:
            self._add(context, tensors, response.parameters, batch)
            return
        if response.empty and sent == 0:
            return  # the stream ended without a response: no sequence was started downstream
        sequence = {"sequence_id": request.internal_id, "sequence_start": sent == 0,
                    "sequence_end": response.final}
        child = Context(step.index, context, sequence, end_marker=response.empty)
        context.children.append(child)
        self._add(child, tensors, response.parameters, batch)


def _conformed(name: str, value: Tensor, dims: tuple[int, ...], batching: bool, batch: int,
               parameters: dict | None = None) -> Tensor:
    """``value`` as tensor ``name``, shaped for a model that declares it ``dims`` (Triton's rule: a tensor
    made without a batch gains one for a batching model, a batch of 1 loses it for a model that does not batch)."""
    shape = conform_shape(tuple(value.shape), dims, batching, batch)
    data = value.data
    if shape != tuple(value.shape) and data is not None:
        data = data.reshape(shape)
    return Tensor(name, value.datatype, shape, data, {} if parameters is None else parameters)
