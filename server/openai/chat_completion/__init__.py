"""``POST /v1/chat/completions``."""

from .serving import create_chat_completion

__all__ = ["create_chat_completion"]
