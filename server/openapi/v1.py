"""The OpenAI-compatible ``/v1`` API as tideserve serves it (``server/openai``, ``docs/openai.md``).

The request schemas are made from the pydantic models the server validates requests with, so the
document and the server cannot disagree on a field, its type or its range; the responses are described
here as ``server/openai/*/serving.py`` writes them.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from ..openai.chat_completion.protocol import ChatCompletionRequest
from ..openai.completion.protocol import CompletionRequest
from ..openai.embedding.protocol import EmbeddingRequest
from ..openai.score.protocol import RerankRequest, ScoreRequest
from ..openai.tokenization.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from .v2 import json_body, ref

_STATUSES = {
    "400": "Invalid request: 'param' names the field",
    "401": "Missing or wrong API key (--api-key)",
    "404": "Unknown model, or a model without the text interface",
    "500": "The model failed while generating",
    "503": "The model is not ready, or the server is shutting down",
}

AUTH = [{"bearer": []}, {}]  # the API key only when the server has one

USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
         "properties": {"prompt_tokens": {"type": "integer", "minimum": 0},
                        "completion_tokens": {"type": "integer", "minimum": 0},
                        "total_tokens": {"type": "integer", "minimum": 0}}}
FINISH = {"type": ["string", "null"], "enum": ["stop", "length", "tool_calls", None]}

RESPONSE_SCHEMAS: dict[str, dict[str, Any]] = {
    "OpenAIError": {
        "type": "object", "required": ["error"],
        "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
            "code": {"type": "integer"}}}}},
    "Model": {"type": "object", "required": ["id", "object", "created", "owned_by"],
              "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                             "owned_by": {"type": "string"}, "root": {"type": "string"},
                             "parent": {"type": ["string", "null"]}}},
    "ModelList": {"type": "object", "required": ["object", "data"],
                  "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": ref("Model")}}},
    "Usage": USAGE,
    "CompletionChunk": {
        "type": "object", "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "id": {"type": "string"}, "object": {"const": "text_completion"}, "created": {"type": "integer"},
            "model": {"type": "string"}, "usage": ref("Usage"),
            "choices": {"type": "array", "items": {
                "type": "object", "required": ["index", "text"],
                "properties": {"index": {"type": "integer", "minimum": 0}, "text": {"type": "string"},
                               "logprobs": {"type": ["object", "null"]}, "finish_reason": FINISH}}}}},
    "ChatCompletionChunk": {
        "type": "object", "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "id": {"type": "string"}, "object": {"const": "chat.completion.chunk"}, "created": {"type": "integer"},
            "model": {"type": "string"}, "usage": ref("Usage"),
            "choices": {"type": "array", "items": {
                "type": "object", "required": ["index", "delta"],
                "properties": {
                    "index": {"type": "integer", "minimum": 0}, "finish_reason": FINISH,
                    "logprobs": {"type": ["object", "null"]},
                    "delta": {"type": "object", "properties": {
                        "role": {"const": "assistant"}, "content": {"type": ["string", "null"]},
                        "tool_calls": {"type": "array", "items": {"type": "object"}}}}}}}}},
    "Completion": {
        "type": "object", "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "id": {"type": "string"}, "object": {"const": "text_completion"}, "created": {"type": "integer"},
            "model": {"type": "string"}, "usage": ref("Usage"),
            "choices": {"type": "array", "items": {
                "type": "object", "required": ["index", "text", "finish_reason"],
                "properties": {"index": {"type": "integer", "minimum": 0}, "text": {"type": "string"},
                               "logprobs": {"type": ["object", "null"]}, "finish_reason": FINISH}}}}},
    "ChatCompletion": {
        "type": "object", "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "id": {"type": "string"}, "object": {"const": "chat.completion"}, "created": {"type": "integer"},
            "model": {"type": "string"}, "usage": ref("Usage"),
            "choices": {"type": "array", "items": {
                "type": "object", "required": ["index", "message", "finish_reason"],
                "properties": {
                    "index": {"type": "integer", "minimum": 0}, "finish_reason": FINISH,
                    "logprobs": {"type": ["object", "null"]},
                    "message": {"type": "object", "required": ["role"], "properties": {
                        "role": {"const": "assistant"}, "content": {"type": ["string", "null"]},
                        "tool_calls": {"type": "array", "items": {"type": "object"}}}}}}}}},
}


def _request_schema(model: type[BaseModel], schemas: dict[str, dict]) -> dict:
    """The pydantic model's JSON schema, its definitions moved to the document's components."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(schema.pop("$defs", {}))
    return schema


def _errors(*statuses: str) -> dict[str, dict]:
    return {s: json_body(ref("OpenAIError"), _STATUSES[s]) for s in statuses}


def _create(summary: str, request: str, response: str, chunk: str) -> dict:
    event = {"type": "object", "required": ["data"], "properties": {"data": {
        "type": "string", "if": {"const": "[DONE]"},
        "else": {"contentMediaType": "application/json",
                 "contentSchema": {"anyOf": [ref(chunk), ref("OpenAIError")]}}}}}
    return {"post": {
        "summary": summary, "tags": ["openai"], "security": AUTH,
        "requestBody": {"required": True, "content": {"application/json": {"schema": ref(request)}}},
        "responses": {
            "200": {"description": "The answer; with stream: true, server-sent events: 'data: {chunk}' per "
                                   "piece (an error after the first: 'data: {error}'), then 'data: [DONE]'",
                    "content": {"application/json": {"schema": ref(response)},
                                "text/event-stream": {"schema": event}}},
            **_errors("400", "401", "404", "500", "503")}}}


def _lora(summary: str, properties: dict) -> dict:
    """vLLM's LoRA adapter routes: a JSON body in, a plain-text sentence out (404 while they are off)."""
    body = {"type": "object", "required": ["lora_name"], "properties": properties}
    return {"post": {
        "summary": summary, "tags": ["openai"], "security": AUTH,
        "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
        "responses": {
            "200": {"description": "Done: 'Success: LoRA adapter ... successfully.'",
                    "content": {"text/plain": {"schema": {"type": "string"}}}},
            **_errors("400", "401"),
            "404": json_body(ref("OpenAIError"), "No such adapter or adapter path, or runtime LoRA updates are off"),
            **_errors("503")}}}


def _manage(summary: str, answer: dict) -> dict:
    """Triton's OpenAI model management routes: no body; 400 outside explicit mode, for a model already loaded
    (load) or not loaded (unload), or a configuration the server refuses."""
    name = {"name": "model_name", "in": "path", "required": True, "schema": {"type": "string"}}
    return {"post": {"summary": summary, "tags": ["openai"], "security": AUTH, "parameters": [name],
                     "responses": {"200": json_body(answer), **_errors("400", "401", "404", "500", "503")}}}


def _post(summary: str, request: dict, answer: str) -> dict:
    """A JSON request answered by one JSON object (the embedding, score and tokenizer routes)."""
    return {"post": {
        "summary": summary, "tags": ["openai"], "security": AUTH,
        "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
        "responses": {"200": json_body({"type": "object"}, answer), **_errors("400", "401", "404", "500", "503")}}}


def schemas() -> dict[str, dict]:
    out = dict(RESPONSE_SCHEMAS)
    out["CompletionRequest"] = _request_schema(CompletionRequest, out)
    out["ChatCompletionRequest"] = _request_schema(ChatCompletionRequest, out)
    out["EmbeddingRequest"] = _request_schema(EmbeddingRequest, out)
    out["ScoreRequest"] = _request_schema(ScoreRequest, out)
    out["RerankRequest"] = _request_schema(RerankRequest, out)
    out["TokenizeCompletionRequest"] = _request_schema(TokenizeCompletionRequest, out)
    out["TokenizeChatRequest"] = _request_schema(TokenizeChatRequest, out)
    out["DetokenizeRequest"] = _request_schema(DetokenizeRequest, out)
    return out


def paths() -> dict[str, dict]:
    model = {"name": "model", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}
    # a name the route cannot match (a line break in it) is answered by the router, in /v2's shape
    _not_found = json_body({"anyOf": [ref("OpenAIError"), ref("Error")]}, _STATUSES["404"])
    return {
        "/v1/models": {"get": {"summary": "The served LLM models", "tags": ["openai"], "security": AUTH,
                               "responses": {"200": json_body(ref("ModelList")), **_errors("401")}}},
        "/v1/models/{model}": {"get": {"summary": "One served model", "tags": ["openai"], "security": AUTH,
                                       "parameters": [model],
                                       "responses": {"200": json_body(ref("Model")), **_errors("401"),
                                                     "404": _not_found}}},
        "/v1/models/{model_name}/load": _manage("Load a model of the repository (--model-control-mode explicit)",
                                                ref("Model")),
        "/v1/models/{model_name}/unload": _manage(
            "Unload a model (--model-control-mode explicit)",
            {"type": "object", "required": ["status", "model"],
             "properties": {"status": {"const": "success"}, "model": {"type": "string"}}}),
        "/v1/completions": _create("Text completion", "CompletionRequest", "Completion", "CompletionChunk"),
        "/v1/chat/completions": _create("Chat completion", "ChatCompletionRequest", "ChatCompletion",
                                        "ChatCompletionChunk"),
        "/v1/load_lora_adapter": _lora("Load a LoRA adapter from disk (--enable-lora-runtime-updates)", {
            "lora_name": {"type": "string"}, "lora_path": {"type": "string"}, "load_inplace": {"type": "boolean"},
            "base_model_name": {"type": "string"}, "is_3d_lora_weight": {"type": "boolean"}}),
        "/v1/unload_lora_adapter": _lora("Unload a LoRA adapter (--enable-lora-runtime-updates)",
                                         {"lora_name": {"type": "string"}}),
        "/v1/embeddings": _post("Embeddings of texts or token ids (a model with openai_task 'embed')",
                                ref("EmbeddingRequest"), "{object: list, data: [{object: embedding, index, "
                                                         "embedding}], model, usage}"),
        "/v1/score": _post("Similarity scores of text pairs (an embedding model)", ref("ScoreRequest"),
                           "{object: list, data: [{object: score, index, score}], model, usage}"),
        "/score": _post("Similarity scores of text pairs (an embedding model)", ref("ScoreRequest"),
                        "{object: list, data: [{object: score, index, score}], model, usage}"),
        "/v1/rerank": _post("Documents ranked by relevance to a query (an embedding model)", ref("RerankRequest"),
                            "{id, model, usage, results: [{index, document, relevance_score}]}"),
        "/rerank": _post("Documents ranked by relevance to a query (an embedding model)", ref("RerankRequest"),
                         "{id, model, usage, results: [{index, document, relevance_score}]}"),
        "/tokenize": _post("Token ids of a prompt or of chat messages rendered by the chat template",
                           {"anyOf": [ref("TokenizeCompletionRequest"), ref("TokenizeChatRequest")]},
                           "{count, max_model_len, tokens, token_strs}"),
        "/detokenize": _post("The text of token ids", ref("DetokenizeRequest"), "{prompt}"),
        "/tokenizer_info": {"get": {
            "summary": "The model's tokenizer configuration (?model=, else the only text-generation model)",
            "tags": ["openai"], "security": AUTH,
            "parameters": [{"name": "model", "in": "query", "required": False, "schema": {"type": "string"}}],
            "responses": {"200": json_body({"type": "object"}, "tokenizer_config.json's entries, "
                                                               "tokenizer_class, chat_template"),
                          **_errors("400", "401", "404", "503")}}},
        "/health/ready": {"get": {"summary": "Readiness, as Triton's OpenAI frontend: 200 (empty body) when the "
                                             "server is ready, 503 (empty) otherwise", "tags": ["health"],
                                  "responses": {"200": {"description": "Ready"},
                                                "503": {"description": "Not ready"}}}},
        "/health": {"get": {"summary": "Liveness, as vLLM's server: 200 (empty body) while healthy, 503 (empty) "
                                       "once it shuts down or a model's engine died", "tags": ["health"],
                            "responses": {"200": {"description": "Healthy"}, "503": {"description": "Not healthy"}}}},
    }
