"""KServe / Triton ``POST /v2/models/<model>[/versions/<v>]/generate_stream`` (server-sent events).

The body uses the fields of Triton's vLLM model interface, which the generate extension maps onto
the model's inputs: ``text_input``, ``stream``, ``sampling_parameters`` (a JSON string with
``max_tokens``, ``ignore_eos``...) and the ``return_num_input_tokens`` / ``return_num_output_tokens``
/ ``return_finish_reason`` flags. Each event is one response: ``text_output`` is the new text,
``num_output_tokens`` the tokens it carries; an ``{"error": ...}`` event fails the request.
"""

from __future__ import annotations

import json
from typing import Any

from ..records import RequestInput, RequestRecord
from .base import short
from .http import SSETarget


def sampling_parameters(request: RequestInput, options) -> dict[str, Any]:
    sampling: dict[str, Any] = {"max_tokens": request.output_len}
    if options.ignore_eos:
        sampling["ignore_eos"] = True
    sampling.update(options.extra)
    return sampling


def first(value: Any) -> Any:
    """A response field holds a bare value for one element, a list for several (``n`` > 1)."""
    return value[0] if isinstance(value, list) and value else value


class ResponseReader:
    """Folds one request's responses (KServe events or gRPC results, as dicts) into its record."""

    def __init__(self, record: RequestRecord) -> None:
        self.record = record
        self.saw_finish_field = False

    def add(self, fields: dict[str, Any], now: float) -> None:
        record = self.record
        text = first(fields.get("text_output"))
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        text = text or ""
        count = first(fields.get("num_output_tokens"))
        if count is not None:
            count = int(count)
            record.server_output_tokens = (record.server_output_tokens or 0) + count
        if (count is not None and count > 0) or (count is None and text):
            record.token_chunk(now, text)
        elif text:  # text without tokens (should not happen): keep it
            record.text += text
        prompt = first(fields.get("num_input_tokens"))
        if prompt is not None:
            record.server_prompt_tokens = int(prompt)
        if "finish_reason" in fields:
            self.saw_finish_field = True
            reason = first(fields["finish_reason"])
            if isinstance(reason, bytes):
                reason = reason.decode()
            if reason not in (None, "", "None"):
                record.finish_reason = str(reason)
                record.ended = True


class KServeTarget(SSETarget):
    name = "kserve-generate"
    streams_usage = True

    @property
    def api_url(self) -> str:
        base = self.options.url.rstrip("/")
        if self.options.endpoint:
            return base + self.options.endpoint
        version = f"/versions/{self.options.model_version}" if self.options.model_version else ""
        return f"{base}/v2/models/{self.options.model}{version}/generate_stream"

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "api_url": self.api_url}

    def body(self, request: RequestInput) -> dict[str, Any]:
        body: dict[str, Any] = {"text_input": request.prompt, "stream": True,
                                "sampling_parameters": json.dumps(sampling_parameters(request, self.options))}
        if self.options.server_counts:
            body.update(return_num_input_tokens=True, return_num_output_tokens=True, return_finish_reason=True)
        return body

    async def _send(self, request: RequestInput, record: RequestRecord) -> None:
        reader = ResponseReader(record)

        def on_event(data: str, now: float) -> bool:
            event = json.loads(data)
            if not isinstance(event, dict):
                return False
            if "error" in event:
                record.fail("server error: " + short(event["error"]))
                return True
            reader.add(event, now)
            return False

        await self.post_stream(self.api_url, self.body(request), record, on_event)
        if not record.error and not reader.saw_finish_field:
            record.ended = True  # the server sends no finish reason: the end of the body is the only marker
