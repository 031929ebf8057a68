"""``GET /v1/models`` and ``GET /v1/models/{model}``."""

from .serving import get_model, list_models

__all__ = ["get_model", "list_models"]
