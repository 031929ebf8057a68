"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``, in vLLM's request and answer shapes.

Off unless the server runs with ``--enable-lora-runtime-updates`` (a load reads files from disk): then
404. The body is vLLM's ``{"lora_name", "lora_path", "load_inplace"}`` (load) or ``{"lora_name"}``
(unload), plus ``base_model_name`` where several models take adapters. Success is a 200 with a plain-text
sentence, as vLLM answers; errors are OpenAI JSON (400 for a bad name, path or adapter, 404 for an adapter
or path that is not there). The adapters live in the core: this module only reaches them through the
DataPlane, with plain values.
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


async def load_lora_adapter(server, doc, _scope) -> bytes:
    doc = _body(doc)
    name = _field(doc, "lora_name", str, "")
    path = _field(doc, "lora_path", str, "")
    inplace = _field(doc, "load_inplace", bool, False)
    base = _field(doc, "base_model_name", str, "")
    if _field(doc, "is_3d_lora_weight", bool, False):
        raise BadRequest("'is_3d_lora_weight' adapters (3D MoE weights) are not supported", "is_3d_lora_weight")
    try:
        message = await server.dataplane.load_lora_adapter(name, path, inplace, base)
    except ServerError as exc:
        raise _error(exc) from None
    return PlainText(message.encode("utf-8"))


async def unload_lora_adapter(server, doc, _scope) -> bytes:
    doc = _body(doc)
    name = _field(doc, "lora_name", str, "")
    try:
        message = await server.dataplane.unload_lora_adapter(name)
    except ServerError as exc:
        raise _error(exc) from None
    return PlainText(message.encode("utf-8"))


def _error(exc: ServerError) -> OpenAIError:
    """vLLM answers these errors with ``param`` null; a 5xx stays what it is (an engine that died)."""
    return OpenAIError(exc.message, exc.http_code)
