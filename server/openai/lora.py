"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``, in vLLM's request and answer shapes.

Off unless the server runs with ``--enable-lora-runtime-updates`` (a load reads files from disk): then
404. The body is vLLM's ``{"lora_name", "lora_path", "load_inplace"}`` (load) or ``{"lora_name"}``
(unload), plus ``base_model_name`` where several models take adapters. Success is a 200 with a plain-text
sentence, as vLLM answers; errors are OpenAI JSON (400 for a bad name, path or adapter, 404 for an adapter
or path that is not there). The adapters belong to the models that take them (``Model.lora_adapters``): this
module picks the model an adapter goes to, in vLLM's words, and asks the serving interface to load or unload it
there.
"""

from __future__ import annotations

from typing import Any

from ..errors import ServerError
from .errors import BadRequest, OpenAIError
from .http import PlainText


def _field(doc: dict, name: str, kind: type, default: Any) -> Any:
    value = doc.get(name, default)
    if value is None and default is None:
        return None
    if not isinstance(value, kind) or (kind is str and isinstance(value, bool)):
        raise BadRequest(f"'{name}' must be a {'string' if kind is str else 'boolean'}", name)
    return value


def _body(doc: Any) -> dict:
    if not isinstance(doc, dict):
        raise BadRequest("the request body must be a JSON object")
    return doc


def _check_updates(server) -> None:
    if not server.adapter_updates:
        raise OpenAIError("loading and unloading LoRA adapters at run time is off; start the server with "
                          "--enable-lora-runtime-updates", 404)


def _adapter_takers(dataplane) -> list[str]:
    """The ready models that take LoRA adapters."""
    takers = []
    for name in dict.fromkeys(row["name"] for row in dataplane.repository_index(ready_only=True)):
        try:
            engine = dataplane.model(name).engine
        except ServerError:
            continue
        if engine is not None and engine.adapters:
            takers.append(name)
    return takers


def _owner(adapters: list[dict[str, str]], name: str) -> str | None:
    """The model that serves adapter ``name`` now, if one does."""
    return next((a["model"] for a in adapters if a["name"] == name), None)


async def load_lora_adapter(server, doc, _scope) -> bytes:
    _check_updates(server)
    doc = _body(doc)
    name = _field(doc, "lora_name", str, "")
    path = _field(doc, "lora_path", str, "")
    inplace = _field(doc, "load_inplace", bool, False)
    base = _field(doc, "base_model_name", str, "")
    if _field(doc, "is_3d_lora_weight", bool, False):
        raise BadRequest("'is_3d_lora_weight' adapters (3D MoE weights) are not supported", "is_3d_lora_weight")
    if not name or not path:
        raise OpenAIError("Both 'lora_name' and 'lora_path' must be provided.", 400)
    dataplane = server.dataplane
    try:
        if name in {row["name"] for row in dataplane.repository_index()}:
            raise OpenAIError(f"The lora adapter '{name}' conflicts with a served base model.", 400)
        adapters = dataplane.adapters()
        owner = _owner(adapters, name)
        if not base:
            if owner is not None:
                base = owner
            else:  # the one ready model that takes adapters
                takers = _adapter_takers(dataplane)
                if len(takers) != 1:
                    names = ", ".join(f"'{m}'" for m in takers)
                    raise OpenAIError("no ready model takes LoRA adapters" if not takers else
                                      f"several models take LoRA adapters ({names}): name one in 'base_model_name'",
                                      400)
                base = takers[0]
        if owner is not None and owner != base:
            raise OpenAIError(f"The lora adapter '{name}' has already been loaded on model '{owner}'.", 400)
        await dataplane.load_adapter(base, name, path, inplace)
    except ServerError as exc:
        raise _error(exc) from None
    return PlainText(f"Success: LoRA adapter '{name}' added successfully.".encode("utf-8"))


async def unload_lora_adapter(server, doc, _scope) -> bytes:
    _check_updates(server)
    doc = _body(doc)
    name = _field(doc, "lora_name", str, "")
    if not name:
        raise OpenAIError("'lora_name' needs to be provided to unload a LoRA adapter.", 400)
    owner = _owner(server.dataplane.adapters(), name)
    if owner is None:
        raise OpenAIError(f"The lora adapter '{name}' cannot be found.", 404)
    try:
        await server.dataplane.unload_adapter(owner, name)
    except ServerError as exc:
        raise _error(exc) from None
    return PlainText(f"Success: LoRA adapter '{name}' removed successfully.".encode("utf-8"))


def _error(exc: ServerError) -> OpenAIError:
    """vLLM answers these errors with ``param`` null; a 5xx stays what it is (an engine that died)."""
    return OpenAIError(exc.message, exc.http_code)
