"""The FIL backend's settings, read from the ``parameters`` of ``config.pbtxt`` as Triton's FIL reads them.

Every value is a string in the config (``value: { string_value: "true" }``); :func:`read_options`
converts them and holds every check in one place, so a bad value fails the load with a message
that names the parameter.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tideserve.backend_api import InvalidArgument, ModelContext

log = logging.getLogger(__name__)

# model_type -> the file Triton's FIL looks for in the version directory
MODEL_FILES = {
    "xgboost": "xgboost.model",
    "xgboost_json": "xgboost.json",
    "xgboost_ubj": "xgboost.ubj",
    "lightgbm": "model.txt",
    "treelite_checkpoint": "checkpoint.tl",
}
PREDICTORS = ("auto", "native", "treelite")

# Parameters of Triton's FIL that tune its GPU kernels (or were removed from it); results never
# depend on them, and this CPU implementation has nothing to tune with them.
IGNORED = ("storage_type", "algo", "layout", "chunk_size", "threads_per_tree", "blocks_per_sm",
           "transfer_threshold", "use_experimental_optimizations")


@dataclass(frozen=True)
class FilOptions:
    model_type: str = "xgboost"
    """Serialization format of the model file: one of :data:`MODEL_FILES`."""
    is_classifier: bool = False
    """Classifier: answer class indices (or probabilities with ``predict_proba``) instead of raw scores.
    Triton's older name for it, ``output_class``, wins when both are given, as in Triton."""
    predict_proba: bool = False
    """Classifier: answer one probability per class instead of the class index."""
    threshold: float = 0.5
    """Binary classifier without ``predict_proba``: class 1 where the probability is above it."""
    cpu_nthread: int | None = None
    """Threads per prediction: unset shares the cores among the model's instances, <= 0 uses all."""
    xgboost_allow_unknown_field: bool = False
    """XGBoost JSON/UBJSON read by Treelite: skip fields it does not know instead of failing."""
    predictor: str = "auto"
    """tideserve only: ``native`` (the framework's own predictor), ``treelite`` (Treelite's GTIL) or
    ``auto`` (the faster of the two for the format: native for XGBoost and LightGBM)."""


def read_options(ctx: ModelContext) -> FilOptions:
    """The options of one model, or InvalidArgument naming the parameter that is wrong."""
    model_type = ctx.parameter("model_type", "xgboost").strip()
    if model_type not in MODEL_FILES:
        raise InvalidArgument(f"model '{ctx.name}': parameter 'model_type' is '{model_type}'; expected one of "
                              f"{', '.join(MODEL_FILES)}")
    is_classifier = _bool(ctx, "is_classifier", False)
    if ctx.parameter("output_class") is not None:
        is_classifier = _bool(ctx, "output_class", False)
    threshold = _float(ctx, "threshold", 0.5) if is_classifier else 0.5
    nthread = ctx.parameter("cpu_nthread")
    predictor = ctx.parameter("predictor", "auto").strip()
    if predictor not in PREDICTORS:
        raise InvalidArgument(f"model '{ctx.name}': parameter 'predictor' is '{predictor}'; expected one of "
                              f"{', '.join(PREDICTORS)}")
    ignored = [key for key in IGNORED if ctx.parameter(key) is not None]
    if ignored:
        log.info("model '%s': FIL parameter(s) %s tune GPU execution only; ignored on CPU", ctx.name, ignored)
    return FilOptions(
        model_type=model_type,
        is_classifier=is_classifier,
        predict_proba=_bool(ctx, "predict_proba", False),
        threshold=threshold,
        cpu_nthread=None if nthread is None else _int(ctx, "cpu_nthread", nthread),
        xgboost_allow_unknown_field=_bool(ctx, "xgboost_allow_unknown_field", False),
        predictor=predictor,
    )


def _bool(ctx: ModelContext, key: str, default: bool) -> bool:
    value = ctx.parameter(key)
    if value is None or not value.strip():
        return default
    text = value.strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise InvalidArgument(f"model '{ctx.name}': parameter '{key}' is '{value}'; expected true or false")


def _float(ctx: ModelContext, key: str, default: float) -> float:
    value = ctx.parameter(key)
    if value is None or not value.strip():
        return default
    try:
        return float(value)
    except ValueError:
        raise InvalidArgument(f"model '{ctx.name}': parameter '{key}' is '{value}'; expected a number") from None


def _int(ctx: ModelContext, key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise InvalidArgument(f"model '{ctx.name}': parameter '{key}' is '{value}'; expected an integer") from None
