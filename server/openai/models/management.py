"""``POST /v1/models/{model}/load`` and ``POST /v1/models/{model}/unload``: model management as Triton's OpenAI
frontend offers it (the ``model-repository`` group of the restricted-API flags).

Both work only with ``--model-control-mode explicit`` (otherwise 400 "Model load/unload requires
--model-control-mode=explicit") and block until the model is loaded (its card is the answer) or unloaded
(``{"status": "success", "model": <name>}``; requests in flight finish first). One load or unload runs at a time
per frontend process: of concurrent loads of one model the first loads it and the others get 400 "Model '<name>'
is already loaded"; of concurrent unloads the first unloads it and the others get 400 "Unknown model: <name>".
A name that holds a '/' or is empty is no model route (404, as Triton's router answers); a blank name or one with
control characters is 400; a load that fails is 400 for a configuration the server refuses, 404 for a model that
is in no repository (Triton: 500), else the error's own status, each "Failed to load model '<name>': <why>".
"""

from __future__ import annotations

import time

import orjson

from ...errors import NOT_EXPLICIT, InvalidArgument, NotFound, ServerError
from ..errors import BadRequest, ModelNotFound, OpenAIError

_EXPLICIT_ONLY = "Model load/unload requires --model-control-mode=explicit"


def _model_name(server, scope) -> str:
    name = scope["path_params"]["model_name"]
    if not name or "/" in name:
        raise ModelNotFound(name)
    if not name.strip() or not name.isprintable():
        raise BadRequest(f"Invalid model name {name!r}", "model")
    if not server.model_control:
        raise BadRequest(_EXPLICIT_ONLY)
    return name


def _failed(action: str, name: str, exc: ServerError) -> OpenAIError:
    if exc.message == NOT_EXPLICIT:  # (the repository's refusal outside the explicit mode)
        return BadRequest(_EXPLICIT_ONLY)
    status = 400 if isinstance(exc, InvalidArgument) else 404 if isinstance(exc, NotFound) else exc.http_code
    return OpenAIError(f"Failed to {action} model '{name}': {exc.message}", status)


async def load_model(server, _doc, scope) -> bytes:
    name = _model_name(server, scope)
    async with server.model_control_lock:
        if server.dataplane.model_ready(name):
            raise BadRequest(f"Model '{name}' is already loaded", "model")
        try:
            await server.dataplane.load_model(name)
        except ServerError as exc:
            raise _failed("load", name, exc) from None
    return orjson.dumps({"id": name, "object": "model", "created": int(time.time()), "owned_by": "tideserve",
                         "root": name, "parent": None})


async def unload_model(server, _doc, scope) -> bytes:
    name = _model_name(server, scope)
    async with server.model_control_lock:
        if not server.dataplane.model_ready(name):
            raise BadRequest(f"Unknown model: {name}", "model")
        try:
            await server.dataplane.unload_model(name)
        except ServerError as exc:
            raise _failed("unload", name, exc) from None
    return orjson.dumps({"status": "success", "model": name})
