"""The model repository: Triton's layout, version policies and model control modes.

Each model loads and unloads on its own: a model that fails is UNAVAILABLE with its reason
and every other model keeps serving.
"""

from __future__ import annotations

import asyncio
import copy
import enum
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from tritonclient.grpc import model_config_pb2 as mc

from . import config as config_module
from .backend import BackendRegistry, ModelContext, ServerHandles
from .errors import (NOT_EXPLICIT, InternalError, InvalidArgument, NotFound, ServerError, Unavailable,
                     as_server_error)
from .runtime import ModelRuntime, ModelState
from .stats import Metrics

log = logging.getLogger(__name__)


class ControlMode(str, enum.Enum):
    NONE = "none"
    POLL = "poll"
    EXPLICIT = "explicit"


@dataclass
class ModelEntry:
    """What the repository knows of one model name."""

    name: str
    versions: dict[int, ModelRuntime] = field(default_factory=dict)
    state: str = ""  # "" until a load was tried
    reason: str = ""
    signature: tuple = ()
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # loaded because a client (or --load-model) named it, not only as a step of an ensemble that was loaded:
    # unloading that ensemble with unload_dependents leaves such a model loaded
    explicit: bool = False


MAX_MODEL_NAME_BYTES = 255  # a directory name (NAME_MAX on Linux and macOS)


def check_startup_models(mode: ControlMode, names: list[str]) -> None:
    """``--load-model`` as tritonserver checks it, in its words: only with ``--model-control-mode=explicit``,
    and ``*`` (every model) only as the one ``--load-model``."""
    if names and mode is not ControlMode.EXPLICIT:
        raise InvalidArgument("Use of '--load-model' requires setting '--model-control-mode=explicit' as well.")
    if "*" in names and len(set(names)) > 1:
        raise InvalidArgument("Wildcard model name '*' must be the ONLY startup model if specified at all.")


def check_model_name(name: str) -> None:
    """Reject names that would leave the repository directory or that no directory can have."""
    if (not name or name in (".", "..") or "/" in name or "\\" in name or "\x00" in name
            or os.path.isabs(name)):
        raise InvalidArgument(f"invalid model name '{name[:100]}': it must be a plain directory name")
    if len(name.encode("utf-8", "surrogateescape")) > MAX_MODEL_NAME_BYTES:
        raise InvalidArgument(f"invalid model name '{name[:40]}...': longer than {MAX_MODEL_NAME_BYTES} bytes")


def check_config_files(ctx: ModelContext) -> None:
    """Refuse a configuration whose model file or label files lie outside the model repository."""
    config = ctx.config
    if config.default_model_filename:
        ctx.check_file(ctx.version_path / config.default_model_filename, "default_model_filename",
                       config.default_model_filename)
    for output in config.output:
        if output.label_filename:
            ctx.check_file(ctx.model_path / output.label_filename, f"output '{output.name}' label_filename",
                           output.label_filename)
    for key in PATH_PARAMETERS:
        value = ctx.parameter(key)
        if value and not value.startswith("${") and "{{" not in value and "{%" not in value:
            ctx.local_path(value.strip(), f"parameter '{key}'")  # refused when it exists outside


DEFAULT_MAX_INSTANCES = 64  # per model version (--model-max-instances)


def check_instance_count(config: mc.ModelConfig, limit: int) -> None:
    """Refuse a configuration (or a load request's override) asking for more instances than the server allows:
    each is a thread or a process, and a load could otherwise ask for a hundred thousand."""
    count = sum(group.count * max(1, len(group.gpus)) for group in config.instance_group)
    if limit > 0 and count > limit:
        raise InvalidArgument(f"model '{config.name}': instance_group asks for {count} instances; this server runs "
                              f"at most {limit} per model (--model-max-instances)")


# Config parameters the OpenAI frontend and the tokenizer models read as paths (relative to the version, then
# the model directory) whatever the backend; checked at load so a config override cannot name a file elsewhere.
# Backend-specific paths (vLLM's model.json, TensorRT-LLM's engine_dir) are checked by their backends.
PATH_PARAMETERS = ("tokenizer_dir", "tokenizer", "chat_template")


def available_versions(model_dir: Path) -> list[int]:
    versions = []
    for child in model_dir.iterdir():
        if child.is_dir() and child.name.isdigit():
            versions.append(int(child.name))
    return sorted(versions)


def select_versions(policy: mc.ModelVersionPolicy, versions: list[int]) -> list[int]:
    which = policy.WhichOneof("policy_choice")
    if which == "all":
        return list(versions)
    if which == "specific":
        wanted = set(policy.specific.versions)
        return [v for v in versions if v in wanted]
    count = policy.latest.num_versions if which == "latest" else 1
    return versions[-count:] if count else []


def composing_models(config: mc.ModelConfig) -> list[str]:
    """The models an ensemble's steps run (none for other models)."""
    return list(dict.fromkeys(s.model_name for s in config.ensemble_scheduling.step if s.model_name))


def _signature(model_dir: Path) -> tuple:
    """Modification state of a model directory two levels deep (what polling watches)."""
    items = []
    try:
        for entry in os.scandir(model_dir):
            stat = entry.stat()
            items.append((entry.name, stat.st_mtime_ns, stat.st_size))
            if entry.is_dir():
                for sub in os.scandir(entry.path):
                    sub_stat = sub.stat()
                    items.append((f"{entry.name}/{sub.name}", sub_stat.st_mtime_ns, sub_stat.st_size))
    except FileNotFoundError:
        return ()
    return tuple(sorted(items))


class ModelRepository:
    def __init__(self, paths: list[Path], backends: BackendRegistry, metrics: Metrics,
                 control_mode: ControlMode = ControlMode.NONE, startup_models: list[str] | None = None,
                 allowed_roots: list[Path] | None = None, max_instances: int = DEFAULT_MAX_INSTANCES,
                 exit_on_error: bool = True) -> None:
        check_startup_models(control_mode, startup_models or [])
        self.paths = [Path(p).resolve() for p in paths]
        self.allowed_roots = tuple(Path(p).resolve() for p in allowed_roots or ())
        self.max_instances = max_instances
        for path in self.paths:
            if not path.is_dir():
                raise InvalidArgument(f"model repository '{path}' is not a directory")
        self.backends = backends
        self.metrics = metrics
        self.control_mode = control_mode
        self.startup_models = startup_models or []
        # explicit mode: a model --load-model names that is missing or fails to load fails the start (else logged)
        self.exit_on_error = exit_on_error
        # what every model built from here is handed; the server adds infer and control (server/app.py)
        self.handles = ServerHandles(models=self.model_config)
        self.entries: dict[str, ModelEntry] = {}
        # called after a load / unload asked through the API, and after a poll that changed something
        self.after_change: Callable[[], None] | None = None
        # called (from any thread) whenever a model version changes state (the frontend workers' copy)
        self.listeners: list[Callable[[], None]] = []
        self.rate_limiter = None  # the server's RateLimiter (--rate-limit execution_count), handed to every runtime

    # -- discovery -----------------------------------------------------------------------
    def model_names(self) -> list[str]:
        names = set()
        for path in self.paths:
            for child in path.iterdir():
                if child.is_dir() and not child.name.startswith("."):
                    names.add(child.name)
        return sorted(names)

    def model_dir(self, name: str) -> Path:
        check_model_name(name)
        found = [p / name for p in self.paths if (p / name).is_dir()]
        if not found:
            raise NotFound(f"failed to load '{name}', failed to poll from model repository: "
                           f"no model directory '{name}' in the model repositories")
        if len(found) > 1:
            raise InvalidArgument(f"model '{name}' appears in more than one model repository: "
                                  f"{', '.join(map(str, found))}")
        resolved = found[0].resolve()
        if not any(resolved.parent == p for p in self.paths):
            raise InvalidArgument(f"invalid model name '{name}': it resolves outside the model repository")
        return found[0]

    # -- start-up and polling ------------------------------------------------------------
    async def start(self) -> None:
        """Load the models of the control mode: every model (``none``, ``poll``, explicit ``--load-model '*'``;
        one that fails is UNAVAILABLE and the rest serve), or the models ``--load-model`` names. A named model
        that is missing or fails to load raises InternalError ("failed to load all models", as tritonserver)
        unless ``exit_on_error`` is off; the models loaded before stay loaded for the caller to shut down."""
        named = self.control_mode is ControlMode.EXPLICIT and "*" not in self.startup_models
        names = list(dict.fromkeys(self.startup_models)) if named else self.model_names()
        unknown = [name for name in names if named and not self._found(name)]
        present = [name for name in names if name not in unknown]
        for wave in self.load_order(present):
            await asyncio.gather(*(self._load_quietly(name) for name in wave))
        for name in present:
            if name in self.entries:
                self.entries[name].explicit = True
        failed = unknown + [name for name in present if name not in self.entries or not self.entries[name].versions]
        if named and failed:
            message = f"failed to load all models: {', '.join(repr(name) for name in failed)} did not load"
            if self.exit_on_error:
                raise InternalError(message)
            log.error("%s (--exit-on-error is off: starting without them)", message)

    def _found(self, name: str) -> bool:
        """Whether a model ``--load-model`` names is in the repositories; when not, say so as tritonserver does."""
        try:
            self.model_dir(name)
        except NotFound:
            log.error("failed to poll model '%s': model not found in any model repository", name)
            return False
        except ServerError as exc:  # a name no directory can have, or one in two repositories
            log.error("failed to poll model '%s': %s", name, exc.message)
            return False
        return True

    async def _load_quietly(self, name: str) -> None:
        try:
            await self.load(name, _internal=True)
        except ServerError as exc:
            log.error("failed to load model '%s': %s", name, exc)

    async def poll(self) -> None:
        """Load new or changed models, and models that broke while serving (a model process that died);
        unload removed ones (``--model-control-mode=poll``)."""
        names = set(self.model_names())
        changed = {name for name in names if name not in self.entries
                   or _signature(self.model_dir(name)) != self.entries[name].signature
                   or any(r.state is ModelState.UNAVAILABLE for r in self.entries[name].versions.values())}
        composing = {name: set(self._composing(name)) for name in names}
        while True:  # an ensemble reloads with its composing models (and loads once they appear)
            dependents = {name for name, uses in composing.items() if uses & changed} - changed
            if not dependents:
                break
            changed |= dependents
        for wave in self.load_order(sorted(changed)):
            for name in wave:
                await self._load_quietly(name)
        removed = [name for name in self.entries if name not in names and self.entries[name].versions]
        for name in removed:
            await self.unload(name, _internal=True)
        if changed or removed:
            self._changed()

    def notify(self) -> None:
        for listener in list(self.listeners):
            try:
                listener()
            except Exception:
                log.exception("a repository listener failed")

    def _changed(self) -> None:
        self.notify()
        if self.after_change is not None:
            try:
                self.after_change()
            except Exception:
                log.exception("after a repository change")

    # -- ensembles: composing models first ----------------------------------------------------
    def _composing(self, name: str) -> list[str]:
        """The models ``name`` runs as an ensemble, from its config on disk ([] if unreadable)."""
        try:
            return composing_models(config_module.read_config(self.model_dir(name)))
        except ServerError:
            return []

    def load_order(self, names: list[str]) -> list[list[str]]:
        """``names`` in waves that load each ensemble after the composing models among ``names``."""
        pending = {name: set(self._composing(name)) & set(names) for name in names}
        waves = []
        while pending:
            wave = sorted(name for name, needs in pending.items() if not needs & pending.keys())
            if not wave:  # a cycle: each of those ensembles fails to load and says why
                wave = sorted(pending)
            waves.append(wave)
            for name in wave:
                del pending[name]
        return waves

    def _check_cycle(self, name: str, composing: list[str]) -> None:
        """Refuse an ensemble that (through other ensembles) runs itself."""
        path, seen = [name], set()

        def visit(models: list[str]) -> list[str] | None:
            for model in models:
                if model == name:
                    return path + [model]
                if model in seen:
                    continue
                seen.add(model)
                path.append(model)
                found = visit(self._composing(model))
                if found:
                    return found
                path.pop()
            return None

        cycle = visit(composing)
        if cycle:
            raise InvalidArgument(f"circular dependency between ensembles: {' -> '.join(cycle)}")

    async def _load_composing(self, composing: list[str]) -> None:
        """Explicit mode: loading an ensemble loads the composing models that are not loaded (as Triton)."""
        missing = [m for m in composing if m not in self.entries or not self.entries[m].versions]
        await asyncio.gather(*(self._load_quietly(model) for model in missing))

    async def poll_forever(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.poll()
            except Exception:
                log.exception("repository poll failed")

    # -- load / unload -------------------------------------------------------------------
    async def load(self, name: str, config_json: str | None = None, *, _internal: bool = False) -> None:
        """Load (or reload) every version of ``name`` its version policy selects."""
        if not _internal and self.control_mode is not ControlMode.EXPLICIT:
            raise Unavailable(NOT_EXPLICIT)
        check_model_name(name)
        if name not in self.entries:
            self.model_dir(name)  # NotFound for a name with no directory: leave no entry behind
        entry = self.entries.setdefault(name, ModelEntry(name))
        async with entry.lock:
            try:
                runtimes = await self._load_versions(name, config_json, entry)
            except BaseException as exc:
                error = as_server_error(exc) if isinstance(exc, Exception) else Unavailable("load cancelled")
                if not entry.versions:
                    entry.state, entry.reason = ModelState.UNAVAILABLE.value, error.message
                log.error("model '%s' failed to load: %s", name, error.message)
                raise error from None
            old = entry.versions
            entry.versions = runtimes
            entry.state, entry.reason = ModelState.READY.value, ""
            for version, runtime in old.items():
                await self._retire(runtime)
        log.info("loaded model '%s' version(s) %s", name, sorted(runtimes))
        if not _internal:
            entry.explicit = True
            self._changed()

    def _context(self, name: str, version: int, config: mc.ModelConfig, model_dir: Path) -> ModelContext:
        handles = self.handles
        ctx = ModelContext(name, version, copy.deepcopy(config), model_dir, self.metrics, infer=handles.infer,
                           models=handles.models, control=handles.control, allowed_roots=self.allowed_roots)
        check_config_files(ctx)
        return ctx

    async def _load_versions(self, name: str, config_json: str | None, entry: ModelEntry) -> dict[int, ModelRuntime]:
        model_dir = self.model_dir(name)
        entry.signature = _signature(model_dir)
        if config_json:
            config = config_module.parse_json(config_json)
        else:
            config = config_module.read_config(model_dir)
        config = config_module.normalize(config, name, model_dir)
        check_instance_count(config, self.max_instances)
        composing = composing_models(config)
        if composing:
            self._check_cycle(name, composing)
            if self.control_mode is ControlMode.EXPLICIT:
                await self._load_composing(composing)
        backend = await self.backends.get(config.backend)
        versions = select_versions(config.version_policy, available_versions(model_dir))
        if not versions:
            raise Unavailable(f"model '{name}' has no version directory its version policy selects "
                              f"(found {available_versions(model_dir) or 'none'})")
        runtimes = {
            version: ModelRuntime(backend, self._context(name, version, config, model_dir),
                                  self.metrics.model_stats(name, str(version)))
            for version in versions}
        for runtime in runtimes.values():
            runtime.on_change = self.notify
            runtime.rate_limiter = self.rate_limiter
        results = await asyncio.gather(*(r.load() for r in runtimes.values()), return_exceptions=True)
        failures = [(v, e) for v, e in zip(runtimes, results) if isinstance(e, BaseException)]
        if failures:
            for version, runtime in runtimes.items():
                if runtime.state is ModelState.READY:
                    await runtime.unload()
            version, exc = failures[0]
            if not isinstance(exc, Exception):
                raise Unavailable(f"version {version}: {exc}")
            error = as_server_error(exc)
            # a configuration the server refuses (a file outside the repository, a bad value) stays a 400
            kind = InvalidArgument if isinstance(error, InvalidArgument) else Unavailable
            raise kind(f"version {version}: {error.message}")
        return runtimes

    async def unload(self, name: str, *, _internal: bool = False, drain_timeout: float | None = 30.0,
                     unload_dependents: bool = False) -> None:
        """Unload every version of ``name``. ``unload_dependents``: also unload, recursively, the models this
        ensemble runs that no other loaded ensemble runs and that were loaded only as its steps (as Triton)."""
        if not _internal and self.control_mode is not ControlMode.EXPLICIT:
            raise Unavailable(NOT_EXPLICIT)
        check_model_name(name)
        entry = self.entries.get(name)
        if entry is None:
            if name in self.model_names():
                return
            raise NotFound(f"failed to unload '{name}': model is not known to the repository")
        steps = self._loaded_steps(entry) if unload_dependents else []
        async with entry.lock:
            old, entry.versions = entry.versions, {}
            entry.state, entry.reason = ModelState.UNAVAILABLE.value, "unloaded"
            entry.explicit = False
            for runtime in old.values():
                await self._retire(runtime, drain_timeout)
        log.info("unloaded model '%s'", name)
        for step in steps:
            step_entry = self.entries.get(step)
            if (step_entry is not None and step_entry.versions and not step_entry.explicit
                    and not any(step in self._loaded_steps(other) for other in self.entries.values())):
                await self.unload(step, _internal=True, drain_timeout=drain_timeout, unload_dependents=True)
        if not _internal:
            self._changed()

    @staticmethod
    def _loaded_steps(entry: ModelEntry) -> list[str]:
        """The models the loaded versions of ``entry`` run as ensemble steps."""
        return list(dict.fromkeys(model for runtime in entry.versions.values() for model, _ in runtime.steps))

    async def _retire(self, runtime: ModelRuntime, drain_timeout: float | None = 30.0) -> None:
        runtime.state = ModelState.UNLOADING
        await runtime.drain(drain_timeout)
        await runtime.unload()

    async def drain(self, timeout: float | None) -> None:
        """Wait until no request is in flight in any model, or ``timeout`` seconds."""
        await asyncio.gather(*(r.drain(timeout) for r in self.runtimes()))

    async def shutdown(self, drain_timeout: float | None) -> None:
        """Drain in-flight requests (up to ``drain_timeout`` seconds), then unload everything."""
        await self.drain(drain_timeout)
        for entry in self.entries.values():
            for runtime in entry.versions.values():
                await runtime.unload()
            entry.versions = {}
        await self.backends.finalize()

    # -- lookup --------------------------------------------------------------------------
    def get(self, name: str, version: str = "") -> ModelRuntime:
        """The runtime serving ``name`` at ``version`` ("" = highest ready version)."""
        entry = self.entries.get(name)
        if entry is None or not entry.versions:
            # a model that failed is unavailable; one unloaded on request is no model (Triton: NOT_FOUND)
            if entry is not None and entry.state == ModelState.UNAVAILABLE.value and entry.reason != "unloaded":
                raise Unavailable(f"model '{name}' is not ready: {entry.reason or 'unavailable'}")
            raise NotFound(f"unknown model: '{name}'" if entry is None
                           else f"Request for unknown model: '{name}' has no available versions")  # Triton's words
        if version:
            try:
                number = int(version)
            except ValueError:
                raise InvalidArgument(f"invalid model version '{version}': versions are integers") from None
            runtime = entry.versions.get(number)
            if runtime is None:
                raise NotFound(f"unknown version {version} of model '{name}'")
        else:
            runtime = entry.versions[max(entry.versions)]
        if runtime.state is not ModelState.READY:
            why = f"{runtime.state.value}: {runtime.reason}" if runtime.reason else runtime.state.value
            raise Unavailable(f"model '{name}' version {runtime.version} is not ready ({why})")
        if runtime.steps:
            problem = self.step_problem(runtime)
            if problem:
                raise Unavailable(f"model '{name}' version {runtime.version} is not ready ({problem})")
        return runtime

    def model_config(self, name: str, version: str = "") -> mc.ModelConfig:
        """The configuration of the ready version :meth:`get` finds (the models handle of backends)."""
        return self.get(name, version).config

    def step_problem(self, runtime: ModelRuntime) -> str:
        """Why an ensemble cannot serve: its first step (at any depth) that is not ready; "" when all are.
        Nothing is stored: the ensemble is UNAVAILABLE exactly while a step is, and back when it returns."""
        for model, version in runtime.steps:
            try:
                self.get(model, version)
            except ServerError as exc:
                return f"step model '{model}' is unavailable: {exc.message}"
        return ""

    def _state(self, runtime: ModelRuntime) -> tuple[str, str]:
        """(state, reason) of a version as the index and readiness report it."""
        if runtime.state is ModelState.READY and runtime.steps:
            problem = self.step_problem(runtime)
            if problem:
                return ModelState.UNAVAILABLE.value, problem
        return runtime.state.value, runtime.reason

    def runtimes(self) -> list[ModelRuntime]:
        return [r for e in self.entries.values() for r in e.versions.values()]

    def all_ready(self) -> bool:
        return all(e.state == ModelState.READY.value
                   and all(self._state(r)[0] == ModelState.READY.value for r in e.versions.values())
                   for e in self.entries.values() if e.state and e.reason != "unloaded")

    def index(self, ready_only: bool = False) -> list[dict]:
        rows = []
        names = set(self.model_names()) | set(self.entries)
        for name in sorted(names):
            entry = self.entries.get(name)
            if entry is not None and entry.versions:
                for version, runtime in sorted(entry.versions.items()):
                    state, reason = self._state(runtime)
                    rows.append({"name": name, "version": str(version), "state": state, "reason": reason})
            elif entry is not None and entry.state:
                rows.append({"name": name, "version": "", "state": entry.state, "reason": entry.reason})
            else:
                rows.append({"name": name, "version": "", "state": "", "reason": ""})
        if ready_only:
            rows = [r for r in rows if r["state"] == ModelState.READY.value]
        return rows
