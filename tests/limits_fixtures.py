"""The limits of tests/e2e/test_limits.py's server, as flags (tests/unit/test_cli.py checks the flags map onto
the options)."""

from __future__ import annotations

HEADER_SIZE = 4096
HEADER_COUNT = 20
TIMEOUT_S = 1.0
CONNECTIONS = 8
JSON_DEPTH = 16
TENSOR_RANK = 8
TENSOR_ELEMENTS = 100_000
DECOMPRESSED = 1 << 20
GRPC_RECEIVE = 1 << 20
GRPC_SEND = 256 << 10
LIMIT_FLAGS = [
    "--http-max-header-size", str(HEADER_SIZE), "--http-max-header-count", str(HEADER_COUNT),
    "--http-header-timeout-secs", str(TIMEOUT_S), "--http-body-timeout-secs", str(TIMEOUT_S),
    "--http-max-connections", str(CONNECTIONS), "--http-max-json-depth", str(JSON_DEPTH),
    "--max-tensor-rank", str(TENSOR_RANK), "--max-tensor-elements", str(TENSOR_ELEMENTS),
    "--http-max-decompressed-size", str(DECOMPRESSED),
    "--grpc-max-receive-message-length", str(GRPC_RECEIVE), "--grpc-max-send-message-length", str(GRPC_SEND),
]
