"""The ``fil`` backend end to end: a real tideserve process serving tree models to tritonclient.

The models are trained here on scikit-learn's bundled datasets (:mod:`model_factory.tree_models`)
and every answer is compared with the framework's own ``predict`` / ``predict_proba`` on the same
rows: exactly where the server runs the same library (XGBoost, LightGBM), within 1e-6 where Treelite
stands in for another library (scikit-learn forests; XGBoost with ``predictor: treelite``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from support import start_server
from model_factory.tree_models import fil_config, train, write_fil_model
from tritonclient.utils import InferenceServerException

pytest.importorskip("treelite")
pytest.importorskip("xgboost")
pytest.importorskip("lightgbm")
pytest.importorskip("sklearn")

BATCH = 1024

# name -> (kind, options for write_fil_model)
MODELS = {
    "xgb_json_class": ("xgboost_json", {}),
    "xgb_json_proba": ("xgboost_json", {"predict_proba": True}),
    "xgb_ubj_class": ("xgboost_ubj", {}),
    "xgb_ubj_proba": ("xgboost_ubj", {"predict_proba": True}),
    "xgb_model_proba": ("xgboost", {"predict_proba": True}),
    "lgbm_class": ("lightgbm", {}),
    "lgbm_proba": ("lightgbm", {"predict_proba": True}),
    "rf_class": ("sklearn_rf", {}),
    "rf_proba": ("sklearn_rf", {"predict_proba": True}),
    "xgb_regressor": ("xgboost_regressor", {}),
    "xgb_multi_class": ("xgboost_multiclass", {}),
    "xgb_multi_proba": ("xgboost_multiclass", {"predict_proba": True}),
    "xgb_proba_one_column": ("xgboost_json", {"predict_proba": True, "output_dims": 1}),
    "xgb_threshold": ("xgboost_json", {"threshold": 0.3}),
    "xgb_output_class": ("xgboost_json", {"parameters": {"output_class": "true", "is_classifier": "false"}}),
    "xgb_scores": ("xgboost_json", {"is_classifier": False}),
    "xgb_treelite": ("xgboost_json", {"predict_proba": True, "parameters": {"predictor": "treelite"}}),
    "lgbm_treelite": ("lightgbm", {"predict_proba": True, "parameters": {"predictor": "treelite"}}),
    "xgb_batched": ("xgboost_ubj", {"predict_proba": True, "instance_count": 2, "max_queue_delay_us": 20000,
                                    "parameters": {"cpu_nthread": "1"}}),
    "lgbm_batched": ("lightgbm", {"predict_proba": True, "instance_count": 2, "max_queue_delay_us": 20000}),
    "rf_batched": ("sklearn_rf", {"instance_count": 2, "max_queue_delay_us": 20000}),
}
TREELITE_STANDS_IN = {"rf_class", "rf_proba", "rf_batched", "xgb_treelite"}

# name -> (kind, options, what the load error says)
BROKEN = {
    "bad_model_type": ("xgboost_json", {"parameters": {"model_type": "catboost"}}, "'model_type' is 'catboost'"),
    "bad_feature_count": ("xgboost_json", {"input_dims": 29}, "takes 30 features"),
    "bad_output_dims": ("xgboost_json", {"predict_proba": True, "output_dims": 3}, "output 'output__0' has dims [3]"),
    "bad_flag": ("xgboost_json", {"parameters": {"predict_proba": "maybe"}}, "'predict_proba' is 'maybe'"),
    "bad_format": ("xgboost_json", {}, "xgboost.json is not an XGBoost JSON model"),  # UBJSON bytes, see below
    "no_batching": ("xgboost_json", {"max_batch_size": 0, "dynamic_batching": False}, "max_batch_size > 0"),
}


def expected(name: str, rows: np.ndarray) -> np.ndarray:
    """What output__0 must hold for ``rows``, from the framework's own predictor."""
    kind, options = MODELS[name]
    model = train(kind)
    if name == "xgb_threshold":
        return (model.predict_proba(rows)[:, 1:] > 0.3).astype(np.float32)
    if name == "xgb_proba_one_column":
        return model.predict_proba(rows)[:, 1:]
    if name == "xgb_scores":  # a binary classifier served as a regressor: the probability of class 1
        return model.predict_proba(rows)[:, 1:]
    return model.predict_proba(rows) if options.get("predict_proba") else model.predict(rows)


def assert_matches(name: str, got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == np.float32 and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    if name in TREELITE_STANDS_IN:
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    else:
        np.testing.assert_array_equal(got, want)


def batch_of(name: str, size: int = BATCH, seed: int = 0) -> np.ndarray:
    rows = train(MODELS[name][0]).rows
    return np.ascontiguousarray(rows[np.random.default_rng(seed).integers(0, len(rows), size)])


@pytest.fixture(scope="module")
def fil_server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("fil_repo")
    for name, (kind, options) in MODELS.items():
        write_fil_model(repo, name, kind, **options)
    for name, (kind, options, _) in BROKEN.items():
        write_fil_model(repo, name, kind, **options)
    ubjson = train("xgboost_json").estimator.get_booster().save_raw("ubj")
    (repo / "bad_format" / "1" / "xgboost.json").write_bytes(ubjson)
    missing = write_fil_model(repo, "missing_file", "lightgbm")
    (missing / "1" / "model.txt").unlink()
    garbage = write_fil_model(repo, "garbage_file", "lightgbm")
    (garbage / "1" / "model.txt").write_text("this is not a LightGBM model\n")
    legacy = write_fil_model(repo, "garbage_legacy", "xgboost")  # not UBJSON: read as legacy binary
    (legacy / "1" / "xgboost.model").write_bytes(b"\x00" * 64)
    no_input = fil_config("no_input", train("xgboost_json"))
    write_fil_model(repo, "no_input", "xgboost_json", config="\n".join(
        line for line in no_input.splitlines() if not line.startswith("input")))
    server = start_server([repo], "--strict-readiness", "false", tmp_dir=tmp_path_factory.mktemp("fil_server"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(fil_server):
    client = httpclient.InferenceServerClient(fil_server.http_url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def grpc(fil_server):
    client = grpcclient.InferenceServerClient(fil_server.grpc_url)
    yield client
    client.close()


def infer(client, module, name: str, rows: np.ndarray) -> np.ndarray:
    tensor = module.InferInput("input__0", list(rows.shape), "FP32")
    tensor.set_data_from_numpy(rows)
    result = client.infer(name, [tensor], outputs=[module.InferRequestedOutput("output__0")])
    return result.as_numpy("output__0")


# -- outputs against the frameworks ---------------------------------------------------------------------
@pytest.mark.parametrize("name", MODELS)
def test_batch_matches_framework_http(http, name):
    rows = batch_of(name)
    assert_matches(name, infer(http, httpclient, name, rows), expected(name, rows))


@pytest.mark.parametrize("name", MODELS)
def test_single_rows_match_framework_grpc(grpc, name):
    rows = batch_of(name, 8, seed=1)
    for index in range(len(rows)):
        row = rows[index:index + 1]
        assert_matches(name, infer(grpc, grpcclient, name, row), expected(name, row))


def test_modes_differ_as_documented(http):
    rows = batch_of("xgb_json_proba", 64)
    proba = infer(http, httpclient, "xgb_json_proba", rows)
    assert proba.shape == (64, 2)
    np.testing.assert_allclose(proba.sum(axis=1), 1, atol=1e-6)
    classes = infer(http, httpclient, "xgb_json_class", rows)
    np.testing.assert_array_equal(classes[:, 0], (proba[:, 1] > 0.5).astype(np.float32))
    lowered = infer(http, httpclient, "xgb_threshold", rows)
    assert (lowered >= classes).all()
    np.testing.assert_array_equal(infer(http, httpclient, "xgb_output_class", rows), classes)
    np.testing.assert_array_equal(infer(http, httpclient, "xgb_proba_one_column", rows)[:, 0], proba[:, 1])
    multi = infer(http, httpclient, "xgb_multi_proba", batch_of("xgb_multi_proba", 16))
    assert multi.shape == (16, 3)


def test_model_config_is_served_as_written(http):
    config = http.get_model_config("xgb_batched")
    assert config["backend"] == "fil"
    assert config["input"][0]["name"] == "input__0" and config["input"][0]["dims"] == [30]
    assert config["output"][0]["dims"] == [2]
    assert config["instance_group"][0]["count"] == 2


# -- dynamic batching ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["xgb_batched", "lgbm_batched", "rf_batched"])
def test_concurrent_small_requests_are_batched_with_exact_results(grpc, name):
    before = grpc.get_inference_statistics(name, as_json=True)["model_stats"][0]
    requests = [batch_of(name, 1 + i % 7, seed=100 + i) for i in range(96)]
    with ThreadPoolExecutor(16) as pool:  # one gRPC client is safe to share between threads
        answers = list(pool.map(lambda rows: infer(grpc, grpcclient, name, rows), requests))
    for rows, got in zip(requests, answers):
        assert_matches(name, got, expected(name, rows))
    after = grpc.get_inference_statistics(name, as_json=True)["model_stats"][0]
    executions = int(after.get("execution_count", 0)) - int(before.get("execution_count", 0))
    rows_done = int(after.get("inference_count", 0)) - int(before.get("inference_count", 0))
    assert rows_done == sum(len(r) for r in requests)
    assert 0 < executions < len(requests)  # requests shared batches


# -- errors ----------------------------------------------------------------------------------------------
def test_wrong_feature_count_is_invalid_argument(http, grpc):
    rows = batch_of("xgb_json_class", 4)[:, :29].copy()
    with pytest.raises(InferenceServerException) as info:
        infer(http, httpclient, "xgb_json_class", rows)
    assert info.value.status() == "400" and "input__0" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        infer(grpc, grpcclient, "xgb_json_class", rows)
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT" and "input__0" in info.value.message()


def test_wrong_datatype_is_invalid_argument(http):
    tensor = httpclient.InferInput("input__0", [1, 30], "FP64")
    tensor.set_data_from_numpy(batch_of("lgbm_class", 1).astype(np.float64))
    with pytest.raises(InferenceServerException) as info:
        http.infer("lgbm_class", [tensor])
    assert info.value.status() == "400" and "input__0" in info.value.message()


def test_broken_models_are_unavailable_with_reason(http, grpc):
    index = {row["name"]: row for row in http.get_model_repository_index()}
    for name, (_, _, reason) in BROKEN.items():
        assert index[name]["state"] == "UNAVAILABLE", name
        assert reason in index[name]["reason"], (name, index[name]["reason"])
    assert "not found" in index["missing_file"]["reason"] and "model.txt" in index["missing_file"]["reason"]
    assert "cannot load model.txt as model_type 'lightgbm'" in index["garbage_file"]["reason"]
    assert "cannot load xgboost.model as model_type 'xgboost'" in index["garbage_legacy"]["reason"]
    assert "exactly one input 'input__0'" in index["no_input"]["reason"]
    assert all(index[name]["state"] == "READY" for name in MODELS)
    with pytest.raises(InferenceServerException) as info:
        infer(grpc, grpcclient, "bad_feature_count", batch_of("xgb_json_class", 1))
    assert info.value.status() == "StatusCode.UNAVAILABLE"
