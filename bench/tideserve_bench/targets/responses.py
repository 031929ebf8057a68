"""OpenAI ``/v1/responses``, streamed: the Responses API's server-sent events.

The body: ``model``, ``input`` (the prompt, one user message), ``max_output_tokens``, ``stream``, and
``store: false`` (chat completions store nothing; ``--extra '{"store": true}'`` measures the response store
too), ``ignore_eos`` when asked, then ``--extra``. A token chunk is an event that carries output:
``response.output_text.delta``, ``response.reasoning_text.delta``, ``response.function_call_arguments.delta``
(the events before the first token, ``response.created`` and the item and part announcements, are not
tokens, as the chat stream's role-only chunk is not with ``--ttft-from content``). ``response.completed`` /
``response.incomplete`` end the stream with the usage (``output_tokens``, ``input_tokens``);
``response.failed`` and ``error`` fail the request.
"""

from __future__ import annotations

import json
from typing import Any

from ..records import RequestInput, RequestRecord
from .base import short
from .http import SSETarget

_TOKEN_EVENTS = ("response.output_text.delta", "response.reasoning_text.delta",
                 "response.function_call_arguments.delta")
# neither tokens nor the end: the data of these, their type first, is not parsed (ResponsesTarget.read_event)
_PASSED_OVER = tuple(f'{{"type":"{kind}"' for kind in (
    "response.created", "response.in_progress", "response.queued", "response.output_item.added",
    "response.content_part.added", "response.output_text.done", "response.reasoning_text.done",
    "response.function_call_arguments.done", "response.content_part.done", "response.output_item.done"))


class ResponsesTarget(SSETarget):
    name = "openai-responses"
    default_endpoint = "/v1/responses"
    streams_usage = True

    @property
    def api_url(self) -> str:
        base = self.options.url.rstrip("/")
        if base.endswith("/responses"):
            return base
        return base + (self.options.endpoint or self.default_endpoint)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "api_url": self.api_url}

    def body(self, request: RequestInput) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.options.model, "input": request.prompt,
                                "max_output_tokens": request.output_len, "stream": True, "store": False}
        if self.options.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.options.extra)
        return body

    def read_event(self, record: RequestRecord, data: str, now: float) -> bool:
        """One event's ``data`` (arrived at ``now``) into ``record``; True when the stream is over. An event that
        is neither a token nor the end (``response.created`` and the other announcements, the ``.done`` events) is
        passed over without being parsed when its ``type`` leads its JSON, as the servers write it: the response
        object of ``response.created`` / ``response.in_progress`` (the first chunk's bulk) would otherwise cost
        this client's event loop, shared by every stream, tens of microseconds per stream at the first token,
        counted in the TTFT of the streams read after it (the chat target parses nothing of that size)."""
        if data.startswith(_PASSED_OVER):
            return False
        event = json.loads(data)
        if not isinstance(event, dict):
            return False
        kind = event.get("type")
        if kind in _TOKEN_EVENTS:
            record.token_chunk(now, event.get("delta") or "")
        elif kind in ("response.completed", "response.incomplete"):
            response = event.get("response") or {}
            usage = response.get("usage") or {}
            if usage.get("output_tokens") is not None:
                record.server_output_tokens = int(usage["output_tokens"])
            if usage.get("input_tokens") is not None:
                record.server_prompt_tokens = int(usage["input_tokens"])
            record.finish_reason = "stop" if kind == "response.completed" else "length"
            record.ended = True
            return True
        elif kind in ("response.failed", "error"):
            error = (event.get("response") or {}).get("error") if kind == "response.failed" else event
            message = error.get("message", error) if isinstance(error, dict) else error
            record.fail("server error: " + short(str(message)))
            return True
        return False

    async def _send(self, request: RequestInput, record: RequestRecord) -> None:
        await self.post_stream(self.api_url, self.body(request), record,
                               lambda data, now: self.read_event(record, data, now))
