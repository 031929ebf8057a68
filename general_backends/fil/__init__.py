"""The ``fil`` backend: XGBoost, LightGBM and Treelite (scikit-learn) tree models, Triton FIL-compatible.

See :mod:`.backend` for the model contract, :mod:`.options` for the config parameters, :mod:`.forests`
for the predictor each format uses and :mod:`.outputs` for what ``output__0`` holds.
"""

from .backend import FilBackend, FilInstance, FilModel

__all__ = ["FilBackend", "FilInstance", "FilModel"]
