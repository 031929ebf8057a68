"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

``type`` is the name of the exception class OpenAI's Python client raises for the status (as vLLM's
server sends it), ``code`` is the HTTP status, ``param`` names the request field that is wrong (or
null). Messages are meant for the client: they never carry a stack trace.
"""

from __future__ import annotations

import re

import orjson

from ..errors import ContentTooLarge, QueueFull, ServerError, Status

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    413: "APIStatusError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    499: "ClientClosedRequest",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}


class OpenAIError(Exception):
    """A request that fails with ``status``; ``param`` is the request field at fault, if any."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.retry_after_s: int | None = None  # a Retry-After header (a queue at its bound: 503)
        self.error_type: str | None = None  # a ``type`` other than the status's (vLLM's overload answer)
        self.deadline_ns = self.fired_ns = 0  # a refusal at a queue deadline (errors.DeadlinePassed)
        self.cpu_wait_ns: int | None = None

    @property
    def type(self) -> str:
        if self.error_type is not None:
            return self.error_type
        return _TYPES.get(self.status, "InternalServerError" if self.status >= 500 else "BadRequestError")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}

    def json(self) -> bytes:
        return orjson.dumps(self.body())


class BadRequest(OpenAIError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, 400, param)


class ModelNotFound(OpenAIError):
    def __init__(self, model: str, why: str = "") -> None:
        super().__init__(f"The model `{model}` does not exist.{(' ' + why) if why else ''}", 404, "model")


# A backend message that names the field at fault: "invalid sampling parameter 'top_p': ...",
# "unknown sampling parameter 'x'" (vLLM), "sampling_parameters: 'temperature': ...",
# "sampling_parameters: unknown key 'x'" (TensorRT-LLM).
_NAMED = re.compile(r"(?:sampling parameter|sampling_parameters:(?: unknown key)?) '([A-Za-z0-9_]+)'")
# ... or one about the prompt: too long for the context, a token id out of the vocabulary
_PROMPT_WORDS = ("prompt", "context length", "token id", "vocabulary")


def from_server_error(exc: BaseException, fields: dict[str, str] | None = None,
                      prompt_param: str = "prompt") -> OpenAIError:
    """The OpenAI error for a DataPlane / backend error.

    ``fields`` maps engine sampling names to the request's field names (``max_tokens`` may have come
    from ``max_completion_tokens``); a prompt the engine rejects (too long for the context, bad token
    ids) is blamed on ``prompt_param``.
    """
    if isinstance(exc, OpenAIError):
        return exc
    if not isinstance(exc, ServerError):
        return OpenAIError(f"internal error: {type(exc).__name__}: {exc}", 500)
    status = 413 if isinstance(exc, ContentTooLarge) else exc.http_code
    message, param = exc.message, None
    if exc.status is Status.INVALID_ARG:
        match = _NAMED.search(message)
        if match:
            name = match.group(1)
            param = (fields or {}).get(name, name)
            if param != name:  # the message speaks of the field the client sent
                message = message.replace(f"'{name}'", f"'{param}'")
        elif any(word in message.lower() for word in _PROMPT_WORDS):
            param = prompt_param
    elif exc.status is Status.NOT_FOUND:
        param = "model"
    error = OpenAIError(message, status, param)
    error.retry_after_s = exc.retry_after_s
    error.deadline_ns, error.fired_ns = getattr(exc, "deadline_ns", 0), getattr(exc, "fired_ns", 0)
    error.cpu_wait_ns = getattr(exc, "cpu_wait_ns", None)
    if isinstance(exc, QueueFull) or exc.retry_after_s is not None:
        error.error_type = "Service Unavailable"  # as vLLM answers its own queue limit (the status's phrase)
    return error
