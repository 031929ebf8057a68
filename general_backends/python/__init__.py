"""The ``python`` backend: Triton Python-backend models (``model.py`` with ``TritonPythonModel``), unchanged.

Models import ``triton_python_backend_utils`` (:mod:`.pb_utils`) as Triton's do.
"""

from .backend import PythonBackend, PythonInstance, PythonModel

__all__ = ["PythonBackend", "PythonInstance", "PythonModel"]
