"""``GET /v1/models``, ``GET /v1/models/{model}``, and ``POST /v1/models/{model}/load`` and ``/unload``."""

from .management import load_model, unload_model
from .serving import get_model, list_models

__all__ = ["get_model", "list_models", "load_model", "unload_model"]
