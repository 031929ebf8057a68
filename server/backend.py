"""The backend API: a Backend makes Models; a Model makes one ModelInstance per instance slot.

A backend is a class registered under the entry-point group ``tideserve.backends`` with the name
that model configs use (``backend: "python"``). Lifecycle hooks may be plain or ``async``;
plain ones run on worker threads so the event loop never waits on them.

``ModelInstance.execute(requests)`` receives a batch. Each request carries a
:class:`~tideserve.responses.ResponseSender`; a backend either answers through it (required for
decoupled models, which send 0..N responses and then FINAL) or returns a list with one
:class:`~tideserve.types.InferenceResponse` per request, which the scheduler sends as final.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import inspect
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Protocol

from . import model_paths
from .errors import InvalidArgument, NotFound, Unavailable

if TYPE_CHECKING:
    from tritonclient.grpc import model_config_pb2

    from .generation import EngineInfo
    from .stats import Metrics
    from .types import InferenceRequest, InferenceResponse

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "tideserve.backends"


async def call_hook(fn: Callable, *args: Any, executor: ThreadPoolExecutor | None = None) -> Any:
    """Await ``fn(*args)`` if it is a coroutine function, else run it on a worker thread."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)


class InferStream(Protocol):
    """The responses of a request submitted through :class:`Infer`, as they come (the last is final).
    ``cancel()`` (or ``aclose()``) cancels the request when the caller stops reading early."""

    request: "InferenceRequest"

    def __aiter__(self) -> AsyncIterator["InferenceResponse"]: ...

    async def __anext__(self) -> "InferenceResponse": ...

    def cancel(self) -> None: ...

    async def aclose(self) -> None: ...


class Infer(Protocol):
    """Calls another model of the server: ``infer(request)`` validates and schedules ``request`` as the
    server does for a client (model readiness, validation, statistics) and returns its
    :class:`InferStream`, or raises a ServerError when it cannot be accepted; ``await
    infer.unary(request)`` returns its one response (a ServerError when the model failed or streamed)."""

    def __call__(self, request: "InferenceRequest") -> InferStream: ...

    async def unary(self, request: "InferenceRequest") -> "InferenceResponse": ...


class ModelLookup(Protocol):
    """The configuration of a loaded model version (``""``: the newest ready one); a ServerError
    (NotFound, Unavailable) when there is none ready."""

    def __call__(self, name: str, version: str = "") -> "model_config_pb2.ModelConfig": ...


class ModelControl(Protocol):
    """Repository control for models that load and unload others (the Python backend's BLS)."""

    async def load(self, name: str, config_json: str | None = None) -> None: ...

    async def unload(self, name: str, unload_dependents: bool = False) -> None: ...

    def ready(self, name: str, version: str = "") -> "bool | Awaitable[bool]": ...


@dataclass(frozen=True)
class ServerHandles:
    """What the server hands every model it builds (see :class:`ModelContext`)."""

    infer: Infer | None = None
    models: ModelLookup | None = None
    control: ModelControl | None = None


@dataclass
class ModelContext:
    """Everything a backend needs to build a model."""

    name: str
    version: int
    config: "model_config_pb2.ModelConfig"
    model_path: Path  # <repository>/<model>
    metrics: "Metrics | None" = None  # the server's metrics, for backends that add their own families
    # for models that call other models (BLS, ensembles): submit a request, get its responses
    infer: Infer | None = None
    # the configuration of another loaded model (an ensemble's steps)
    models: ModelLookup | None = None
    # load / unload / readiness of other models (the Python backend's pb_utils.load_model ...)
    control: ModelControl | None = None
    # set by the server: a loaded model that breaks for good (its engine died) calls report_failure
    on_failure: "Callable[[str], None] | None" = None
    # directories beyond the model repository that this model's files may live in (--allowed-model-root)
    allowed_roots: tuple[Path, ...] = ()

    def report_failure(self, reason: str) -> None:
        """Mark this model version UNAVAILABLE with ``reason``: it leaves readiness (and strict server
        readiness), requests get 503 naming the reason; an explicit load (or a restart) replaces it."""
        if self.on_failure is not None:
            self.on_failure(reason)

    @property
    def version_path(self) -> Path:
        return self.model_path / str(self.version)

    def local_path(self, value: str, field: str) -> Path | None:
        """The file or directory ``value`` names: absolute as given, else under the version directory,
        then the model directory (the first that exists); None when none exists. Symlinks are resolved
        and a path outside the model repository (or an allowed root) is refused with InvalidArgument
        naming ``field`` (see :mod:`tideserve.model_paths`)."""
        for path in model_paths.candidates(value, [self.version_path, self.model_path]):
            if path.exists():
                return model_paths.check_inside(path, self.file_roots, self.name, field, value)
        return None

    def check_file(self, path: Path, field: str, value: str) -> Path:
        """``path`` (symlinks resolved) if it lies inside the model repository or an allowed root."""
        return model_paths.check_inside(path, self.file_roots, self.name, field, value)

    @property
    def file_roots(self) -> tuple[Path, ...]:
        return model_paths.model_roots(self.model_path, self.allowed_roots)

    @property
    def decoupled(self) -> bool:
        return self.config.model_transaction_policy.decoupled

    def parameter(self, key: str, default: str | None = None) -> str | None:
        """String value of ``parameters { key: ... value: { string_value: ... } }``."""
        if key in self.config.parameters:
            return self.config.parameters[key].string_value
        return default


@dataclass
class InstanceContext:
    """One slot of an instance group."""

    name: str  # e.g. "add_sub_0_1": <group name>_<slot>
    kind: str  # KIND_CPU, KIND_GPU, KIND_MODEL, KIND_AUTO
    device_id: int
    index: int  # position among all instances of the model
    group_name: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class ModelInstance:
    """One execution slot of a model. Override :meth:`execute` (plain or ``async``)."""

    # A plain execute that spends its time in native code releasing the GIL (ONNX Runtime's run): the event loop
    # hands the GIL to the instance's thread with each batch instead of keeping it until a switch interval forces it
    releases_gil = False
    # Set while the instance is busy with work the core did not send it (a batch from the frontend workers that
    # waits on a BLS call): its scheduler hands it no batch until the event is set
    hold: asyncio.Event | None = None

    def __init__(self, model: "Model", ctx: InstanceContext) -> None:
        self.model = model
        self.ctx = ctx

    def initialize(self) -> None:
        """Prepare the instance (load weights onto its device, open a session...)."""

    def execute(self, requests: "list[InferenceRequest]") -> "list[InferenceResponse] | None":
        raise NotImplementedError(f"{type(self).__name__} does not implement execute()")

    def submit(self, requests: "list[InferenceRequest]") -> "asyncio.Future | None":
        """An instance that runs its batches in order elsewhere (a model process) sends ``requests`` now and returns
        a future done when they have run (``await`` it as ``execute``; the responses go through each request's
        sender); it may be handed the next batch while one runs, which it starts as soon as that one ends. The
        base class's (not overridden): the instance takes one batch at a time, through :meth:`execute`."""
        return None

    def finalize(self) -> None:
        """Release what :meth:`initialize` acquired."""

    async def drain_direct(self, timeout: float | None) -> None:
        """``--frontend-direct``: take no more requests straight from frontend workers and wait up to ``timeout``
        seconds for those in flight (the core's drain waits for its own). An instance that takes none has none."""


class Model:
    """State shared by the instances of one model version."""

    instance_class: type[ModelInstance] = ModelInstance
    def __init__(self, backend: "Backend", ctx: ModelContext) -> None:
        self.backend = backend
        self.ctx = ctx

    @property
    def config(self) -> "model_config_pb2.ModelConfig":
        return self.ctx.config

    def auto_complete_config(self) -> None:
        """Fill in what the config leaves out (inputs, outputs, max_batch_size); edit in place."""

    def initialize(self) -> None:
        """Load what all instances share."""

    def create_instance(self, ctx: InstanceContext) -> ModelInstance:
        return self.instance_class(self, ctx)

    def engine_info(self) -> "EngineInfo | None":
        """What an LLM backend tells frontends of its engine once initialized (tideserve.generation.EngineInfo:
        typed requests, tokenizer files, context length, structured outputs); None for other models."""
        return None

    def generation(self, stream):
        """A typed LLM generation (``engine_info().typed_requests``) as one coroutine that runs it to its end. The
        request is its ``GenerationStream`` (``generation``, ``id``, ``priority``, ``timeout_us``, ``arrival_ns``,
        ``internal_id``; ``is_cancelled()`` and ``on_cancel(abort)``), which takes its answers (``send_delta``,
        ``send_error``); the pass-through scheduler runs it as a task of its own, with no instance ``execute``
        around it. None: the model takes typed requests through ``execute`` like any other (as an
        InferenceRequest with ``generation`` set)."""
        return None

    def generation_entry(self):
        """``generation`` resolved once: a callable ``(stream) -> coroutine`` that the DataPlane keeps while the
        model serves (its typed requests then run no backend code beside it); None: ``generation`` per request."""
        return None

    def waiting_requests(self) -> int | None:
        """Requests waiting in the model's own engine (a backend that batches continuously), or None
        when the model does not know; the pass-through scheduler reports it as the pending count."""
        return None

    def engine_capacity(self) -> int | None:
        """Requests the model's engine runs at once (vLLM's ``max_num_seqs``), or None when it does not say;
        the pass-through scheduler's ``max_queue_size`` bounds the requests in flight beyond it."""
        return None

    def engine_load(self) -> dict[str, float] | None:
        """The engine's load after its last step, ``{"num_requests_running", "num_requests_waiting",
        "kv_cache_usage_perc"}`` (vLLM's names; the usage a fraction 0 to 1), or None when the model has no
        engine of its own (GET /load and the ORCA load header report the server's in-flight count for it)."""
        return None

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool | None:
        """Drop the engine's prefix cache (vLLM's ``reset_prefix_cache``): True when done, False when blocks are
        still held (retry later), None when the model has no prefix cache."""
        return None

    # -- LoRA adapters (a model that serves adapters on one base model overrides these three) --
    def lora_adapters(self) -> list[dict[str, str]] | None:
        """The LoRA adapters the model serves now, ``{"name", "path"}`` each; None when it takes none."""
        return None

    async def load_lora_adapter(self, name: str, path: str, load_inplace: bool = False) -> None:
        """Load the adapter at ``path`` (as the client wrote it: the model resolves and confines it)."""
        raise InvalidArgument(f"model '{self.ctx.name}' takes no LoRA adapters")

    async def unload_lora_adapter(self, name: str) -> None:
        raise NotFound(f"The lora adapter '{name}' cannot be found.")

    def finalize(self) -> None:
        """Release what :meth:`initialize` acquired."""


class Backend:
    """A named family of models. One Backend object per server, made on first use."""

    name: str = ""
    model_class: type[Model] = Model
    # ``--backend-config`` settings for this backend (Triton's ``<backend>,<setting>=<value>``; the global ones
    # without a backend name included), set by the registry before ``initialize``
    settings: dict[str, str] = {}

    def initialize(self) -> None:
        """Once, before the first model of this backend loads."""

    def create_model(self, ctx: ModelContext) -> Model:
        return self.model_class(self, ctx)

    def finalize(self) -> None:
        """Once, at server shutdown."""


class BackendRegistry:
    """Finds backends by name: explicit registrations first, then package entry points."""

    def __init__(self, settings: dict[str, dict[str, str]] | None = None) -> None:
        self._classes: dict[str, type[Backend]] = {}
        self._backends: dict[str, Backend] = {}
        self._lock = asyncio.Lock()
        # --backend-config: backend name ("" for every backend) -> {setting: value}
        self._settings = settings or {}

    def register(self, name: str, backend_class: type[Backend]) -> None:
        self._classes[name] = backend_class

    def _find_class(self, name: str) -> type[Backend]:
        if name in self._classes:
            return self._classes[name]
        for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if entry.name == name:
                try:
                    backend_class = entry.load()
                except Exception as exc:  # an optional dependency may be missing
                    raise Unavailable(f"backend '{name}' failed to import: {type(exc).__name__}: {exc}") from exc
                self._classes[name] = backend_class
                return backend_class
        raise Unavailable(f"unknown backend '{name}': no backend of that name is installed")

    def names(self) -> list[str]:
        found = {e.name for e in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
        return sorted(found | set(self._classes))

    async def get(self, name: str) -> Backend:
        async with self._lock:
            backend = self._backends.get(name)
            if backend is None:
                backend = self._find_class(name)()
                backend.name = backend.name or name
                backend.settings = {**self._settings.get("", {}), **self._settings.get(name, {})}
                if backend.settings:  # as Triton logs a backend's command-line configuration
                    log.info("backend '%s' configuration: %s", name,
                             json.dumps({"cmdline": backend.settings}, separators=(",", ":")))
                await call_hook(backend.initialize)
                self._backends[name] = backend
            return backend

    async def finalize(self) -> None:
        for name, backend in list(self._backends.items()):
            try:
                await call_hook(backend.finalize)
            except Exception:
                log.exception("backend '%s' failed to finalize", name)
        self._backends.clear()
