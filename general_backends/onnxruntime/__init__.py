"""The ``onnxruntime`` backend (``backend: "onnxruntime"`` / ``platform: "onnxruntime_onnx"``).

Serves ``<model>/<version>/model.onnx`` with ONNX Runtime the way Triton's onnxruntime backend
does: config auto-completed from the graph, session options and execution accelerators from the
config, one session per instance, batches through the dynamic batcher. Needs the ``onnx`` extra.
"""

from .backend import OnnxInstance, OnnxModel, OnnxRuntimeBackend

__all__ = ["OnnxInstance", "OnnxModel", "OnnxRuntimeBackend"]
