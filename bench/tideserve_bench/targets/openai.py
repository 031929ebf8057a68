"""OpenAI ``/v1/chat/completions`` and ``/v1/completions``, streamed, with ``stream_options.include_usage``.

The body is what ``vllm bench serve`` sends (``max_completion_tokens`` / ``max_tokens``,
``ignore_eos`` when asked, usage in the stream), so the two tools load a server the same way.
A token chunk is a chunk with a choice, as vLLM counts: the chat stream's first chunk, which only
announces the assistant role, included (vLLM's server and tideserve's send it with the first token).
``role_chunk_is_token=False`` (``--ttft-from content``) leaves that chunk out, for servers that send it
before any token exists; TTFT is then the first chunk with content, a finish reason or tool calls.
"""

from __future__ import annotations

import json
from typing import Any

from ..records import RequestInput, RequestRecord
from .base import short
from .http import SSETarget


class OpenAITarget(SSETarget):
    chat = False
    default_endpoint = "/v1/completions"
    streams_usage = True

    @property
    def api_url(self) -> str:
        base = self.options.url.rstrip("/")
        if base.endswith("/completions"):
            return base
        return base + (self.options.endpoint or self.default_endpoint)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "api_url": self.api_url}

    def body(self, request: RequestInput) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.options.model, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.chat:
            body["messages"] = [{"role": "user", "content": request.prompt}]
            body["max_completion_tokens"] = request.output_len
        else:
            body["prompt"] = request.prompt
            body["max_tokens"] = request.output_len
        if self.options.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.options.extra)
        return body

    async def _send(self, request: RequestInput, record: RequestRecord) -> None:
        def on_event(data: str, now: float) -> bool:
            if data.strip() == "[DONE]":
                record.ended = True
                return False
            event = json.loads(data)
            if not isinstance(event, dict):
                return False
            if event.get("error") is not None:
                error = event["error"]
                record.fail("server error: " + short(error.get("message", error) if isinstance(error, dict) else error))
                return True
            choices = event.get("choices")
            if choices:
                choice = choices[0]
                if self.chat:
                    delta = choice.get("delta") or {}
                    text = delta.get("content") or ""
                    reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
                    role_only = (not self.options.role_chunk_is_token and "role" in delta and not text
                                 and not reasoning and not delta.get("tool_calls") and not choice.get("finish_reason"))
                    if not role_only:
                        record.token_chunk(now, text or reasoning)
                else:
                    record.token_chunk(now, choice.get("text") or "")
                if choice.get("finish_reason"):
                    record.finish_reason = str(choice["finish_reason"])
                    record.ended = True
            usage = event.get("usage")
            if usage:
                if usage.get("completion_tokens") is not None:
                    record.server_output_tokens = int(usage["completion_tokens"])
                if usage.get("prompt_tokens") is not None:
                    record.server_prompt_tokens = int(usage["prompt_tokens"])
            return False

        await self.post_stream(self.api_url, self.body(request), record, on_event)


class ChatTarget(OpenAITarget):
    name = "openai-chat"
    chat = True
    default_endpoint = "/v1/chat/completions"


class CompletionsTarget(OpenAITarget):
    name = "openai-completions"
