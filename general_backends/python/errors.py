"""``pb_utils.TritonError`` / ``TritonModelException`` and their mapping to the server's errors."""

from __future__ import annotations

import enum

from tideserve.backend_api import (
    Cancelled,
    InternalError,
    InvalidArgument,
    NotFound,
    ServerError,
    Status,
    Unavailable,
    Unsupported,
)


class ErrorCode(enum.IntEnum):
    """``TRITONSERVER_Error_Code``."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7


class TritonModelException(Exception):
    """Raised by Python models (and by the utilities when a model misuses them)."""


class TritonError(Exception):
    """An error a model attaches to a response: ``TritonError(message, code=TritonError.INTERNAL)``.

    Triton's TritonError is a plain object; deriving from Exception here only lets a model raise it too.
    """

    UNKNOWN = ErrorCode.UNKNOWN
    INTERNAL = ErrorCode.INTERNAL
    NOT_FOUND = ErrorCode.NOT_FOUND
    INVALID_ARG = ErrorCode.INVALID_ARG
    UNAVAILABLE = ErrorCode.UNAVAILABLE
    UNSUPPORTED = ErrorCode.UNSUPPORTED
    ALREADY_EXISTS = ErrorCode.ALREADY_EXISTS
    CANCELLED = ErrorCode.CANCELLED

    def __init__(self, message: str, code: int = ErrorCode.INTERNAL) -> None:
        if message is None:
            raise TypeError("TritonError message must not be None")
        super().__init__(message)
        self._message = str(message)
        self._code = ErrorCode(code)
        self._server_error: ServerError | None = None  # the server's error this one reports (a BLS response's)

    def message(self) -> str:
        return self._message

    def code(self) -> ErrorCode:
        return self._code

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, {self._code.name})"


_SERVER_ERROR_OF_CODE = {
    ErrorCode.UNKNOWN: InternalError,
    ErrorCode.INTERNAL: InternalError,
    ErrorCode.NOT_FOUND: NotFound,
    ErrorCode.INVALID_ARG: InvalidArgument,
    ErrorCode.UNAVAILABLE: Unavailable,
    ErrorCode.UNSUPPORTED: Unsupported,
    ErrorCode.CANCELLED: Cancelled,
}

_CODE_OF_STATUS = {
    Status.INVALID_ARG: ErrorCode.INVALID_ARG,
    Status.NOT_FOUND: ErrorCode.NOT_FOUND,
    Status.UNAVAILABLE: ErrorCode.UNAVAILABLE,
    Status.UNSUPPORTED: ErrorCode.UNSUPPORTED,
    Status.ALREADY_EXISTS: ErrorCode.ALREADY_EXISTS,
    Status.CANCELLED: ErrorCode.CANCELLED,
    Status.DEADLINE_EXCEEDED: ErrorCode.UNAVAILABLE,
    Status.INTERNAL: ErrorCode.INTERNAL,
    Status.UNKNOWN: ErrorCode.UNKNOWN,
}


def to_server_error(error: TritonError) -> ServerError:
    """The server error a model's TritonError stands for: the very error it was made from (a BLS response's, with
    its HTTP code and Retry-After) where its code says the same, else one of the class its code has."""
    code = error.code()
    origin = error._server_error
    if origin is not None and _CODE_OF_STATUS.get(origin.status) == code:
        return origin
    if code == ErrorCode.ALREADY_EXISTS:
        return ServerError(error.message(), Status.ALREADY_EXISTS)
    if code == ErrorCode.UNKNOWN:
        return ServerError(error.message(), Status.UNKNOWN)
    return _SERVER_ERROR_OF_CODE[code](error.message())


def from_server_error(error: ServerError) -> TritonError:
    found = TritonError(error.message, _CODE_OF_STATUS.get(error.status, ErrorCode.INTERNAL))
    found._server_error = error
    return found
