"""Triton's ``triton_python_backend_utils`` for tideserve: ``import triton_python_backend_utils as pb_utils``.

Everything lives in :mod:`general_backends.python.pb_utils`; this top-level module gives it the
name Triton models import.
"""

from tideserve.general_backends.python.pb_utils import *
from tideserve.general_backends.python.pb_utils import __all__  # noqa: F401
