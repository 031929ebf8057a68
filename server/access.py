"""Who may call what: restricted API groups and the API key, decided once at start-up for every frontend.

Every HTTP route, every gRPC method and the metrics endpoint belongs to one API group (Triton's
names: ``health``, ``metadata``, ``inference``, ``shared-memory``, ``model-config``,
``model-repository``, ``statistics``, ``trace``, ``logging``). Two kinds of check guard them:

* a restriction (``--http-restricted-api`` / ``--grpc-restricted-protocol``
  ``<api>[,<api>...]:<header>=<value>``): the group's requests must carry ``<header>`` with exactly
  ``<value>`` (over gRPC the metadata key is ``triton-grpc-protocol-<header>``), else 403 /
  PERMISSION_DENIED naming the group and the header;
* the API key (``--api-key``): ``Authorization: Bearer <key>`` on the OpenAI ``/v1`` routes, and with
  ``--api-key-scope all`` on ``/v2``, every gRPC method and ``/metrics`` too, else 401 /
  UNAUTHENTICATED. The ``health`` group never asks for the key, so probes keep working.

The API key is checked first (an unauthenticated client learns no header names), then the group's
restriction. Values are compared with :func:`hmac.compare_digest`. A route or method without a
check gets none at all: :func:`guard_routes` leaves its ASGI app untouched, and the gRPC server has
no interceptor unless some method is guarded, so an unconfigured server pays nothing per request.
"""

from __future__ import annotations

import enum
import hmac
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from .asgi import error_body

HEALTH = "health"
METADATA = "metadata"
INFERENCE = "inference"
SHARED_MEMORY = "shared-memory"
MODEL_CONFIG = "model-config"
MODEL_REPOSITORY = "model-repository"
STATISTICS = "statistics"
TRACE = "trace"
LOGGING = "logging"
GROUPS = (HEALTH, METADATA, INFERENCE, SHARED_MEMORY, MODEL_CONFIG, MODEL_REPOSITORY, STATISTICS, TRACE, LOGGING)

GRPC_HEADER_PREFIX = "triton-grpc-protocol-"  # a gRPC restriction's header is this prefix + <header>
AUTHORIZATION = "authorization"

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # an HTTP header name (RFC 9110 token)
_VALUE = re.compile(r"[\x21-\x7e]([\x20-\x7e]*[\x21-\x7e])?")  # printable ASCII, no outer spaces


class ApiKeyScope(str, enum.Enum):
    """Where ``--api-key`` is asked for."""

    OPENAI = "openai"  # the OpenAI /v1 routes only
    ALL = "all"        # also /v2, every gRPC method and /metrics (never the health group)


# -- which group each endpoint belongs to ------------------------------------------------------------
def _http_routes() -> dict[str, str]:
    routes = {
        "/v2/health/live": HEALTH, "/v2/health/ready": HEALTH, "/v2": METADATA, "/v2/models/stats": STATISTICS,
        "/openapi.json": METADATA,  # the description of these routes
        "/v2/repository/index": MODEL_REPOSITORY,
        "/v2/repository/models/{model_name}/load": MODEL_REPOSITORY,
        "/v2/repository/models/{model_name}/unload": MODEL_REPOSITORY,
        "/v2/trace/setting": TRACE, "/v2/models/{model_name}/trace/setting": TRACE,
        # for routers: the replica's load (vLLM's GET /load), and vLLM's prefix-cache reset (an engine change)
        "/load": STATISTICS, "/reset_prefix_cache": MODEL_REPOSITORY,
    }
    for kind in ("system", "cuda"):  # Triton's shared-memory extension
        for path in ("/status", "/unregister", "/region/{region_name}/status", "/region/{region_name}/register",
                     "/region/{region_name}/unregister"):
            routes[f"/v2/{kind}sharedmemory{path}"] = SHARED_MEMORY
    for model in ("/v2/models/{model_name}", "/v2/models/{model_name}/versions/{model_version}"):
        routes.update({model: METADATA, model + "/ready": HEALTH, model + "/config": MODEL_CONFIG,
                       model + "/stats": STATISTICS, model + "/infer": INFERENCE, model + "/generate": INFERENCE,
                       model + "/generate_stream": INFERENCE})
    return routes


# KServe v2 routes (path template as routed -> group); a route missing here makes the app refuse to build
HTTP_ROUTE_GROUPS: dict[str, str] = _http_routes()
# /metrics on the HTTP port: the same check as the metrics port's (the API key with scope all)
METRICS_PATH = "/metrics"
# The OpenAI routes: their errors take OpenAI's shape and they ask for the API key in either scope.
# /v1/models is model-repository, as Triton's OpenAI frontend files it.
OPENAI_ROUTE_GROUPS: dict[str, str] = {
    "/v1/models": MODEL_REPOSITORY, "/v1/models/{model:path}": MODEL_REPOSITORY,
    "/v1/models/{model_name:path}/load": MODEL_REPOSITORY, "/v1/models/{model_name:path}/unload": MODEL_REPOSITORY,
    "/v1/completions": INFERENCE, "/v1/chat/completions": INFERENCE, "/health": HEALTH,
    "/health/ready": HEALTH,
    # LoRA adapters loaded from disk (--enable-lora-runtime-updates): repository changes, as a model load is
    "/v1/load_lora_adapter": MODEL_REPOSITORY, "/v1/unload_lora_adapter": MODEL_REPOSITORY,
    "/v1/embeddings": INFERENCE, "/tokenize": INFERENCE, "/detokenize": INFERENCE, "/tokenizer_info": MODEL_CONFIG,
    "/v1/score": INFERENCE, "/score": INFERENCE, "/v1/rerank": INFERENCE, "/rerank": INFERENCE,
    "/v1/responses": INFERENCE, "/v1/responses/{response_id}": INFERENCE,
    "/v1/responses/{response_id}/cancel": INFERENCE, "/v1/responses/{response_id}/input_items": INFERENCE,
}
# Anthropic's Messages API: like the OpenAI routes, and the API key may come as 'x-api-key: <key>' as well;
# refusals in Anthropic's error shape
ANTHROPIC_ROUTE_GROUPS: dict[str, str] = {"/v1/messages": INFERENCE, "/v1/messages/count_tokens": INFERENCE}
X_API_KEY = "x-api-key"

_SHARED_MEMORY_RPCS = tuple(f"{kind}SharedMemory{op}" for kind in ("System", "Cuda")
                            for op in ("Status", "Register", "Unregister"))
# gRPC method (full name as routed) -> group; a method missing here asks for the API key only (scope all)
GRPC_METHOD_GROUPS: dict[str, str] = {
    **{f"/inference.GRPCInferenceService/{name}": group for names, group in (
        (("ServerLive", "ServerReady", "ModelReady"), HEALTH),
        (("ServerMetadata", "ModelMetadata"), METADATA),
        (("ModelInfer", "ModelStreamInfer"), INFERENCE),
        (("ModelConfig",), MODEL_CONFIG),
        (("ModelStatistics",), STATISTICS),
        (("RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload"), MODEL_REPOSITORY),
        (_SHARED_MEMORY_RPCS, SHARED_MEMORY),
        (("TraceSetting",), TRACE),
        (("LogSettings",), LOGGING),
    ) for name in names},
    "/grpc.health.v1.Health/Check": HEALTH,
    "/grpc.health.v1.Health/Watch": HEALTH,
}


# -- the checks ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Restriction:
    """Requests of ``group`` must carry ``header`` (lower case) with exactly ``value``."""

    group: str
    header: str
    value: bytes = field(repr=False)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request is turned away: ``status`` 401 (no valid API key) or 403 (restricted group)."""

    status: int
    message: str


class Guard:
    """The check of one endpoint: the API key (when it applies), then its group's restriction."""

    __slots__ = ("api_key", "key_header", "restriction")

    def __init__(self, api_key: bytes | None, restriction: Restriction | None, key_header: str | None = None) -> None:
        self.api_key = api_key
        self.restriction = restriction
        self.key_header = key_header  # a header that may carry the bare key instead (Anthropic's x-api-key)

    def check(self, header: Callable[[str], bytes | None], grpc: bool = False) -> Refusal | None:
        """None when the request may pass; ``header(name)`` gives a request header's value or None."""
        if self.api_key is not None and not _bearer_matches(header(AUTHORIZATION), self.api_key) and not (
                self.key_header is not None and _key_matches(header(self.key_header), self.api_key)):
            where = "metadata" if grpc else "header"
            return Refusal(401, f"Invalid or missing API key: send the {where} 'authorization: Bearer <key>'")
        restriction = self.restriction
        if restriction is not None:
            value = header(restriction.header)
            if value is None or not hmac.compare_digest(value, restriction.value):
                what = "protocol" if grpc else "API"
                return Refusal(403, f"This {what} is restricted, expecting header '{restriction.header}' "
                                    f"(restricted API group '{restriction.group}')")
        return None


def _bearer_matches(value: bytes | None, key: bytes) -> bool:
    if value is None:
        return False
    scheme, _, token = value.partition(b" ")
    return hmac.compare_digest(token.strip(), key) and scheme.lower() == b"bearer"


def _key_matches(value: bytes | None, key: bytes) -> bool:
    return value is not None and hmac.compare_digest(value.strip(), key)


@dataclass(frozen=True)
class AccessPolicy:
    """The server's access settings, as the flags give them; frontends ask it for one Guard per endpoint."""

    http_restricted: Mapping[str, Restriction] = field(default_factory=dict)  # group -> restriction
    grpc_restricted: Mapping[str, Restriction] = field(default_factory=dict)
    api_key: str | None = field(default=None, repr=False)  # None or empty: no key
    api_key_scope: ApiKeyScope = ApiKeyScope.OPENAI

    def _key(self, group: str | None, openai: bool) -> bytes | None:
        if not self.api_key or group == HEALTH or not (openai or self.api_key_scope is ApiKeyScope.ALL):
            return None
        return self.api_key.encode()

    def http_guard(self, group: str, openai: bool = False, key_header: str | None = None) -> Guard | None:
        """The check of an HTTP route of ``group`` (``openai``: a /v1 route; ``key_header``: a header that may
        carry the bare API key too), or None when it needs none."""
        guard = _guard(self._key(group, openai), self.http_restricted.get(group))
        if guard is not None:
            guard.key_header = key_header
        return guard

    def grpc_guard(self, group: str | None) -> Guard | None:
        """The check of a gRPC method of ``group`` (None: a method of no known group: the API key only)."""
        return _guard(self._key(group, False), self.grpc_restricted.get(group) if group else None)

    def metrics_guard(self) -> Guard | None:
        """The check of ``/metrics``: the API key with scope ``all``; no restricted group covers it."""
        return _guard(self._key(None, False), None)


def _guard(api_key: bytes | None, restriction: Restriction | None) -> Guard | None:
    return None if api_key is None and restriction is None else Guard(api_key, restriction)


# -- parsing the flags ------------------------------------------------------------------------------
def parse_restrictions(specs: Iterable[str], flag: str, header_prefix: str = "") -> dict[str, Restriction]:
    """``<api>[,<api>...]:<header>=<value>`` values of ``flag`` -> group -> Restriction.

    The API list ends at the first ':' and the header name at the first '=' after it, so the value may
    hold both. Raises ValueError for malformed syntax, an unknown group or a group given twice, in
    tritonserver's words ("unknown restricted api 'x'", "restricted protocol 'x' can not be specified in
    multiple config groups"; ``flag`` says whether the groups are "api"s or "protocol"s). The value is a
    secret: no message echoes it.
    """
    kind = "protocol" if flag.endswith("protocol") else "api"
    usage = f"{flag} option format is '<{kind}>[,<{kind}>...]:<header>=<value>'"
    restrictions: dict[str, Restriction] = {}
    for spec in specs:
        apis, colon, setting = spec.partition(":")
        header, equals, value = setting.partition("=")
        if not colon or not equals:
            raise ValueError(f"{usage}; the ':' after the API list is missing" if not colon else
                             f"{usage}; the '=' after the header name is missing")
        if not apis or not header or not value:
            raise ValueError(f"{usage}; the API list, the header name and the value must not be empty")
        if not _TOKEN.fullmatch(header):
            raise ValueError(f"{flag}: '{header}' is not a valid header name")
        if not _VALUE.fullmatch(value):
            raise ValueError(f"{flag}: the value for header '{header}' must be printable ASCII without "
                             "leading or trailing spaces")
        for group in apis.split(","):
            if group not in GROUPS:
                raise ValueError(f"{flag}: unknown restricted {kind} '{group}'; the groups are {', '.join(GROUPS)}")
            if group in restrictions:
                raise ValueError(f"{flag}: restricted {kind} '{group}' can not be specified in multiple config "
                                 "groups")
            restrictions[group] = Restriction(group, header_prefix + header.lower(), value.encode())
    return restrictions


# -- HTTP (ASGI) ------------------------------------------------------------------------------------
Render = Callable[[Refusal], bytes]  # a refusal as the response body, in the route's protocol's shape


class GuardedRoute:
    """An ASGI app behind its Guard: a refused request is answered here and never reaches the app."""

    __slots__ = ("app", "guard", "render")

    def __init__(self, app, guard: Guard, render: Render) -> None:
        self.app = app
        self.guard = guard
        self.render = render

    async def __call__(self, scope, receive, send) -> None:
        if await admit(self.guard, self.render, scope, send):
            await self.app(scope, receive, send)


async def admit(guard: Guard, render: Render, scope, send) -> bool:
    """Check an HTTP request; when refused, answer it (401 or 403) and return False."""
    headers = scope["headers"]

    def header(name: str) -> bytes | None:
        key = name.encode("latin-1")
        return next((value for name_, value in headers if name_ == key), None)

    refusal = guard.check(header)
    if refusal is None:
        return True
    body = render(refusal)
    response_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if refusal.status == 401:
        response_headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": refusal.status, "headers": response_headers})
    await send({"type": "http.response.body", "body": body})
    return False


def kserve_body(refusal: Refusal) -> bytes:
    return error_body(refusal.message)


def guard_routes(app, policy: AccessPolicy, openai_body: Render, anthropic_body: Render | None = None) -> None:
    """Put every route of ``app`` (a Starlette / FastAPI app) behind its group's Guard.

    Every route must be listed in HTTP_ROUTE_GROUPS or OPENAI_ROUTE_GROUPS: an unlisted one raises
    RuntimeError, so no endpoint can be added without deciding its group.
    """
    for route in app.router.routes:
        path = getattr(route, "path", None)
        if path in HTTP_ROUTE_GROUPS:
            guard, render = policy.http_guard(HTTP_ROUTE_GROUPS[path]), kserve_body
        elif path in OPENAI_ROUTE_GROUPS:
            guard, render = policy.http_guard(OPENAI_ROUTE_GROUPS[path], openai=True), openai_body
        elif path in ANTHROPIC_ROUTE_GROUPS:
            guard = policy.http_guard(ANTHROPIC_ROUTE_GROUPS[path], openai=True, key_header=X_API_KEY)
            render = anthropic_body or openai_body
        elif path == METRICS_PATH:
            guard, render = policy.metrics_guard(), kserve_body
        else:
            raise RuntimeError(f"HTTP route {path!r} belongs to no API group: add it to "
                               "tideserve.access.HTTP_ROUTE_GROUPS, OPENAI_ROUTE_GROUPS or ANTHROPIC_ROUTE_GROUPS")
        if guard is not None:
            route.app = GuardedRoute(route.app, guard, render)


def guard_metrics(app, policy: AccessPolicy) -> None:
    """Put the routes of the metrics app behind the API key when its scope is ``all``."""
    guard = policy.metrics_guard()
    if guard is not None:
        for route in app.router.routes:
            route.app = GuardedRoute(route.app, guard, kserve_body)

