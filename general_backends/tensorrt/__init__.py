"""The ``tensorrt`` backend: serialized TensorRT engines (``<version>/model.plan``, ``platform: "tensorrt_plan"``).

The binding logic (:mod:`.engine`, :mod:`.binding`) is plain Python over what the engine reports;
:mod:`.backend` drives TensorRT's Python runtime, imported only when a model loads.
"""

from .backend import TensorRTBackend, TensorRTInstance, TensorRTModel

__all__ = ["TensorRTBackend", "TensorRTInstance", "TensorRTModel"]
