"""``POST /v1/completions``."""

from .serving import create_completion

__all__ = ["create_completion"]
