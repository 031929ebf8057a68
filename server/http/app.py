"""The HTTP port's app: KServe v2, Triton's generate extension and the OpenAI-compatible routes on one
FastAPI app, every route behind the access checks of its API group.

:func:`create_app` is the one place the app is put together:

* KServe v2 with Triton's extensions (:mod:`.kserve`); :class:`HttpApp` answers
  ``POST /v2/models/<m>[/versions/<v>]/infer`` before routing and middleware (the hot path);
* ``/generate`` and ``/generate_stream`` (:mod:`.generate`);
* ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` and ``/health`` (:mod:`tideserve.openai`);
* ``GET /openapi.json``, the description of all of them (:mod:`tideserve.openapi`);
* ``GET /metrics``, the same Prometheus text as the metrics port (``DataPlane.metrics_text``);
* ``GET /load`` (the replica's load, :mod:`tideserve.load_report`) and vLLM's ``POST /reset_prefix_cache``;
* the access checks (:mod:`tideserve.access`): :func:`~tideserve.access.guard_routes` puts every route
  behind its group's Guard, and the fast infer path asks the inference group's Guard itself.

Every route reads its body through one :class:`~.body.BodyReader`; the rest of what the frontends share
over ASGI (sending answers, client disconnects) is :mod:`tideserve.asgi`. An error that no route
answered itself is KServe's ``{"error": "<message>"}``.
"""

from __future__ import annotations

import logging

import orjson
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from .. import load_report
from .. import openapi as openapi_document
from ..access import INFERENCE, METRICS_PATH, AccessPolicy, Guard, Refusal, admit, guard_routes, kserve_body
from ..asgi import ClientGone
from ..errors import InvalidArgument, ServerError
from ..limits import TensorLimits
from ..openai import mount as mount_openai
from ..openai.errors import OpenAIError
from ..openai.limits import OpenAILimits
from ..openai.llm import OutputParsers
from ..openai.messages import refusal_body as anthropic_refusal
from ..openai.responses import StoreSettings
from ..openai.responses.mcp import McpSettings
from ..serving import ServingInterface
from . import codec, generate, kserve
from .body import DEFAULT_MAX_INPUT_SIZE, BodyReader
from .kserve import INFER_PREFIX, INFER_SUFFIX, JSON, HttpFrontend, error_response, infer_target

log = logging.getLogger(__name__)
# POST routes answered before routing, as infer is (their app answers every error itself): the LLM streams and
# the embeddings (the router would walk past ~40 routes first)
DIRECT_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/embeddings")
GENERATE_SUFFIXES = (generate.GENERATE, generate.GENERATE_STREAM)


class HttpApp(FastAPI):
    """FastAPI with the infer endpoint answered before routing (the hot path)."""

    frontend: HttpFrontend
    infer_guard: Guard | None = None  # the access check of the inference group, None when it has none
    direct: dict = {}  # POST path -> its route's app (behind its guard), answered before routing and middleware
    generate_routes: tuple = ()  # the generate routes (behind their guard), also answered before the middleware

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            path = scope["path"]
            if path.endswith(INFER_SUFFIX) and path.startswith(INFER_PREFIX):
                target = infer_target(path)
                if target is not None:
                    guard = self.infer_guard
                    if guard is None or await admit(guard, kserve_body, scope, send):
                        await self.frontend.infer(scope, receive, send, target[0], target[1])
                    return
            route = self.direct.get(path)
            if route is not None:  # the LLM routes: each streamed chunk skips the middleware's send wrappers
                await route(scope, receive, send)
                return
            if path.endswith(GENERATE_SUFFIXES):  # the same for generate's (a refusal leaves in one write, at once)
                for route in self.generate_routes:
                    match, child = route.matches(scope)
                    if match is Match.FULL:
                        scope.update(child)
                        await route.handle(scope, receive, send)
                        return
        await super().__call__(scope, receive, send)

    def infer_handler(self, path: str):
        """For the HTTP protocol (server/http/limits.py), which answers a ``POST`` to ``path`` without an ASGI
        call where this gives one: ``(handler, model, version)``, called as ``handler(scope, receive, send, model,
        version)``, for a KServe infer path; None for any other path and where the inference group has an access
        check (``__call__`` asks it)."""
        if self.infer_guard is not None or not (path.endswith(INFER_SUFFIX) and path.startswith(INFER_PREFIX)):
            return None
        target = infer_target(path)
        if target is None:
            return None
        return self.frontend.infer, target[0], target[1]


def create_app(dataplane: ServingInterface, *, max_input_size: int = DEFAULT_MAX_INPUT_SIZE, max_decompressed_size: int | None = None,
               max_json_depth: int = codec.MAX_JSON_DEPTH, tensor_limits: TensorLimits | None = None,
               access: AccessPolicy | None = None, openapi: bool = True,
               openai_limits: OpenAILimits | None = None,
               openai_parsers: OutputParsers | None = None, openai_model_control: bool = False,
               response_store: StoreSettings | None = None, mcp: McpSettings | None = None,
               openai_adapter_updates: bool = False) -> HttpApp:
    """The HTTP app: KServe v2 and Triton's extensions, generate, and the OpenAI routes (``access``: the
    restricted API groups and the API key, see server/access.py; ``openapi``: serve the API's description
    at ``GET /openapi.json``; ``openai_limits``: what one /v1 request may ask for, server/openai/limits.py;
    ``openai_parsers``: the default tool-call and reasoning parsers)."""
    body = BodyReader(max_input_size, max_decompressed_size, max_json_depth)
    frontend = HttpFrontend(dataplane, body, tensor_limits)
    app = HttpApp(title="tideserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.frontend = frontend
    _answer_errors(app)
    kserve.mount(app, frontend)
    generate.mount(app, dataplane, body)
    mount_openai(app, dataplane, body, openai_limits, openai_parsers, model_control=openai_model_control,
                 response_store=(response_store or StoreSettings()).open(), mcp=mcp,
                 adapter_updates=openai_adapter_updates)
    @app.get(METRICS_PATH)
    async def metrics():  # the metrics port's registry, for routers and autoscalers that scrape this port
        return Response(await dataplane.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    @app.get(load_report.LOAD_PATH)
    async def load(model: str | None = None):  # the replica's load for routers (tideserve.load_report)
        return Response(orjson.dumps(await dataplane.load_report(_named(model))), media_type=JSON)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(model: str | None = None, reset_running_requests: bool = False):  # as vLLM's
        return Response(orjson.dumps(await dataplane.reset_prefix_cache(_named(model), reset_running_requests)),
                        media_type=JSON)

    if openapi:
        @app.get(openapi_document.PATH)
        async def openapi_json():
            return Response(openapi_document.document_json(), media_type=JSON)

    # every route behind the checks of its API group (a route of no group makes this raise)
    policy = access or AccessPolicy()
    guard_routes(app, policy, _openai_refusal, anthropic_refusal)
    app.infer_guard = policy.http_guard(INFERENCE)  # the fast path answers infer before routing
    app.direct = {route.path: route.app for route in app.router.routes
                  if getattr(route, "path", None) in DIRECT_ROUTES and "POST" in route.methods}
    app.generate_routes = tuple(route for route in app.router.routes
                                if getattr(route, "path", "").endswith(GENERATE_SUFFIXES) and "POST" in route.methods)
    return app


def _named(model: str | None) -> str:
    """The ``model`` query parameter: absent means every model; present, it must name one."""
    if model is not None and not model:
        raise InvalidArgument("query parameter 'model' must name a model (leave it out for every model)")
    return model or ""


def _openai_refusal(refusal: Refusal) -> bytes:
    return OpenAIError(refusal.message, refusal.status).json()


def _answer_errors(app: FastAPI) -> None:
    """What the app answers for an exception no route answered itself: KServe's error shape."""

    @app.exception_handler(ServerError)
    async def _server_error(_request, exc: ServerError):
        retry = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else None
        return error_response(exc.http_code, exc.message, retry)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(ClientGone)
    async def _client_gone(_request, _exc: ClientGone):
        return Response(status_code=499)  # nobody reads it: the client left before its body arrived

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request, exc: RequestValidationError):
        return error_response(400, f"invalid request: {exc.errors()}")

    @app.exception_handler(Exception)
    async def _internal_error(_request, exc: Exception):
        log.exception("HTTP request failed")
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
