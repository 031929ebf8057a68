"""``sequence_batching { iterative_sequence: true }``: the sequence batcher of a model that generates
iteratively, as Triton's iterative sequencer.

A request may come without a correlation id: it then starts a sequence of its own (an id is assigned
and START set, so the model sees both). While ``execute`` runs, the backend may mark a request
``reschedule`` (a Python model's ``request.set_release_flags(TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)``):
once the batch is done it goes back to its sequence's queue with neither START nor END, on the same
instance slot, and runs again in a later batch; its response sender stays open in between, so a decoupled
model streams across iterations. A request that is done (released without the flag) ends its sequence:
the slot frees for the next one.
"""

from __future__ import annotations

import itertools
import time

from ..types import InferenceRequest
from .sequence import SequenceBatcher, _Sequence, _StateCapture


class IterativeSequenceBatcher(SequenceBatcher):
    """The sequence batcher with Triton's iterative-sequence rules (see the module's docstring)."""

    def __init__(self, runtime) -> None:
        super().__init__(runtime)
        self._ids = itertools.count(1)

    def enqueue(self, request: InferenceRequest) -> None:
        params = request.parameters
        corrid = params.get("sequence_id", 0)
        if corrid == 0 or corrid == "":
            params["sequence_id"] = self._new_id()
            params["sequence_start"] = True
            params.pop("sequence_end", None)
        super().enqueue(request)

    def _new_id(self) -> int | str:
        """An id no sequence in flight uses (a string one when the model's CORRID control takes strings)."""
        while True:
            corrid = next(self._ids)
            if not self._int_corrid():
                corrid = str(corrid)
            if corrid not in self.sequences:
                return corrid

    def _after(self, rows: list[tuple[_Sequence | None, InferenceRequest]]) -> None:
        ended = []
        for sequence, request in rows:
            if sequence is None:
                continue
            if request.reschedule:  # (cancelled meanwhile: answered when it comes up again)
                self._requeue(sequence, request)
            elif not request.parameters.get("sequence_end"):
                ended.append(sequence)
        super()._after(rows)
        for sequence in ended:  # released for good: its sequence is over
            if not sequence.queue and not sequence.running:
                self._release(sequence)

    def _requeue(self, sequence: _Sequence, request: InferenceRequest) -> None:
        """Put a rescheduled request back at the end of its sequence's queue, as a middle request."""
        request.reschedule = False
        params = request.parameters
        params["sequence_start"] = False
        params.pop("sequence_end", None)
        sender = request.response_sender
        if isinstance(sender._sink, _StateCapture):  # wrapped again when it next runs
            sender._sink = sender._sink.sink
        request.queue_start_ns = time.monotonic_ns()
        sequence.queue.append(request)
        if sequence.batcher is not None:
            sequence.batcher.wake.set()
