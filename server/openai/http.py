"""The ASGI side of the OpenAI routes: API key, body, JSON or server-sent events, client disconnects.

A handler gets the parsed body and returns the JSON bytes of the answer or an :class:`EventStream`.
Errors before the first byte are JSON in OpenAI's shape with their status; an error once a stream
has started is one ``data: {"error": ...}`` event, then ``data: [DONE]``. A client that disconnects
cancels the handler, which closes its DataPlane streams (the engine aborts the requests).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import orjson

from ..errors import ServerError
from ..http.app import _ClientGone, _decompress, _DisconnectWatch, _parse_length
from .errors import BadRequest, OpenAIError, from_server_error

log = logging.getLogger(__name__)

_JSON_HEADERS = [(b"content-type", b"application/json")]
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]
DONE = b"data: [DONE]\n\n"


def event(doc: Any) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n\n"


class EventStream:
    """A streamed answer: its events, and what to close when it ends (or the client leaves)."""

    __slots__ = ("close", "events")

    def __init__(self, events: AsyncGenerator[bytes, None], close: Callable[[], Awaitable[None]]) -> None:
        self.events = events
        self.close = close


class OpenAIServer:
    """What the handlers share: the DataPlane, the model catalog, body limits and the API key."""

    def __init__(self, dataplane, catalog, frontend, api_key: str | None) -> None:
        self.dataplane = dataplane
        self.catalog = catalog
        self.frontend = frontend  # server.http.app.HttpFrontend: body size limit and reading
        self.api_key = api_key.encode() if api_key else None

    def authorized(self, scope) -> bool:
        if self.api_key is None:
            return True
        for key, value in scope["headers"]:
            if key == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)
        return False

    async def read_json(self, scope, receive) -> Any:
        content_length = encoding = None
        for key, value in scope["headers"]:
            if key == b"content-length":
                content_length = value
            elif key == b"content-encoding":
                encoding = value
        try:
            length = _parse_length(content_length, "Content-Length") if content_length is not None else None
            body = await self.frontend._read_asgi_body(receive, length)
            if encoding is not None:
                body = _decompress(body, encoding, self.frontend.max_input_size)
        except ServerError as exc:
            raise from_server_error(exc) from None
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise BadRequest(f"the request body is not valid JSON: {exc}") from None


Handler = Callable[[OpenAIServer, Any, dict], Awaitable["bytes | EventStream"]]


class OpenAIRoute:
    """One endpoint as a plain ASGI app for the router."""

    def __init__(self, server: OpenAIServer, handler: Handler, body: bool, public: bool = False) -> None:
        self.server = server
        self.handler = handler
        self.body = body
        self.public = public  # answered without the API key (health)

    async def __call__(self, scope, receive, send) -> None:
        server = self.server
        if not self.public and not server.authorized(scope):
            await _send_error(send, OpenAIError("Invalid or missing API key: send 'Authorization: Bearer <key>'",
                                                401), [(b"www-authenticate", b"Bearer")])
            return
        try:
            doc = await server.read_json(scope, receive) if self.body else None
        except OpenAIError as exc:
            await _send_error(send, exc)
            return
        except _ClientGone:
            return
        watch = _DisconnectWatch(receive, asyncio.current_task())
        watch.start()
        reply = None
        try:
            reply = await self.handler(server, doc, scope)
            if isinstance(reply, bytes):
                await _send(send, 200, reply, list(_JSON_HEADERS))
                return
            await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
            try:  # from here on an error is an event of the stream
                async for chunk in reply.events:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except (OpenAIError, ServerError) as exc:
                await send({"type": "http.response.body", "body": _error_event(exc), "more_body": True})
            except Exception as exc:
                log.exception("OpenAI stream %s failed", scope["path"])
                await send({"type": "http.response.body", "body": _error_event(exc), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if watch.gone:  # the client went away: the DataPlane streams are closed below
                watch.task.uncancel()
                return
            raise
        except (OpenAIError, ServerError) as exc:
            await _send_error(send, from_server_error(exc))
        except Exception as exc:  # a bug, not bad input: say so without a stack trace
            log.exception("OpenAI request %s failed", scope["path"])
            await _send_error(send, OpenAIError(f"internal error: {type(exc).__name__}: {exc}", 500))
        finally:
            watch.stop()
            if isinstance(reply, EventStream):
                await reply.events.aclose()  # a generator left at a yield (client gone) ends here
                await reply.close()


def _error_event(exc: BaseException) -> bytes:
    return b"data: " + from_server_error(exc).json() + b"\n\n" + DONE


async def _send(send, status: int, body: bytes, headers: list) -> None:
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _send_error(send, exc: OpenAIError, headers: list | None = None) -> None:
    await _send(send, exc.status, exc.json(), list(_JSON_HEADERS) + (headers or []))
