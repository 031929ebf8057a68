"""The ASGI side of ``/v1/messages``: errors in Anthropic's shape, ``event: <type>`` server-sent events.

An error before the first byte is ``{"type": "error", "error": {"type", "message"}}`` with its status; one
after a stream has started is an ``event: error`` with that body. Otherwise as the OpenAI routes
(:mod:`..http`): the body is read within the HTTP port's limits, and a client that disconnects cancels
the handler, which closes its DataPlane stream (the engine aborts the request).
"""

from __future__ import annotations

import logging

import orjson

from ...asgi import JSON_HEADER, ClientGone, cancel_on_disconnect, send_response
from ...errors import ServerError
from ..errors import OpenAIError, from_server_error
from ..http import _SSE_HEADERS, EventStream, OpenAIServer

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
          529: "overloaded_error"}


def error_body(status: int, message: str) -> bytes:
    kind = _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})


def refusal_body(refusal) -> bytes:
    """An access refusal (server/access.py) in Anthropic's shape."""
    return error_body(refusal.status, refusal.message)


def sse(kind: str, doc: dict) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(doc) + b"\n\n"


class AnthropicRoute:
    """One Anthropic endpoint as a plain ASGI app: ``handler(server, doc, scope)`` returns JSON bytes or an
    :class:`~..http.EventStream`."""

    def __init__(self, server: OpenAIServer, handler) -> None:
        self.server = server
        self.handler = handler

    async def __call__(self, scope, receive, send) -> None:
        reply = None
        try:
            doc = await self.server.read_json(scope, receive)  # before the disconnect watch reads the messages
            with cancel_on_disconnect(receive):
                reply = await self.handler(self.server, doc, scope)
                if isinstance(reply, bytes):
                    await send_response(send, 200, reply, [JSON_HEADER])
                    return
                await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
                try:
                    async for chunk in reply.events:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                except Exception as exc:  # from here on an error is an event of the stream
                    if not isinstance(exc, (OpenAIError, ServerError)):
                        log.exception("Anthropic stream %s failed", scope["path"])
                    error = from_server_error(exc)
                    body = {"type": "error", "error": orjson.loads(error_body(error.status, error.message))["error"]}
                    await send({"type": "http.response.body", "body": sse("error", body), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except ClientGone:
            return
        except (OpenAIError, ServerError) as exc:
            await _send_error(send, from_server_error(exc))
        except Exception as exc:
            log.exception("Anthropic request %s failed", scope["path"])
            await _send_error(send, OpenAIError(f"internal error: {type(exc).__name__}: {exc}", 500))
        finally:
            if isinstance(reply, EventStream):
                await reply.events.aclose()
                await reply.close()


async def _send_error(send, exc: OpenAIError) -> None:
    headers = [JSON_HEADER]
    if exc.retry_after_s is not None:
        headers.append((b"retry-after", str(exc.retry_after_s).encode()))
    message = exc.message if not exc.param or exc.param in exc.message else f"{exc.param}: {exc.message}"
    await send_response(send, exc.status, error_body(exc.status, message), headers)
