"""``tideserve``: command-line flags modelled on ``tritonserver``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from . import __version__
from .access import GROUPS, GRPC_HEADER_PREFIX, ApiKeyScope, parse_restrictions
from .app import Server, ServerOptions
from .errors import ServerError
from .openai.limits import OpenAILimits
from .openai.llm import OutputParsers
from .openai.responses.mcp import DEFAULT_MAX_TOOL_ROUNDS as DEFAULT_MCP_ROUNDS
from .openai.responses.mcp import McpSettings
from .openai.responses.store import DEFAULT_MAX_AGE_S as DEFAULT_STORE_AGE
from .openai.responses.store import DEFAULT_MAX_BYTES as DEFAULT_STORE_BYTES
from .openai.responses.store import StoreSettings
from .reasoning_parsers import REASONING_PARSERS
from .tool_parsers import TOOL_PARSERS
from .repository import ControlMode, check_startup_models
from .response_cache import parse_cache_config
from .schedulers.rate_limiter import parse_resource
from .tracing import parse_trace_config


def _bool(text: str, expected: str = "a boolean") -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected {expected}, got '{text}'")


def _count(text: str, least: int = 1) -> int:
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got '{text}'")
    return value


def _on_off_auto(text: str) -> bool | None:
    """``on`` / ``off`` (and the other boolean spellings), or ``auto``: None, decided once the rest is known."""
    if text.strip().lower() == "auto":
        return None
    return _bool(text, "on, off or auto")


def _workers(text: str) -> int | str:
    """A count, or ``auto`` (kept as the string: the count and the layout are decided from it)."""
    if text.strip().lower() == "auto":
        return "auto"
    return _count(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got '{text}'")
    return value


def _add_limit_flags(p: argparse.ArgumentParser) -> None:
    """Limits on what one request or connection can take (docs/security.md)."""
    d = ServerOptions
    p.add_argument("--http-max-decompressed-size", type=_count, default=None,
                   help="most bytes a gzip / deflate request body may inflate to; it is refused (400) as soon as "
                        "it passes (default: --http-max-input-size)")
    p.add_argument("--http-max-json-depth", type=_count, default=d.http_max_json_depth,
                   help=f"deepest nesting of arrays and objects in a JSON request body (400 past it; default "
                        f"{d.http_max_json_depth})")
    p.add_argument("--http-max-header-size", type=_count, default=d.http_max_header_size,
                   help=f"most bytes of request line and headers (431 past it; default {d.http_max_header_size})")
    p.add_argument("--http-max-header-count", type=_count, default=d.http_max_header_count,
                   help=f"most headers in one request (431 past it; default {d.http_max_header_count})")
    p.add_argument("--http-header-timeout-secs", type=_seconds, default=d.http_header_timeout_secs,
                   help="seconds for a request line and its headers to arrive, from the connection's opening or "
                        f"the request's first byte (408 and close; default {d.http_header_timeout_secs:g})")
    p.add_argument("--http-body-timeout-secs", type=_seconds, default=d.http_body_timeout_secs,
                   help="longest pause between two chunks of a request body (408 and close; default "
                        f"{d.http_body_timeout_secs:g})")
    p.add_argument("--http-max-connections", type=lambda text: _count(text, 0), default=d.http_max_connections,
                   help="most open HTTP connections and requests in flight, per HTTP and metrics port; past it "
                        f"requests are answered 503 (0: no limit; default {d.http_max_connections})")
    p.add_argument("--max-tensor-rank", type=_count, default=d.max_tensor_rank,
                   help=f"most dimensions of an input tensor, HTTP and gRPC (400 / INVALID_ARGUMENT past it; "
                        f"default {d.max_tensor_rank})")
    p.add_argument("--max-tensor-elements", type=_count, default=d.max_tensor_elements,
                   help="most elements of an input tensor, zero-size dimensions aside (400 / INVALID_ARGUMENT past "
                        f"it; default {d.max_tensor_elements})")
    p.add_argument("--grpc-max-receive-message-length", type=_count, default=d.grpc_max_receive_message_length,
                   help="largest gRPC request message in bytes (RESOURCE_EXHAUSTED past it; default "
                        f"{d.grpc_max_receive_message_length})")
    p.add_argument("--grpc-max-send-message-length", type=_count, default=d.grpc_max_send_message_length,
                   help="largest gRPC response message in bytes (RESOURCE_EXHAUSTED past it; default "
                        f"{d.grpc_max_send_message_length})")


def _limit_options(args: argparse.Namespace) -> dict:
    return {"http_max_decompressed_size": args.http_max_decompressed_size,
            "http_max_json_depth": args.http_max_json_depth, "http_max_header_size": args.http_max_header_size,
            "http_max_header_count": args.http_max_header_count,
            "http_header_timeout_secs": args.http_header_timeout_secs,
            "http_body_timeout_secs": args.http_body_timeout_secs,
            "http_max_connections": args.http_max_connections or None,
            "max_tensor_rank": args.max_tensor_rank, "max_tensor_elements": args.max_tensor_elements,
            "grpc_max_receive_message_length": args.grpc_max_receive_message_length,
            "grpc_max_send_message_length": args.grpc_max_send_message_length}


def _add_openai_flags(p: argparse.ArgumentParser) -> None:
    """What one OpenAI /v1 request may ask for (docs/openai.md, "Limits"); past a limit: 400 naming the field."""
    d = OpenAILimits
    p.add_argument("--openai-max-prompts", type=_count, default=d.max_prompts,
                   help=f"most prompts in one /v1/completions request (default {d.max_prompts})")
    p.add_argument("--openai-max-prompt-tokens", type=_count, default=d.max_prompt_tokens,
                   help="most prompt tokens in one /v1 request, all its prompts together (default "
                        f"{d.max_prompt_tokens})")
    p.add_argument("--openai-max-n", type=_count, default=d.max_n,
                   help=f"most choices per prompt, 'n' (default {d.max_n})")
    p.add_argument("--openai-max-logprobs", type=lambda text: _count(text, 0), default=d.max_logprobs,
                   help=f"largest 'logprobs' (completions) / 'top_logprobs' (chat) (default {d.max_logprobs})")
    p.add_argument("--enable-lora-runtime-updates", type=_bool, nargs="?", const=True, default=False,
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters loaded from disk "
                        "(inside the model repositories or an --allowed-model-root) at run time (default false)")
    p.add_argument("--openai-chat-template-timeout-secs", type=_seconds, default=d.chat_template_timeout_s,
                   help="longest a chat template may take to render one request's prompt (default "
                        f"{d.chat_template_timeout_s:g})")


def _add_response_store_flags(p: argparse.ArgumentParser) -> None:
    """Where /v1/responses keeps stored responses (docs/openai.md, "Responses API")."""
    p.add_argument("--response-store", default=None, metavar="PATH",
                   help="SQLite file of the responses /v1/responses stores (store: true), kept across restarts; "
                        "':memory:' keeps them until the server stops (default: $XDG_CACHE_HOME/tideserve/"
                        "responses.sqlite3, else ~/.cache/tideserve/responses.sqlite3)")
    p.add_argument("--response-store-max-age-secs", type=lambda text: _seconds(text) if text.strip() != "0" else 0.0,
                   default=DEFAULT_STORE_AGE, help="stored responses older than this are deleted, 0: never "
                                                   f"(default {DEFAULT_STORE_AGE:.0f}, 30 days)")
    p.add_argument("--response-store-max-bytes", type=lambda text: _count(text, 0), default=DEFAULT_STORE_BYTES,
                   help="past this size of stored responses the oldest are deleted, 0: no limit "
                        f"(default {DEFAULT_STORE_BYTES})")


def _add_mcp_flags(p: argparse.ArgumentParser) -> None:
    """The MCP servers /v1/responses may call (docs/openai.md, "MCP tools")."""
    p.add_argument("--mcp-allow", action="append", default=[], metavar="URL_PREFIX",
                   help="an MCP server URL prefix (http:// or https://) that /v1/responses may reach for the MCP "
                        "tools of a request; repeatable. None by default: an MCP tool is then refused (400)")
    p.add_argument("--mcp-max-tool-rounds", type=lambda text: _count(text, 1), default=DEFAULT_MCP_ROUNDS,
                   help="most generations of one response whose MCP tool calls the server runs; calls past it are "
                        f"left unrun and the response is incomplete (default {DEFAULT_MCP_ROUNDS})")


def _add_parser_flags(p: argparse.ArgumentParser) -> None:
    """Default output parsers of /v1 chat completions, for models whose config names none (docs/openai.md)."""
    p.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                   help="parse tool calls out of the output of models whose config sets no 'tool_call_parser' "
                        "parameter: enables tool_choice 'auto' for them (default: none)")
    p.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                   help="split reasoning ('reasoning_content') from the answer of models whose config sets no "
                        "'reasoning_parser' parameter (default: none)")


def _add_prompt_tokens_details_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="OpenAI /v1: add usage.prompt_tokens_details.cached_tokens (prompt tokens the engine's "
                        "prefix cache served; vLLM models), as vLLM's flag of the same name does")


def _add_scheduling_flags(p: argparse.ArgumentParser) -> None:
    """Triton's response cache and rate limiter flags."""
    p.add_argument("--cache-config", action="append", default=[], metavar="local,size=<bytes>",
                   help="the response cache for models whose config has 'response_cache { enable: true }': "
                        "'local,size=N' gives it N bytes (default: no cache)")
    p.add_argument("--response-cache-byte-size", type=lambda text: _count(text, 0), default=None,
                   help="the same as --cache-config local,size=N (Triton's older flag)")
    p.add_argument("--rate-limit", choices=["off", "execution_count"], default="off",
                   help="'execution_count': instances run only while they hold the resources their "
                        "instance_group's rate_limiter asks for, by priority and execution count (default off)")
    p.add_argument("--trace-config", action="append", default=[], metavar="[<mode>,]<setting>=<value>",
                   help="request tracing as Triton's flag: level=OFF|TIMESTAMPS|TENSORS, rate=N, count=N, "
                        "mode=triton|opentelemetry; triton,file=PATH, triton,log-frequency=N; "
                        "opentelemetry,url=HOST:PORT/v1/traces, opentelemetry,resource=KEY=VALUE, "
                        "opentelemetry,bsp_max_queue_size|bsp_schedule_delay|bsp_max_export_batch_size=N; "
                        "repeatable (default: off)")
    p.add_argument("--rate-limit-resource", action="append", default=[], metavar="<name>:<count>[:<device>]",
                   help="copies of a rate limiter resource (on one device, or on every device when none is "
                        "named); repeatable. Default: the largest count any loaded instance asks for")


def _scheduling_options(args: argparse.Namespace) -> dict:
    if args.response_cache_byte_size is not None and args.cache_config:
        raise ValueError("--response-cache-byte-size and --cache-config are incompatible flags: use --cache-config")
    values = args.cache_config
    if args.response_cache_byte_size is not None:
        values = [f"local,size={args.response_cache_byte_size}"]
    resources = []
    for text in args.rate_limit_resource:
        try:
            resources.append(parse_resource(text))
        except ValueError as exc:
            raise ValueError(f"--rate-limit-resource {exc}") from None
    return {"response_cache_size": parse_cache_config(values), "rate_limit": args.rate_limit == "execution_count",
            "rate_limit_resources": resources, "trace_config": parse_trace_config(args.trace_config)}


def _openai_limits(args: argparse.Namespace) -> OpenAILimits:
    return OpenAILimits(max_prompts=args.openai_max_prompts, max_prompt_tokens=args.openai_max_prompt_tokens,
                        max_n=args.openai_max_n, max_logprobs=args.openai_max_logprobs,
                        chat_template_timeout_s=args.openai_chat_template_timeout_secs,
                        prompt_tokens_details=args.enable_prompt_tokens_details)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tideserve", description="LLM-first inference server (Triton-compatible).")
    p.add_argument("--model-repository", "--model-store", dest="model_repository", action="append",
                   required=True, type=Path, help="path to a model repository; repeat for several")
    p.add_argument("--host", "--http-address", dest="host", default="127.0.0.1",
                   help="address to bind the HTTP and gRPC endpoints to (default 127.0.0.1)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--metrics-address", default="127.0.0.1",
                   help="address to bind the metrics endpoint to (default 127.0.0.1, whatever --host says)")
    p.add_argument("--allow-http", type=_bool, default=True)
    p.add_argument("--allow-grpc", type=_bool, default=True)
    p.add_argument("--allow-metrics", type=_bool, default=True)
    p.add_argument("--allow-cpu-metrics", type=_bool, default=True,
                   help="Triton's CPU gauges nv_cpu_utilization, nv_cpu_memory_total_bytes and "
                        "nv_cpu_memory_used_bytes (Linux; default true)")
    p.add_argument("--metrics-interval-ms", type=_count, default=2000,
                   help="the CPU gauges are read at most once per this many milliseconds (default 2000)")
    p.add_argument("--model-control-mode", choices=[m.value for m in ControlMode], default="none")
    p.add_argument("--allowed-model-root", dest="allowed_model_roots", action="append", default=[], type=Path,
                   help="a directory outside the model repositories whose files model configurations may name "
                        "(weights, tokenizers); repeatable. Any other path outside the repositories is refused")
    p.add_argument("--model-max-instances", type=int, default=64,
                   help="most instances (threads or processes) one model version may ask for in its instance_group, "
                        "on disk or in a load request's override (default 64; 0: no limit)")
    p.add_argument("--load-model", action="append", default=[],
                   help="model to load at start-up; needs --model-control-mode explicit; '*' (as the only "
                        "--load-model) loads all; repeatable")
    p.add_argument("--backend-config", action="append", default=[], metavar="<backend>,<setting>=<value>",
                   help="a backend's setting, as tritonserver's (repeatable; without '<backend>,' it applies to every "
                        "backend), e.g. onnxruntime,default-max-batch-size=8")
    p.add_argument("--exit-on-error", type=_bool, default=True,
                   help="exit when a model --load-model names is missing or fails to load (default true; false: "
                        "log it and serve the others)")
    p.add_argument("--repository-poll-secs", type=float, default=15.0,
                   help="seconds between repository polls in poll mode")
    p.add_argument("--exit-timeout-secs", type=float, default=30.0,
                   help="on SIGTERM, how long to wait for in-flight requests before exiting")
    p.add_argument("--strict-readiness", type=_bool, default=True,
                   help="ready only when every model is ready (default true)")
    p.add_argument("--http-max-input-size", type=int, default=64 * 1024 * 1024,
                   help="largest HTTP request body in bytes")
    _add_limit_flags(p)
    _add_openai_flags(p)
    _add_prompt_tokens_details_flag(p)
    _add_parser_flags(p)
    _add_response_store_flags(p)
    _add_mcp_flags(p)
    _add_scheduling_flags(p)
    p.add_argument("--api-key", default=os.environ.get("TIDESERVE_API_KEY") or None,
                   help="API key required as 'Authorization: Bearer <key>' (default: $TIDESERVE_API_KEY; "
                        "none: open) on the routes --api-key-scope names")
    p.add_argument("--api-key-scope", choices=[s.value for s in ApiKeyScope], default="openai",
                   help="where --api-key is required: 'openai' (default): the /v1 routes; 'all': also /v2, every "
                        "gRPC method (metadata 'authorization') and /metrics. Health checks never ask for it")
    p.add_argument("--http-restricted-api", action="append", default=[], metavar="<api>[,<api>...]:<header>=<value>",
                   help="HTTP requests of these API groups must carry <header> with exactly <value>, else 403; "
                        f"repeatable, a group in one flag only. Groups: {', '.join(GROUPS)}")
    p.add_argument("--grpc-restricted-protocol", action="append", default=[],
                   metavar="<api>[,<api>...]:<header>=<value>",
                   help=f"gRPC calls of these API groups must carry the metadata '{GRPC_HEADER_PREFIX}<header>' "
                        "with exactly <value>, else PERMISSION_DENIED; repeatable, a group in one flag only")
    p.add_argument("--openapi", type=_bool, default=None,
                   help="serve the HTTP API's OpenAPI document at GET /openapi.json (default true, false when "
                        "--http-restricted-api is given)")
    p.add_argument("--frontend-workers", type=_workers, default="auto",
                   help="processes that serve the HTTP and gRPC ports (same ports, shared), each talking to the core "
                        "process that runs the models; 1 serves them in the core process itself. 'auto' "
                        "(default): one per two cores, at most 8; where that is one (under 4 cores), one worker "
                        "with --frontend-direct on when every model loaded at start is a Python model it can reach "
                        "directly, else the core process itself")
    p.add_argument("--frontend-direct", type=_on_off_auto, default=None, metavar="on|off|auto",
                   help="with frontend workers (more than one, or one with 'on'): plain inference requests to Python models (process "
                        "mode; no sequence batching, response cache, ensemble or --rate-limit) go from the worker "
                        "straight to the model's instance processes, which batch them with the model's "
                        "dynamic_batching settings (one queue per instance), instead of through the core process. "
                        "'auto' (default): on whenever there is more than one frontend worker; '--frontend-workers 1 "
                        "--frontend-direct on': one worker process serves the ports and the core runs none of those requests")
    p.add_argument("--grpc-frontend", choices=["grpcio", "pyvoy"], default="grpcio",
                   help="what serves the gRPC port: 'grpcio' (default): grpc.aio in each frontend process; 'pyvoy': "
                        "Envoy's HTTP/2 (pyvoy, the optional extra tideserve[pyvoy]) running tideserve's gRPC app in "
                        "its embedded Python, a frontend process of its own beside the HTTP ones")
    p.add_argument("--log-verbose", type=int, default=0, help="0: info, 1 or more: debug")
    p.add_argument("--version", action="version", version=f"tideserve {__version__}")
    return p


def backend_settings(values: list[str]) -> dict[str, dict[str, str]]:
    """``--backend-config`` values as {backend ("" for all): {setting: value}}; ValueError in tritonserver's words."""
    settings: dict[str, dict[str, str]] = {}
    for value in values:
        backend, _, pair = value.rpartition(",") if "," in value else ("", "", value)
        setting, equals, setting_value = pair.partition("=")
        if not equals or not setting or "," in backend:
            raise ValueError(f"--backend-config option format is '<backend name>,<setting>=<value>'. Got {value}")
        settings.setdefault(backend, {})[setting] = setting_value
    return settings


def options_from_args(args: argparse.Namespace) -> ServerOptions:
    """The server's options; ValueError for flag values argparse alone cannot check."""
    scope = ApiKeyScope(args.api_key_scope)
    try:
        check_startup_models(ControlMode(args.model_control_mode), args.load_model)
    except ServerError as exc:
        raise ValueError(exc.message) from None
    if scope is ApiKeyScope.ALL and not args.api_key:
        raise ValueError("--api-key-scope all needs an API key (--api-key or $TIDESERVE_API_KEY)")
    if args.grpc_frontend == "pyvoy" and args.allow_grpc:
        from .grpc.asgi_transport import available
        if not available():
            raise ValueError("--grpc-frontend pyvoy needs pyvoy, which is not installed: "
                             "pip install 'tideserve[pyvoy]'")
    from .workers.pool import worker_count

    workers = worker_count(None) if args.frontend_workers == "auto" else args.frontend_workers
    return ServerOptions(
        model_repositories=args.model_repository, host=args.host, http_port=args.http_port,
        grpc_port=args.grpc_port, metrics_port=args.metrics_port, allow_http=args.allow_http,
        allow_grpc=args.allow_grpc, allow_metrics=args.allow_metrics, allow_cpu_metrics=args.allow_cpu_metrics,
        metrics_interval_ms=args.metrics_interval_ms,
        model_control_mode=ControlMode(args.model_control_mode), load_models=args.load_model,
        exit_on_error=args.exit_on_error,
        backend_settings=backend_settings(args.backend_config),
        allowed_model_roots=args.allowed_model_roots, model_max_instances=args.model_max_instances,
        repository_poll_secs=args.repository_poll_secs, exit_timeout_secs=args.exit_timeout_secs,
        strict_readiness=args.strict_readiness, http_max_input_size=args.http_max_input_size,
        **_limit_options(args), **_scheduling_options(args), openai_limits=_openai_limits(args),
        openai_parsers=OutputParsers(args.tool_call_parser, args.reasoning_parser),
        enable_lora_runtime_updates=args.enable_lora_runtime_updates,
        response_store=StoreSettings(args.response_store, args.response_store_max_age_secs,
                                     args.response_store_max_bytes),
        mcp=_mcp_settings(args),
        log_verbose=args.log_verbose, api_key=args.api_key, freeze_heap=True,
        frontend_workers=workers, grpc_frontend=args.grpc_frontend,
        frontend_direct=workers > 1 if args.frontend_direct is None else args.frontend_direct,
        # auto on a host it gives one worker (under 4 cores): the layout is chosen once the models are loaded
        frontend_auto=args.frontend_workers == "auto" and workers == 1 and args.frontend_direct is None,
        openapi=args.openapi if args.openapi is not None else not args.http_restricted_api,
        metrics_address=args.metrics_address, api_key_scope=scope,
        http_restricted_apis=parse_restrictions(args.http_restricted_api, "--http-restricted-api"),
        grpc_restricted_protocols=parse_restrictions(args.grpc_restricted_protocol, "--grpc-restricted-protocol",
                                                     GRPC_HEADER_PREFIX))


def _mcp_settings(args: argparse.Namespace) -> McpSettings:
    for prefix in args.mcp_allow:
        if not prefix.startswith(("http://", "https://")) or len(prefix.split("://", 1)[1].strip("/")) == 0:
            raise ValueError(f"--mcp-allow {prefix!r}: give an http:// or https:// URL prefix with a host")
    return McpSettings(tuple(args.mcp_allow), args.mcp_max_tool_rounds)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        options = options_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))  # exits 2 with the usage line, as for any bad flag
    logging.basicConfig(level=logging.DEBUG if args.log_verbose > 0 else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvloop
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    try:
        server = Server(options)
        run(server.run())
    except ServerError as exc:
        logging.getLogger("tideserve").error("%s", exc)
        return 1
    except OSError as exc:  # e.g. a port already in use
        logging.getLogger("tideserve").error("cannot start: %s", exc)
        return 1
    return 0


def entry() -> None:
    """Console-script entry: exit without waiting on model threads still stuck past the exit timeout."""
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
