"""HTTP + server-sent events over aiohttp: the transport of the OpenAI and KServe targets."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import aiohttp

from ..records import RequestRecord, SSEParser
from .base import Target, http_headers, short


class SSETarget(Target):
    """POSTs a JSON body and hands each SSE ``data`` payload, with its arrival time, to ``on_event``."""

    def __init__(self, options) -> None:
        super().__init__(options)
        self.session: aiohttp.ClientSession | None = None
        self.headers = http_headers(options)

    async def open(self) -> None:
        # no connection limit here: the runner bounds concurrency; keep-alive connections are reused
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        self.session = aiohttp.ClientSession(connector=connector, trust_env=True,
                                             timeout=aiohttp.ClientTimeout(total=None))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def post_stream(self, url: str, body: dict[str, Any], record: RequestRecord,
                          on_event: Callable[[str, float], bool | None]) -> None:
        """``on_event`` returns True to stop reading (an error event). The record's start is reset to
        the moment the request goes out, after the body is serialized."""
        assert self.session is not None, "open() the target first"
        parser = SSEParser()
        record.start = time.perf_counter()
        async with self.session.post(url, json=body, headers=self.headers) as response:
            if response.status != 200:
                text = await response.text(errors="replace")
                record.fail(f"HTTP {response.status}: {short(_error_text(text))}")
                return
            async for chunk in response.content.iter_any():
                now = time.perf_counter()
                for data in parser.feed(chunk):
                    if on_event(data, now):
                        return
            now = time.perf_counter()
            for data in parser.close():
                if on_event(data, now):
                    return


def _error_text(body: str) -> str:
    import json

    try:
        doc = json.loads(body)
    except ValueError:
        return body
    if isinstance(doc, dict):
        error = doc.get("error", doc.get("message", doc.get("detail", doc)))
        if isinstance(error, dict):
            error = error.get("message", error)
        return str(error)
    return body
