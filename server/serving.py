"""The serving interface: everything a frontend (KServe HTTP and gRPC, generate, OpenAI) may ask of the server.

Frontends are written against :class:`ServingInterface` and nothing else. Two classes implement it, method by
method: :class:`tideserve.dataplane.DataPlane` in the core process, and
:class:`tideserve.workers.remote.RemoteDataPlane` in a frontend worker process, where each method either answers
from the repository snapshot the core pushes (the synchronous questions: readiness, lookups, configurations) or
sends one of the closed set of messages of :mod:`tideserve.workers.protocol` to the core.
``tests/unit/test_serving_interface.py`` fails when a method is on the interface and not on one side, or when the
signatures differ.

What is not here is not for frontends: the server's own wiring (handles for the models, aborting every request at
shutdown, the tracer) stays on ``DataPlane``.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, AsyncIterator, Protocol

if TYPE_CHECKING:
    from tritonclient.grpc import model_config_pb2 as mc

    from .backend import ModelContext
    from .generation import EngineInfo, GenerationDelta, GenerationRequest
    from .limits import TensorLimits
    from .types import InferenceRequest, InferenceResponse


class ServedModel(Protocol):
    """A loaded model version as frontends read it."""

    name: str
    version: int
    config: mc.ModelConfig
    ctx: ModelContext  # its files (``ctx.version_path``, ``ctx.local_path``) for tokenizers and templates
    engine: EngineInfo | None  # what an LLM backend tells of its engine (tideserve.generation); None for others


class ResponseStream(Protocol):
    """The responses of one request as they come; the last has ``final`` set. Closing it early (``cancel()`` or
    ``aclose()``) cancels the request."""

    request: InferenceRequest

    def __aiter__(self) -> AsyncIterator[InferenceResponse]: ...

    async def __anext__(self) -> InferenceResponse: ...

    def cancel(self) -> None: ...

    async def aclose(self) -> None: ...


class GenerationStream(Protocol):
    """The typed deltas of one LLM generation (:meth:`ServingInterface.generate`) as the engine makes them (deltas
    the reader has not taken yet join into one); a model's error is raised as a ServerError, the end is
    ``StopAsyncIteration``. Closing it early (``cancel()`` or ``aclose()``) cancels the request (the engine aborts
    it)."""

    model_name: str  # the model asked for

    def __aiter__(self) -> AsyncIterator[GenerationDelta]: ...

    async def __anext__(self) -> GenerationDelta: ...

    def cancel(self) -> None: ...

    async def aclose(self) -> None: ...


class JsonInferStream(Protocol):
    """The answer to a body handed over by :meth:`ServingInterface.infer_json`."""

    async def result(self) -> tuple[bytes, int | None] | None:
        """The HTTP body and, where binary outputs follow its JSON, the JSON's length; None: not taken, decode it
        here. A refusal or the model's error is raised as the ServerError :meth:`ServingInterface.infer` gives."""

    def cancel(self) -> None: ...


class ServingInterface(abc.ABC):
    """The server as its frontends see it. Errors are :class:`tideserve.errors.ServerError` subclasses, which
    each frontend answers in its protocol's own shape."""

    # -- health and metadata ----------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def accepting(self) -> bool:
        """False once shutdown has begun: no new requests."""

    @abc.abstractmethod
    def live(self) -> bool:
        """KServe server liveness."""

    @abc.abstractmethod
    def ready(self) -> bool:
        """KServe server readiness (every model ready under ``--strict-readiness``)."""

    @abc.abstractmethod
    def healthy(self) -> bool:
        """vLLM's ``GET /health``: false once shutdown begins or when a loaded model broke while serving."""

    @abc.abstractmethod
    def server_metadata(self) -> dict[str, Any]:
        """KServe server metadata: ``{"name", "version", "extensions"}``."""

    # -- models -----------------------------------------------------------------------------------------
    @abc.abstractmethod
    def model(self, name: str, version: str = "") -> ServedModel:
        """The loaded version ``version`` of model ``name`` ("" for the one it serves); NotFound / Unavailable /
        InvalidArgument otherwise."""

    @abc.abstractmethod
    def model_ready(self, name: str, version: str = "") -> bool:
        """KServe model readiness."""

    @abc.abstractmethod
    def model_metadata(self, name: str, version: str = "") -> dict[str, Any]:
        """KServe model metadata (name, versions, platform, inputs, outputs)."""

    @abc.abstractmethod
    def model_config(self, name: str, version: str = "") -> mc.ModelConfig:
        """The model's configuration as Triton's ``ModelConfig`` message."""

    @abc.abstractmethod
    async def statistics(self, name: str = "", version: str = "") -> list[dict]:
        """Triton's model statistics of one model version, one model, or every model."""

    @abc.abstractmethod
    async def metrics_text(self) -> bytes:
        """The Prometheus text exposition of the server (``GET /metrics``)."""

    # -- repository -------------------------------------------------------------------------------------
    @abc.abstractmethod
    def repository_index(self, ready_only: bool = False) -> list[dict]:
        """The repository's models, ``[{"name", "version", "state", "reason"}]``, as last known (for lists that
        are read on every request, such as ``/v1/models``)."""

    @abc.abstractmethod
    async def index(self, ready_only: bool = False) -> list[dict]:
        """The repository index as it is now (Triton's repository API)."""

    @abc.abstractmethod
    async def load_model(self, name: str, config_json: str | None = None) -> None:
        """Load (or reload) model ``name``, with ``config_json`` overriding its configuration."""

    @abc.abstractmethod
    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        """Unload model ``name`` (and the models that depend on it)."""

    # -- inference --------------------------------------------------------------------------------------
    @abc.abstractmethod
    def infer(self, request: InferenceRequest) -> ResponseStream:
        """Schedule ``request`` and return its responses as they come. A request refused before it is scheduled
        raises here (in the core) or from the stream's first step (in a worker)."""

    @abc.abstractmethod
    def generate(self, model_name: str, generation: GenerationRequest, *, model_version: str = "", id: str = "",
                 priority: int = 0, timeout_us: int = 0, arrival_ns: int = 0,
                 trace_context: Any = None) -> GenerationStream:
        """A typed LLM generation (a :class:`tideserve.generation.GenerationRequest`, with the request's id,
        priority, deadline ``timeout_us`` counted from ``arrival_ns`` (0: now) and a client's traceparent) for a
        model whose engine takes them (``ServedModel.engine.typed_requests``): its
        :class:`~tideserve.generation.GenerationDelta` s as they come, what vLLM's ``EngineClient.generate`` is.
        The stream carries the request (the backend takes it as such) and its cancellation (closing it early).
        Statistics, metrics, tracing, deadlines and cancellation are those of :meth:`infer`. A request refused
        before it is scheduled raises here (in the core) or from the stream's first step (in a worker)."""

    @abc.abstractmethod
    def infer_json(self, model_name: str, model_version: str, body: bytes, header_length: int | None,
                   limits: TensorLimits, max_json_depth: int) -> JsonInferStream | None:
        """A KServe v2 HTTP infer body (JSON, binary tensors after it where ``header_length`` says) handed as it came
        to where its model runs, which decodes it within ``limits`` and ``max_json_depth``, schedules it and answers
        with the HTTP body; None where no such place takes it (the caller decodes it and calls :meth:`infer`). Its
        stream's :meth:`JsonInferStream.result` may still say "decode it here" (None) for a body the model's process
        does not take whole (anything but a plain, valid request); that happens before the request is scheduled."""

    @abc.abstractmethod
    def record_frontend_runs(self, model: ServedModel, count: int, elapsed_ns: int) -> None:
        """Count ``count`` requests of ``model`` that a frontend served itself by a shorter way than the model's
        own run (an ensemble whose first step it took: ``openai_tokenize_in_frontend``): a success and an
        execution of one inference each, ``elapsed_ns`` long, in the model's statistics (from a worker: its
        counters of the version, which the core adds)."""

    @abc.abstractmethod
    async def infer_unary(self, request: InferenceRequest) -> InferenceResponse:
        """One request, one response (its model's error raised): for protocols without streaming. Unsupported
        when a decoupled model sends none or several."""

    # -- system and CUDA shared memory (Triton's shared-memory extensions) -------------------------------
    @abc.abstractmethod
    async def register_system_shared_memory(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Register region ``name``: ``byte_size`` bytes at ``offset`` of the POSIX shared memory object ``key``."""

    @abc.abstractmethod
    async def unregister_system_shared_memory(self, name: str = "") -> None:
        """Unregister region ``name``, or every region when ``name`` is empty."""

    @abc.abstractmethod
    async def system_shared_memory_status(self, name: str = "") -> list[dict]:
        """``[{"name", "key", "offset", "byte_size"}]`` of region ``name``, or of every region."""

    @abc.abstractmethod
    async def register_cuda_shared_memory(self, name: str, raw_handle: bytes, device_id: int,
                                          byte_size: int) -> None:
        """Register a CUDA IPC memory region."""

    @abc.abstractmethod
    async def unregister_cuda_shared_memory(self, name: str = "") -> None:
        """Unregister CUDA region ``name``, or every one."""

    @abc.abstractmethod
    async def cuda_shared_memory_status(self, name: str = "") -> list[dict]:
        """The registered CUDA regions."""

    # -- trace settings (Triton's trace extension) ------------------------------------------------------
    @abc.abstractmethod
    async def trace_setting(self, model_name: str = "", updates: dict | None = None) -> dict[str, Any]:
        """The trace settings, global or of ``model_name``, after applying ``updates`` (None clears one)."""

    # -- load and caches, for routers (GET /load, the ORCA header, POST /reset_prefix_cache) -------------
    @abc.abstractmethod
    async def load_report(self, model_name: str = "") -> dict[str, Any]:
        """The load of the ready models, or of model ``model``: requests in flight, the engines' running and
        waiting requests and KV-cache usage (tideserve.load_report)."""

    @abc.abstractmethod
    async def reset_prefix_cache(self, model_name: str = "", reset_running_requests: bool = False) -> dict[str, Any]:
        """vLLM's ``reset_prefix_cache`` on the engine of model ``model``, or of every ready model that has a
        prefix cache: ``{"success": bool}`` (false while blocks are still held: retry)."""

    # -- adapters (LoRA) of the models that take them -------------------------------------------------------
    @abc.abstractmethod
    def adapters(self) -> list[dict[str, str]]:
        """The adapters of the ready models that take them: ``[{"name", "path", "model"}]``."""

    @abc.abstractmethod
    async def load_adapter(self, model_name: str, adapter_name: str, path: str, load_inplace: bool = False) -> None:
        """Load an adapter from disk into model ``model_name`` (off unless the server allows updates at run time)."""

    @abc.abstractmethod
    async def unload_adapter(self, model_name: str, adapter_name: str) -> None:
        """Unload adapter ``adapter_name`` of model ``model_name``."""


def interface_methods() -> dict[str, Any]:
    """The interface's members (name -> the abstract function or property), for the conformance test."""
    return {name: getattr(ServingInterface, name) for name in sorted(ServingInterface.__abstractmethods__)}


__all__ = ["GenerationStream", "ResponseStream", "ServedModel", "ServingInterface", "interface_methods"]
