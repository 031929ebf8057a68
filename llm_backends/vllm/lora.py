"""LoRA adapters of a vLLM model: declared with the model, selected per request, loaded at run time.

Adapters are declared in ``<version>/multi_lora.json`` (``{"name": "path"}``, as Triton's vLLM backend
reads it) and/or under ``lora_modules`` in ``model.json`` (vLLM's ``--lora-modules``: ``"name=path"``
strings, ``{"name", "path"}`` objects, or one ``{"name": "path"}`` object). Either needs
``enable_lora: true`` among the engine arguments (``max_loras``, ``max_lora_rank``... pass through to
the engine). A relative path resolves against the version directory; every path must lie inside the
model repository or an ``--allowed-model-root`` (tideserve.model_paths), and name a local directory:
adapters are never fetched from a hub.

A request picks an adapter with the ``lora_name`` sampling parameter (a request parameter or a key of
``sampling_parameters``, as in Triton's vLLM backend); the OpenAI frontend sets it for a ``model``
that names an adapter.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

from tideserve.backend_api import InvalidArgument, ModelContext, NotFound, Unavailable, model_paths

log = logging.getLogger(__name__)

MULTI_LORA_FILE = "multi_lora.json"
LORA_NAME = "lora_name"  # the sampling parameter that selects an adapter


def lora_enabled(kwargs: dict[str, Any]) -> bool:
    """Whether the engine arguments enable LoRA (``true`` or ``"true"``, as Triton's backend reads it)."""
    return str(kwargs.get("enable_lora", False)).lower() == "true"


def declared_adapters(ctx: ModelContext, kwargs: dict[str, Any]) -> dict[str, str]:
    """Adapter name -> resolved local path, from ``multi_lora.json`` and ``lora_modules`` (which this removes
    from ``kwargs``: it is no engine argument)."""
    declared: dict[str, tuple[str, str]] = {}  # name -> (path as written, where it was declared)
    modules = kwargs.pop("lora_modules", None)
    if modules is not None:
        for name, path in _modules(ctx, modules):
            declared[name] = (path, "lora_modules")
    multi = ctx.version_path / MULTI_LORA_FILE
    if multi.is_file():
        for name, path in _multi_lora(ctx, multi).items():
            if name in declared:
                raise InvalidArgument(f"model '{ctx.name}': LoRA adapter '{name}' is declared both in "
                                      f"'{MULTI_LORA_FILE}' and in 'lora_modules'")
            declared[name] = (path, MULTI_LORA_FILE)
    if declared and not lora_enabled(kwargs):
        raise InvalidArgument(f"model '{ctx.name}' declares LoRA adapters ({', '.join(declared)}) but its engine "
                              "arguments do not set 'enable_lora': true")
    return {name: resolve_adapter_path(ctx, name, path, f"LoRA adapter '{name}' ({where})")
            for name, (path, where) in declared.items()}


def _modules(ctx: ModelContext, modules: Any) -> list[tuple[str, str]]:
    if isinstance(modules, dict):
        modules = [{"name": k, "path": v} for k, v in modules.items()]
    if not isinstance(modules, list):
        raise InvalidArgument(f"model '{ctx.name}': 'lora_modules' must be a list of 'name=path' strings or "
                              "{\"name\", \"path\"} objects")
    found = []
    for item in modules:
        if isinstance(item, str) and "=" in item:
            name, path = item.split("=", 1)
        elif isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("path"), str):
            name, path = item["name"], item["path"]
        else:
            raise InvalidArgument(f"model '{ctx.name}': entry {item!r} of 'lora_modules' is neither 'name=path' "
                                  "nor {\"name\": ..., \"path\": ...}")
        if any(name == seen for seen, _ in found):
            raise InvalidArgument(f"model '{ctx.name}': LoRA adapter '{name}' appears twice in 'lora_modules'")
        found.append((name, path))
    return found


def _multi_lora(ctx: ModelContext, path: Path) -> dict[str, str]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"failed to parse '{path}': {exc}") from None
    if not isinstance(doc, dict) or not all(isinstance(v, str) for v in doc.values()):
        raise InvalidArgument(f"'{path}' must hold a JSON object of adapter name -> adapter directory")
    return doc


def resolve_adapter_path(ctx: ModelContext, name: str, value: str, field: str) -> str:
    """The adapter directory ``value`` names (relative: under the version directory), confined to the model
    repository and the allowed roots. InvalidArgument outside them; NotFound (vLLM's message) where there is
    no adapter."""
    if not name or any(c in name for c in "\n\r\0"):
        raise InvalidArgument(f"model '{ctx.name}': LoRA adapter name {name!r} is empty or holds a control character")
    if not value:
        raise InvalidArgument(f"model '{ctx.name}': {field} names no path")
    candidate = Path(value)
    if not candidate.is_absolute():
        candidate = ctx.version_path / candidate
    resolved = model_paths.check_inside(candidate, ctx.file_roots, ctx.name, field, value)
    if not (resolved / "adapter_config.json").is_file():
        raise NotFound(f"Loading lora {name} failed: No adapter found for {value}")
    return str(resolved)


class Adapters:
    """The adapters one engine serves now: name -> vLLM ``LoRARequest``; loads go through the engine."""

    def __init__(self, model_name: str, enabled: bool) -> None:
        self.model_name = model_name
        self.enabled = enabled
        self._requests: dict[str, Any] = {}  # name -> LoRARequest
        self._next_id = 1
        self._lock = asyncio.Lock()

    def listing(self) -> list[dict[str, str]]:
        return [{"name": name, "path": r.lora_path} for name, r in self._requests.items()]

    def select(self, name: Any):
        """The ``LoRARequest`` of a request's ``lora_name`` (None: the base model)."""
        if name is None:
            return None
        if not isinstance(name, str):
            raise InvalidArgument(f"sampling parameter '{LORA_NAME}' must be a string, got {name!r}")
        if not self.enabled:
            raise InvalidArgument(f"sampling parameter '{LORA_NAME}': model '{self.model_name}' serves no LoRA "
                                  "adapters (its engine arguments do not set 'enable_lora': true)")
        request = self._requests.get(name)
        if request is None:
            known = ", ".join(f"'{n}'" for n in self._requests) or "none"
            raise InvalidArgument(f"sampling parameter '{LORA_NAME}': model '{self.model_name}' has no LoRA adapter "
                                  f"'{name}' (its adapters: {known})")
        return request

    async def load(self, engine, name: str, path: str, load_inplace: bool = False) -> None:
        """Load ``path`` (resolved and confined already) into ``engine`` as adapter ``name``."""
        from vllm.lora.request import LoRARequest

        if not self.enabled:
            raise InvalidArgument(f"model '{self.model_name}' takes no LoRA adapters: its engine arguments do not "
                                  "set 'enable_lora': true")
        async with self._lock:
            previous = self._requests.get(name)
            if previous is not None and not load_inplace:
                raise InvalidArgument(f"The lora adapter '{name}' has already been loaded. If you want to load the "
                                      "adapter in place, set 'load_inplace' to True.")
            await asyncio.to_thread(check_adapter, engine, name, path)
            lora_id = previous.lora_int_id if previous is not None else self._next_id
            request = LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path,
                                  load_inplace=previous is not None)
            try:
                await engine.add_lora(request)
            except Exception as exc:
                raise _load_error(name, path, exc) from None
            if previous is None:
                self._next_id += 1
            self._requests[name] = request
            log.info("model '%s': LoRA adapter '%s' loaded from '%s'", self.model_name, name, path)

    async def unload(self, name: str) -> None:
        """Forget adapter ``name``: new requests cannot select it; its weights leave the engine's adapter
        cache as other adapters need the room (vLLM's OpenAI server does the same)."""
        async with self._lock:
            if self._requests.pop(name, None) is None:
                raise NotFound(f"The lora adapter '{name}' cannot be found.")
            log.info("model '%s': LoRA adapter '%s' unloaded", self.model_name, name)


def check_adapter(engine, name: str, path: str) -> None:
    """vLLM's own checks of an adapter's config against the engine (rank, bias, unsupported features), made
    before the engine loads it: a refused adapter is the client's error, and no engine worker logs a traceback."""
    from vllm.lora.peft_helper import PEFTHelper

    text_config = engine.model_config.hf_config.get_text_config()
    try:
        helper = PEFTHelper.from_local_dir(path, getattr(text_config, "max_position_embeddings", None))
        helper.validate_legal(engine.vllm_config.lora_config)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise InvalidArgument(f"Loading lora {name} failed: {type(exc).__name__}: {exc}") from None


def _load_error(name: str, path: str, exc: BaseException):
    """An engine's failure to load an adapter as the client's error: the adapter is bad, the server is not."""
    from vllm.exceptions import LoRAAdapterNotFoundError
    from vllm.v1.engine.exceptions import EngineDeadError

    if isinstance(exc, EngineDeadError):
        return Unavailable(f"the vLLM engine is dead: {exc}")
    text = str(exc)
    if isinstance(exc, LoRAAdapterNotFoundError) or "No adapter found" in text:
        return NotFound(f"Loading lora {name} failed: No adapter found for {path}")
    return InvalidArgument(f"Loading lora {name} failed: {type(exc).__name__}: {text}")
