"""``/v1/responses`` (OpenAI's Responses API): create, retrieve, delete, cancel, input items; a SQLite store."""

from .serving import Responses, cancel_response, create_response, delete_response, list_input_items, retrieve_response
from .store import ResponseStore, StoreSettings

__all__ = ["ResponseStore", "Responses", "StoreSettings", "cancel_response", "create_response", "delete_response", "list_input_items",
           "retrieve_response"]
