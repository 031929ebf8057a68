"""TensorRT-LLM backend (``backend: "tensorrtllm"``): Triton's ``tensorrt_llm`` tensor interface and the
vLLM backend's text interface over TensorRT-LLM's LLM API. See docs/tensorrt_llm.md."""

from .backend import NOT_INSTALLED, TensorRTLLMBackend, TensorRTLLMModel

__all__ = ["NOT_INSTALLED", "TensorRTLLMBackend", "TensorRTLLMModel"]
