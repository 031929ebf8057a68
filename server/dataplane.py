"""The DataPlane: the one place every protocol goes through to reach a model.

It finds the model, checks readiness, validates and times the request, records success and
failure, and hands back an async iterator of responses. Frontends only translate wire formats.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from . import __version__
from .backend import ServerHandles
from .datatypes import config_to_datatype
from .errors import NotFound, ServerError, Status, Unavailable, Unsupported
from .repository import ModelRepository
from .responses import ResponseSender, ResponseStream
from .runtime import ModelRuntime
from .stats import Metrics
from .types import InferenceRequest, InferenceResponse

# Triton protocol extensions this server implements (listed in the server metadata).
EXTENSIONS = ["classification", "model_repository", "model_repository(unload_dependents)", "schedule_policy",
              "model_configuration",
              "binary_tensor_data", "parameters", "statistics", "generate"]

_FAILURE_REASON = {Status.CANCELLED: "CANCELED", Status.UNAVAILABLE: "REJECTED"}


class InferenceStream:
    """The responses of one request. Closing it early cancels the request."""

    __slots__ = ("_dataplane", "runtime", "request", "_stream", "_done", "_first")

    def __init__(self, dataplane: "DataPlane", runtime: ModelRuntime, request: InferenceRequest,
                 stream: ResponseStream) -> None:
        self._dataplane = dataplane
        self.runtime = runtime
        self.request = request
        self._stream = stream
        self._done = False
        self._first = True

    def __aiter__(self) -> "InferenceStream":
        return self

    async def __anext__(self) -> InferenceResponse:
        if self._done:
            raise StopAsyncIteration
        try:
            response = await self._stream.get()
        except asyncio.CancelledError:
            self.cancel()
            raise
        response.model_version = str(self.runtime.version)
        stats = self.runtime.stats
        elapsed = time.monotonic_ns() - self.request.arrival_ns
        if self._first:
            self._first = False
            stats.record_first_response(elapsed)
        if response.final:
            self._done = True
            self._dataplane.active.discard(self)
            self.runtime.request_finished()
            if response.error is None:
                stats.record_success(elapsed)
            else:
                stats.record_failure(elapsed, _FAILURE_REASON.get(response.error.status, "BACKEND"))
        return response

    def cancel(self) -> None:
        """The client went away: flag the request so its backend can stop working on it."""
        if self._done:
            return
        self._done = True
        self._dataplane.active.discard(self)
        self.request.cancellation.cancel()
        self.runtime.request_finished()
        self.runtime.stats.record_failure(time.monotonic_ns() - self.request.arrival_ns, "CANCELED")

    async def aclose(self) -> None:
        self.cancel()

    def abort(self, error: ServerError) -> None:
        """End the stream with ``error`` now (server shutdown) and cancel the backend's work."""
        self.request.cancellation.cancel()
        self._stream.put(InferenceResponse(error=error, final=True))


class _Infer:
    """The ``infer`` handle of backends: requests go through the DataPlane as a client's do."""

    __slots__ = ("_dataplane",)

    def __init__(self, dataplane: "DataPlane") -> None:
        self._dataplane = dataplane

    def __call__(self, request: InferenceRequest) -> InferenceStream:
        return self._dataplane.infer(request)

    async def unary(self, request: InferenceRequest) -> InferenceResponse:
        return await self._dataplane.infer_unary(request)


class _Control:
    """The model-control handle of backends (BLS ``load_model`` / ``unload_model`` / ``is_model_ready``)."""

    __slots__ = ("_dataplane",)

    def __init__(self, dataplane: "DataPlane") -> None:
        self._dataplane = dataplane

    async def load(self, name: str, config_json: str | None = None) -> None:
        await self._dataplane.load_model(name, config_json)

    async def unload(self, name: str, unload_dependents: bool = False) -> None:
        await self._dataplane.unload_model(name, unload_dependents=unload_dependents)

    def ready(self, name: str, version: str = "") -> bool:
        return self._dataplane.model_ready(name, version)


class DataPlane:
    def __init__(self, repository: ModelRepository, metrics: Metrics, *, strict_readiness: bool = True) -> None:
        self.repository = repository
        self.metrics = metrics
        self.strict_readiness = strict_readiness
        self.accepting = True  # false once shutdown begins
        self.active: set[InferenceStream] = set()

    def server_handles(self) -> ServerHandles:
        """What the repository hands the models it builds: calls into this DataPlane (``infer``, model
        control) and the repository's model lookup. The server wires them (``repository.handles``)."""
        return ServerHandles(infer=_Infer(self), models=self.repository.model_config, control=_Control(self))

    # -- health and metadata -------------------------------------------------------------
    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        if not self.accepting:
            return False
        return self.repository.all_ready() if self.strict_readiness else True

    def server_metadata(self) -> dict[str, Any]:
        return {"name": "tideserve", "version": __version__, "extensions": list(EXTENSIONS)}

    def model(self, name: str, version: str = "") -> ModelRuntime:
        return self.repository.get(name, version)

    def model_ready(self, name: str, version: str = "") -> bool:
        try:
            self.repository.get(name, version)
        except ServerError:
            return False
        return True

    def model_metadata(self, name: str, version: str = "") -> dict[str, Any]:
        runtime = self.repository.get(name, version)
        config = runtime.config
        entry = self.repository.entries[name]
        batch = [-1] if config.max_batch_size > 0 else []

        def tensors(items):
            return [{"name": t.name, "datatype": config_to_datatype(mc.DataType.Name(t.data_type)),
                     "shape": batch + list(t.dims)} for t in items]

        return {"name": name, "versions": [str(v) for v in sorted(entry.versions)],
                "platform": config.platform or config.backend,
                "inputs": tensors(config.input), "outputs": tensors(config.output)}

    def model_config(self, name: str, version: str = "") -> mc.ModelConfig:
        return self.repository.get(name, version).config

    def model_statistics(self, name: str = "", version: str = "") -> list[dict]:
        if not name:
            runtimes = [r for r in self.repository.runtimes()]
        elif version:
            runtimes = [self.repository.get(name, version)]
        else:
            entry = self.repository.entries.get(name)
            if entry is None or not entry.versions:
                raise NotFound(f"requested model '{name}' is not available")
            runtimes = list(entry.versions.values())
        return [r.stats.as_dict() for r in runtimes]

    # -- repository ----------------------------------------------------------------------
    def repository_index(self, ready_only: bool = False) -> list[dict]:
        return self.repository.index(ready_only)

    async def load_model(self, name: str, config_json: str | None = None) -> None:
        await self.repository.load(name, config_json)

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        await self.repository.unload(name, unload_dependents=unload_dependents)

    # -- inference -----------------------------------------------------------------------
    def infer(self, request: InferenceRequest) -> InferenceStream:
        """Validate and schedule ``request``; raise a ServerError if it cannot be accepted."""
        if not self.accepting:
            raise Unavailable("the server is shutting down and accepts no new requests")
        runtime = self.repository.get(request.model_name, request.model_version)
        try:
            runtime.validator.validate(request)
        except ServerError:
            runtime.stats.record_failure(time.monotonic_ns() - request.arrival_ns, "OTHER")
            raise
        stream = ResponseStream(asyncio.get_running_loop())
        request.response_sender = ResponseSender(request, stream.put)
        try:
            runtime.enqueue(request)
        except ServerError as exc:
            runtime.stats.record_failure(time.monotonic_ns() - request.arrival_ns,
                                         _FAILURE_REASON.get(exc.status, "OTHER"))
            raise
        runtime.request_started()
        inference = InferenceStream(self, runtime, request, stream)
        self.active.add(inference)
        return inference

    def abort_all(self, message: str) -> None:
        """Answer every unfinished request with UNAVAILABLE (used when the exit timeout runs out)."""
        for inference in list(self.active):
            inference.abort(Unavailable(message))

    async def infer_unary(self, request: InferenceRequest) -> InferenceResponse:
        """One request, one response: for protocols without streaming."""
        request.streaming = False
        stream = self.infer(request)
        responses = []
        try:
            async for response in stream:
                if response.error is not None:
                    raise response.error
                if not response.empty:
                    responses.append(response)
        finally:
            await stream.aclose()
        if len(responses) == 1:
            return responses[0]
        if not responses:
            raise Unsupported(f"model '{request.model_name}' sent no response; use the streaming API")
        raise Unsupported(f"model '{request.model_name}' is decoupled and sent {len(responses)} responses; "
                          "use the streaming API (gRPC ModelStreamInfer or generate_stream)")
