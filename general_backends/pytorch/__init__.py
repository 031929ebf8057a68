"""The ``pytorch`` backend: TorchScript models (``<version>/model.pt``, ``platform: "pytorch_libtorch"``).

Triton's PyTorch-backend conventions: ``INPUT__0`` / ``OUTPUT__0`` names bind by position, or inputs
named after ``forward()``'s arguments; the ``parameters`` Triton's backend reads; instance kinds
``KIND_CPU`` / ``KIND_GPU`` / ``KIND_MODEL``.
"""

from .backend import PyTorchBackend, PyTorchInstance, PyTorchModel

__all__ = ["PyTorchBackend", "PyTorchInstance", "PyTorchModel"]
