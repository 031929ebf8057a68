"""The OpenAI-compatible frontend: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``, ``/health``.

Mounted on the HTTP app (same port as KServe v2). Like every frontend it only translates: requests
become DataPlane requests of the model's text interface (:mod:`.llm`), responses become OpenAI JSON
or server-sent events. One package per endpoint (``models``, ``completion``, ``chat_completion``),
as in vLLM's ``entrypoints/openai``. The API key and the restricted API groups guard these routes
like every other (server/access.py): with ``--api-key`` the ``/v1`` routes answer 401 without
``Authorization: Bearer <key>``; ``/health`` never asks for the key.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.routing import Route

from .chat_completion import create_chat_completion
from .completion import create_completion
from .errors import OpenAIError
from .http import OpenAIRoute, OpenAIServer
from .limits import OpenAILimits
from .llm import Catalog
from .models import get_model, list_models

if TYPE_CHECKING:
    from ..http.body import BodyReader

__all__ = ["OpenAILimits", "mount"]


async def _health(server, _doc, _scope) -> bytes:
    if not server.dataplane.accepting:
        raise OpenAIError("the server is shutting down", 503)
    return b""


def mount(app, dataplane, body: BodyReader, limits: OpenAILimits | None = None) -> OpenAIServer:
    """Add the OpenAI routes to ``app`` (a FastAPI / Starlette app); ``body`` is the HTTP port's body
    reader, ``limits`` what one request may ask for (the ``--openai-*`` flags)."""
    server = OpenAIServer(dataplane, Catalog(dataplane), body, limits)
    routes = [
        ("/v1/models", list_models, ["GET"], False),
        ("/v1/models/{model:path}", get_model, ["GET"], False),
        ("/v1/completions", create_completion, ["POST"], True),
        ("/v1/chat/completions", create_chat_completion, ["POST"], True),
    ]
    for path, handler, methods, body in routes:
        app.router.routes.append(Route(path, OpenAIRoute(server, handler, body), methods=methods))
    app.router.routes.append(Route("/health", OpenAIRoute(server, _health, False), methods=["GET"]))
    return server
