"""``pb_utils.InferenceRequest`` / ``InferenceResponse`` / ``InferenceResponseSender``.

One InferenceRequest class serves both roles Triton gives it: the requests handed to ``execute``
(a thin view over the server's request) and the requests a model builds to call another model
(BLS), which :meth:`InferenceRequest.exec` / :meth:`InferenceRequest.async_exec` run through the
server's DataPlane.
"""

from __future__ import annotations

import json
import threading

from tideserve.backend_api import InferenceRequest as CoreRequest, RequestedOutput

from .errors import TritonModelException, to_server_error
from .response import InferenceResponse, check_parameters, check_tensors
from .tensor import Tensor

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2

# Request parameters the protocols reserve; Triton does not pass them on to the model.
_RESERVED_PARAMETERS = frozenset({"sequence_id", "sequence_start", "sequence_end", "priority", "timeout",
                                  "binary_data_output"})


class PreferredMemory:
    """Where BLS outputs should land; every tensor here lives in CPU memory, so this is advisory."""

    TRITONSERVER_MEMORY_GPU = 0
    TRITONSERVER_MEMORY_CPU = 1

    def __init__(self, preferred_memory_type: int = 1, preferred_device_id: int = 0) -> None:
        self.preferred_memory_type = preferred_memory_type
        self.preferred_device_id = preferred_device_id


TRITONSERVER_MEMORY_GPU = PreferredMemory.TRITONSERVER_MEMORY_GPU
TRITONSERVER_MEMORY_CPU = PreferredMemory.TRITONSERVER_MEMORY_CPU


class InferenceTrace:
    """Tracing is not supported: every request has an empty trace context."""

    def get_context(self) -> None:
        return None


class InferenceResponseSender:
    """Sends a request's responses: ``send(response=None, flags=0)``; the last one carries FINAL.

    A decoupled model sends any number of responses, then FINAL. A default-mode model sends exactly one
    response, FINAL with it or as a flag-only send afterwards (the response is held until then).
    """

    __slots__ = ("_closed", "_decoupled", "_held", "_lock", "_request", "_sent")

    def __init__(self, request: CoreRequest, decoupled: bool) -> None:
        self._request = request
        self._decoupled = decoupled
        self._lock = threading.Lock()
        self._closed = False
        self._sent = 0
        self._held: InferenceResponse | None = None

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if response is not None and not isinstance(response, InferenceResponse):
            raise TypeError(f"response must be a pb_utils.InferenceResponse, got {type(response).__name__}")
        if flags not in (0, TRITONSERVER_RESPONSE_COMPLETE_FINAL):
            raise TritonModelException(
                "Unable to send response. Unsupported flag provided: use 0 or TRITONSERVER_RESPONSE_COMPLETE_FINAL.")
        final = flags == TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if response is None and not final:
            raise TritonModelException(
                "Inference Response object must be provided when the response flags is set to zero.")
        with self._lock:
            self._update_state(response, final)
            if not self._decoupled:
                if not final:
                    self._held = response
                    return
                if response is None:
                    response, self._held = self._held, None
        sender = self._request.response_sender
        if response is None:
            sender.send(None, final=True)
        elif response._error is not None:
            if final:
                sender.send_error(to_server_error(response._error))
            else:
                sender.send(response._core(), final=False)
        else:
            sender.send(response._core(), final=final)

    def _update_state(self, response: InferenceResponse | None, final: bool) -> None:
        """Triton's checks, made under the lock before anything is sent."""
        if not self._decoupled:
            if response is not None and self._sent > 0:
                raise TritonModelException(
                    "Unable to send response. Non-decoupled model cannot send more than one response.")
            if response is None and final and self._sent == 0:
                raise TritonModelException(
                    "Unable to send response. Non-decoupled model cannot send complete final before "
                    "sending a response.")
        if self._closed:
            raise TritonModelException("Unable to send response. Response sender has been closed.")
        if final:
            self._closed = True
        self._sent += 1

    def is_cancelled(self) -> bool:
        return self._request.is_cancelled()

    def _close(self) -> None:
        """Close the sender after a failed execute. A default-mode model's response that is held for its FINAL
        flag goes out now as the request's answer: Triton would already have sent it, and a non-decoupled client
        takes the first response and nothing after it (the batch's error is then dropped for this request)."""
        with self._lock:
            self._closed = True
            held, self._held = self._held, None
        if held is not None:
            self._request.response_sender.send(held._core(), final=True)

    @property
    def _is_closed(self) -> bool:
        return self._closed


class InferenceRequest:
    """A request given to ``execute``, or one a model builds to call another model (BLS).

    BLS: ``InferenceRequest(model_name=..., inputs=[...], requested_output_names=[...],
    request_id="", correlation_id=0, model_version=-1, flags=0, timeout=0 (microseconds),
    preferred_memory=..., trace=..., parameters={...})``, then ``exec()`` or ``await async_exec()``.
    """

    __slots__ = (
        "_core",
        "_correlation_id",
        "_decoupled",
        "_flags",
        "_inputs",
        "_model_name",
        "_model_version",
        "_parameters",
        "_preferred_memory",
        "_release_flags",
        "_request_id",
        "_requested",
        "_sender",
        "_timeout",
    )

    def __init__(self, request_id: str = "", correlation_id: int | str = 0, inputs=None,
                 requested_output_names=None, model_name: str | None = None, model_version: int = -1,
                 flags: int = 0, timeout: int = 0, preferred_memory: PreferredMemory | None = None,
                 trace: InferenceTrace | None = None, parameters=None) -> None:
        if model_name is None or inputs is None or requested_output_names is None:
            raise TypeError("InferenceRequest() needs model_name, inputs and requested_output_names")
        if not isinstance(correlation_id, (int, str)):
            raise TritonModelException("Correlation ID must be integer or string")
        self._core = None
        self._decoupled = False
        self._sender = None
        self._inputs = check_tensors(inputs, "inputs")
        self._request_id = str(request_id)
        self._correlation_id = correlation_id
        self._requested = [str(n) for n in requested_output_names]
        self._model_name = str(model_name)
        self._model_version = int(model_version)
        self._flags = int(flags)
        self._timeout = int(timeout)
        self._parameters = check_parameters(parameters)
        self._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL
        self._preferred_memory = preferred_memory

    @classmethod
    def _wrap(cls, request: CoreRequest, decoupled: bool) -> InferenceRequest:
        """A view of a server request for ``execute``."""
        out = object.__new__(cls)
        out._core = request
        out._decoupled = decoupled
        out._sender = None
        out._inputs = None
        out._parameters = None
        out._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL
        return out

    # -- accessors ------------------------------------------------------------------------
    def inputs(self) -> list[Tensor]:
        if self._inputs is None:
            self._inputs = [Tensor._wrap(t) for t in self._core.inputs.values()]
        return self._inputs

    def requested_output_names(self) -> list[str]:
        if self._core is not None:
            return [o.name for o in self._core.outputs]
        return list(self._requested)

    def request_id(self) -> str:
        return self._core.id if self._core is not None else self._request_id

    def correlation_id(self) -> int | str:
        if self._core is not None:
            value = self._core.parameters.get("sequence_id", 0)
            return value if isinstance(value, (int, str)) else 0
        return self._correlation_id

    def flags(self) -> int:
        if self._core is None:
            return self._flags
        params = self._core.parameters
        return ((TRITONSERVER_REQUEST_FLAG_SEQUENCE_START if params.get("sequence_start") else 0)
                | (TRITONSERVER_REQUEST_FLAG_SEQUENCE_END if params.get("sequence_end") else 0))

    def set_flags(self, flags: int) -> None:
        self._flags = int(flags)

    def timeout(self) -> int:
        return self._core.timeout_us if self._core is not None else self._timeout

    def parameters(self) -> str:
        if self._parameters is None:
            self._parameters = {k: v for k, v in self._core.parameters.items() if k not in _RESERVED_PARAMETERS}
        return json.dumps(self._parameters, default=str)

    @property
    def model_name(self) -> str:
        return self._core.model_name if self._core is not None else self._model_name

    @property
    def model_version(self) -> int:
        if self._core is not None:
            return int(self._core.model_version) if self._core.model_version else -1
        return self._model_version

    def trace(self) -> InferenceTrace:
        return InferenceTrace()

    def is_cancelled(self) -> bool:
        return self._core.is_cancelled() if self._core is not None else False

    def get_response_sender(self) -> InferenceResponseSender:
        if self._core is None:
            raise TritonModelException("a BLS request has no response sender")
        if self._sender is None:
            self._sender = InferenceResponseSender(self._core, self._decoupled)
        return self._sender

    def set_release_flags(self, flags: int) -> None:
        """``TRITONSERVER_REQUEST_RELEASE_RESCHEDULE``: once ``execute`` returns, the request is run again in a
        later batch (a model whose config has ``sequence_batching { iterative_sequence: true }``); its response
        in the returned list must then be None. ``TRITONSERVER_REQUEST_RELEASE_ALL`` (the default): it is done."""
        if isinstance(flags, bool) or not isinstance(flags, int):
            raise TypeError(f"set_release_flags() takes an int, got {type(flags).__name__}")
        self._release_flags = flags

    @property
    def _rescheduled(self) -> bool:
        return self._release_flags == TRITONSERVER_REQUEST_RELEASE_RESCHEDULE

    def __repr__(self) -> str:
        return f"InferenceRequest(model_name={self.model_name!r}, request_id={self.request_id()!r})"

    # -- BLS ------------------------------------------------------------------------------
    def exec(self, decoupled: bool = False):
        """Run this request on its model and wait: one InferenceResponse, or with ``decoupled=True``
        an iterator of them (the last one carries the end of the stream, possibly with no outputs)."""
        from .bls import execute_blocking
        return execute_blocking(self, decoupled)

    def async_exec(self, decoupled: bool = False):
        """Like :meth:`exec`, as an awaitable that starts at once (call it from ``async def execute``)."""
        from .bls import execute_async
        return execute_async(self, decoupled)

    def _to_core(self) -> CoreRequest:
        parameters = dict(self._parameters or {})
        if self._correlation_id:
            parameters["sequence_id"] = self._correlation_id
            if self._flags & TRITONSERVER_REQUEST_FLAG_SEQUENCE_START:
                parameters["sequence_start"] = True
            if self._flags & TRITONSERVER_REQUEST_FLAG_SEQUENCE_END:
                parameters["sequence_end"] = True
        inputs = {t.name(): t._core() for t in self.inputs()}
        return CoreRequest(
            self.model_name, inputs,
            model_version="" if self._model_version < 0 else str(self._model_version),
            id=self._request_id, outputs=[RequestedOutput(n) for n in self._requested],
            parameters=parameters, timeout_us=self._timeout)
