"""The ``triton_python_backend_utils`` API that Python models import as ``pb_utils``.

Same names and behaviour as Triton's Python backend, so models written for Triton run unchanged:
tensors, requests (including BLS), responses, the response sender, errors, logging, custom
metrics, model control and the auto-complete ``ModelConfig``.
"""

from __future__ import annotations

import enum
import logging
from typing import ClassVar

from .bls import ResponseIterator, is_model_ready, load_model, unload_model
from .errors import TritonError, TritonModelException
from .messages import (
    TRITONSERVER_MEMORY_CPU,
    TRITONSERVER_MEMORY_GPU,
    TRITONSERVER_REQUEST_FLAG_SEQUENCE_END,
    TRITONSERVER_REQUEST_FLAG_SEQUENCE_START,
    TRITONSERVER_REQUEST_RELEASE_ALL,
    TRITONSERVER_REQUEST_RELEASE_RESCHEDULE,
    TRITONSERVER_RESPONSE_COMPLETE_FINAL,
    InferenceRequest,
    InferenceResponse,
    InferenceResponseSender,
    InferenceTrace,
    PreferredMemory,
)
from .metrics import Metric, MetricFamily, MetricKind
from .model_config import (
    ModelConfig,
    get_input_config_by_name,
    get_output_config_by_name,
    using_decoupled_model_transaction_policy,
)
from .scope import current_logger, current_scope
from .tensor import (
    TRITON_STRING_TO_NUMPY,
    Tensor,
    deserialize_bytes_tensor,
    numpy_to_triton_type,
    serialize_byte_tensor,
    triton_string_to_numpy,
    triton_to_numpy_type,
)


def get_input_tensor_by_name(inference_request: InferenceRequest, name: str) -> Tensor | None:
    """The input called ``name`` of a request, or None."""
    for tensor in inference_request.inputs():
        if tensor.name() == name:
            return tensor
    return None


def get_output_tensor_by_name(inference_response: InferenceResponse, name: str) -> Tensor | None:
    """The output called ``name`` of a response, or None."""
    for tensor in inference_response.output_tensors():
        if tensor.name() == name:
            return tensor
    return None


def get_model_dir() -> str:
    """The version directory of the calling model (where its ``model.py`` lives)."""
    scope = current_scope()
    if scope is None:
        raise TritonModelException("get_model_dir() is only available inside a model")
    return str(scope.version_dir)


class Logger:
    """``pb_utils.Logger.log_info(msg)`` ... into the server's log (VERBOSE is DEBUG)."""

    class LogLevel(enum.IntEnum):
        INFO = 0
        WARNING = 1
        ERROR = 2
        VERBOSE = 3

    INFO = LogLevel.INFO
    WARNING = LogLevel.WARNING
    ERROR = LogLevel.ERROR
    VERBOSE = LogLevel.VERBOSE

    _LEVELS: ClassVar[dict] = {LogLevel.INFO: logging.INFO, LogLevel.WARNING: logging.WARNING,
                               LogLevel.ERROR: logging.ERROR, LogLevel.VERBOSE: logging.DEBUG}

    @staticmethod
    def log(message: str, level: Logger.LogLevel = LogLevel.INFO) -> None:
        current_logger().log(Logger._LEVELS[Logger.LogLevel(level)], "%s", message, stacklevel=2)

    @staticmethod
    def log_info(message: str) -> None:
        current_logger().info("%s", message, stacklevel=2)

    @staticmethod
    def log_warn(message: str) -> None:
        current_logger().warning("%s", message, stacklevel=2)

    @staticmethod
    def log_error(message: str) -> None:
        current_logger().error("%s", message, stacklevel=2)

    @staticmethod
    def log_verbose(message: str) -> None:
        current_logger().debug("%s", message, stacklevel=2)


__all__ = [
    "TRITONSERVER_MEMORY_CPU",
    "TRITONSERVER_MEMORY_GPU",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_END",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_START",
    "TRITONSERVER_REQUEST_RELEASE_ALL",
    "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE",
    "TRITONSERVER_RESPONSE_COMPLETE_FINAL",
    "TRITON_STRING_TO_NUMPY",
    "InferenceRequest",
    "InferenceResponse",
    "InferenceResponseSender",
    "InferenceTrace",
    "Logger",
    "Metric",
    "MetricFamily",
    "MetricKind",
    "ModelConfig",
    "PreferredMemory",
    "ResponseIterator",
    "Tensor",
    "TritonError",
    "TritonModelException",
    "deserialize_bytes_tensor",
    "get_input_config_by_name",
    "get_input_tensor_by_name",
    "get_model_dir",
    "get_output_config_by_name",
    "get_output_tensor_by_name",
    "is_model_ready",
    "load_model",
    "numpy_to_triton_type",
    "serialize_byte_tensor",
    "triton_string_to_numpy",
    "triton_to_numpy_type",
    "unload_model",
    "using_decoupled_model_transaction_policy",
]
