"""The KServe v2 / Triton HTTP/REST frontend: a FastAPI app over the DataPlane.

The control endpoints (health, metadata, config, statistics, repository) are ordinary FastAPI
routes. The infer endpoint is a raw ASGI handler: :class:`HttpApp` recognises
``POST /v2/models/<m>[/versions/<v>]/infer`` before routing and middleware, reads the body once,
parses it with ``orjson`` straight into numpy arrays and writes the response bytes itself. The same
handler is also registered as a regular route, so the app behaves identically when mounted.

Every error is ``{"error": "<message>"}`` with the status of the ServerError that caused it.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
import zlib
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from .. import config as config_module
from ..access import INFERENCE, AccessPolicy, Guard, admit, guard_routes, kserve_body
from ..errors import InvalidArgument, ServerError, Unsupported, as_server_error
from ..classification import classify, read_labels
from ..limits import TensorLimits
from . import codec
from .body import DEFAULT_MAX_INPUT_SIZE, BodyReader, ClientGone, parse_length

log = logging.getLogger(__name__)

JSON = "application/json"
_JSON_HEADER = (b"content-type", b"application/json")
_BINARY_HEADER = (b"content-type", b"application/octet-stream")
COMPRESS_MIN_BYTES = 1024  # smaller responses go back uncompressed whatever Accept-Encoding says
_INFER_PREFIX = "/v2/models/"
_INFER_SUFFIX = "/infer"
DISCONNECT_WATCH_S = 0.25  # infer requests running longer than this watch for the client going away


class _Disconnected(Exception):
    """The client disconnected while its request ran; the request was cancelled."""


class _DisconnectWatch:
    """Cancels a request's handler task when its client disconnects; started only for slow requests."""

    __slots__ = ("gone", "receive", "stopped", "task", "watcher")

    def __init__(self, receive, task: asyncio.Task) -> None:
        self.receive = receive
        self.task = task
        self.watcher: asyncio.Task | None = None
        self.gone = False
        self.stopped = False

    def start(self) -> None:
        if not self.stopped:
            self.watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        try:
            message = await self.receive()
        except Exception:  # the server is closing the connection itself
            log.debug("disconnect watch ended", exc_info=True)
            return
        if message["type"] == "http.disconnect" and not self.stopped:
            self.gone = True
            self.task.cancel()

    def stop(self) -> None:
        self.stopped = True
        if self.watcher is not None:
            self.watcher.cancel()


def _response_encoding(accept: bytes) -> str | None:
    """Triton's choice among identity, gzip and deflate by ``q`` weight (ties: first listed)."""
    best, weight = None, 0.0
    for part in accept.decode("latin-1").split(","):
        kind, _, q = part.strip().partition(";")
        kind = kind.strip().lower()
        if kind not in ("gzip", "deflate", "identity"):
            continue
        value = 1.0
        q = q.strip()
        if q.startswith("q="):
            try:
                value = float(q[2:])
            except ValueError:
                continue
        if value > weight:
            best, weight = (None if kind == "identity" else kind), value
    return best


def _compress(payload: bytes, encoding: str) -> bytes:
    if encoding == "gzip":
        compressor = zlib.compressobj(6, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    else:
        compressor = zlib.compressobj(6)
    return compressor.compress(payload) + compressor.flush()


def _error_body(message: str) -> bytes:
    return codec.dumps({"error": message})


def error_response(status: int, message: str, headers: dict | None = None) -> Response:
    return Response(_error_body(message), status_code=status, media_type=JSON, headers=headers)


def json_response(data: Any, status: int = 200) -> Response:
    return Response(codec.dumps(data), status_code=status, media_type=JSON)


async def _send(send, status: int, body: bytes, headers: list) -> None:
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _send_error(send, status: int, message: str) -> None:
    await _send(send, status, _error_body(message), [_JSON_HEADER])


class HttpFrontend:
    """The request handling behind the routes; holds the DataPlane and the limits."""

    def __init__(self, dataplane, body: BodyReader | None = None, tensor_limits: TensorLimits | None = None) -> None:
        self.dataplane = dataplane
        self.body = body or BodyReader()  # every route reads its body through this
        self.max_input_size = self.body.max_input_size
        self.tensor_limits = tensor_limits or TensorLimits()
        self._labels: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    # -- bodies --------------------------------------------------------------------------
    async def read_json(self, request: Request, what: str) -> Any:
        """A control request's JSON body (None when empty), within the limits."""
        body = await self.body.read_request(request.scope, request.receive)
        if not body.strip():
            return None
        doc = self.body.parse_json(body, what)
        if type(doc) is not dict:
            raise InvalidArgument(f"the {what} body must be a JSON object")
        return doc

    # -- inference -----------------------------------------------------------------------
    async def infer(self, scope, receive, send, model_name: str, model_version: str) -> None:
        content_length = header_length = encoding = accept = None
        for key, value in scope["headers"]:
            if key == b"content-length":
                content_length = value
            elif key == b"inference-header-content-length":
                header_length = value
            elif key == b"content-encoding":
                encoding = value
            elif key == b"accept-encoding":
                accept = value
        try:
            if content_length is not None:
                content_length = parse_length(content_length, "Content-Length")
            body = await self.body.read(receive, content_length, encoding)
            if header_length is not None:
                header_length = parse_length(header_length, "Inference-Header-Content-Length")
            if header_length == 0:
                decoded = codec.decode_raw_request(model_name, model_version, body,
                                                   self.dataplane.model_config(model_name, model_version))
            else:
                decoded = codec.decode_request(model_name, model_version, body, header_length, self.tensor_limits,
                                               self.body.max_json_depth)
            response, runtime = await self._run(decoded.request, receive)
            classifier = self._classifier(runtime) if decoded.classify else None
            payload, json_length = codec.encode_response(response, decoded, classifier)
        except ServerError as exc:
            await _send_error(send, exc.http_code, exc.message)
            return
        except (ClientGone, _Disconnected):
            return
        except Exception as exc:  # a bug, not bad input: report it without a stack trace
            log.exception("HTTP infer request for model '%s' failed", model_name)
            await _send_error(send, 500, f"internal error: {type(exc).__name__}: {exc}")
            return
        if json_length is None:
            headers = [_JSON_HEADER]
        else:
            headers = [_BINARY_HEADER, (b"inference-header-content-length", str(json_length).encode())]
        if accept is not None and len(payload) >= COMPRESS_MIN_BYTES:
            chosen = _response_encoding(accept)
            if chosen is not None:
                payload = _compress(payload, chosen)
                headers.append((b"content-encoding", chosen.encode()))
        await _send(send, 200, payload, headers)

    async def _run(self, request, receive):
        """Schedule one request and wait for its single response (HTTP infer is unary).

        A request still running after DISCONNECT_WATCH_S starts watching its connection: if the
        client goes away, the request is cancelled (the model sees ``request.is_cancelled()``).
        """
        request.streaming = False  # one response: LLM backends send the whole result at once
        stream = self.dataplane.infer(request)
        watch = _DisconnectWatch(receive, asyncio.current_task())
        timer = asyncio.get_running_loop().call_later(DISCONNECT_WATCH_S, watch.start)
        result = None
        try:
            async for response in stream:
                if response.error is not None:
                    raise as_server_error(response.error)
                if response.empty:
                    continue
                if result is not None:
                    raise Unsupported(f"model '{request.model_name}' is decoupled and sent more than one "
                                      "response; the HTTP infer endpoint returns exactly one (use the gRPC "
                                      "streaming API)")
                result = response
        except asyncio.CancelledError:
            await stream.aclose()
            if watch.gone:
                watch.task.uncancel()
                raise _Disconnected() from None
            raise
        except BaseException:
            await stream.aclose()
            raise
        finally:
            timer.cancel()
            watch.stop()
        if result is None:
            raise Unsupported(f"model '{request.model_name}' sent no response to the request")
        return result, stream.runtime

    def _classifier(self, runtime):
        batched = runtime.config.max_batch_size > 0

        def classify_output(name, datatype, array, count):
            return classify(array, datatype, count, name, self._output_labels(runtime, name), batched)[0]

        return classify_output

    def _output_labels(self, runtime, name: str):
        cache = self._labels.get(runtime)
        if cache is None:
            cache = self._labels[runtime] = {}
        if name not in cache:
            filename = next((o.label_filename for o in runtime.config.output if o.name == name), "")
            cache[name] = read_labels(runtime.ctx.model_path, filename)
        return cache[name]


class _InferRoute:
    """The infer handler as a plain ASGI app, for the router (used when the fast path does not apply)."""

    def __init__(self, frontend: HttpFrontend) -> None:
        self.frontend = frontend

    async def __call__(self, scope, receive, send) -> None:
        params = scope["path_params"]
        await self.frontend.infer(scope, receive, send, params["model_name"], params.get("model_version", ""))


def _infer_target(path: str) -> tuple[str, str] | None:
    """(model, version) of an infer path, or None when the path is not one."""
    middle = path[len(_INFER_PREFIX):-len(_INFER_SUFFIX)]
    if not middle:
        return None
    if "/" not in middle:
        return middle, ""
    name, sep, version = middle.partition("/versions/")
    if not sep or not name or not version or "/" in name or "/" in version:
        return None
    return name, version


class HttpApp(FastAPI):
    """FastAPI with the infer endpoint answered before routing (the hot path)."""

    frontend: HttpFrontend
    infer_guard: Guard | None = None  # the access check of the inference group, None when it has none

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"]
            if path.endswith(_INFER_SUFFIX) and path.startswith(_INFER_PREFIX) and not scope.get("root_path"):
                target = _infer_target(path)
                if target is not None:
                    guard = self.infer_guard
                    if guard is None or await admit(guard, kserve_body, scope, send):
                        await self.frontend.infer(scope, receive, send, target[0], target[1])
                    return
        await super().__call__(scope, receive, send)


def create_app(dataplane, *, max_input_size: int = DEFAULT_MAX_INPUT_SIZE, max_decompressed_size: int | None = None,
               max_json_depth: int = codec.MAX_JSON_DEPTH, tensor_limits: TensorLimits | None = None,
               access: AccessPolicy | None = None, openapi: bool = True, openai_limits=None) -> HttpApp:
    """The HTTP app: KServe v2 and Triton's extensions, plus the OpenAI routes (``access``: the restricted
    API groups and the API key, see server/access.py; ``openapi``: serve the API's description at
    ``GET /openapi.json``; ``openai_limits``: what one /v1 request may ask for, server/openai/limits.py)."""
    frontend = HttpFrontend(dataplane, BodyReader(max_input_size, max_decompressed_size, max_json_depth), tensor_limits)
    app = HttpApp(title="tideserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.frontend = frontend
    dp = dataplane

    # -- errors ----------------------------------------------------------------------------
    @app.exception_handler(ServerError)
    async def _server_error(_request, exc: ServerError):
        return error_response(exc.http_code, exc.message)

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

    # -- health and metadata ---------------------------------------------------------------
    @app.get("/v2/health/live")
    async def health_live():
        return Response(status_code=200 if dp.live() else 400)

    @app.get("/v2/health/ready")
    async def health_ready():
        return Response(status_code=200 if dp.ready() else 400)

    @app.get("/v2")
    async def server_metadata():
        return json_response(dp.server_metadata())

    @app.get("/v2/models/stats")
    async def all_statistics():
        return json_response({"model_stats": dp.model_statistics("", "")})

    if openapi:
        from .. import openapi as openapi_document

        @app.get(openapi_document.PATH)
        async def openapi_json():
            return Response(openapi_document.document_json(), media_type=JSON)

    def target(request: Request) -> tuple[str, str]:
        params = request.path_params
        return params["model_name"], params.get("model_version", "")

    async def model_ready(request: Request):
        name, version = target(request)
        if dp.model_ready(name, version):
            return Response(status_code=200)
        which = f"version {version} of model '{name}'" if version else f"model '{name}'"
        return error_response(400, f"{which} is not ready")

    async def model_metadata(request: Request):
        return json_response(dp.model_metadata(*target(request)))

    async def model_config(request: Request):
        return json_response(config_module.to_dict(dp.model_config(*target(request))))

    async def model_statistics(request: Request):
        return json_response({"model_stats": dp.model_statistics(*target(request))})

    for suffix, handler in (("", model_metadata), ("/ready", model_ready), ("/config", model_config),
                            ("/stats", model_statistics)):
        app.add_api_route("/v2/models/{model_name}" + suffix, handler, methods=["GET"])
        app.add_api_route("/v2/models/{model_name}/versions/{model_version}" + suffix, handler, methods=["GET"])

    infer_route = _InferRoute(frontend)
    app.router.routes.append(Route("/v2/models/{model_name}/infer", infer_route, methods=["POST"]))
    app.router.routes.append(Route("/v2/models/{model_name}/versions/{model_version}/infer", infer_route,
                                   methods=["POST"]))

    # -- generate extension (server/http/generate.py) ---------------------------------------
    from .generate import GENERATE, GENERATE_STREAM, GenerateRoute

    for suffix, streaming in ((GENERATE, False), (GENERATE_STREAM, True)):
        generate_route = GenerateRoute(frontend, streaming)
        app.router.routes.append(Route("/v2/models/{model_name}" + suffix, generate_route, methods=["POST"]))
        app.router.routes.append(Route("/v2/models/{model_name}/versions/{model_version}" + suffix,
                                       generate_route, methods=["POST"]))

    # -- OpenAI-compatible API (server/openai/) --------------------------------------------
    from ..openai import mount as mount_openai

    mount_openai(app, frontend, openai_limits)

    # -- model repository -----------------------------------------------------------------
    @app.post("/v2/repository/index")
    async def repository_index(request: Request):
        doc = await frontend.read_json(request, "repository index request")
        ready = False
        if doc is not None and "ready" in doc:
            ready = doc["ready"]
            if type(ready) is not bool:
                raise InvalidArgument("invalid value for 'ready': expected a boolean")
        return json_response(dp.repository_index(ready))

    @app.post("/v2/repository/models/{model_name}/load")
    async def repository_load(model_name: str, request: Request):
        doc = await frontend.read_json(request, "load request")
        config_json = None
        params = _parameters(doc, "load")
        for key, value in params.items():
            if key == "config":
                if type(value) is not str:
                    raise InvalidArgument("load parameter 'config' must be a string holding the model "
                                          "configuration as JSON")
                config_json = value
            elif key.startswith("file:"):
                raise Unsupported(f"load parameter '{key}': loading model files sent with the request is not "
                                  "supported; place them in the model repository")
        await dp.load_model(model_name, config_json)
        return Response(status_code=200)

    @app.post("/v2/repository/models/{model_name}/unload")
    async def repository_unload(model_name: str, request: Request):
        doc = await frontend.read_json(request, "unload request")
        params = _parameters(doc, "unload")
        dependents = params.get("unload_dependents", False)
        if type(dependents) is not bool:
            raise InvalidArgument("unload parameter 'unload_dependents' must be a boolean")
        await dp.unload_model(model_name, unload_dependents=dependents)
        return Response(status_code=200)

    # -- access control (server/access.py): each route behind the checks of its API group ----------
    from ..openai.errors import OpenAIError

    policy = access or AccessPolicy()
    guard_routes(app, policy, lambda refusal: OpenAIError(refusal.message, refusal.status).json())
    app.infer_guard = policy.http_guard(INFERENCE)  # the fast path answers infer before routing
    return app


def _parameters(doc: dict | None, what: str) -> dict:
    if doc is None:
        return {}
    params = doc.get("parameters", {})
    if type(params) is not dict:
        raise InvalidArgument(f"{what} request 'parameters' must be an object")
    return params

