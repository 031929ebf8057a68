"""Errors that carry a protocol-neutral status; frontends map them to HTTP codes / gRPC status."""

from __future__ import annotations

import enum


class Status(enum.Enum):
    """Status of a failed operation, mirroring Triton's TRITONSERVER_Error codes."""

    INVALID_ARG = "INVALID_ARG"
    NOT_FOUND = "NOT_FOUND"
    UNAVAILABLE = "UNAVAILABLE"
    UNSUPPORTED = "UNSUPPORTED"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    CANCELLED = "CANCELLED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    INTERNAL = "INTERNAL"
    UNKNOWN = "UNKNOWN"  # a model's TritonError(code=UNKNOWN)

    @property
    def http_code(self) -> int:
        return _HTTP_CODES[self]

    @property
    def grpc_name(self) -> str:
        """Name of the matching ``grpc.StatusCode`` member."""
        return _GRPC_NAMES[self]


_HTTP_CODES = {
    Status.INVALID_ARG: 400,
    Status.NOT_FOUND: 404,
    Status.UNAVAILABLE: 503,
    Status.UNSUPPORTED: 501,
    Status.ALREADY_EXISTS: 409,
    Status.CANCELLED: 499,
    Status.DEADLINE_EXCEEDED: 504,
    Status.INTERNAL: 500,
    Status.UNKNOWN: 400,  # as Triton's HTTP endpoint answers an error of no matching code
}

_GRPC_NAMES = {
    Status.INVALID_ARG: "INVALID_ARGUMENT",
    Status.NOT_FOUND: "NOT_FOUND",
    Status.UNAVAILABLE: "UNAVAILABLE",
    Status.UNSUPPORTED: "UNIMPLEMENTED",
    Status.ALREADY_EXISTS: "ALREADY_EXISTS",
    Status.CANCELLED: "CANCELLED",
    Status.DEADLINE_EXCEEDED: "DEADLINE_EXCEEDED",
    Status.INTERNAL: "INTERNAL",
    Status.UNKNOWN: "UNKNOWN",
}


class ServerError(Exception):
    """An error with a status; its message is safe to show to a client."""

    status: Status = Status.INTERNAL
    # seconds a client should wait before it retries (HTTP ``Retry-After``); None: no advice
    retry_after_s: int | None = None

    def __init__(self, message: str, status: Status | None = None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status

    def __str__(self) -> str:
        return self.message

    @property
    def http_code(self) -> int:
        """The HTTP status: the status table's, unless a subclass names a narrower one."""
        return self.status.http_code


class InvalidArgument(ServerError):
    status = Status.INVALID_ARG


class ContentTooLarge(InvalidArgument):
    """A request body over ``--http-max-input-size``: an invalid argument (HTTP 400) on the KServe routes, as
    Triton's HTTP server answers it; the OpenAI routes answer 413, as Triton's OpenAI frontend does."""


class UnsupportedMediaType(InvalidArgument):
    """A request body in a Content-Encoding the server cannot read: HTTP 415, otherwise an invalid argument."""

    http_code = 415


class NotFound(ServerError):
    status = Status.NOT_FOUND


class Unavailable(ServerError):
    status = Status.UNAVAILABLE


# A load or unload outside the explicit model control mode (none or poll), as Triton words it, with Unavailable (its
# UNAVAILABLE: HTTP 503)
NOT_EXPLICIT = "explicit model load / unload is not allowed if polling is enabled"


class QueueFull(Unavailable):
    """A request refused because its model's queue is at its bound (``max_queue_size``): 503 with
    ``Retry-After`` over HTTP, UNAVAILABLE over gRPC, counted as REJECTED."""

    retry_after_s = 1


class DeadlinePassed(QueueFull):
    """A request refused because it had not started by its queue deadline (503 + ``Retry-After``, UNAVAILABLE,
    REJECTED). ``deadline_ns`` and ``fired_ns``: the deadline and when the server refused (``time.monotonic_ns``),
    which the HTTP answer reports in its ``tideserve-deadline-late-us`` header (with ``cpu_wait_ns``, when
    measured: how long the loop's thread waited for a CPU meanwhile)."""

    def __init__(self, message: str, deadline_ns: int = 0, fired_ns: int = 0) -> None:
        super().__init__(message)
        self.deadline_ns = deadline_ns
        self.fired_ns = fired_ns
        self.cpu_wait_ns: int | None = None


class Unsupported(ServerError):
    status = Status.UNSUPPORTED


class Cancelled(ServerError):
    status = Status.CANCELLED


class DeadlineExceeded(ServerError):
    status = Status.DEADLINE_EXCEEDED


class InternalError(ServerError):
    status = Status.INTERNAL


def error_of_status(status: Status, message: str) -> ServerError:
    """A ServerError of the class ``status`` has (the base class for statuses without one), e.g. rebuilt from
    what another process sent."""
    kind = {Status.INVALID_ARG: InvalidArgument, Status.NOT_FOUND: NotFound, Status.UNAVAILABLE: Unavailable,
            Status.UNSUPPORTED: Unsupported, Status.CANCELLED: Cancelled, Status.DEADLINE_EXCEEDED: DeadlineExceeded,
            Status.INTERNAL: InternalError}.get(status)
    return kind(message) if kind is not None else ServerError(message, status)


def as_server_error(exc: BaseException) -> ServerError:
    """Wrap any exception raised by a backend as a ServerError with a readable message."""
    if isinstance(exc, ServerError):
        return exc
    return InternalError(f"{type(exc).__name__}: {exc}")
