"""The ``pytorch`` backend (TorchScript) end to end: a real tideserve driven by tritonclient HTTP and gRPC.

The test models are written once per module into a temporary repository: a seeded MLP
(16 -> 32 -> 4) made with ``torch.jit.script``, a module made with ``torch.jit.trace`` that takes two
inputs and returns a dict, a scripted List[str] model, one with an optional input, and a scripted
"spin" model whose run time the request chooses. Every output is compared byte for byte with what
the TorchScript module itself returns for the same input. Everything runs on the CPU: CUDA instances
(KIND_GPU) are untested here.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from support import free_port
from in_process import InProcessServer
from tritonclient.utils import InferenceServerException

from tideserve.app import ServerOptions
from tideserve.backend import BackendRegistry

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.filterwarnings("ignore:`torch.jit.*is deprecated:DeprecationWarning")]


# == TorchScript test modules =======================================================================
class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(16, 32)
        self.out = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x)))


class Pair(torch.nn.Module):
    """Traced: two inputs, a dict output."""

    def forward(self, a, b):
        return {"sum": a + b, "diff": a - b}


class Shout(torch.nn.Module):
    def forward(self, words: list[str]) -> tuple[list[str], torch.Tensor]:
        return [w.upper() for w in words], torch.tensor([len(w) for w in words], dtype=torch.int64)


class Masked(torch.nn.Module):
    """An optional input: forward() has a default for it."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return x if mask is None else x * mask


class Spin(torch.nn.Module):
    """Runs ``n`` matrix products: as long as a request wants."""

    def forward(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        w = torch.eye(64)
        for _ in range(int(n.item())):
            x = torch.tanh(x @ w)
        return x


def make_modules(root: Path) -> dict[str, Path]:
    torch.manual_seed(0)
    modules = {
        "mlp": torch.jit.script(MLP().eval()),
        "pair": torch.jit.trace(Pair(), (torch.ones(2, 3), torch.ones(2, 3)), strict=False),
        "shout": torch.jit.script(Shout()),
        "masked": torch.jit.script(Masked()),
        "spin": torch.jit.script(Spin()),
    }
    paths = {}
    for name, module in modules.items():
        paths[name] = root / f"{name}.pt"
        module.save(str(paths[name]))
    return paths


def _io(kind: str, name: str, dtype: str, dims: str) -> str:
    return f'{kind} {{ name: "{name}" data_type: {dtype} dims: [ {dims} ] }}\n'


def _params(**values: str) -> str:
    return "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in values.items())


MLP_IO = _io("input", "INPUT__0", "TYPE_FP32", "16") + _io("output", "OUTPUT__0", "TYPE_FP32", "4")
PAIR_NAMED = (_io("input", "b", "TYPE_FP32", "3") + _io("input", "a", "TYPE_FP32", "3")
              + _io("output", "diff", "TYPE_FP32", "3") + _io("output", "sum", "TYPE_FP32", "3"))
PAIR_INDEXED = (_io("input", "INPUT__0", "TYPE_FP32", "3") + _io("input", "INPUT__1", "TYPE_FP32", "3")
                + _io("output", "OUTPUT__0", "TYPE_FP32", "3") + _io("output", "OUTPUT__1", "TYPE_FP32", "3"))
SPIN_IO = (_io("input", "INPUT__0", "TYPE_FP32", "1, 64") + _io("input", "INPUT__1", "TYPE_INT64", "1")
           + _io("output", "OUTPUT__0", "TYPE_FP32", "1, 64"))
SHOUT_IO = (_io("input", "words", "TYPE_STRING", "-1") + _io("output", "OUTPUT__0", "TYPE_STRING", "-1")
            + _io("output", "OUTPUT__1", "TYPE_INT64", "-1"))

# model name -> (module file, config body)
MODELS = {
    "mlp": ("mlp", 'platform: "pytorch_libtorch"\nmax_batch_size: 8\n' + MLP_IO),
    "mlp_wrong_type": ("mlp", 'backend: "pytorch"\nmax_batch_size: 8\n'
                       + _io("input", "INPUT__0", "TYPE_FP32", "16") + _io("output", "OUTPUT__0", "TYPE_INT64", "4")),
    "pair": ("pair", 'backend: "pytorch"\nmax_batch_size: 16\n' + PAIR_NAMED
             + "dynamic_batching { max_queue_delay_microseconds: 200000 }\n"),
    "pair_indexed": ("pair", 'backend: "pytorch"\nmax_batch_size: 0\n' + PAIR_INDEXED  # the other switches too
                     + "instance_group [ { count: 2 kind: KIND_CPU } ]\n"
                     + _params(DISABLE_OPTIMIZED_EXECUTION="true", INFERENCE_MODE="false",
                               ENABLE_WEIGHT_SHARING="true")),
    "shout": ("shout", 'backend: "pytorch"\nmax_batch_size: 0\n' + SHOUT_IO),
    "masked": ("masked", 'backend: "pytorch"\nmax_batch_size: 4\n' + _io("input", "x", "TYPE_FP32", "2")
               + 'input { name: "mask" data_type: TYPE_FP32 dims: [ 2 ] optional: true }\n'
               + _io("output", "OUTPUT__0", "TYPE_FP32", "2")),
    "spin_one": ("spin", 'backend: "pytorch"\nmax_batch_size: 0\n' + SPIN_IO
                 + _params(INTRA_OP_THREAD_COUNT="1")),
    "spin_two": ("spin", 'backend: "pytorch"\nmax_batch_size: 0\n' + SPIN_IO
                 + "instance_group [ { count: 2 kind: KIND_CPU } ]\n"
                 + _params(INTRA_OP_THREAD_COUNT="1")),
    # models that must fail to load, each with its own reason
    "bad_file": (None, 'backend: "pytorch"\nmax_batch_size: 8\n' + MLP_IO),
    "bad_names": ("pair", 'backend: "pytorch"\nmax_batch_size: 0\n' + _io("input", "a", "TYPE_FP32", "3")
                  + _io("input", "c", "TYPE_FP32", "3") + _io("output", "sum", "TYPE_FP32", "3")),
    "too_many_inputs": ("mlp", 'backend: "pytorch"\nmax_batch_size: 8\n' + MLP_IO
                        + _io("input", "INPUT__1", "TYPE_FP32", "16")),
    "gpu": ("mlp", 'backend: "pytorch"\nmax_batch_size: 8\n' + MLP_IO
            + "instance_group [ { count: 1 kind: KIND_GPU } ]\n"),
}
FAILING = {"bad_file", "bad_names", "too_many_inputs", "gpu"}


def write_repository(root: Path, modules: dict[str, Path]) -> None:
    for name, (module, body) in MODELS.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(f'name: "{name}"\n' + body)
        target = root / name / "1" / "model.pt"
        if module is None:
            target.write_bytes(b"this is not a TorchScript archive")
        else:
            target.write_bytes(modules[module].read_bytes())


# == the server =====================================================================================
@pytest.fixture(scope="module")
def modules(tmp_path_factory) -> dict[str, Path]:
    return make_modules(tmp_path_factory.mktemp("torchscript"))


@pytest.fixture(scope="module")
def tideserve(tmp_path_factory, modules):
    root = tmp_path_factory.mktemp("pytorch_repo")
    write_repository(root, modules)
    options = ServerOptions(model_repositories=[root], http_port=free_port(), grpc_port=free_port(),
                            allow_metrics=False, strict_readiness=False, exit_timeout_secs=2)
    running = InProcessServer(options, BackendRegistry())  # "pytorch" comes from the package entry point
    yield running
    running.stop()


@pytest.fixture(scope="module")
def http(tideserve):
    with httpclient.InferenceServerClient(tideserve.http_url, concurrency=8) as client:
        yield client


@pytest.fixture(scope="module")
def grpc(tideserve):
    with grpcclient.InferenceServerClient(tideserve.grpc_url) as client:
        yield client


def infer_input(module, name: str, array: np.ndarray):
    datatype = "BYTES" if array.dtype == np.object_ else {
        np.float32: "FP32", np.int64: "INT64"}[array.dtype.type]
    tensor = module.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def reference(path: Path, *args, **kwargs):
    """What the TorchScript module itself returns."""
    module = torch.jit.load(str(path))
    with torch.inference_mode():
        return module(*args, **kwargs)


# == tests ==========================================================================================
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_mlp_outputs_are_byte_for_byte_the_modules(protocol, http, grpc, modules):
    client, module = (http, httpclient) if protocol == "http" else (grpc, grpcclient)
    x = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
    result = client.infer("mlp", [infer_input(module, "INPUT__0", x)])
    out = result.as_numpy("OUTPUT__0")
    expected = reference(modules["mlp"], torch.from_numpy(x)).numpy()
    assert out.dtype == np.float32 and out.shape == (3, 4)
    assert out.tobytes() == expected.tobytes()


def test_named_inputs_bind_to_forward_arguments_and_dict_outputs_by_key(grpc, modules):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.full((2, 3), 0.5, np.float32)
    # the config lists b before a: binding is by name, not position
    result = grpc.infer("pair", [infer_input(grpcclient, "b", b), infer_input(grpcclient, "a", a)])
    expected = reference(modules["pair"], torch.from_numpy(a), torch.from_numpy(b))
    assert result.as_numpy("diff").tobytes() == expected["diff"].numpy().tobytes()
    assert result.as_numpy("sum").tobytes() == expected["sum"].numpy().tobytes()
    np.testing.assert_array_equal(result.as_numpy("diff"), a - b)


def test_indexed_names_bind_by_position(http, modules):
    a = np.array([1, 2, 3], np.float32)
    b = np.array([10, 20, 30], np.float32)
    result = http.infer("pair_indexed", [infer_input(httpclient, "INPUT__1", b), infer_input(httpclient, "INPUT__0", a)])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT__0"), a + b)  # dict values in order: sum, diff
    np.testing.assert_array_equal(result.as_numpy("OUTPUT__1"), a - b)
    requested = http.infer("pair_indexed", [infer_input(httpclient, "INPUT__0", a), infer_input(httpclient, "INPUT__1", b)],
                           outputs=[httpclient.InferRequestedOutput("OUTPUT__1")])
    assert requested.as_numpy("OUTPUT__0") is None
    np.testing.assert_array_equal(requested.as_numpy("OUTPUT__1"), a - b)


def test_string_lists_in_and_out(grpc, modules):
    texts = ["tide", "serve", "\u00e9t\u00e9"]
    words = np.array([t.encode() for t in texts], dtype=np.object_)
    result = grpc.infer("shout", [infer_input(grpcclient, "words", words)])
    upper, lengths = reference(modules["shout"], texts)
    assert result.as_numpy("OUTPUT__0").tolist() == [w.encode() for w in upper]
    assert result.as_numpy("OUTPUT__0").tolist()[:2] == [b"TIDE", b"SERVE"]
    assert result.as_numpy("OUTPUT__1").tobytes() == lengths.numpy().tobytes()


def test_an_optional_input_left_out_takes_forwards_default(http):
    x = np.array([[1.5, -2.0]], np.float32)
    alone = http.infer("masked", [infer_input(httpclient, "x", x)])
    np.testing.assert_array_equal(alone.as_numpy("OUTPUT__0"), x)
    mask = np.array([[0.0, 2.0]], np.float32)
    masked = http.infer("masked", [infer_input(httpclient, "x", x), infer_input(httpclient, "mask", mask)])
    np.testing.assert_array_equal(masked.as_numpy("OUTPUT__0"), x * mask)


def test_dynamic_batching_gives_each_request_its_exact_rows(http, modules):
    before = http.get_inference_statistics("pair")["model_stats"][0]
    rng = np.random.default_rng(2)
    pairs = [(rng.standard_normal((rows, 3)).astype(np.float32), rng.standard_normal((rows, 3)).astype(np.float32))
             for rows in (1, 2, 1, 3, 1, 2, 1, 1)]
    pending = [http.async_infer("pair", [infer_input(httpclient, "a", a), infer_input(httpclient, "b", b)])
               for a, b in pairs]
    results = [p.get_result(timeout=30) for p in pending]
    for (a, b), result in zip(pairs, results):
        expected = reference(modules["pair"], torch.from_numpy(a), torch.from_numpy(b))
        assert result.as_numpy("sum").tobytes() == expected["sum"].numpy().tobytes()
        assert result.as_numpy("diff").tobytes() == expected["diff"].numpy().tobytes()
    after = http.get_inference_statistics("pair")["model_stats"][0]
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert inferences == sum(len(a) for a, _ in pairs)
    assert executions < len(pairs)


def _spin(client, model: str, iterations: int, finished: dict, key: str) -> None:
    x = np.ones((1, 64), np.float32)
    client.infer(model, [infer_input(grpcclient, "INPUT__0", x),
                         infer_input(grpcclient, "INPUT__1", np.array([iterations], np.int64))])
    finished[key] = time.monotonic()


@pytest.mark.parametrize("model, parallel", [("spin_two", True), ("spin_one", False)])
def test_instances_run_in_parallel(model, parallel, tideserve):
    """A long request occupies one instance; with two instances a short request overtakes it."""
    finished: dict[str, float] = {}
    with grpcclient.InferenceServerClient(tideserve.grpc_url) as slow_client, \
            grpcclient.InferenceServerClient(tideserve.grpc_url) as fast_client:
        _spin(fast_client, model, 1, {}, "warm")
        slow = threading.Thread(target=_spin, args=(slow_client, model, 1_600_000, finished, "slow"))
        slow.start()
        time.sleep(0.5)  # the long request is now running on an instance (a loaded machine takes a while)
        sent = time.monotonic()
        _spin(fast_client, model, 1, finished, "fast")
        slow.join(30)
    assert set(finished) == {"slow", "fast"}
    assert finished["slow"] > sent, "the long request ended before the short one was sent: make it longer"
    if parallel:
        assert finished["fast"] < finished["slow"]
    else:  # the short request waited for the long one: both answers leave together, and which of the two client
        # threads reads its answer first is a race of its own, so allow the slow one's thread a moment's lead
        assert finished["fast"] > finished["slow"] - 0.1


def test_output_datatype_mismatch_is_a_clear_error(grpc):
    x = np.zeros((1, 16), np.float32)
    with pytest.raises(InferenceServerException) as info:
        grpc.infer("mlp_wrong_type", [infer_input(grpcclient, "INPUT__0", x)])
    assert "configuration expects datatype TYPE_INT64 for output 'OUTPUT__0', model provides TYPE_FP32" in str(info.value)


def test_models_that_cannot_load_are_unavailable_with_reasons_and_others_serve(grpc, http):
    index = {m["name"]: m for m in grpc.get_model_repository_index(as_json=True)["models"]}
    for name in FAILING:
        assert index[name]["state"] == "UNAVAILABLE", name
        assert not http.is_model_ready(name)
    assert "failed to load TorchScript model" in index["bad_file"]["reason"]
    assert "must be a TorchScript module" in index["bad_file"]["reason"]
    assert "input(s) ['c'] are not arguments of forward(a, b)" in index["bad_names"]["reason"]
    assert "the configuration expects 2 inputs, forward(x) takes 1" in index["too_many_inputs"]["reason"]
    if not torch.cuda.is_available():
        assert "is KIND_GPU, but PyTorch sees no CUDA device" in index["gpu"]["reason"]
    assert http.is_model_ready("mlp")
    assert http.infer("mlp", [infer_input(httpclient, "INPUT__0", np.zeros((1, 16), np.float32))]
                      ).as_numpy("OUTPUT__0").shape == (1, 4)
