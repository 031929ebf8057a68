"""The server process: repository, DataPlane and the HTTP, gRPC and metrics endpoints."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

from . import heap
from .access import AccessPolicy, ApiKeyScope, Restriction, guard_metrics
from .backend import BackendRegistry
from .cpu_metrics import CpuMetrics
from .dataplane import DataPlane
from .errors import ServerError
from .limits import TensorLimits
from .openai.limits import OpenAILimits
from .openai.llm import OutputParsers
from .openai.responses.mcp import McpSettings
from .openai.responses.store import MEMORY, StoreSettings
from .repository import ControlMode, ModelRepository
from .schedulers.rate_limiter import RateLimiter, ResourceLimit
from .serving import ServingInterface
from .stats import Metrics
from .tracing import TraceConfig, Tracer

log = logging.getLogger(__name__)


@dataclass
class ServerOptions:
    """Settings of one server process; the CLI flags map onto these one to one."""

    model_repositories: list[Path]
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    metrics_address: str = "127.0.0.1"  # the metrics port's own address: loopback unless asked otherwise
    allow_http: bool = True
    allow_grpc: bool = True
    allow_metrics: bool = True
    allow_cpu_metrics: bool = True  # Triton's nv_cpu_utilization / nv_cpu_memory_*_bytes gauges (Linux /proc)
    metrics_interval_ms: int = 2000  # the CPU gauges are read at most once per interval
    model_control_mode: ControlMode = ControlMode.NONE
    # directories outside the model repositories that model configs may name files in (absolute tokenizer or
    # weight paths); nothing else outside the repositories can be named (server/model_paths.py)
    allowed_model_roots: list[Path] = field(default_factory=list)
    model_max_instances: int = 64  # instances one model version may ask for (0: no limit)
    load_models: list[str] = field(default_factory=list)
    # a model load_models names that is missing or fails to load stops the start (tritonserver's --exit-on-error)
    exit_on_error: bool = True
    # --backend-config: backend name ("" for every backend) -> {setting: value}
    backend_settings: dict[str, dict[str, str]] = field(default_factory=dict)
    repository_poll_secs: float = 15.0
    exit_timeout_secs: float = 30.0
    strict_readiness: bool = True
    http_max_input_size: int = 64 * 1024 * 1024
    # -- limits on what one request or connection can take (docs/security.md) --
    http_max_decompressed_size: int | None = None  # most bytes a compressed body inflates to; None: the input size
    http_max_json_depth: int = 64             # deepest nesting of arrays and objects in a JSON body
    http_max_header_size: int = 64 * 1024     # most bytes of request line and headers (431 past it)
    http_max_header_count: int = 100          # most headers in a request (431 past it)
    http_header_timeout_secs: float = 10.0    # time for the request line and headers to arrive (408)
    http_body_timeout_secs: float = 30.0      # longest pause between two chunks of a body (408)
    http_max_connections: int | None = 1000   # open HTTP connections and requests in flight (503 past it)
    max_tensor_rank: int = 32                 # most dimensions of an input tensor (HTTP and gRPC)
    max_tensor_elements: int = 1 << 28        # most elements of an input tensor, zero dims aside
    grpc_max_receive_message_length: int = 64 * 1024 * 1024  # largest gRPC request (RESOURCE_EXHAUSTED)
    grpc_max_send_message_length: int = 2**31 - 1             # largest gRPC response (RESOURCE_EXHAUSTED)
    log_verbose: int = 0
    api_key: str | None = None  # 'Authorization: Bearer <key>' on the OpenAI /v1 routes (and more: api_key_scope)
    api_key_scope: ApiKeyScope = ApiKeyScope.OPENAI  # ALL: also /v2, every gRPC method and /metrics, not health
    # restricted API groups: group -> header and value its requests must carry (server.access.parse_restrictions)
    http_restricted_apis: dict[str, Restriction] = field(default_factory=dict)
    grpc_restricted_protocols: dict[str, Restriction] = field(default_factory=dict)
    openapi: bool = True  # serve the HTTP API's OpenAPI document at GET /openapi.json
    openai_limits: OpenAILimits = field(default_factory=OpenAILimits)  # what one /v1 request may ask for
    # default tool-call and reasoning parsers of /v1 chat for models whose config names none
    openai_parsers: OutputParsers = field(default_factory=OutputParsers)
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters loaded from disk at run time
    enable_lora_runtime_updates: bool = False
    # /v1/responses: the SQLite file of stored responses and its limits (--response-store*)
    response_store: StoreSettings = field(default_factory=StoreSettings)
    # /v1/responses: the MCP servers a response may use and its tool rounds (--mcp-allow, --mcp-max-tool-rounds)
    mcp: McpSettings = field(default_factory=McpSettings)
    # processes serving HTTP and gRPC (server/workers): 1 serves them in this process, beside the models
    frontend_workers: int = 1
    # --frontend-direct: with frontend workers, eligible requests to Python models go from the worker straight to
    # the model's instance processes (server/workers/direct.py), not through the core
    frontend_direct: bool = False
    # --frontend-workers auto where it means one (--frontend-direct not given): once the models loaded at start are
    # up, one worker with the direct path when every one of them is a Python model it can reach directly (measured
    # faster: docs/performance.md), else the core process itself
    frontend_auto: bool = False
    # --grpc-frontend: what serves the gRPC port: "grpcio" (grpc.aio, in the frontend process) or "pyvoy" (Envoy's
    # HTTP/2 with an ASGI app of ours in its embedded Python: a frontend process of its own; server/grpc/asgi_transport.py)
    grpc_frontend: str = "grpcio"

    @property
    def serves_in_workers(self) -> bool:
        """Frontend worker processes serve the ports: more than one, or one with the direct path."""
        return self.frontend_workers > 1 or self.frontend_direct

    # Freeze the garbage collector's heap once models are loaded (the CLI does; see tideserve.heap). Off by default
    # for servers embedded in another program, whose heap is that program's business.
    freeze_heap: bool = False
    # -- response cache and rate limiter (Triton's --cache-config, --rate-limit, --rate-limit-resource) --
    response_cache_size: int | None = None  # bytes of the local response cache; None: no cache
    rate_limit: bool = False                # --rate-limit execution_count
    rate_limit_resources: list[ResourceLimit] = field(default_factory=list)
    # -- tracing (Triton's --trace-config): None or level OFF: nothing is traced until /v2/trace/setting asks --
    trace_config: TraceConfig | None = None


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the Server decides when to stop."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class Frontends:
    """The HTTP and gRPC ports over the serving interface: the core's DataPlane, or a frontend worker's
    RemoteDataPlane.

    ``http_socket``: a listening socket to serve instead of binding ``--http-port`` (frontend workers share
    the one the core made); ``grpc_shared``: bind the gRPC port with SO_REUSEPORT beside other workers."""

    def __init__(self, dataplane: ServingInterface, options: ServerOptions, access: AccessPolicy) -> None:
        self.dataplane = dataplane
        self.options = options
        self.access = access
        self._uvicorns: list[_EmbeddedUvicorn] = []
        self._serving: list[asyncio.Task] = []
        # a frontend worker's: ``http_acceptor(sock, server)`` takes the shared HTTP socket's connections for that
        # uvicorn server (server/workers/balance.py) and returns what to close at stop; None: uvicorn accepts
        self.http_acceptor = None
        self._acceptors: list = []
        self._grpc = None

    async def start(self, http_socket=None, grpc_shared: bool = False, grpc: bool = True) -> None:
        opts = self.options
        tensor_limits = TensorLimits(opts.max_tensor_rank, opts.max_tensor_elements)
        if opts.allow_grpc and grpc:
            from .grpc import start_grpc_server
            channel_args = [("grpc.max_receive_message_length", opts.grpc_max_receive_message_length),
                            ("grpc.max_send_message_length", opts.grpc_max_send_message_length)]
            if grpc_shared:
                channel_args.append(("grpc.so_reuseport", 1))
            self._grpc = await start_grpc_server(self.dataplane, opts.host, opts.grpc_port, access=self.access,
                                                 options=channel_args, tensor_limits=tensor_limits)
        # HTTP last: clients poll its health endpoints, so once it answers the gRPC port is up too
        if opts.allow_http:
            from .http import create_app
            app = create_app(self.dataplane, max_input_size=opts.http_max_input_size,
                             max_decompressed_size=opts.http_max_decompressed_size,
                             max_json_depth=opts.http_max_json_depth, tensor_limits=tensor_limits,
                             access=self.access, openapi=opts.openapi, openai_limits=opts.openai_limits,
                             openai_parsers=opts.openai_parsers,
                             openai_model_control=opts.model_control_mode is ControlMode.EXPLICIT,
                             response_store=opts.response_store, mcp=opts.mcp,
                             openai_adapter_updates=opts.enable_lora_runtime_updates)
            await self.serve_http(app, opts.host, opts.http_port, http_socket)

    async def serve_http(self, app, host: str, port: int, sock=None) -> None:
        from .http.limits import ConnectionLimits

        opts = self.options
        limits = ConnectionLimits(opts.http_max_header_size, opts.http_max_header_count, opts.http_header_timeout_secs,
                                  opts.http_body_timeout_secs, opts.http_max_connections)
        accept = self.http_acceptor if sock is not None else None
        if accept is not None and not port:
            port = sock.getsockname()[1]
        config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                                access_log=opts.log_verbose > 1, lifespan="off",
                                timeout_graceful_shutdown=1, backlog=4096, proxy_headers=False,
                                **limits.uvicorn_settings())
        server = _EmbeddedUvicorn(config)
        task = asyncio.create_task(server.serve(sockets=[] if accept is not None else [sock] if sock is not None else None))
        while not server.started:
            if task.done():
                task.result()  # re-raises the bind error
                raise RuntimeError(f"HTTP server on port {port} stopped during start-up")
            await asyncio.sleep(0.01)
        self._uvicorns.append(server)
        self._serving.append(task)
        if accept is not None:
            self._acceptors.append(accept(sock, server))

    async def stop(self) -> None:
        if self._grpc is not None:
            await self._grpc.stop(grace=1)
        for acceptor in self._acceptors:
            acceptor.close()
        for server in self._uvicorns:
            server.should_exit = True
        await asyncio.gather(*self._serving, return_exceptions=True)


class Server:
    def __init__(self, options: ServerOptions, backends: BackendRegistry | None = None) -> None:
        self._store_dir: str | None = None
        options = self._shared_store(options)
        self.options = options
        cpu = options.allow_metrics and options.allow_cpu_metrics and CpuMetrics.available()
        self.metrics = Metrics(CpuMetrics(options.metrics_interval_ms / 1000) if cpu else None)
        self.backends = backends or BackendRegistry(options.backend_settings)
        self.repository = ModelRepository(options.model_repositories, self.backends, self.metrics,
                                          options.model_control_mode, options.load_models,
                                          allowed_roots=options.allowed_model_roots,
                                          max_instances=options.model_max_instances,
                                          exit_on_error=options.exit_on_error)
        if options.rate_limit:
            self.repository.rate_limiter = RateLimiter(options.rate_limit_resources)
        self.dataplane = DataPlane(self.repository, self.metrics, strict_readiness=options.strict_readiness,
                                   cache_size=options.response_cache_size, tracer=Tracer(options.trace_config),
                                   lora_runtime_updates=options.enable_lora_runtime_updates)
        # backends reach other models through these handles, never through the DataPlane itself
        self.repository.handles = self.dataplane.server_handles()
        self.access = AccessPolicy(options.http_restricted_apis, options.grpc_restricted_protocols,
                                   options.api_key, options.api_key_scope)
        self.frontends = Frontends(self.dataplane, options, self.access)  # the metrics port; HTTP / gRPC in-process
        self.workers = None  # FrontendWorkers when --frontend-workers > 1
        self._background: list[asyncio.Task] = []  # repository polling
        self._stop = asyncio.Event()

    def _shared_store(self, options: ServerOptions) -> ServerOptions:
        if options.serves_in_workers and options.response_store.path == MEMORY:
            # ':memory:' lives in one process; the frontend workers share a file instead, gone when the server stops
            # (the same lifetime: a stored response is found by whichever worker a GET reaches)
            self._store_dir = tempfile.mkdtemp(prefix="tideserve-responses-")
            options = replace(options, response_store=replace(
                options.response_store, path=str(Path(self._store_dir) / "responses.sqlite3")))
        return options

    def _choose_layout(self) -> None:
        """``--frontend-workers auto`` where it means one: one worker with direct instances when the models loaded
        at start (at least one) are all Python models whose requests the worker can send straight to their instance
        processes (on 2 cores add_sub ran 1.2-1.3x the one process's throughput at concurrency 1 and ~1.1x at 8
        through it, docs/performance.md); else (an LLM, whose engine client the one process runs faster; an
        ensemble, ONNX Runtime or a tree model, one hop more from a worker; nothing loaded; tracing on, whose
        requests go through the core) the core serves the ports itself. A model loaded later does not change it (in
        the worker layout an LLM loaded later has no engine client in the worker: its generations go through the
        core)."""
        from .workers.pool import FrontendWorkers

        runtimes = [r for r in self.repository.runtimes() if r.state.value == "READY"]
        # (traced requests go through the core: with tracing on from the start, the worker would relay them all)
        direct = (bool(runtimes) and all(FrontendWorkers.direct_eligible(r) for r in runtimes)
                  and not self.dataplane.tracer.active)
        if direct:
            self.options = self._shared_store(replace(self.options, frontend_direct=True))
            self.frontends.options = self.options
        log.info("--frontend-workers auto: %s", "one frontend worker process sending the requests straight to the "
                 "models' instance processes (every model loaded is a Python model it reaches directly)" if direct
                 else "the ports served in the core process (a model loaded is not one a frontend worker reaches "
                 "directly, or none is loaded)")

    async def start(self) -> None:
        opts = self.options
        if opts.allow_http or opts.allow_grpc:  # before the models load: their engines take the workers' clients
            from .workers import engines

            engines.configure(opts)
        try:
            await self.repository.start()
        except ServerError:  # a model --load-model names did not load: unload the others, then say why
            await self.repository.shutdown(drain_timeout=0)
            raise
        if opts.frontend_auto and (opts.allow_http or opts.allow_grpc):
            self._choose_layout()
            opts = self.options
        if opts.freeze_heap:
            heap.freeze()
            self.repository.after_change = heap.freeze
        if opts.model_control_mode is ControlMode.POLL:
            self._background.append(asyncio.create_task(self.repository.poll_forever(opts.repository_poll_secs)))
        if opts.allow_metrics:
            await self.frontends.serve_http(self._metrics_app(), opts.metrics_address, opts.metrics_port)
        pyvoy = opts.allow_grpc and opts.grpc_frontend == "pyvoy"  # the gRPC port: an Envoy process of its own
        workers = opts.serves_in_workers
        if (workers and (opts.allow_http or opts.allow_grpc)) or pyvoy:
            from .workers.pool import FrontendWorkers
            http_workers = opts.frontend_workers if workers else 0
            self.workers = FrontendWorkers(self.dataplane, opts, http_workers, grpc_process=pyvoy)
            await self.workers.start()
            if not http_workers:
                await self.frontends.start(grpc=False)  # HTTP in this process
        else:
            await self.frontends.start()
        log.info("tideserve ready: HTTP %s:%d, gRPC %s:%d, metrics %s:%d%s", opts.host, opts.http_port,
                 opts.host, opts.grpc_port, opts.metrics_address, opts.metrics_port,
                 (f"; {opts.frontend_workers} frontend worker processes" if workers else "")
                 + ("; gRPC on pyvoy (Envoy)" if pyvoy else ""))

    def _metrics_app(self) -> Starlette:
        render = self.dataplane.metrics_text

        async def metrics(_request):
            return Response(await render(), media_type=CONTENT_TYPE_LATEST)

        app = Starlette(routes=[Route("/metrics", metrics)])
        guard_metrics(app, self.access)
        return app

    def request_stop(self) -> None:
        self._stop.set()

    async def stop(self) -> None:
        """Refuse new requests, drain in-flight ones up to the exit timeout, then shut down."""
        self.dataplane.accepting = False
        if self.workers is not None:
            self.workers.changed()  # the workers refuse new requests too
        await self.repository.drain(self.options.exit_timeout_secs)
        message = (f"the server is shutting down: the request did not finish within the exit timeout of "
                   f"{self.options.exit_timeout_secs:g}s")
        self.dataplane.abort_all(message)
        await asyncio.sleep(0.05)  # let the frontends write those answers
        if self.workers is not None:  # they answer theirs straight to the models' processes likewise, and exit
            await self.workers.stop(message=message)
        await self.repository.shutdown(drain_timeout=0)
        for task in self._background:
            task.cancel()
        await self.frontends.stop()
        await asyncio.gather(*self._background, return_exceptions=True)
        await asyncio.get_running_loop().run_in_executor(None, self.dataplane.tracer.shutdown)
        if self._store_dir is not None:
            shutil.rmtree(self._store_dir, ignore_errors=True)

    async def run(self) -> None:
        """Start, serve until SIGINT / SIGTERM, then stop gracefully."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.request_stop)
        await self.start()
        await self._stop.wait()
        log.info("shutting down: draining in-flight requests (up to %.0fs)", self.options.exit_timeout_secs)
        await self.stop()
