"""The one reader of HTTP request bodies, for every route (infer, generate, OpenAI, repository).

The body comes from the ASGI ``receive`` channel chunk by chunk. Its size on the wire is held to
``--http-max-input-size`` (at once from Content-Length, otherwise as the chunks arrive). A ``gzip`` or
``deflate`` body is inflated as it arrives and refused as soon as its decompressed size passes
``--http-max-decompressed-size``: the compressed bytes are never held whole, and a small compressed
body cannot make the server inflate more than the limit. A Content-Encoding the server cannot read is
refused with 415 before any of the body is read. JSON bodies are parsed with the nesting limit
``--http-max-json-depth``. Every refusal is a :class:`~tideserve.errors.ServerError` naming the limit; a
client that leaves before its body arrived is :class:`~tideserve.asgi.ClientGone`.
"""

from __future__ import annotations

import zlib
from typing import Any

from ..asgi import ClientGone, whole_body
from ..errors import ContentTooLarge, InvalidArgument, UnsupportedMediaType
from . import codec

DEFAULT_MAX_INPUT_SIZE = 64 * 1024 * 1024


def parse_length(value: bytes, header: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise InvalidArgument(f"unable to parse {header} header, got '{value[:40].decode('latin-1')}'")
    return number


def too_large(size: int, limit: int) -> ContentTooLarge:
    return ContentTooLarge(f"request body of {size} bytes exceeds the maximum allowed input size of {limit} "
                           "bytes; use --http-max-input-size to increase the limit")


class _Inflater:
    """Decompresses a body chunk by chunk, never past ``limit`` bytes of output."""

    __slots__ = ("decompressor", "limit", "name", "parts", "size")

    def __init__(self, encoding: bytes, limit: int) -> None:
        if encoding == b"gzip":
            wbits = 16 + zlib.MAX_WBITS
        elif encoding == b"deflate":
            wbits = 32 + zlib.MAX_WBITS  # zlib stream (what clients send), header auto-detected
        else:
            raise UnsupportedMediaType(f"unsupported Content-Encoding '{encoding[:40].decode('latin-1')}'; "
                                       "use gzip, deflate or identity")
        self.decompressor = zlib.decompressobj(wbits)
        self.name = encoding.decode()
        self.limit = limit
        self.parts: list[bytes] = []
        self.size = 0

    def feed(self, chunk: bytes) -> None:
        try:
            # at most one byte past the limit (never 0, which zlib reads as "no limit")
            out = self.decompressor.decompress(chunk, self.limit - self.size + 1)
        except zlib.error as exc:
            raise InvalidArgument(f"failed to decompress the {self.name} request body: {exc}") from None
        self.size += len(out)
        if self.size > self.limit:
            raise InvalidArgument(f"the decompressed request body exceeds the maximum allowed input size of "
                                  f"{self.limit} bytes; use --http-max-decompressed-size to increase the limit")
        if out:
            self.parts.append(out)

    def finish(self) -> bytes:
        if not self.decompressor.eof:
            raise InvalidArgument(f"the {self.name} request body is truncated")
        return b"".join(self.parts)


class BodyReader:
    """Reads and parses request bodies within the HTTP frontend's limits."""

    __slots__ = ("max_decompressed_size", "max_input_size", "max_json_depth")

    def __init__(self, max_input_size: int = DEFAULT_MAX_INPUT_SIZE, max_decompressed_size: int | None = None,
                 max_json_depth: int = codec.MAX_JSON_DEPTH) -> None:
        self.max_input_size = max_input_size
        """Most bytes of body on the wire (``--http-max-input-size``)."""
        self.max_decompressed_size = max_input_size if max_decompressed_size is None else max_decompressed_size
        """Most bytes a compressed body may inflate to (``--http-max-decompressed-size``; default: the input size)."""
        self.max_json_depth = max_json_depth
        """Deepest nesting of arrays and objects in a JSON body (``--http-max-json-depth``)."""

    def check_length(self, content_length: int | None) -> None:
        """A Content-Length over the limit is refused before any of the body is read."""
        if content_length is not None and content_length > self.max_input_size:
            raise too_large(content_length, self.max_input_size)

    def _inflater(self, content_length: int | None, encoding: bytes | None) -> _Inflater | None:
        """The checks before any of the body is read; the body's inflater (None: not compressed)."""
        self.check_length(content_length)
        if encoding is not None:
            encoding = encoding.strip().lower()
            if encoding not in (b"", b"identity"):
                return _Inflater(encoding, self.max_decompressed_size)
        return None

    def whole(self, receive, content_length: int | None, encoding: bytes | None) -> bytes | None:
        """:meth:`read` without an await where all of the body has arrived (the usual case: uvicorn's cycle holds
        it); None, having taken nothing, where :meth:`read` must be awaited."""
        inflater = self._inflater(content_length, encoding)
        body = whole_body(receive)
        if body is None:
            return None
        if len(body) > self.max_input_size:
            raise too_large(len(body), self.max_input_size)
        if inflater is None:
            return body
        inflater.feed(body)
        return inflater.finish()

    async def read(self, receive, content_length: int | None, encoding: bytes | None) -> bytes:
        """The whole body, decompressed; ``content_length`` and ``encoding`` are the request's headers."""
        body = self.whole(receive, content_length, encoding)
        if body is not None:  # all of it is in: no need to wait for it
            return body
        limit = self.max_input_size
        inflater = self._inflater(content_length, encoding)
        message = await receive()
        if message["type"] != "http.request":
            raise ClientGone()
        body = message.get("body", b"")
        total = len(body)
        if total > limit:
            raise too_large(total, limit)
        if inflater is None and not message.get("more_body", False):
            return body  # the common case: one chunk, as it came
        chunks = []
        if inflater is None:
            chunks.append(body)
        else:
            inflater.feed(body)
        while message.get("more_body", False):
            message = await receive()
            if message["type"] != "http.request":
                raise ClientGone()
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > limit:
                raise too_large(total, limit)
            if inflater is None:
                chunks.append(chunk)
            else:
                inflater.feed(chunk)
        return b"".join(chunks) if inflater is None else inflater.finish()

    async def read_request(self, scope, receive) -> bytes:
        """:meth:`read` with the Content-Length and Content-Encoding taken from ``scope``'s headers."""
        content_length = encoding = None
        for key, value in scope["headers"]:
            if key == b"content-length":
                content_length = parse_length(value, "Content-Length")
            elif key == b"content-encoding":
                encoding = value
        return await self.read(receive, content_length, encoding)

    def parse_json(self, body: bytes, what: str) -> Any:
        """A JSON body, within the nesting limit; InvalidArgument naming ``what`` otherwise."""
        return codec.parse_json(body, what, self.max_json_depth)
