"""The ASGI side of the OpenAI routes: body, JSON or server-sent events, client disconnects.

A handler gets the parsed body and returns the JSON bytes of the answer or an :class:`EventStream`.
Errors before the first byte are JSON in OpenAI's shape with their status; an error once a stream
has started is one ``data: {"error": ...}`` event, then ``data: [DONE]``. A client that disconnects
cancels the handler, which closes its DataPlane streams (the engine aborts the requests). The API key
and the restricted API groups are checked before a route runs (server/access.py).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import orjson

from .. import load_report
from ..asgi import (
    JSON_HEADER,
    ClientGone,
    RefusalNow,
    cancel_on_disconnect,
    deadline_late_header,
    send_response,
    uvicorn_cycle,
    whole_body,
)
from ..asgi import received_ns as request_received_ns  # noqa: F401 (the /v1 routes read it beside request_timeout_us)
from ..errors import ServerError
from .errors import BadRequest, OpenAIError, from_server_error
from .limits import OpenAILimits

if TYPE_CHECKING:
    from ..http.body import BodyReader
    from ..serving import ServingInterface

log = logging.getLogger(__name__)
T = TypeVar("T")
_WORKERS = 4  # threads for blocking request work; a chat template's render is bounded in time

_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]
DONE = b"data: [DONE]\n\n"


def event(doc: Any) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n\n"


class PlainText(bytes):
    """A reply sent as ``text/plain`` (vLLM's LoRA adapter routes answer a sentence), not JSON."""


_TEXT_HEADER = (b"content-type", b"text/plain; charset=utf-8")


class EventStream:
    """A streamed answer: its events, and what to close when it ends (or the client leaves). ``write``, set by the
    route once the answer's head is sent (None until then, and for a server other than uvicorn's httptools): one
    event written to the connection at once, False having written nothing where the route's own ``send`` must
    serve (:func:`_event_writer`); a handler's events may write some of their events through it themselves, while
    the route waits for the next (``DeltaStream.write_through``)."""

    __slots__ = ("close", "events", "write")

    def __init__(self, events: AsyncGenerator[bytes, None] | None, close: Callable[[], Awaitable[None]]) -> None:
        self.events = events
        self.close = close
        self.write: Callable[[bytes], bool] | None = None


class OpenAIServer:
    """What the handlers share: the DataPlane, the model catalog, the HTTP port's body reader, the request
    limits and the threads that keep blocking work (chat templates, token counts) off the event loop."""

    def __init__(self, dataplane: ServingInterface, catalog, body: BodyReader, limits: OpenAILimits | None = None,
                 embedders=None, model_control: bool = False, adapter_updates: bool = False) -> None:
        self.dataplane = dataplane
        # POST /v1/load_lora_adapter and /unload_lora_adapter: served with --enable-lora-runtime-updates
        self.adapter_updates = adapter_updates
        # POST /v1/models/{model}/load and /unload: served with --model-control-mode explicit, one at a time
        self.model_control = model_control
        self.model_control_lock = asyncio.Lock()
        self.catalog = catalog
        self.embedders = embedders  # the embedding models (embedding.EmbedderCatalog)
        self.body = body  # the reader every route of the port reads its body with (size, decompression, depth)
        self.limits = limits or OpenAILimits()
        self._workers = ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="openai-work")

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker thread: the event loop keeps serving meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._workers, fn, *args)

    async def read_json(self, scope, receive, parse: bool = True) -> Any:
        """The request's JSON body, read within the HTTP frontend's limits; with ``parse`` false its bytes (a handler
        that validates them straight into its request model, :func:`.protocol.parse`). A body that is not encoded
        and has all arrived (the usual chat request: it came with its headers) is taken from uvicorn's cycle as it is
        (``asgi.whole_body``); any other (compressed, still arriving, another server) is read by the HTTP frontend's
        body reader (server/http/body.py)."""
        encoded = _require_json(scope)
        reader = self.body
        try:
            body = None if encoded else whole_body(receive)
            if body is None:
                body = await reader.read_request(scope, receive)
            elif len(body) > reader.max_input_size:
                from ..http.body import too_large  # (its package imports this module)

                raise too_large(len(body), reader.max_input_size)
            return reader.parse_json(body, "request body") if parse else body
        except ServerError as exc:
            raise from_server_error(exc) from None

    def check_no_body(self, scope) -> None:
        """A route that reads no body (``/v1/models/{model}/load``) still refuses one whose Content-Length is over
        the size limit, as the routes that read theirs do (413)."""
        for key, value in scope["headers"]:
            if key == b"content-length":
                from ..http.body import parse_length  # (its package imports this module)

                try:
                    self.body.check_length(parse_length(value, "Content-Length"))
                except ServerError as exc:
                    raise from_server_error(exc) from None


Handler = Callable[[OpenAIServer, Any, dict], Awaitable["bytes | EventStream"]]


class OpenAIRoute:
    """One endpoint as a plain ASGI app for the router."""

    def __init__(self, server: OpenAIServer, handler: Handler, body: bool) -> None:
        self.server = server
        self.handler = handler
        self.body = body
        self.parse = not getattr(handler, "takes_bytes", False)  # a handler that parses its body's bytes itself
        # a handler answered in well under this (a unary one) watches its connection only once it runs longer
        self.watch_delay = getattr(handler, "disconnect_watch_s", 0.0)

    async def __call__(self, scope, receive, send) -> None:
        server = self.server
        try:
            if self.body:
                doc = await server.read_json(scope, receive, self.parse)
            else:
                server.check_no_body(scope)
                doc = None
        except OpenAIError as exc:
            await _send_error(send, exc)
            return
        except ClientGone:
            return
        reply = None
        refusal = RefusalNow(send, _refusal_answer) if getattr(self.handler, "answers_refusals", False) else None
        REFUSAL.set(refusal)  # (this request's task alone: its runs' streams answer a deadline refusal at once)
        try:
            with cancel_on_disconnect(receive, self.watch_delay):
                reply = await self.handler(server, doc, scope)
                if refusal is not None:
                    refusal.armed = False
                if isinstance(reply, bytes):
                    header = _TEXT_HEADER if isinstance(reply, PlainText) else JSON_HEADER
                    await send_response(send, 200, reply, [header, *await _load_header(server, scope, doc)])
                    return
                await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
                write = reply.write = _event_writer(uvicorn_cycle(send))
                try:  # from here on an error is an event of the stream
                    async for chunk in reply.events:
                        if write is None or not write(chunk):
                            await send({"type": "http.response.body", "body": chunk, "more_body": True})
                except (OpenAIError, ServerError) as exc:
                    await send({"type": "http.response.body", "body": _error_event(exc), "more_body": True})
                except Exception as exc:
                    log.exception("OpenAI stream %s failed", scope["path"])
                    await send({"type": "http.response.body", "body": _error_event(exc), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except ClientGone:  # the client went away: the DataPlane streams are closed below
            return
        except (OpenAIError, ServerError) as exc:
            if refusal is not None and refusal.done:  # answered at the deadline itself
                return
            await _send_error(send, from_server_error(exc))
        except Exception as exc:  # a bug, not bad input: say so without a stack trace
            log.exception("OpenAI request %s failed", scope["path"])
            if refusal is None or not refusal.done:  # (a refusal written at its deadline is the whole answer)
                await _send_error(send, OpenAIError(f"internal error: {type(exc).__name__}: {exc}", 500))
        finally:
            if isinstance(reply, EventStream):
                await reply.events.aclose()  # a generator left at a yield (client gone) ends here
                await reply.close()


def _event_writer(cycle) -> Callable[[bytes], bool] | None:
    """A streamed answer's writer of one event, as uvicorn's httptools ``cycle`` writes an ``http.response.body``
    message with ``more_body`` of a chunked answer, without the message (per event one coroutine, one dict and
    uvicorn's checks of the message fewer; the same bytes), through the transport's ``write_event`` (written at
    once, server/http/limits.py) looked up once. The writer returns False, having written nothing, where ``send``
    must serve: the connection paused for flow control (its drain), closed or answered, the answer not chunked, an
    empty event, a cycle unlike the one this was written for. None for no cycle (another server)."""
    if cycle is None:
        return None
    try:
        transport = cycle.transport
        send = getattr(transport, "write_event", None) or transport.write
    except AttributeError:
        return None

    def write(chunk: bytes) -> bool:
        try:
            if (not chunk or cycle.disconnected or cycle.response_complete or cycle.chunked_encoding is not True
                    or cycle.flow.write_paused):
                return False
            send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except AttributeError:
            return False
        return True

    return write


TIMEOUT_HEADER = b"x-request-timeout-ms"


def request_timeout_us(scope) -> int:
    """The request's deadline from ``x-request-timeout-ms`` (milliseconds from arrival until the model must have
    started generating), in microseconds; 0 when absent. A value that is not a non-negative integer is a 400."""
    for key, value in scope["headers"]:
        if key.lower() == TIMEOUT_HEADER:
            text = value.decode("latin-1").strip()
            if not text.isdigit():
                raise BadRequest(f"header 'x-request-timeout-ms' must be a non-negative integer (milliseconds), got "
                                 f"'{text[:40]}'")
            return int(text) * 1000
    return 0


async def _load_header(server: OpenAIServer, scope, doc: Any) -> list[tuple[bytes, bytes]]:
    """The ORCA ``endpoint-load-metrics`` header when the request asked for it (as vLLM's server answers), with the
    load of the model it named (of the whole server when that is no loaded model)."""
    metrics_format = load_report.requested_format(scope["headers"])
    if not metrics_format:
        return []
    if isinstance(doc, bytes):
        try:
            doc = orjson.loads(doc)
        except orjson.JSONDecodeError:
            doc = None
    model = doc.get("model") if isinstance(doc, dict) else None
    try:
        figures = await server.dataplane.load_report(model if isinstance(model, str) else "")
    except ServerError:  # an adapter's name, or a model that went away: the server's figures
        figures = await server.dataplane.load_report()
    header = load_report.orca_header(metrics_format, figures)
    return [header] if header is not None else []


def _require_json(scope) -> bool:
    """A body of another media type (or none named) is a 400 before it is read, as vLLM's server answers; True when
    the body is encoded (a Content-Encoding other than identity: the body reader inflates it)."""
    media = None
    encoded = False
    for key, value in scope["headers"]:
        if key == b"content-type":
            if media is None:
                media = value.split(b";", 1)[0].strip().lower()
        elif key == b"content-encoding":
            encoded = value.strip().lower() not in (b"", b"identity")
    if media == b"application/json":
        return encoded
    shown = "none" if media is None else media.decode("latin-1")[:80]
    raise BadRequest(f"Unsupported Media Type: the request body must be 'application/json' (Content-Type: "
                     f"{shown})")


def _error_event(exc: BaseException) -> bytes:
    return b"data: " + from_server_error(exc).json() + b"\n\n" + DONE


def _error_headers(exc: OpenAIError) -> list:
    headers = [JSON_HEADER]
    if exc.retry_after_s is not None:
        headers.append((b"retry-after", str(exc.retry_after_s).encode()))
    if (late := deadline_late_header(exc)) is not None:
        headers.append(late)
    return headers


async def _send_error(send, exc: OpenAIError) -> None:
    await send_response(send, exc.status, exc.json(), _error_headers(exc))


def _refusal_answer(error: BaseException) -> tuple[int, bytes, list]:
    """:class:`~tideserve.asgi.RefusalNow`'s answer for the routes whose handler ``answers_refusals``
    (completions, chat): 503, the OpenAI error, Retry-After. Each :class:`~.generation.Run` arms it on its
    stream; it is disarmed once the handler returns (an answer started)."""
    exc = from_server_error(error)
    return exc.status, exc.json(), _error_headers(exc)


REFUSAL: contextvars.ContextVar[RefusalNow | None] = contextvars.ContextVar("tideserve_openai_refusal",
                                                                            default=None)
"""The request's :class:`~tideserve.asgi.RefusalNow` (set by :class:`OpenAIRoute` in the request's own task)."""
