"""The access checks of :mod:`tideserve.access` on the gRPC server: one interceptor, only when a method is guarded.

A refused call ends with UNAUTHENTICATED (no valid API key) or PERMISSION_DENIED (restricted group)
before its handler runs; the request message is not even decoded.
"""

from __future__ import annotations

import grpc

from ..access import GRPC_METHOD_GROUPS, AccessPolicy, Guard

_CODES = {401: grpc.StatusCode.UNAUTHENTICATED, 403: grpc.StatusCode.PERMISSION_DENIED}


class AccessInterceptor(grpc.aio.ServerInterceptor):
    """Checks each call against its method's Guard (None: open); ``default`` guards methods of no known group."""

    def __init__(self, guards: dict[str, Guard | None], default: Guard | None) -> None:
        self.guards = guards
        self.default = default

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        guard = self.guards.get(details.method, self.default)
        if guard is not None:
            metadata = details.invocation_metadata or ()

            def header(name: str) -> bytes | None:
                for key, value in metadata:
                    if key == name:
                        return value if isinstance(value, bytes) else value.encode()
                return None

            refusal = guard.check(header, grpc=True)
            if refusal is not None:
                handler = await continuation(details)
                if handler is None:  # an unknown method stays UNIMPLEMENTED
                    return None
                return _refusing(handler, _CODES[refusal.status], refusal.message)
        return await continuation(details)


def _refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that only ends the call with ``code``."""

    async def refuse(_request, context):
        await context.abort(code, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


def access_interceptors(access: AccessPolicy | None) -> list[grpc.aio.ServerInterceptor]:
    """The interceptor the policy needs, or none at all (every call then goes straight to its handler)."""
    if access is None:
        return []
    guards = {method: access.grpc_guard(group) for method, group in GRPC_METHOD_GROUPS.items()}  # None: open
    default = access.grpc_guard(None)
    if default is None and not any(guards.values()):
        return []
    return [AccessInterceptor(guards, default)]
