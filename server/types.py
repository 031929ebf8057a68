"""Protocol-free core types: tensors, requests, responses."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .datatypes import datatype_of
from .errors import ServerError
from .generation import GenerationDelta, GenerationRequest


@dataclass
class Tensor:
    """A named tensor. ``data`` is a numpy array; BYTES tensors are object arrays of ``bytes``."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: np.ndarray
    parameters: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_numpy(cls, name: str, array: np.ndarray, datatype: str | None = None) -> "Tensor":
        array = np.asarray(array)
        if array.dtype.kind in ("S", "U"):
            array = np.array([x.encode() if isinstance(x, str) else bytes(x) for x in array.ravel()],
                             dtype=np.object_).reshape(array.shape)
        return cls(name, datatype or datatype_of(array), tuple(array.shape), array)


@dataclass
class RequestedOutput:
    name: str
    parameters: dict[str, Any] = field(default_factory=dict)


class CancellationToken:
    """Cancellation flag with callbacks (backends may abort engine work on it); thread-safe.

    Made for every request, so it is cheap: a bool and a list behind one shared lock.
    """

    __slots__ = ("_cancelled", "_callbacks")
    _lock = threading.Lock()

    def __init__(self) -> None:
        self._cancelled = False
        self._callbacks: list[Callable[[], None]] | None = None

    def is_cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
            callbacks, self._callbacks = self._callbacks, None
        for callback in callbacks or ():
            callback()

    def add_callback(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on cancellation (at once if already cancelled)."""
        with self._lock:
            if not self._cancelled:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(callback)
                return
        callback()


request_ids = itertools.count(1)  # InferenceRequest.internal_id (and a typed generation's: DeltaStream)


class InferenceRequest:
    """One inference request as the core sees it, whatever protocol it came in on."""

    __slots__ = ("model_name", "model_version", "id", "inputs", "outputs", "parameters",
                 "priority", "timeout_us", "cancellation", "arrival_ns", "response_sender",
                 "internal_id", "batch_size", "queue_start_ns", "streaming", "trace_context", "trace",
                 "reschedule", "generation")

    def __init__(self, model_name: str, inputs: dict[str, Tensor], *, model_version: str = "",
                 id: str = "", outputs: list[RequestedOutput] | None = None,
                 parameters: dict[str, Any] | None = None, priority: int = 0,
                 timeout_us: int = 0, generation: GenerationRequest | None = None) -> None:
        self.model_name = model_name
        self.model_version = model_version
        self.id = id
        self.inputs = inputs
        self.outputs = outputs or []
        self.parameters = parameters or {}
        self.priority = priority
        self.timeout_us = timeout_us
        self.cancellation = CancellationToken()
        self.arrival_ns = time.monotonic_ns()
        self.response_sender = None  # set by the DataPlane before scheduling
        self.internal_id = next(request_ids)
        self.batch_size = 1          # set by validation: rows along the batch dimension
        self.queue_start_ns = 0
        # False when the client's protocol takes one response (HTTP infer, gRPC ModelInfer,
        # generate): backends that stream (LLMs) then send one response with the whole result.
        self.streaming = True
        # where this request's trace comes from: a client's W3C traceparent (str), or the traced request
        # of an ensemble step (its RequestTrace); None: none
        self.trace_context = None
        self.trace = None  # the request's own RequestTrace when it is traced (set by the DataPlane)
        # set by a backend during execute to have the request run again in a later batch (Triton's
        # TRITONSERVER_REQUEST_RELEASE_RESCHEDULE); only the sequence batcher of an iterative_sequence model does
        self.reschedule = False
        # a typed LLM request (no input tensors) for a model that takes them (tideserve.generation)
        self.generation = generation

    def is_cancelled(self) -> bool:
        return self.cancellation.is_cancelled()

    def requested_output_names(self) -> list[str]:
        return [o.name for o in self.outputs]


@dataclass
class InferenceResponse:
    """One response of a request's stream; ``final`` marks the last."""

    model_name: str = ""
    model_version: str = ""
    id: str = ""
    outputs: list[Tensor] = field(default_factory=list)
    parameters: dict[str, Any] = field(default_factory=dict)
    error: ServerError | None = None
    final: bool = True
    empty: bool = False  # a bare FINAL flag with no response content (decoupled models)
    generation: GenerationDelta | None = None  # the answer to a typed LLM request (tideserve.generation)

    def output(self, name: str) -> Tensor | None:
        for tensor in self.outputs:
            if tensor.name == name:
                return tensor
        return None
