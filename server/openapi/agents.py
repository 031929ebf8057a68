"""The agent APIs in the OpenAPI document: OpenAI's Responses API (``/v1/responses``) and Anthropic's Messages
API (``/v1/messages``), as ``server/openai/responses`` and ``server/openai/messages`` serve them
(``docs/openai.md``). Request schemas come from the pydantic models the server validates with."""

from __future__ import annotations

from typing import Any

from ..openai.messages.protocol import CountTokensRequest, MessagesRequest
from ..openai.responses.protocol import ResponsesRequest
from .v1 import AUTH, _errors, _request_schema
from .v2 import json_body, ref

ANTHROPIC_AUTH = [{"bearer": []}, {"x_api_key": []}, {}]
RESPONSE_ID = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}

RESPONSE_SCHEMAS: dict[str, dict[str, Any]] = {
    "Response": {
        "type": "object", "required": ["id", "object", "created_at", "status", "model", "output"],
        "properties": {
            "id": {"type": "string"}, "object": {"const": "response"}, "created_at": {"type": "integer"},
            "status": {"enum": ["completed", "incomplete", "failed", "in_progress", "queued", "cancelled"]},
            "model": {"type": "string"}, "output": {"type": "array", "items": {"type": "object"}},
            "usage": {"type": ["object", "null"]}, "error": {"type": ["object", "null"]}}},
    "ResponseDeleted": {"type": "object", "required": ["id", "object", "deleted"],
                        "properties": {"id": {"type": "string"}, "object": {"const": "response"},
                                       "deleted": {"const": True}}},
    "InputItemList": {"type": "object", "required": ["object", "data", "has_more"],
                      "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {"type": "object"}},
                                     "first_id": {"type": ["string", "null"]}, "last_id": {"type": ["string", "null"]},
                                     "has_more": {"type": "boolean"}}},
    "AnthropicMessage": {
        "type": "object", "required": ["id", "type", "role", "model", "content", "stop_reason", "usage"],
        "properties": {"id": {"type": "string"}, "type": {"const": "message"}, "role": {"const": "assistant"},
                       "model": {"type": "string"}, "content": {"type": "array", "items": {"type": "object"}},
                       "stop_reason": {"enum": ["end_turn", "max_tokens", "tool_use"]},
                       "usage": {"type": "object"}}},
    "AnthropicError": {
        "type": "object", "required": ["type", "error"],
        "properties": {"type": {"const": "error"}, "error": {
            "type": "object", "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}},
}


def schemas(out: dict[str, dict]) -> dict[str, dict]:
    out.update(RESPONSE_SCHEMAS)
    out["ResponsesRequest"] = _request_schema(ResponsesRequest, out)
    out["MessagesRequest"] = _request_schema(MessagesRequest, out)
    out["CountTokensRequest"] = _request_schema(CountTokensRequest, out)
    return out


def _anthropic_errors(*statuses: str) -> dict[str, dict]:
    return {s: json_body(ref("AnthropicError"), "Error (Anthropic's shape)") for s in statuses}


def _stored(method: str, summary: str, answer: dict, parameters: list | None = None) -> dict:
    return {method: {"summary": summary, "tags": ["openai"], "security": AUTH,
                     "parameters": [RESPONSE_ID, *(parameters or [])],
                     "responses": {"200": json_body(answer), **_errors("400", "401"),
                                   "404": json_body(ref("OpenAIError"), "No stored response with this id")}}}


def paths() -> dict[str, dict]:
    events = {"text/event-stream": {"schema": {"type": "string", "description": "'event: <type>' then 'data: "
                                                                                "{event}' per event"}}}
    query = [{"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
             {"name": "order", "in": "query", "schema": {"enum": ["asc", "desc"]}},
             {"name": "after", "in": "query", "schema": {"type": "string"}},
             {"name": "before", "in": "query", "schema": {"type": "string"}}]
    retrieve = _stored("get", "A stored response", ref("Response"))
    retrieve.update(_stored("delete", "Delete a stored response", ref("ResponseDeleted")))
    return {
        "/v1/responses": {"post": {
            "summary": "Create a response (OpenAI's Responses API)", "tags": ["openai"], "security": AUTH,
            "requestBody": {"required": True, "content": {"application/json": {"schema": ref("ResponsesRequest")}}},
            "responses": {"200": {"description": "The response; with stream: true, the Responses event sequence",
                                  "content": {"application/json": {"schema": ref("Response")}, **events}},
                          **_errors("400", "401", "404", "500", "503"),
                          "424": json_body(ref("OpenAIError"), "An MCP server of the request's tools could not "
                                                               "list its tools")}}},
        "/v1/responses/{response_id}": retrieve,
        "/v1/responses/{response_id}/cancel": {"post": _stored("post", "Cancel a background response",
                                                               ref("Response"))["post"]},
        "/v1/responses/{response_id}/input_items": _stored("get", "The input items of a stored response",
                                                           ref("InputItemList"), query),
        "/v1/messages": {"post": {
            "summary": "Create a message (Anthropic's Messages API)", "tags": ["openai"], "security": ANTHROPIC_AUTH,
            "requestBody": {"required": True, "content": {"application/json": {"schema": ref("MessagesRequest")}}},
            "responses": {"200": {"description": "The message; with stream: true, Anthropic's event sequence",
                                  "content": {"application/json": {"schema": ref("AnthropicMessage")}, **events}},
                          **_anthropic_errors("400", "401", "404", "500", "503")}}},
        "/v1/messages/count_tokens": {"post": {
            "summary": "The input tokens of a Messages request", "tags": ["openai"], "security": ANTHROPIC_AUTH,
            "requestBody": {"required": True, "content": {"application/json": {"schema": ref("CountTokensRequest")}}},
            "responses": {"200": json_body({"type": "object", "required": ["input_tokens"],
                                            "properties": {"input_tokens": {"type": "integer", "minimum": 0}}}),
                          **_anthropic_errors("400", "401", "404", "500", "503")}}},
    }
