"""General-model backends (Python models, ONNX Runtime, FIL, PyTorch, TensorRT) under the batchers."""
