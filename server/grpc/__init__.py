"""KServe v2 / Triton gRPC frontend (grpc.aio) and the standard gRPC health service."""

from .service import HealthServicer, InferenceServicer, start_grpc_server

__all__ = ["HealthServicer", "InferenceServicer", "start_grpc_server"]
