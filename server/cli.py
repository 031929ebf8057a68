"""``tideserve``: command-line flags modelled on ``tritonserver``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from . import __version__
from .app import Server, ServerOptions
from .errors import ServerError
from .repository import ControlMode


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got '{text}'")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tideserve", description="LLM-first inference server (Triton-compatible).")
    p.add_argument("--model-repository", "--model-store", dest="model_repository", action="append",
                   required=True, type=Path, help="path to a model repository; repeat for several")
    p.add_argument("--host", "--http-address", dest="host", default="127.0.0.1",
                   help="address to bind every endpoint to (default 127.0.0.1)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--allow-http", type=_bool, default=True)
    p.add_argument("--allow-grpc", type=_bool, default=True)
    p.add_argument("--allow-metrics", type=_bool, default=True)
    p.add_argument("--model-control-mode", choices=[m.value for m in ControlMode], default="none")
    p.add_argument("--load-model", action="append", default=[],
                   help="model to load at start-up in explicit mode; '*' loads all; repeatable")
    p.add_argument("--repository-poll-secs", type=float, default=15.0,
                   help="seconds between repository polls in poll mode")
    p.add_argument("--exit-timeout-secs", type=float, default=30.0,
                   help="on SIGTERM, how long to wait for in-flight requests before exiting")
    p.add_argument("--strict-readiness", type=_bool, default=True,
                   help="ready only when every model is ready (default true)")
    p.add_argument("--http-max-input-size", type=int, default=64 * 1024 * 1024,
                   help="largest HTTP request body in bytes")
    p.add_argument("--api-key", default=os.environ.get("TIDESERVE_API_KEY") or None,
                   help="API key the OpenAI /v1 routes require as 'Authorization: Bearer <key>' (default: "
                        "$TIDESERVE_API_KEY; none: open). /v2, /health and /metrics do not ask for it")
    p.add_argument("--log-verbose", type=int, default=0, help="0: info, 1 or more: debug")
    p.add_argument("--version", action="version", version=f"tideserve {__version__}")
    return p


def options_from_args(args: argparse.Namespace) -> ServerOptions:
    return ServerOptions(
        model_repositories=args.model_repository, host=args.host, http_port=args.http_port,
        grpc_port=args.grpc_port, metrics_port=args.metrics_port, allow_http=args.allow_http,
        allow_grpc=args.allow_grpc, allow_metrics=args.allow_metrics,
        model_control_mode=ControlMode(args.model_control_mode), load_models=args.load_model,
        repository_poll_secs=args.repository_poll_secs, exit_timeout_secs=args.exit_timeout_secs,
        strict_readiness=args.strict_readiness, http_max_input_size=args.http_max_input_size,
        log_verbose=args.log_verbose, api_key=args.api_key, freeze_heap=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.log_verbose > 0 else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvloop
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    try:
        server = Server(options_from_args(args))
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
