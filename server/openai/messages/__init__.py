"""``/v1/messages`` and ``/v1/messages/count_tokens`` (Anthropic's Messages API)."""

from .http import AnthropicRoute, refusal_body
from .serving import count_tokens, create_message

__all__ = ["AnthropicRoute", "count_tokens", "create_message", "refusal_body"]
