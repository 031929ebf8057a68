"""A tideserve Server in the test process, so synchronous clients (tritonclient, requests) can drive it.

The server runs on its own asyncio event loop in a daemon thread; the test thread reaches that loop
through `call`. Usage:

    running = InProcessServer(ServerOptions(model_repositories=[root], http_port=free_port(), ...), registry)
    try:
        with httpclient.InferenceServerClient(running.http_url) as client:
            ...
    finally:
        running.stop()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
import time
from pathlib import Path

from tideserve.app import Server, ServerOptions
from tideserve.backend import BackendRegistry

_WILDCARD_HOSTS = {"", "0.0.0.0", "::"}


class InProcessServer:
    """Starts `Server(options, registry)` on a fresh event loop thread; `stop()` undoes all of it.

    `registry=None` gives the server's default registry, which finds backends by package entry point.
    """

    def __init__(self, options: ServerOptions, registry: BackendRegistry | None = None,
                 start_timeout: float = 120) -> None:
        workers = os.environ.get("TIDESERVE_TEST_FRONTEND_WORKERS")  # see tests/support.py start_server
        if workers and options.frontend_workers == 1:
            options.frontend_workers = int(workers)
        grpc_frontend = os.environ.get("TIDESERVE_TEST_GRPC_FRONTEND")  # the gRPC port on pyvoy (support.py)
        if grpc_frontend and options.grpc_frontend == "grpcio":
            options.grpc_frontend = grpc_frontend
        self.options = options
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                       name=f"tideserve-{options.http_port}-{options.grpc_port}")
        self.thread.start()
        try:
            self.server = self.call(self._make(options, registry))
            self.call(self.server.start(), timeout=start_timeout)
        except BaseException:
            if hasattr(self, "server") and self.thread.is_alive():  # release what started before the failure
                with contextlib.suppress(Exception):
                    self.call(self.server.stop(), timeout=10)
            self._close_loop()
            raise

    @staticmethod
    async def _make(options: ServerOptions, registry: BackendRegistry | None) -> Server:
        return Server(options, registry)  # made on the server's loop, which owns its asyncio objects

    def call(self, coro, timeout: float = 30):
        """Run `coro` on the server's loop and wait (from this thread) for its result.

        Fails at once, rather than at the timeout, if the loop's thread has died: uvicorn answers a
        port already in use with SystemExit, which ends `run_forever` and with it the thread.
        """
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        deadline = time.monotonic() + timeout
        while True:
            try:
                return future.result(max(0.0, min(0.1, deadline - time.monotonic())))
            except concurrent.futures.TimeoutError:
                if not self.thread.is_alive():
                    future.cancel()
                    raise RuntimeError(f"the event loop thread {self.thread.name} died (see the log above)") from None
                if time.monotonic() >= deadline:
                    raise

    def stop(self) -> None:
        """Stop the server (draining up to its exit timeout), then the loop and its thread. Idempotent."""
        if self.loop.is_closed():
            return
        try:
            self.call(self.server.stop())
        finally:
            self._close_loop()

    def _close_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if self.thread.is_alive():
            raise RuntimeError(f"the event loop thread {self.thread.name} did not stop within 10s")
        self.loop.close()

    # -- derived from the options -----------------------------------------------------------------
    @property
    def host(self) -> str:
        """The address clients use: the server's host, or loopback when it binds every interface."""
        return "127.0.0.1" if self.options.host in _WILDCARD_HOSTS else self.options.host

    @property
    def http_port(self) -> int:
        return self.options.http_port

    @property
    def grpc_port(self) -> int:
        return self.options.grpc_port

    @property
    def http_url(self) -> str:
        """host:port, as tritonclient.http takes it."""
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        """host:port, as tritonclient.grpc and grpc.insecure_channel take it."""
        return f"{self.host}:{self.grpc_port}"

    @property
    def base(self) -> str:
        """The HTTP base URL, e.g. for urllib / aiohttp: http://host:port."""
        return f"http://{self.http_url}"

    @property
    def repo(self) -> Path:
        """The first model repository."""
        return Path(self.options.model_repositories[0])

    def model(self, name: str):
        """The loaded Model object behind the repository entry `name`."""
        return self.server.repository.get(name).model
