"""Tree models loaded through the library made for their format, behind one small interface.

A :class:`Forest` answers ``predict(rows) -> scores``: one row per input row and one column per
class (a single column for regressors and binary classifiers), transformed as the framework's
own ``predict`` / ``predict_proba`` transforms them (sigmoid, softmax, averaging...), in the library's
own precision.

Which predictor runs each format (``predictor: auto``), the faster on 1,024-row batches:

======================  ==================================  =========================================
model_type              native predictor                    Treelite
======================  ==================================  =========================================
xgboost_json, _ubj      ``xgboost.Booster.inplace_predict`` ``treelite.frontend.load_xgboost_model``
xgboost (legacy binary) (XGBoost 3 no longer reads it)      ``load_xgboost_model_legacy_binary``
lightgbm                ``lightgbm.Booster.predict``        ``treelite.frontend.load_lightgbm_model``
treelite_checkpoint     (none: Treelite is the format)      ``treelite.Model.deserialize``
======================  ==================================  =========================================

The native predictors give exactly the framework's own results; Treelite's GTIL sums the trees in
its own order and differs from XGBoost by up to a few float32 ulps (about 1e-7 on probabilities).
Each library's import is deferred to the first model that needs it, so a server without LightGBM
still serves XGBoost models.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tideserve.backend_api import Unavailable, Unsupported

from .options import FilOptions


class Forest:
    """A loaded tree ensemble; instances of a model share it unless :meth:`for_instance` says otherwise."""

    predictor = ""  # which library predicts: "xgboost", "lightgbm" or "treelite"
    num_features = 0
    num_classes = 1  # score columns per row

    def predict(self, rows: np.ndarray) -> np.ndarray:
        """``rows``: C-contiguous float32 (n, num_features) -> (n, num_classes) in the library's own
        precision (float64 for LightGBM), so that derived values (``1 - p``) round as the framework's do."""
        raise NotImplementedError

    def for_instance(self) -> Forest:
        """The forest one more instance predicts with: this one where predicting is thread-safe
        (XGBoost's ``inplace_predict``, Treelite's GTIL), a copy where it is not."""
        return self


class XGBoostForest(Forest):
    predictor = "xgboost"

    def __init__(self, raw: bytes, nthread: int) -> None:
        import xgboost

        self.booster = xgboost.Booster(model_file=bytearray(raw))
        self.booster.set_param({"nthread": nthread})
        learner = json.loads(self.booster.save_config())["learner"]
        params = learner["learner_model_param"]
        if int(params.get("num_target", "1")) > 1:
            raise Unsupported(f"multi-output models are not supported ({params['num_target']} targets)")
        self.num_features = self.booster.num_features()
        self.num_classes = max(1, int(params.get("num_class", "0")))
        # multi:softmax predicts class indices; its probabilities are the softmax of the margins
        self.softmax = learner["objective"]["name"] == "multi:softmax"

    def predict(self, rows: np.ndarray) -> np.ndarray:
        if self.softmax:
            margins = self.booster.inplace_predict(rows, predict_type="margin", validate_features=False)
            return _softmax(margins.reshape(len(rows), self.num_classes))
        scores = self.booster.inplace_predict(rows, validate_features=False)
        return scores.reshape(len(rows), self.num_classes)


class LightGBMForest(Forest):
    predictor = "lightgbm"

    def __init__(self, path: Path, nthread: int) -> None:
        import lightgbm

        self.path = path
        self.booster = lightgbm.Booster(model_file=str(path))
        self.nthread = nthread
        self.num_features = self.booster.num_feature()
        self.num_classes = self.booster.num_model_per_iteration()

    def predict(self, rows: np.ndarray) -> np.ndarray:
        scores = self.booster.predict(rows, num_threads=self.nthread)
        return scores.reshape(len(rows), self.num_classes)

    def for_instance(self) -> LightGBMForest:
        # a Booster's predict re-initialises shared predictor state on each call: one Booster per instance
        return LightGBMForest(self.path, self.nthread)


class TreeliteForest(Forest):
    predictor = "treelite"

    def __init__(self, model, nthread: int) -> None:
        header = model.get_header_accessor()
        num_target = int(header.get_field("num_target")[0])
        if num_target > 1:
            raise Unsupported(f"multi-output models are not supported ({num_target} targets)")
        self.model = model
        self.nthread = nthread
        self.num_features = model.num_feature
        self.num_classes = int(header.get_field("num_class")[0])

    def predict(self, rows: np.ndarray) -> np.ndarray:
        from treelite import gtil

        scores = gtil.predict(self.model, rows, nthread=self.nthread)
        return scores.reshape(len(rows), self.num_classes)


def load_forest(path: Path, options: FilOptions, nthread: int) -> Forest:
    """Load ``path`` as ``options.model_type`` with the chosen predictor; Unavailable if it cannot."""
    if not path.is_file():
        raise Unavailable(f"model file {path} not found (model_type '{options.model_type}')")
    try:
        return _load(path, options, nthread)
    except (Unavailable, Unsupported):
        raise
    except Exception as exc:  # each library raises its own error type for a file it cannot read
        raise Unavailable(f"cannot load {path.name} as model_type '{options.model_type}': "
                          f"{type(exc).__name__}: {_first_line(exc)}") from exc


def _load(path: Path, options: FilOptions, nthread: int) -> Forest:
    model_type, native = options.model_type, options.predictor != "treelite"
    if model_type.startswith("xgboost"):
        raw = path.read_bytes()
        found = _xgboost_format(raw)
        expected = {"xgboost_json": "json", "xgboost_ubj": "ubjson"}.get(model_type)
        if expected is not None and found != expected:
            raise Unavailable(f"{path.name} is not an XGBoost {expected.upper()} model "
                              f"(model_type '{model_type}'); it reads as {found}")
        if found == "binary":  # the legacy binary format: only Treelite still reads it
            if options.predictor == "native":
                raise Unsupported(f"{path.name} is in XGBoost's legacy binary format, which XGBoost 3 no "
                                  "longer reads; use predictor 'treelite' or 'auto', or re-save it as UBJSON")
            import treelite

            return TreeliteForest(treelite.frontend.load_xgboost_model_legacy_binary(path), nthread)
        if native:
            return XGBoostForest(raw, nthread)
        import treelite

        return TreeliteForest(treelite.frontend.load_xgboost_model(
            path, format_choice=found, allow_unknown_field=options.xgboost_allow_unknown_field), nthread)
    if model_type == "lightgbm":
        if native:
            return LightGBMForest(path, nthread)
        import treelite

        return TreeliteForest(treelite.frontend.load_lightgbm_model(path), nthread)
    import treelite  # treelite_checkpoint

    return TreeliteForest(treelite.Model.deserialize(path), nthread)


def _xgboost_format(raw: bytes) -> str:
    """``json`` (``{"``), ``ubjson`` (``{`` then a UBJSON marker) or ``binary`` (anything else)."""
    text = raw[:64].lstrip()
    if not text.startswith(b"{"):
        return "binary"
    return "json" if text[1:].lstrip()[:1] in (b'"', b"}") else "ubjson"


def _softmax(margins: np.ndarray) -> np.ndarray:
    shifted = np.exp(margins - margins.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[-1] if text else ""
