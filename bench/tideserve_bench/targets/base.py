"""What every target shares: its options, the request-timeout guard and the bookkeeping of one request."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Any

from ..records import RequestInput, RequestRecord


@dataclass
class TargetOptions:
    url: str                                  # http://host:port (HTTP targets) or host:port (gRPC)
    model: str                                # the served model name
    ignore_eos: bool = False
    server_counts: bool = True                # ask the server for token counts (usage / num_*_tokens)
    extra: dict[str, Any] = field(default_factory=dict)   # merged into the body / sampling parameters
    request_timeout: float = 600.0
    endpoint: str | None = None               # path override (HTTP targets)
    model_version: str = ""                   # KServe / gRPC model version ("" = the server's choice)
    headers: dict[str, str] = field(default_factory=dict)
    role_chunk_is_token: bool = True          # openai-chat: the role-only first chunk counts (as vLLM does)


class Target:
    """One protocol. ``send`` never raises: every outcome is a RequestRecord (failed ones with ``error``)."""

    name = ""
    streams_usage = False  # the protocol reports token counts itself

    def __init__(self, options: TargetOptions) -> None:
        self.options = options

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {"target": self.name, "url": self.options.url, "model": self.options.model}

    async def send(self, request: RequestInput) -> RequestRecord:
        record = RequestRecord(request.index, request.request_id or f"bench-{request.index}",
                               request.prompt_len, request.output_len)
        record.start = time.perf_counter()
        try:
            async with asyncio.timeout(self.options.request_timeout):
                await self._send(request, record)
        except TimeoutError:
            record.fail(f"timed out after {self.options.request_timeout:g} s")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure is a result, never a crash of the run
            record.fail(f"{type(exc).__name__}: {exc}".strip().removesuffix(":"))
        else:
            if not record.error and not record.chunk_times:
                record.fail("the stream ended without any output token")
            elif not record.error:
                record.success = True
        return record

    async def _send(self, request: RequestInput, record: RequestRecord) -> None:
        raise NotImplementedError


def http_headers(options: TargetOptions) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    key = os.environ.get("OPENAI_API_KEY")
    if key:
        headers["Authorization"] = f"Bearer {key}"
    headers.update(options.headers)
    return headers


def short(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."
