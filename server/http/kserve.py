"""The KServe v2 / Triton HTTP/REST routes over the DataPlane: health, metadata, config, statistics,
model repository, and infer (with Triton's binary tensors and classification extensions).

The control endpoints are ordinary FastAPI routes. Infer is a raw ASGI handler
(:meth:`HttpFrontend.infer`): one body read, ``orjson`` straight into numpy arrays, the response bytes
written by hand. The app (:mod:`tideserve.http.app`) answers ``POST /v2/models/<m>[/versions/<v>]/infer``
with it before routing; the same handler is also a regular route, so the app behaves the same when mounted.

Every error is ``{"error": "<message>"}`` with the status of the ServerError that caused it.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import weakref
import zlib
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from starlette.routing import Route

from .. import config as config_module
from ..asgi import (
    JSON_HEADER,
    ClientGone,
    FastCycle,
    cancel_on_disconnect,
    error_body,
    send_error,
    send_response,
    send_whole,
)
from ..classification import classify, read_labels
from ..errors import InvalidArgument, ServerError, Unsupported, as_server_error
from ..limits import TensorLimits
from ..serving import ServingInterface
from . import codec
from .body import BodyReader, parse_length

log = logging.getLogger(__name__)

JSON = "application/json"
BINARY_HEADER = (b"content-type", b"application/octet-stream")
COMPRESS_MIN_BYTES = 1024  # smaller responses go back uncompressed whatever Accept-Encoding says
INFER_PREFIX = "/v2/models/"
INFER_SUFFIX = "/infer"
DISCONNECT_WATCH_S = 0.25  # infer requests running longer than this watch for the client going away
MODEL_ROUTES = ("/v2/models/{model_name}", "/v2/models/{model_name}/versions/{model_version}")


_NO_WATCH = contextlib.nullcontext()


def error_response(status: int, message: str, headers: dict | None = None) -> Response:
    return Response(error_body(message), status_code=status, media_type=JSON, headers=headers)


def json_response(data: Any, status: int = 200) -> Response:
    return Response(codec.dumps(data), status_code=status, media_type=JSON)


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


class HttpFrontend:
    """The request handling behind the KServe routes; holds the DataPlane and the limits."""

    def __init__(self, dataplane: ServingInterface, body: BodyReader | None = None, tensor_limits: TensorLimits | None = None) -> None:
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
        given = dict(scope["headers"])  # the last of a repeated header, as a loop over them would keep
        content_length = given.get(b"content-length")
        header_length = given.get(b"inference-header-content-length")
        encoding = given.get(b"content-encoding")
        accept = given.get(b"accept-encoding")
        traceparent = given.get(b"traceparent")
        try:
            if content_length is not None:
                content_length = parse_length(content_length, "Content-Length")
            body = self.body.whole(receive, content_length, encoding)
            if body is None:  # more to come: wait for it
                body = await self.body.read(receive, content_length, encoding)
            if header_length is not None:
                header_length = parse_length(header_length, "Inference-Header-Content-Length")
            there = None
            if header_length != 0 and traceparent is None:  # decoded and answered where the model runs, if it can
                handed = self.dataplane.infer_json(model_name, model_version, body, header_length, self.tensor_limits,
                                                   self.body.max_json_depth)
                if handed is not None:
                    try:  # (the HTTP protocol cancels this handler when its connection is lost: so is the request)
                        there = await handed.result()
                    except BaseException:
                        handed.cancel()
                        raise
            if there is not None:
                payload, json_length = there
            else:
                if header_length == 0:
                    decoded = codec.decode_raw_request(model_name, model_version, body,
                                                       self.dataplane.model_config(model_name, model_version))
                else:
                    decoded = codec.decode_request(model_name, model_version, body, header_length, self.tensor_limits,
                                                   self.body.max_json_depth)
                request = decoded.request
                if traceparent is not None:
                    request.trace_context = traceparent.decode("latin-1")
                # Schedule the request and wait for its single response (HTTP infer is unary; here, not in a
                # coroutine of its own: one frame fewer on every resume). A request still running after
                # DISCONNECT_WATCH_S starts watching its connection: if the client goes away, the request is
                # cancelled (the model sees ``request.is_cancelled()``).
                request.streaming = False  # one response: LLM backends send the whole result at once
                stream = self.dataplane.infer(request)
                response = None
                # the HTTP protocol cancels a request it handed straight to this handler when its connection is lost
                # (server/http/limits.py): no watch of its own
                watch = _NO_WATCH if type(getattr(receive, "__self__", None)) is FastCycle else \
                    cancel_on_disconnect(receive, DISCONNECT_WATCH_S)
                with watch:
                    try:
                        async for answer in stream:
                            if answer.error is not None:
                                raise as_server_error(answer.error)
                            if not answer.empty:
                                if response is not None:
                                    raise Unsupported(f"model '{request.model_name}' is decoupled and sent more than "
                                                      "one response; the HTTP infer endpoint returns exactly one (use "
                                                      "the gRPC streaming API)")
                                response = answer
                            if answer.final:  # the last: no need to ask the stream for its end
                                break
                    except BaseException:
                        await stream.aclose()
                        raise
                if response is None:
                    raise Unsupported(f"model '{request.model_name}' sent no response to the request")
                classifier = self._classifier(stream.runtime) if decoded.classify else None
                payload, json_length = codec.encode_response(response, decoded, classifier)
        except ServerError as exc:
            await send_error(send, exc.http_code, exc.message, exc.retry_after_s)
            return
        except ClientGone:
            return
        except Exception as exc:  # a bug, not bad input: report it without a stack trace
            log.exception("HTTP infer request for model '%s' failed", model_name)
            await send_error(send, 500, f"internal error: {type(exc).__name__}: {exc}")
            return
        if json_length is None:
            headers = [JSON_HEADER]
        else:
            headers = [BINARY_HEADER, (b"inference-header-content-length", str(json_length).encode())]
        if accept is not None and len(payload) >= COMPRESS_MIN_BYTES:
            chosen = _response_encoding(accept)
            if chosen is not None:
                payload = _compress(payload, chosen)
                headers.append((b"content-encoding", chosen.encode()))
        if not send_whole(send, 200, payload, headers):
            await send_response(send, 200, payload, headers)

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


class InferRoute:
    """The infer handler as a plain ASGI app, for the router (used when the fast path does not apply)."""

    def __init__(self, frontend: HttpFrontend) -> None:
        self.frontend = frontend

    async def __call__(self, scope, receive, send) -> None:
        params = scope["path_params"]
        await self.frontend.infer(scope, receive, send, params["model_name"], params.get("model_version", ""))


def infer_target(path: str) -> tuple[str, str] | None:
    """(model, version) of a path that starts with INFER_PREFIX and ends with INFER_SUFFIX, or None when
    it is no infer path."""
    middle = path[len(INFER_PREFIX):-len(INFER_SUFFIX)]
    if not middle:
        return None
    if "/" not in middle:
        return middle, ""
    name, sep, version = middle.partition("/versions/")
    if not sep or not name or not version or "/" in name or "/" in version:
        return None
    return name, version


def mount(app, frontend: HttpFrontend) -> None:
    """Add the KServe v2 routes to ``app`` (a FastAPI app)."""
    dp = frontend.dataplane

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
        return json_response({"model_stats": await dp.statistics("", "")})

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
        return json_response({"model_stats": await dp.statistics(*target(request))})

    for suffix, handler in (("", model_metadata), ("/ready", model_ready), ("/config", model_config),
                            ("/stats", model_statistics)):
        for model in MODEL_ROUTES:
            app.add_api_route(model + suffix, handler, methods=["GET"])

    infer_route = InferRoute(frontend)
    for model in MODEL_ROUTES:
        app.router.routes.append(Route(model + INFER_SUFFIX, infer_route, methods=["POST"]))

    # -- model repository -----------------------------------------------------------------
    @app.post("/v2/repository/index")
    async def repository_index(request: Request):
        doc = await frontend.read_json(request, "repository index request")
        ready = False
        if doc is not None and "ready" in doc:
            ready = doc["ready"]
            if type(ready) is not bool:
                raise InvalidArgument("invalid value for 'ready': expected a boolean")
        return json_response(await dp.index(ready))

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

    _mount_shared_memory(app, frontend)
    _mount_trace(app, frontend)


def _mount_trace(app, frontend: HttpFrontend) -> None:
    """Triton's trace extension: ``GET`` / ``POST`` ``/v2[/models/<name>]/trace/setting``."""
    dp = frontend.dataplane

    async def trace_setting(request: Request):
        model = request.path_params.get("model_name", "")
        updates = None
        if request.method == "POST":
            updates = await frontend.read_json(request, "trace setting request") or {}
        return json_response(await dp.trace_setting(model, updates))

    for path in ("/v2/trace/setting", "/v2/models/{model_name}/trace/setting"):
        app.add_api_route(path, trace_setting, methods=["GET", "POST"])


def _mount_shared_memory(app, frontend: HttpFrontend) -> None:
    """Triton's shared-memory extension: ``/v2/{system,cuda}sharedmemory[/region/<name>]/...``."""
    dp = frontend.dataplane

    async def system_status(request: Request):
        return json_response(await dp.system_shared_memory_status(request.path_params.get("region_name", "")))

    async def system_register(region_name: str, request: Request):
        doc = await frontend.read_json(request, "shared memory register request") or {}
        key = doc.get("key")
        if type(key) is not str:
            raise InvalidArgument("shared memory register request: 'key' must be a string")
        await dp.register_system_shared_memory(region_name, key, _count(doc, "offset", 0), _count(doc, "byte_size"))
        return Response(status_code=200)

    async def system_unregister(request: Request):
        await dp.unregister_system_shared_memory(request.path_params.get("region_name", ""))
        return Response(status_code=200)

    async def cuda_status(request: Request):
        return json_response(await dp.cuda_shared_memory_status(request.path_params.get("region_name", "")))

    async def cuda_register(region_name: str, request: Request):
        doc = await frontend.read_json(request, "shared memory register request") or {}
        handle = doc.get("raw_handle")
        b64 = handle.get("b64") if type(handle) is dict else None
        if type(b64) is not str:
            raise InvalidArgument("shared memory register request: 'raw_handle' must be {\"b64\": <string>}")
        try:
            raw = base64.b64decode(b64, validate=True)
        except ValueError:
            raise InvalidArgument("shared memory register request: 'raw_handle.b64' is not base64") from None
        await dp.register_cuda_shared_memory(region_name, raw, _count(doc, "device_id", 0), _count(doc, "byte_size"))
        return Response(status_code=200)

    async def cuda_unregister(request: Request):
        await dp.unregister_cuda_shared_memory(request.path_params.get("region_name", ""))
        return Response(status_code=200)

    for kind, status, register, unregister in (("system", system_status, system_register, system_unregister),
                                               ("cuda", cuda_status, cuda_register, cuda_unregister)):
        base, one = f"/v2/{kind}sharedmemory", f"/v2/{kind}sharedmemory/region/{{region_name}}"
        app.add_api_route(f"{base}/status", status, methods=["GET"])
        app.add_api_route(f"{one}/status", status, methods=["GET"])
        app.add_api_route(f"{one}/register", register, methods=["POST"])
        app.add_api_route(f"{base}/unregister", unregister, methods=["POST"])
        app.add_api_route(f"{one}/unregister", unregister, methods=["POST"])


def _count(doc: dict, key: str, default: int | None = None) -> int:
    value = doc.get(key, default)
    if type(value) is not int or value < 0:
        raise InvalidArgument(f"shared memory register request: '{key}' must be a non-negative integer"
                              + (" (required)" if value is None else f", got {value!r}"))
    return value


def _parameters(doc: dict | None, what: str) -> dict:
    if doc is None:
        return {}
    params = doc.get("parameters", {})
    if type(params) is not dict:
        raise InvalidArgument(f"{what} request 'parameters' must be an object")
    return params
