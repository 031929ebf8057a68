"""Small tree models for the ``fil`` backend, trained here on scikit-learn's bundled datasets.

Nothing is downloaded: the classifiers learn ``load_breast_cancer`` (569 rows, 30 features, binary),
the regressor ``load_diabetes`` (10 features), the multi-class model ``load_iris`` (4 features,
3 classes). Seeds are fixed and every trainer runs on one thread, so a kind always gives the same
model. :func:`write_fil_model` writes a ready Triton model directory (``config.pbtxt`` and
``1/<file>``) for a kind, for tests, benchmarks and example deployments alike::

    from tideserve.bench.examples.tree_models import write_fil_model
    write_fil_model(Path("model_repository"), "cancer_xgb", "xgboost_json", predict_proba=True)

The example deployment's ``tabular`` model is the ``xgboost_json`` kind; the tests use every kind
(``tests/model_factory/tree_models.py`` re-exports this module).

scikit-learn forests are served the way Triton's FIL serves them: converted to a Treelite
checkpoint (``treelite.sklearn.import_model(forest).serialize("checkpoint.tl")``) and declared
``model_type: treelite_checkpoint``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SEED = 0
N_TREES = 50


@dataclass(frozen=True)
class TreeModel:
    """A trained model of one kind, with the data it learnt and how Triton's FIL should load it."""

    kind: str
    model_type: str  # the FIL ``model_type`` parameter
    filename: str  # the file FIL expects for that model_type
    estimator: Any  # the fitted scikit-learn style estimator
    rows: np.ndarray  # its training rows, float32
    is_classifier: bool
    num_classes: int  # classes of a classifier, 1 for a regressor

    @property
    def num_features(self) -> int:
        return self.rows.shape[1]

    def predict(self, rows: np.ndarray) -> np.ndarray:
        """The framework's own ``predict`` (class labels or values), as float32 [n, 1]."""
        return np.asarray(self.estimator.predict(rows), dtype=np.float32).reshape(len(rows), 1)

    def predict_proba(self, rows: np.ndarray) -> np.ndarray:
        """The framework's own ``predict_proba``, as float32 [n, num_classes]."""
        return np.asarray(self.estimator.predict_proba(rows), dtype=np.float32)

    def save(self, path: Path) -> None:
        """Write the model file in this kind's format."""
        KINDS[self.kind].saver(self.estimator, path)


# -- training ----------------------------------------------------------------------------------------
def _dataset(name: str) -> tuple[np.ndarray, np.ndarray]:
    from sklearn import datasets

    loader = {"breast_cancer": datasets.load_breast_cancer, "diabetes": datasets.load_diabetes,
              "iris": datasets.load_iris}[name]
    rows, target = loader(return_X_y=True)
    return rows.astype(np.float32), target


def _xgb_classifier(rows, target):
    import xgboost

    return xgboost.XGBClassifier(n_estimators=N_TREES, max_depth=4, learning_rate=0.3, random_state=SEED,
                                 n_jobs=1).fit(rows, target)


def _xgb_regressor(rows, target):
    import xgboost

    return xgboost.XGBRegressor(n_estimators=N_TREES, max_depth=4, learning_rate=0.1, random_state=SEED,
                                n_jobs=1).fit(rows, target)


def _lgbm_classifier(rows, target):
    import lightgbm

    return lightgbm.LGBMClassifier(n_estimators=N_TREES, num_leaves=15, random_state=SEED, n_jobs=1,
                                   deterministic=True, verbose=-1).fit(rows, target)


def _random_forest(rows, target):
    from sklearn.ensemble import RandomForestClassifier

    return RandomForestClassifier(n_estimators=N_TREES, max_depth=8, random_state=SEED, n_jobs=1).fit(rows, target)


def _save_booster(estimator, path: Path) -> None:
    raw_format = "json" if path.suffix == ".json" else "ubj"
    path.write_bytes(estimator.get_booster().save_raw(raw_format))


def _save_lightgbm(estimator, path: Path) -> None:
    estimator.booster_.save_model(str(path))


def _save_checkpoint(estimator, path: Path) -> None:
    import treelite

    treelite.sklearn.import_model(estimator).serialize(str(path))


@dataclass(frozen=True)
class Kind:
    dataset: str  # a scikit-learn bundled dataset
    trainer: Callable  # (rows, target) -> fitted estimator
    saver: Callable  # (estimator, path) -> None
    model_type: str
    filename: str
    is_classifier: bool


KINDS: dict[str, Kind] = {
    "xgboost_json": Kind("breast_cancer", _xgb_classifier, _save_booster, "xgboost_json", "xgboost.json", True),
    "xgboost_ubj": Kind("breast_cancer", _xgb_classifier, _save_booster, "xgboost_ubj", "xgboost.ubj", True),
    # model_type "xgboost" names xgboost.model; XGBoost 3 writes it as UBJSON (it no longer writes the
    # legacy binary format), which the backend recognises by its content.
    "xgboost": Kind("breast_cancer", _xgb_classifier, _save_booster, "xgboost", "xgboost.model", True),
    "lightgbm": Kind("breast_cancer", _lgbm_classifier, _save_lightgbm, "lightgbm", "model.txt", True),
    "sklearn_rf": Kind("breast_cancer", _random_forest, _save_checkpoint, "treelite_checkpoint", "checkpoint.tl",
                       True),
    "xgboost_regressor": Kind("diabetes", _xgb_regressor, _save_booster, "xgboost_json", "xgboost.json", False),
    "xgboost_multiclass": Kind("iris", _xgb_classifier, _save_booster, "xgboost_json", "xgboost.json", True),
}


@functools.cache
def train(kind: str) -> TreeModel:
    """The model of ``kind`` (one of :data:`KINDS`), trained once per process."""
    spec = KINDS[kind]
    rows, target = _dataset(spec.dataset)
    estimator = _fit(spec.dataset, spec.trainer)
    num_classes = len(np.unique(target)) if spec.is_classifier else 1
    return TreeModel(kind, spec.model_type, spec.filename, estimator, rows, spec.is_classifier, num_classes)


@functools.cache
def _fit(dataset: str, trainer: Callable):
    """One fit per (dataset, trainer): the three XGBoost classifier kinds are one model in three files."""
    return trainer(*_dataset(dataset))


# -- model directories -------------------------------------------------------------------------------
def fil_config(name: str, model: TreeModel, *, predict_proba: bool = False, is_classifier: bool | None = None,
               threshold: float | None = None, max_batch_size: int = 8192, instance_count: int = 1,
               dynamic_batching: bool = True, max_queue_delay_us: int = 2000, input_dims: int | None = None,
               output_dims: int | None = None, parameters: dict[str, str] | None = None) -> str:
    """``config.pbtxt`` text for ``model``; dims default to what the options make FIL answer."""
    classify = model.is_classifier if is_classifier is None else is_classifier
    if output_dims is None:
        output_dims = model.num_classes if (classify and predict_proba) else 1
    params = {"model_type": model.model_type, "is_classifier": _flag(classify),
              "predict_proba": _flag(predict_proba)}
    if threshold is not None:
        params["threshold"] = repr(float(threshold))
    params.update(parameters or {})
    lines = [
        f'name: "{name}"',
        'backend: "fil"',
        f"max_batch_size: {max_batch_size}",
        f'input [ {{ name: "input__0" data_type: TYPE_FP32 dims: [ {input_dims or model.num_features} ] }} ]',
        f'output [ {{ name: "output__0" data_type: TYPE_FP32 dims: [ {output_dims} ] }} ]',
        f"instance_group [ {{ count: {instance_count} kind: KIND_CPU }} ]",
        "parameters [",
        ",\n".join(f'  {{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in params.items()),
        "]",
    ]
    if dynamic_batching:
        lines.append(f"dynamic_batching {{ max_queue_delay_microseconds: {max_queue_delay_us} }}")
    return "\n".join(lines) + "\n"


def write_fil_model(repo: Path, name: str, kind: str, *, config: str | None = None, **options) -> Path:
    """Write ``<repo>/<name>/config.pbtxt`` and ``<repo>/<name>/1/<file>`` for ``kind``; the model dir.

    ``options`` go to :func:`fil_config`; ``config`` replaces the generated text entirely.
    """
    model = train(kind)
    model_dir = Path(repo) / name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    model.save(model_dir / "1" / model.filename)
    (model_dir / "config.pbtxt").write_text(config if config is not None else fil_config(name, model, **options))
    return model_dir


def _flag(value: bool) -> str:
    return "true" if value else "false"
