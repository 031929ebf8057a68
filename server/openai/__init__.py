"""The OpenAI-compatible frontend: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``,
``/v1/embeddings``, ``/v1/score``, ``/v1/rerank``, ``/tokenize``, ``/detokenize``, ``/tokenizer_info``,
``/health``, ``/health/ready`` (Triton's OpenAI frontend's readiness); OpenAI's Responses API
(``/v1/responses``) and Anthropic's Messages API (``/v1/messages``).

Mounted on the HTTP app (same port as KServe v2). Like every frontend it only translates: requests
become DataPlane requests of the model's text interface (:mod:`.llm`), responses become OpenAI JSON
or server-sent events. One package per endpoint (``models``, ``completion``, ``chat_completion``,
``embedding``, ``score``, ``tokenization``), as in vLLM's ``entrypoints/openai``. The API key and the
restricted API groups guard these routes like every other (server/access.py): with ``--api-key`` the
``/v1`` routes (and ``/score``, ``/rerank``, ``/tokenize``, ``/detokenize``, ``/tokenizer_info``) answer
401 without ``Authorization: Bearer <key>``; ``/health`` never asks for the key.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.responses import Response
from starlette.routing import Route

from .chat_completion import create_chat_completion
from .completion import create_completion
from .embedding import EmbedderCatalog, create_embedding
from .http import OpenAIRoute, OpenAIServer
from .limits import OpenAILimits
from .llm import Catalog, OutputParsers
from .lora import load_lora_adapter, unload_lora_adapter
from .messages import AnthropicRoute, count_tokens, create_message
from .models import get_model, list_models, load_model, unload_model
from .responses.mcp import McpSettings
from .responses import (ResponseStore, Responses, cancel_response, create_response, delete_response, list_input_items,
                        retrieve_response)
from .score import create_rerank, create_score
from .tokenization import detokenize, tokenize, tokenizer_info

if TYPE_CHECKING:
    from ..http.body import BodyReader

__all__ = ["OpenAILimits", "mount"]


def _health(dataplane):
    """vLLM's liveness probe: 200 with an empty body, 503 (empty) once shutting down or when a model's
    engine died (``DataPlane.healthy``)."""

    async def health(_request) -> Response:
        return Response(status_code=200 if dataplane.healthy() else 503)

    return health


def _ready(dataplane):
    """Triton's OpenAI frontend's readiness probe: 200 (empty body) when the server is ready (KServe readiness),
    else 503 (empty)."""

    async def ready(_request) -> Response:
        return Response(status_code=200 if dataplane.ready() else 503)

    return ready


def mount(app, dataplane, body: BodyReader, limits: OpenAILimits | None = None,
          parsers: OutputParsers | None = None, model_control: bool = False,
          response_store: ResponseStore | None = None, mcp: McpSettings | None = None,
          adapter_updates: bool = False) -> OpenAIServer:
    """Add the OpenAI routes to ``app`` (a FastAPI / Starlette app); ``body`` is the HTTP port's body
    reader, ``limits`` what one request may ask for (the ``--openai-*`` flags), ``parsers`` the default
    tool-call and reasoning parsers (``--tool-call-parser``, ``--reasoning-parser``); ``model_control``: the
    server runs ``--model-control-mode explicit``, so ``/v1/models/{model}/load`` and ``/unload`` may act;
    ``response_store``: where ``/v1/responses`` keeps stored responses (``--response-store``); ``mcp``: the MCP
    servers ``/v1/responses`` may use (``--mcp-allow``); ``adapter_updates``: LoRA adapters may be loaded and
    unloaded at run time (``--enable-lora-runtime-updates``)."""
    server = OpenAIServer(dataplane, Catalog(dataplane, parsers), body, limits,
                          embedders=EmbedderCatalog(dataplane), model_control=model_control,
                          adapter_updates=adapter_updates)
    routes = [
        ("/v1/models", list_models, ["GET"], False),
        # before the catch-all model route: a name with '/' in it reaches these and is answered 404 there
        ("/v1/models/{model_name:path}/load", load_model, ["POST"], False),
        ("/v1/models/{model_name:path}/unload", unload_model, ["POST"], False),
        ("/v1/models/{model:path}", get_model, ["GET"], False),
        ("/v1/completions", create_completion, ["POST"], True),
        ("/v1/chat/completions", create_chat_completion, ["POST"], True),
        ("/v1/embeddings", create_embedding, ["POST"], True),
        ("/v1/score", create_score, ["POST"], True),
        ("/score", create_score, ["POST"], True),
        ("/v1/rerank", create_rerank, ["POST"], True),
        ("/rerank", create_rerank, ["POST"], True),
        ("/tokenize", tokenize, ["POST"], True),
        ("/detokenize", detokenize, ["POST"], True),
        ("/tokenizer_info", tokenizer_info, ["GET"], False),
        ("/v1/load_lora_adapter", load_lora_adapter, ["POST"], True),
        ("/v1/unload_lora_adapter", unload_lora_adapter, ["POST"], True),
        ("/v1/responses", create_response, ["POST"], True),
        ("/v1/responses/{response_id}", retrieve_response, ["GET"], False),
        ("/v1/responses/{response_id}", delete_response, ["DELETE"], False),
        ("/v1/responses/{response_id}/cancel", cancel_response, ["POST"], False),
        ("/v1/responses/{response_id}/input_items", list_input_items, ["GET"], False),
    ]
    server.responses = Responses(response_store or ResponseStore(), mcp=mcp or McpSettings())
    for path, handler, methods, body in routes:
        app.router.routes.append(Route(path, OpenAIRoute(server, handler, body), methods=methods))
    for path, handler in (("/v1/messages", create_message), ("/v1/messages/count_tokens", count_tokens)):
        app.router.routes.append(Route(path, AnthropicRoute(server, handler), methods=["POST"]))
    app.router.routes.append(Route("/health", _health(dataplane), methods=["GET"]))
    app.router.routes.append(Route("/health/ready", _ready(dataplane), methods=["GET"]))
    return server
