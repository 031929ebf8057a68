"""Helpers the tests share: free ports, the test repository, a real tideserve process on 127.0.0.1.

Fixtures live in conftest.py; tests import these helpers by name (``from support import start_server``):
``tests/`` is on the import path (pytest ``pythonpath``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent  # the checkout
TEST_MODELS = TESTS / "models"  # Python-backend models of the test repository


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class RunningServer:
    process: subprocess.Popen
    http_port: int
    grpc_port: int
    metrics_port: int
    log_path: Path
    signalled: int | None = None  # the signal stop() (or stop_session_servers_together) sent it

    def register_for_session(self) -> None:
        """A session fixture's server: SIGTERM reaches it with the others' at the session's end."""
        _SESSION_SERVERS.append(self)

    @property
    def http_url(self) -> str:  # what tritonclient.http expects
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            return r.read().decode()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.process.poll() is None:
            if sig != self.signalled:  # once is enough (see stop_session_servers_together)
                self.process.send_signal(sig)
                self.signalled = sig
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


_SESSION_SERVERS: list[RunningServer] = []


def wait_http_ok(proc: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
    """Poll ``url`` until it answers 200 while ``proc`` runs; fail with ``log``'s text if it exits or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)


def stop_session_servers_together() -> None:
    """SIGTERM to every running session server at once (their fixtures then wait for each in turn): engines
    stop side by side instead of one after another."""
    for running in _SESSION_SERVERS:
        if running.process.poll() is None and running.signalled is None:
            running.process.send_signal(signal.SIGTERM)
            running.signalled = signal.SIGTERM


def stop_servers(servers) -> None:
    """Stop several servers side by side: SIGTERM to each, then wait for each."""
    for running in servers:
        if running.process.poll() is None and running.signalled is None:
            running.process.send_signal(signal.SIGTERM)
            running.signalled = signal.SIGTERM
    for running in servers:
        running.stop()


class PortTaken(RuntimeError):
    """The server could not bind a port it was given (another process took it after it was found free)."""


def start_server(repositories: list[Path], *extra_args: str, tmp_dir: Path, ready_timeout: float = 120,
                 wait_ready: bool = True, env: dict | None = None,
                 ports: tuple[int, int, int] | None = None, session: bool = False) -> RunningServer:
    """Start ``tideserve`` as its own process and wait until it answers on HTTP. ``ports``: its HTTP, gRPC and
    metrics ports (a replica restarted where a router expects it); free ones by default, and others again if one
    of them was taken before the server bound it (it binds once its models are loaded, minutes for an engine,
    while another server's engine may take ephemeral ports). ``session``: a session fixture's server (see
    :meth:`RunningServer.register_for_session`)."""
    for attempt in range(3):
        try:
            running = _start_server(repositories, extra_args, tmp_dir, ready_timeout, wait_ready, env,
                                    ports or (free_port(), free_port(), free_port()))
            if session:
                running.register_for_session()
            return running
        except PortTaken:
            if ports is not None or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _start_server(repositories: list[Path], extra_args: tuple[str, ...], tmp_dir: Path, ready_timeout: float,
                  wait_ready: bool, env: dict | None, ports: tuple[int, int, int]) -> RunningServer:
    http_port, grpc_port, metrics_port = ports
    args = [sys.executable, "-m", "tideserve.cli", "--http-port", str(http_port), "--grpc-port", str(grpc_port),
            "--metrics-port", str(metrics_port)]
    for repo in repositories:
        args += ["--model-repository", str(repo)]
    args += list(extra_args)
    # the protocol tests run a second time with frontend worker processes (.ci/run; see docs/architecture.md)
    named = "--frontend-workers" in extra_args  # a test of a layout of its own: the passes leave it as it is
    if not named:  # not the core count's default: the same on every machine
        args += ["--frontend-workers", os.environ.get("TIDESERVE_TEST_FRONTEND_WORKERS") or "1"]
    # ... through the core (the second pass: --frontend-direct off), and once more with --frontend-direct on
    # (TIDESERVE_TEST_FRONTEND_DIRECT=1: `make test`'s third pass); a test that names neither gets the default
    if not named and "--frontend-direct" not in extra_args and os.environ.get("TIDESERVE_TEST_FRONTEND_WORKERS"):
        args += ["--frontend-direct", "on" if os.environ.get("TIDESERVE_TEST_FRONTEND_DIRECT") == "1" else "off"]
    # the gRPC protocol tests again with the gRPC port on pyvoy (TIDESERVE_TEST_GRPC_FRONTEND=pyvoy)
    if "--grpc-frontend" not in extra_args and os.environ.get("TIDESERVE_TEST_GRPC_FRONTEND"):
        args += ["--grpc-frontend", os.environ["TIDESERVE_TEST_GRPC_FRONTEND"]]
    log_path = tmp_dir / f"tideserve-{http_port}.log"
    log_file = open(log_path, "ab")  # a server restarted on the same ports logs after its predecessor
    process = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT,
                               env={**os.environ, **(env or {})})
    server = RunningServer(process, http_port, grpc_port, metrics_port, log_path)
    path = "/v2/health/ready" if wait_ready else "/v2/health/live"
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log = server.log()
            taken = "failed to bind" in log or "address already in use" in log.lower()
            raise (PortTaken if taken else RuntimeError)(f"tideserve exited with {process.returncode}:\n{log}")
        try:
            with urllib.request.urlopen(f"{server.base_url}{path}", timeout=2) as response:
                if response.status == 200:
                    return server
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.1)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"tideserve did not become ready in {ready_timeout}s:\n{server.log()}")
