"""Triton's sequence batcher: every request of a sequence (one correlation id) runs on the same
instance, in order, with control tensors that tell the model where the sequence stands, and with
the sequence's implicit state carried from one request to the next.

Each instance has a number of sequence slots: ``max(1, max_batch_size)``, or with the ``oldest``
strategy ``max_candidate_sequences`` when set. A START request takes the lowest free slot (or
waits in the backlog until one frees); later requests of the sequence go to its slot; the slot
frees once the END request has run, or when the sequence has been idle for
``max_sequence_idle_microseconds`` (default 1 s), after which a request without START for that id
is refused, as is a first request without START. A backlogged sequence whose requests carry a timeout
is rejected as a whole once the earliest of them expires ("timeout of the corresponding sequence has
been expired"); a sequence holding a slot is never timed out.

* ``direct``: a batch has one row per slot up to the highest slot with a ready request; a slot runs
  its next request at its row when that request (and its implicit state) has the shapes of the lowest
  ready slot's request, except for inputs with ``allow_ragged_batch``. Every other row is padding: a
  copy of that lowest request whose READY (and START / END) controls are false; padding rows count in
  the batch size of the batch statistics but are not inferences. With ``max_queue_delay_microseconds``
  and ``minimum_slot_utilization`` it waits for a fuller batch, up to the delay.
* ``oldest``: the oldest ready request of each candidate sequence, up to ``max_batch_size`` of them
  (batched as the dynamic batcher does: ``preferred_batch_size``, ``max_queue_delay_microseconds``);
  no padding. With ``preserve_ordering`` each instance answers its requests in the order they reached
  its slots.

Triton's test hooks ``TRITONSERVER_DELAY_SCHEDULER`` and ``TRITONSERVER_BACKLOG_DELAY_SCHEDULER``
hold each instance's first batch until that many requests are queued in the slots of all instances
(``oldest``: sequences ready on the instance) and in the backlog.

Implicit state (``state`` entries): before a request runs, its ``input_name`` tensor is the
``output_name`` tensor the model produced for the previous request of the sequence (the initial
state on START); the state output is taken out of the response unless the client asked for it.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import logging
import time

import numpy as np

from ..datatypes import numpy_dtype
from ..errors import Cancelled, InvalidArgument, Unavailable
from ..responses import ResponseSender
from ..types import InferenceRequest, InferenceResponse, RequestedOutput, Tensor
from .base import BACKLOG_DELAY_SCHEDULER_ENV, DELAY_SCHEDULER_ENV, OrderGate, Scheduler, held_until
from .sequence_config import read_sequence_config

log = logging.getLogger(__name__)

DEFAULT_IDLE_US = 1_000_000  # Triton's default max_sequence_idle_microseconds
HOLD_POLL_S = 0.01  # how often a held batcher looks at the queues again (Triton: 10 ms)


class _Sequence:
    """One correlation id's requests, its slot and its implicit state."""

    __slots__ = ("corrid", "queue", "batcher", "slot", "last_ns", "state", "running", "expires_ns")

    def __init__(self, corrid: int | str) -> None:
        self.corrid = corrid
        self.queue: collections.deque[InferenceRequest] = collections.deque()
        self.batcher: _InstanceBatcher | None = None  # None while in the backlog
        self.slot = -1
        self.last_ns = time.monotonic_ns()
        self.state: dict[str, np.ndarray] | None = None
        self.running = False
        self.expires_ns = 0  # while backlogged: when the earliest request timeout expires (0: never)


class _InstanceBatcher:
    """The sequence slots of one instance and the loop that runs its batches."""

    def __init__(self, index: int, instance_slot, slot_count: int, preserve_ordering: bool) -> None:
        self.index = index
        self.instance_slot = instance_slot
        self.slots: list[_Sequence | None] = [None] * slot_count
        self.wake = asyncio.Event()
        self.gate = OrderGate() if preserve_ordering else None
        self.hold = held_until(DELAY_SCHEDULER_ENV)  # test hook: requests to wait for before the first batch


class SequenceBatcher(Scheduler):
    def __init__(self, runtime) -> None:
        super().__init__(runtime)
        config = runtime.config
        ctx = runtime.ctx
        self.controls, self.states = read_sequence_config(config, ctx.model_path, ctx.check_file)
        batching = config.sequence_batching
        self.idle_ns = (batching.max_sequence_idle_microseconds or DEFAULT_IDLE_US) * 1000
        self.max_batch_size = max(1, config.max_batch_size)
        self.oldest = batching.HasField("oldest")
        slots = self.max_batch_size
        preserve_ordering = False
        if self.oldest:
            strategy = batching.oldest
            preserve_ordering = strategy.preserve_ordering
            if strategy.max_candidate_sequences > 0:
                slots = strategy.max_candidate_sequences
            self.delay_ns = strategy.max_queue_delay_microseconds * 1000
            self.preferred = max(strategy.preferred_batch_size, default=self.max_batch_size)
            self.min_utilization = 0.0
        else:
            self.delay_ns = batching.direct.max_queue_delay_microseconds * 1000
            self.min_utilization = batching.direct.minimum_slot_utilization
            self.preferred = self.max_batch_size
        self.batchers = [_InstanceBatcher(i, s, slots, preserve_ordering) for i, s in enumerate(runtime.slots)]
        self._free = [(slot, b.index) for b in self.batchers for slot in range(slots)]
        heapq.heapify(self._free)  # lowest slot first, spreading sequences over the instances
        self.sequences: dict[int | str, _Sequence] = {}
        self._backlog: collections.deque[_Sequence] = collections.deque()
        self._by_output = {s.output_name: s for s in self.states}
        self._config_outputs = {t.name for t in config.output}
        self._ragged = {t.name for t in config.input if t.allow_ragged_batch}
        self._reaper_wake = asyncio.Event()
        self._backlog_hold = held_until(BACKLOG_DELAY_SCHEDULER_ENV)
        self._held_counts: dict[int, int] = {}  # requests each held instance saw queued when it last looked
        self._hold_met = False  # the delay hooks' counts were reached: every instance may run

    # -- admission -----------------------------------------------------------------------
    def enqueue(self, request: InferenceRequest) -> None:
        model = self.runtime.name
        if request.batch_size > 1:
            raise InvalidArgument(f"inference request to model '{model}' must specify batch-size 1 due to "
                                  "requirements of sequence batcher")
        params = request.parameters
        corrid = params.get("sequence_id", 0)
        if corrid == 0 or corrid == "" or not isinstance(corrid, (int, str)):
            raise InvalidArgument(f"inference request to model '{model}' must specify a non-zero or non-empty "
                                  "correlation ID")
        self.controls.check_corrid(corrid, model)
        start = bool(params.get("sequence_start"))
        sequence = self.sequences.get(corrid)
        if sequence is None:
            if not start:
                raise InvalidArgument(f"inference request for sequence {corrid} to model '{model}' must specify "
                                      "the START flag on the first request of the sequence")
            sequence = self.sequences[corrid] = _Sequence(corrid)
            self._assign(sequence)
            self._reaper_wake.set()
        elif start:
            log.warning("sequence %s for model '%s' has a conflict: the previous sequence did not end before this "
                        "sequence start; the previous sequence ends early", corrid, model)
        sequence.queue.append(request)
        now = sequence.last_ns = time.monotonic_ns()
        if params.get("sequence_end"):
            del self.sequences[corrid]  # a later request for this id must start a new sequence
        if sequence.batcher is not None:
            if sequence.batcher.gate is not None:
                sequence.batcher.gate.admit([request])
            sequence.batcher.wake.set()
        elif request.timeout_us > 0:  # only a backlogged sequence times out
            expires = now + request.timeout_us * 1000
            if not sequence.expires_ns or expires < sequence.expires_ns:
                sequence.expires_ns = expires
                self._reaper_wake.set()

    def _assign(self, sequence: _Sequence) -> None:
        if not self._free:
            self._backlog.append(sequence)
            return
        slot, index = heapq.heappop(self._free)
        batcher = self.batchers[index]
        batcher.slots[slot] = sequence
        sequence.batcher, sequence.slot = batcher, slot
        sequence.state = None
        sequence.expires_ns = 0
        if batcher.gate is not None and sequence.queue:  # a backlogged sequence's requests reach the instance
            batcher.gate.admit(list(sequence.queue))

    def _release(self, sequence: _Sequence) -> None:
        """Free the sequence's slot for the oldest backlogged sequence, or for a future one."""
        batcher, slot = sequence.batcher, sequence.slot
        if batcher is None or batcher.slots[slot] is not sequence:
            return
        batcher.slots[slot] = None
        sequence.batcher, sequence.state = None, None
        if self.sequences.get(sequence.corrid) is sequence:
            del self.sequences[sequence.corrid]
        heapq.heappush(self._free, (slot, batcher.index))
        if self._backlog:
            waiting = self._backlog.popleft()
            self._assign(waiting)
            waiting.batcher.wake.set()

    def pending(self) -> int:
        queued = sum(len(s.queue) for b in self.batchers for s in b.slots if s is not None)
        return queued + sum(len(s.queue) for s in self._backlog)

    # -- workers -------------------------------------------------------------------------
    async def start(self) -> None:
        self._workers = [asyncio.create_task(self._serve(b), name=f"{b.instance_slot.instance.ctx.name}-sequences")
                         for b in self.batchers]
        self._workers.append(asyncio.create_task(self._reap(), name=f"{self.runtime.name}-sequence-reaper"))

    async def stop(self) -> None:
        await super().stop()
        error = Unavailable(f"model '{self.runtime.name}' is unloading")
        for sequence in [s for b in self.batchers for s in b.slots if s is not None] + list(self._backlog):
            while sequence.queue:
                sequence.queue.popleft().response_sender.send_error(error)

    async def _serve(self, batcher: _InstanceBatcher) -> None:
        while True:
            rows = await self._next_batch(batcher)
            try:
                await self.runtime.execute(batcher.instance_slot, [request for _, request in rows])
            except Exception:  # keep the worker alive whatever happens
                log.exception("model '%s': sequence batch execution failed", self.runtime.name)
            finally:
                self._after(rows)

    def _after(self, rows: list[tuple[_Sequence | None, InferenceRequest]]) -> None:
        now = time.monotonic_ns()
        for sequence, request in rows:
            if sequence is None:
                continue
            sequence.running = False
            sequence.last_ns = now
            if request.parameters.get("sequence_end") and not sequence.queue:
                self._release(sequence)

    async def _next_batch(self, batcher: _InstanceBatcher) -> list[tuple[_Sequence | None, InferenceRequest]]:
        while True:
            batcher.wake.clear()
            if batcher.hold and self._held(batcher):
                await asyncio.sleep(HOLD_POLL_S)
                continue
            rows, wait_ns = self._form(batcher, time.monotonic_ns())
            if rows:
                return rows
            if not wait_ns:
                await batcher.wake.wait()
                continue
            try:
                await asyncio.wait_for(batcher.wake.wait(), wait_ns / 1e9)
            except asyncio.TimeoutError:
                pass

    def _held(self, batcher: _InstanceBatcher) -> bool:
        """Triton's delay hooks: True while this instance must not run its first batch yet."""
        if self.oldest:  # the instance's own queue: sequences with a request ready
            held = sum(1 for s in batcher.slots if s is not None and s.queue) < batcher.hold
        elif self._hold_met:  # another instance saw the counts reached (and may since have drained the backlog)
            held = False
        else:  # requests in the slots of every instance (as each last saw them), then in the backlog
            self._held_counts[batcher.index] = sum(len(s.queue) for s in batcher.slots if s is not None)
            held = sum(self._held_counts.values()) < batcher.hold
            if not held and self._backlog_hold:
                held = sum(len(s.queue) for s in self._backlog) < self._backlog_hold
            self._hold_met = not held
        if not held:
            batcher.hold = 0
        return held

    def _ready(self, batcher: _InstanceBatcher) -> list[_Sequence]:
        """Sequences of this instance with a request to run (cancelled sequences answered and freed)."""
        ready = []
        for sequence in batcher.slots:
            if sequence is None or not sequence.queue:
                continue
            if sequence.queue[0].is_cancelled():
                self._cancel(sequence)
                continue
            ready.append(sequence)
        return ready

    def _cancel(self, sequence: _Sequence) -> None:
        """A cancelled request cancels its sequence: every queued request is answered, the slot freed."""
        while sequence.queue:
            sequence.queue.popleft().response_sender.send_error(Cancelled("request was cancelled before it ran"))
        self._release(sequence)

    def _form(self, batcher: _InstanceBatcher, now: int) -> tuple[list, int]:
        """(rows of the batch to run now, or [] and how long to wait for more)."""
        ready = self._ready(batcher)
        if not ready:
            return [], 0
        if self.oldest:
            return self._form_oldest(ready, now)
        return self._form_direct(ready, now)

    def _form_oldest(self, ready: list[_Sequence], now: int) -> tuple[list, int]:
        ready.sort(key=lambda s: s.queue[0].queue_start_ns)
        signature = self._row_signature(ready[0])
        chosen = [s for s in ready if s is ready[0] or self._row_signature(s) == signature][:self.max_batch_size]
        full = len(chosen) >= self.preferred or len(chosen) < len(ready)
        if self.delay_ns and not full:
            oldest = chosen[0].queue[0].queue_start_ns
            if now < oldest + self.delay_ns:
                return [], oldest + self.delay_ns - now
        return [(s, self._prepare(s, s.queue.popleft())) for s in chosen], 0

    def _form_direct(self, ready: list[_Sequence], now: int) -> tuple[list, int]:
        """Rows 0 .. the highest ready slot; slots whose request does not batch with the lowest one's are padded."""
        underused = self.min_utilization > 0.0 and len(ready) / self.max_batch_size < self.min_utilization
        if self.delay_ns and underused:
            oldest = min(s.queue[0].queue_start_ns for s in ready)
            if now < oldest + self.delay_ns:
                return [], oldest + self.delay_ns - now
        signature = self._row_signature(ready[0])  # ready is in slot order
        chosen = [s for s in ready if s is ready[0] or self._row_signature(s) == signature]
        rows = [(s, self._prepare(s, s.queue.popleft())) for s in chosen]
        if self.max_batch_size == 1:
            return rows, 0
        by_slot = {sequence.slot: (sequence, request) for sequence, request in rows}
        template = rows[0][1]
        return [by_slot.get(slot) or (None, self._null_request(template)) for slot in range(ready[-1].slot + 1)], 0

    def _row_signature(self, sequence: _Sequence):
        """What must match for two sequences' next requests to share a batch: datatypes and the shapes of
        the inputs that do not allow ragged batching, the implicit state's included."""
        request = sequence.queue[0]
        signature = [(name, t.datatype, None if name in self._ragged else tuple(t.shape[1:]))
                     for name, t in request.inputs.items()]
        if self.states:
            starting = sequence.state is None or request.parameters.get("sequence_start")
            for spec in self.states:
                data = spec.initial if starting else sequence.state[spec.input_name]
                signature.append((spec.input_name, spec.datatype, tuple(data.shape[1:])))
        return tuple(sorted(signature))

    def _null_request(self, like: InferenceRequest) -> InferenceRequest:
        inputs = dict(like.inputs)
        for tensor in self.controls.tensors(False, False, False, 0 if self._int_corrid() else ""):
            inputs[tensor.name] = tensor
        request = InferenceRequest(like.model_name, inputs, model_version=like.model_version,
                                   outputs=list(like.outputs))
        request.response_sender = ResponseSender(request, _discard)
        return request

    def _int_corrid(self) -> bool:
        return self.controls.corrid is None or self.controls.corrid[1] != "BYTES"

    # -- one request ---------------------------------------------------------------------
    def _prepare(self, sequence: _Sequence, request: InferenceRequest) -> InferenceRequest:
        """Add the control and state inputs; take the next state out of the responses."""
        sequence.running = True
        params = request.parameters
        start = bool(params.get("sequence_start"))
        end = bool(params.get("sequence_end"))
        inputs = request.inputs
        for tensor in self.controls.tensors(start, end, True, sequence.corrid):
            inputs[tensor.name] = tensor
        if not self.states:
            return request
        if start or sequence.state is None:
            sequence.state = {s.input_name: s.initial for s in self.states}
        state = sequence.state
        for spec in self.states:
            data = state[spec.input_name]
            inputs[spec.input_name] = Tensor(spec.input_name, spec.datatype, tuple(data.shape), data)
        asked = {o.name for o in request.outputs}
        hidden = set()
        for spec in self.states:
            name = spec.output_name
            if name in asked:
                continue
            if request.outputs:  # the model (and the response's filter) must still see the state output
                request.outputs.append(RequestedOutput(name))
                hidden.add(name)
            elif name not in self._config_outputs:
                hidden.add(name)
        sender = request.response_sender
        sender._sink = _StateCapture(self._by_output, state, hidden, sender._sink)
        return request

    # -- idle sequences ------------------------------------------------------------------
    async def _reap(self) -> None:
        while True:
            self._reaper_wake.clear()
            now = time.monotonic_ns()
            wait_ns = self.idle_ns
            for sequence in list(self.sequences.values()):
                if sequence.batcher is None or sequence.running or sequence.queue:
                    continue
                left = sequence.last_ns + self.idle_ns - now
                if left <= 0:
                    log.info("model '%s': sequence %s was idle for longer than %d us and is released",
                             self.runtime.name, sequence.corrid, self.idle_ns // 1000)
                    self._release(sequence)
                else:
                    wait_ns = min(wait_ns, left)
            for sequence in [s for s in self._backlog if s.expires_ns]:
                left = sequence.expires_ns - now
                if left <= 0:
                    self._expire(sequence)
                else:
                    wait_ns = min(wait_ns, left)
            try:
                await asyncio.wait_for(self._reaper_wake.wait(), wait_ns / 1e9)
                await asyncio.sleep(0.01)  # coalesce the wakes of a burst of requests
            except asyncio.TimeoutError:
                pass


    def _expire(self, sequence: _Sequence) -> None:
        """A backlogged sequence whose request timeout passed: all its requests are rejected, its id forgotten."""
        self._backlog.remove(sequence)
        if self.sequences.get(sequence.corrid) is sequence:
            del self.sequences[sequence.corrid]
        error = Unavailable("timeout of the corresponding sequence has been expired")
        while sequence.queue:
            sequence.queue.popleft().response_sender.send_error(error)


class _StateCapture:
    """A response sink that keeps the state outputs as the sequence's next input state."""

    __slots__ = ("specs", "state", "hidden", "sink")

    def __init__(self, specs: dict, state: dict, hidden: set[str], sink) -> None:
        self.specs, self.state, self.hidden, self.sink = specs, state, hidden, sink

    def __call__(self, response: InferenceResponse) -> None:
        if response.outputs:
            kept = []
            for tensor in response.outputs:
                spec = self.specs.get(tensor.name)
                if spec is not None:
                    data = tensor.data
                    if spec.datatype == "BYTES":
                        data = np.array(data, dtype=np.object_, copy=True)
                    else:
                        data = np.array(data, dtype=numpy_dtype(spec.datatype), copy=True)
                    self.state[spec.input_name] = data
                    if tensor.name in self.hidden:
                        continue
                kept.append(tensor)
            response.outputs = kept
        self.sink(response)


def _discard(response: InferenceResponse) -> None:
    """Where the responses of padding rows go."""
