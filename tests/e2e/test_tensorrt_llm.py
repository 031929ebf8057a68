"""The TensorRT-LLM backend (``llm_backends/tensorrt_llm``) against a TEST DOUBLE of TensorRT-LLM's LLM API.

TensorRT-LLM needs an NVIDIA GPU, so nothing here runs it. ``FakeTensorRTLLM`` is a test double of the
surface the backend uses: ``LLM(model=..., **kwargs)`` (and ``_tensorrt_engine.LLM`` for built engines),
``.tokenizer``, ``generate_async(inputs, sampling_params, streaming)`` returning an async-iterable
``RequestOutput`` (``outputs[i].token_ids / .text / .finish_reason / .cumulative_logprob / .logprobs``,
``prompt_token_ids``, ``finished``, ``abort()``), ``SamplingParams`` (same field names, the same
construction checks, and the same ``_setup`` / stop-word handling as the real class), ``get_stats_async``
and ``shutdown``. It generates deterministic letters ('a', 'b', ... one token per character) so every
response can be checked exactly. It is injected with ``TensorRTLLMBackend.using(fake)`` — no globals patched.

A real in-process tideserve Server is driven with tritonclient (gRPC streaming and unary, HTTP).
What this proves: the adapter (tensor interface, parameter mapping, streaming, cancellation, errors).
What it does not: that a real TensorRT-LLM engine behaves like the double.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import queue
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from support import free_port
from in_process import InProcessServer
from tritonclient.utils import InferenceServerException

from tideserve.llm_backends.tensorrt_llm import TensorRTLLMBackend
from tideserve.llm_backends.tensorrt_llm.interface import encode_word_list
from tideserve.app import ServerOptions
from tideserve.backend import Backend, BackendRegistry, Model, ModelInstance
from tideserve.repository import ControlMode
from tideserve.types import InferenceResponse, Tensor

pytestmark = pytest.mark.timeout(60)

A = ord("a")
FAIL_TOKEN = 7  # a prompt holding this token id makes the test double fail mid-stream
REFUSE_TOKEN = 6  # ... and this one makes its generate_async raise (not an argument error)


# == the test double ================================================================================
class FakeTokenizer:
    """Test double of a TensorRT-LLM tokenizer: one token per character (id = code point); 0 pad, 2 eos."""

    eos_token_id = 2
    pad_token_id = 0

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True, **kwargs):
        return "".join(chr(i) for i in ids if i > 2)


@dataclass
class FakeLogprob:
    logprob: float
    rank: int | None = None


@dataclass(kw_only=True)
class FakeSamplingParams:
    """Test double of ``tensorrt_llm.SamplingParams``: same fields the backend uses, same checks."""

    end_id: int | None = None
    pad_id: int | None = None
    max_tokens: int = 32
    bad: str | list[str] | None = None
    bad_token_ids: list[int] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    temperature: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    length_penalty: float | None = None
    no_repeat_ngram_size: int | None = None
    min_p: float | None = None
    logprobs: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    _stop_word_ids: list | None = field(default=None, init=False, repr=False)
    _bad_word_ids: list | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if self.pad_id is None:
            self.pad_id = self.end_id
        self.best_of = self.best_of or self.n
        if self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) cannot be less than n ({self.n})")
        greedy = not self.use_beam_search and self.top_k in (None, 1) and self.top_p in (None, 0.0)
        if self.best_of > 1 and greedy:
            raise ValueError("Greedy decoding in the LLM API does not allow multiple returns.")

    def _setup(self, tokenizer):
        if self.end_id is None:
            self.end_id = tokenizer.eos_token_id
            self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.end_id
        if self.bad is not None:
            words = [self.bad] if isinstance(self.bad, str) else self.bad
            self._bad_word_ids = [tokenizer.encode(s, add_special_tokens=False) for s in words]
        if self.stop is not None:
            words = [self.stop] if isinstance(self.stop, str) else self.stop
            self._stop_word_ids = [tokenizer.encode(s, add_special_tokens=False) for s in words]
        return self

    def _words(self, singles, strings, ids, what):
        words = [[i] for i in singles or []]
        if strings is None:
            return words
        if ids is None:
            raise RuntimeError(f"SamplingParams.{what} ({strings}) is not processed by tokenizer")
        return words + ids

    def _get_stop_words(self):
        return self._words(self.stop_token_ids, self.stop, self._stop_word_ids, "stop")

    def _get_bad_words(self):
        return self._words(self.bad_token_ids, self.bad, self._bad_word_ids, "bad")


@dataclass
class FakeCompletionOutput:
    index: int
    text: str = ""
    token_ids: list = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: object = None


class FakeRequestOutput:
    """Test double of ``RequestOutput``: one generated token per sequence per step."""

    def __init__(self, fake, llm, prompt, prompt_ids, params, streaming):
        self.fake, self.llm = fake, llm
        self.prompt = prompt
        self.prompt_token_ids = prompt_ids
        self.params = params
        self.streaming = streaming
        # what the executor request is built from, fixed at submission as in TensorRT-LLM
        self.stop_words = params._get_stop_words()
        self.bad_words = params._get_bad_words()
        self.outputs = [FakeCompletionOutput(i) for i in range(params.n)]
        self.finished = False
        self.aborted = threading.Event()
        self.steps = 0

    def abort(self):
        self.aborted.set()

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.finished:
            raise StopAsyncIteration
        await self._step()
        while not self.streaming and not self.finished:
            await self._step()
        return self

    async def _step(self):
        await asyncio.sleep(self.fake.step_delay)
        if self.aborted.is_set():
            for out in self.outputs:
                out.finish_reason = out.finish_reason or "cancelled"
            self.finished = True
            return
        if FAIL_TOKEN in self.prompt_token_ids and self.steps >= 2:
            raise RuntimeError("simulated engine failure")
        p = self.params
        for k, out in enumerate(self.outputs):
            if out.finish_reason is not None:
                continue
            token = A + (self.steps + k) % 26
            if token == p.end_id and not p.ignore_eos:
                out.finish_reason = "stop"
                continue
            out.token_ids.append(token)
            if p.logprobs:
                out.logprobs.append({token: FakeLogprob(-0.5 - 0.25 * k, 1)})
                out.cumulative_logprob = sum(d[t].logprob for d, t in zip(out.logprobs, out.token_ids))
            for word in self.stop_words:
                if out.token_ids[-len(word):] == word:
                    out.finish_reason, out.stop_reason = "stop", word
                    if not p.include_stop_str_in_output:
                        del out.token_ids[-len(word):]
                        del out.logprobs[len(out.token_ids):]
                    break
            else:
                if len(out.token_ids) >= p.max_tokens:
                    out.finish_reason = "length"
            out.text = FakeTokenizer().decode(out.token_ids)
        self.steps += 1
        self.finished = all(o.finish_reason is not None for o in self.outputs)


class FakeKvCacheConfig(SimpleNamespace):
    """Test double of ``tensorrt_llm.llmapi.KvCacheConfig``."""


class FakeLLM:
    """Test double of ``tensorrt_llm.LLM``."""

    engine = False

    def __init__(self, fake, model, tokenizer=None, skip_tokenizer_init=False, **kwargs):
        self.fake = fake
        self.model = model
        self.tokenizer_arg = tokenizer
        self.kwargs = kwargs
        self.tokenizer = None if skip_tokenizer_init else FakeTokenizer()
        self.requests: list[FakeRequestOutput] = []
        self.shut_down = False
        if "broken" in str(model):
            raise RuntimeError("engine plan was built for another GPU")
        fake.llms.append(self)

    def _prepare_sampling_params(self, params):
        if params.end_id is None:  # as the real LLM: only then does it run _setup
            if self.tokenizer is None:
                raise ValueError("tokenizer is required to reset end_id if it is None, or you can explicitly "
                                 "specify the end_id for sampling_params")
            params._setup(self.tokenizer)
        return params

    def generate_async(self, inputs, sampling_params=None, streaming=False, **kwargs):
        if not isinstance(inputs, str) and REFUSE_TOKEN in inputs:
            raise RuntimeError("executor queue is gone")
        params = self._prepare_sampling_params(sampling_params)
        if isinstance(inputs, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer")
            prompt_ids = self.tokenizer.encode(inputs)
        else:
            prompt_ids = list(inputs)
        if len(prompt_ids) + params.max_tokens > self.fake.max_seq_len:
            raise ValueError(f"The sum of prompt length ({len(prompt_ids)}) and max_tokens ({params.max_tokens}) "
                             f"should not exceed max_seq_len ({self.fake.max_seq_len})")
        result = FakeRequestOutput(self.fake, self, inputs, prompt_ids, params, streaming)
        self.requests.append(result)
        return result

    async def _stats(self):
        yield {"numActiveRequests": sum(not r.finished for r in self.requests), "numQueuedRequests": 1,
               "kvCacheStats": {"usedNumBlocks": 3, "maxNumBlocks": 12}}

    def get_stats_async(self, timeout=2):
        return self._stats()

    def shutdown(self):
        self.shut_down = True


class FakeTensorRTLLM:
    """TEST DOUBLE of the ``tensorrt_llm`` package (its LLM API surface), given to the backend in place
    of the real import with ``TensorRTLLMBackend.using(fake)``."""

    def __init__(self):
        self.llms: list[FakeLLM] = []
        self.step_delay = 0.001
        self.max_seq_len = 4096
        fake = self

        class LLM(FakeLLM):
            def __init__(self, model, **kwargs):
                super().__init__(fake, model, **kwargs)

        class EngineLLM(LLM):
            engine = True

        self.LLM = LLM
        self._tensorrt_engine = SimpleNamespace(LLM=EngineLLM)
        self.SamplingParams = FakeSamplingParams
        self.KvCacheConfig = FakeKvCacheConfig

    def llm(self, model_name: str) -> FakeLLM:
        found = [llm for llm in self.llms if f"/{model_name}/" in str(llm.model) or str(llm.model) == model_name]
        assert found, f"no LLM was made for {model_name}"
        return found[-1]


# == server fixtures ================================================================================
def _trt_config(name, params, max_batch_size=0, extra=""):
    parameters = "\n".join(f'parameters {{ key: "{k}" value: {{ string_value: {json.dumps(v)} }} }}'
                           for k, v in params.items())
    return f'name: "{name}"\nbackend: "tensorrtllm"\nmax_batch_size: {max_batch_size}\n{parameters}\n{extra}\n'


def _write_repository(root):
    models = {
        # a built engine (engine_dir, relative to the version directory), tokenizer, Triton-style knobs
        "trt": _trt_config("trt", {"engine_dir": "engine", "tokenizer_dir": "tokenizer", "tensor_parallel_size": "1",
                                   "kv_cache_free_gpu_mem_fraction": "0.85", "enable_kv_cache_reuse": "true",
                                   "max_beam_width": "${max_beam_width}",
                                   "llm_args": '{"max_num_tokens": 4096, "kv_cache_config": {"dtype": "fp8"}}',
                                   "stats_interval_s": "0.05"}),
        # the PyTorch flow from a checkpoint, Triton's batch dimension (max_batch_size > 0)
        # (inputs in Triton's own style: scalars with reshape; dynamic_batching ignored: the engine batches)
        "trt_batched": _trt_config("trt_batched", {"model": "org/some-checkpoint"}, max_batch_size=8, extra="""
            input [ { name: "request_output_len" data_type: TYPE_INT32 dims: [ 1 ] reshape: { shape: [ ] }
                      optional: true } ]
            dynamic_batching { max_queue_delay_microseconds: 3000000 }"""),
        # no tokenizer: token ids only
        "trt_ids_only": _trt_config("trt_ids_only", {"engine_dir": "engine", "skip_tokenizer_init": "true"}),
        # explicitly not decoupled: one response per request, streaming refused
        "trt_unary": _trt_config("trt_unary", {"engine_dir": "engine"},
                                 extra="model_transaction_policy { decoupled: false }"),
        "trt_unloadable": _trt_config("trt_unloadable", {"engine_dir": "engine"}),
        # configurations that cannot load
        "bad_both": _trt_config("bad_both", {"engine_dir": "engine", "model": "x"}),
        "bad_none": _trt_config("bad_none", {}),
        "bad_path": _trt_config("bad_path", {"engine_dir": "no_such_engine"}),
        "bad_bool": _trt_config("bad_bool", {"engine_dir": "engine", "enable_kv_cache_reuse": "maybe"}),
        "bad_json": _trt_config("bad_json", {"engine_dir": "engine", "llm_args": "{oops"}),
        "bad_engine": _trt_config("bad_engine", {"engine_dir": "broken"}),
    }
    for name, text in models.items():
        (root / name / "1" / "engine").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(text)
    (root / "trt" / "1" / "tokenizer").mkdir()
    (root / "bad_engine" / "1" / "broken").mkdir()


@pytest.fixture(scope="module")
def fake():
    return FakeTensorRTLLM()


@pytest.fixture(scope="module")
def tideserve(tmp_path_factory, fake):
    root = tmp_path_factory.mktemp("trt_repo")
    _write_repository(root)
    registry = BackendRegistry()
    registry.register("tensorrtllm", TensorRTLLMBackend.using(fake))
    options = ServerOptions(model_repositories=[root], grpc_port=free_port(), http_port=free_port(),
                            allow_metrics=False, model_control_mode=ControlMode.EXPLICIT, load_models=["*"],
                            exit_timeout_secs=2)
    running = InProcessServer(options, registry)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(tideserve):
    with grpcclient.InferenceServerClient(tideserve.grpc_url) as c:
        yield c


@pytest.fixture(scope="module")
def http(tideserve):
    c = httpclient.InferenceServerClient(tideserve.http_url)
    yield c
    c.close()


# == helpers ========================================================================================
def _in(module, name, value, datatype=None):
    array = np.asarray(value)
    if datatype is None:
        datatype = "BYTES" if array.dtype == np.object_ else module.np_to_triton_dtype(array.dtype)
    tensor = module.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def token_inputs(module=grpcclient, prompt="hi", output_len=5, **extra):
    tensors = [_in(module, "input_ids", np.array(ids(prompt), np.int32)),
               _in(module, "input_lengths", np.array([len(prompt)], np.int32)),
               _in(module, "request_output_len", np.array([output_len], np.int32))]
    for name, value in extra.items():
        tensors.append(_in(module, name, value))
    return tensors


def text_inputs(module=grpcclient, prompt="hello", params=None, **flags):
    tensors = [_in(module, "text_input", np.array([prompt.encode()], dtype=np.object_))]
    if params is not None:
        tensors.append(_in(module, "sampling_parameters", np.array([json.dumps(params).encode()], dtype=np.object_)))
    for name, value in flags.items():
        tensors.append(_in(module, name, np.array([value])))
    return tensors


class StreamCollector:
    def __init__(self) -> None:
        self.items: queue.Queue = queue.Queue()

    def __call__(self, result, error):
        self.items.put((result, error))

    def take_until_final(self, timeout=10):
        out = []
        while True:
            result, error = self.items.get(timeout=timeout)
            out.append((result, error))
            if error is not None or _final(result):
                return out


def _final(result) -> bool:
    params = result.get_response().parameters
    return "triton_final_response" in params and params["triton_final_response"].bool_param


def stream(client, model, inputs, request_id="r", **kwargs):
    """Run one request on a gRPC stream; its responses (result, error) up to and including the final one."""
    collector = StreamCollector()
    client.start_stream(callback=collector)
    try:
        client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=True, **kwargs)
        return collector.take_until_final()
    finally:
        client.stop_stream()


def _grpc_status(exc: InferenceServerException) -> str:
    return str(exc.status())


# == config and loading =============================================================================
def test_config_is_auto_completed(client):
    config = client.get_model_config("trt", as_json=True)["config"]
    inputs = {t["name"]: t for t in config["input"]}
    outputs = {t["name"]: t for t in config["output"]}
    for name in ("input_ids", "input_lengths", "request_output_len", "streaming", "end_id", "pad_id", "runtime_top_k",
                 "runtime_top_p", "temperature", "beam_width", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "random_seed", "stop_words_list", "bad_words_list", "text_input", "stream",
                 "sampling_parameters"):
        assert inputs[name].get("optional") is True, name
    assert inputs["input_ids"]["data_type"] == "TYPE_INT32" and inputs["input_ids"]["dims"] == ["-1"]
    assert inputs["random_seed"]["data_type"] == "TYPE_UINT64"
    assert inputs["stop_words_list"]["dims"] == ["2", "-1"]
    assert inputs["text_input"]["data_type"] == "TYPE_STRING"
    for name in ("output_ids", "sequence_length", "cum_log_probs", "output_log_probs", "text_output"):
        assert name in outputs
    assert outputs["output_ids"]["dims"] == ["-1", "-1"]
    assert config["model_transaction_policy"]["decoupled"] is True
    assert client.get_model_config("trt_unary", as_json=True)["config"]["model_transaction_policy"].get(
        "decoupled", False) is False
    meta = client.get_model_metadata("trt_batched", as_json=True)
    shapes = {t["name"]: t["shape"] for t in meta["inputs"]}
    assert shapes["input_ids"] == ["-1", "-1"] and shapes["stop_words_list"] == ["-1", "2", "-1"]


def test_llm_is_built_from_the_config_parameters(fake, tideserve):
    engine = fake.llm("trt")
    assert engine.engine, "a built engine must load with tensorrt_llm._tensorrt_engine.LLM"
    assert engine.model == str(tideserve.repo / "trt" / "1" / "engine")
    assert engine.tokenizer_arg == str(tideserve.repo / "trt" / "1" / "tokenizer")
    assert engine.kwargs == {"max_num_tokens": 4096, "tensor_parallel_size": 1,  # ${max_beam_width}: unset
                             "kv_cache_config": FakeKvCacheConfig(dtype="fp8", free_gpu_memory_fraction=0.85,
                                                                  enable_block_reuse=True)}
    checkpoint = fake.llm("org/some-checkpoint")
    assert not checkpoint.engine and checkpoint.kwargs == {}  # the PyTorch flow: tensorrt_llm.LLM


BAD_CONFIGS = {
    "bad_both": "engine_dir (a built TensorRT engine) or model (a checkpoint for the PyTorch flow), not both",
    "bad_none": "set parameters engine_dir",
    "bad_path": "no_such_engine not found",
    "bad_bool": "parameter enable_kv_cache_reuse must be true or false, got 'maybe'",
    "bad_json": "parameter llm_args is not valid JSON",
    "bad_engine": "TensorRT-LLM could not load",
}


def test_bad_configs_leave_the_model_unavailable_with_the_reason(client):
    index = {m["name"]: m for m in client.get_model_repository_index(as_json=True)["models"]}
    for name, reason in BAD_CONFIGS.items():
        assert index[name]["state"] == "UNAVAILABLE", name
        assert reason in index[name]["reason"], (name, index[name]["reason"])
    assert "engine plan was built for another GPU" in index["bad_engine"]["reason"]
    assert client.is_model_ready("trt")


# == the token-id interface (Triton's tensorrt_llm model) ===========================================
def test_every_token_input_lands_in_sampling_params(client, fake):
    stop = encode_word_list([[ids("x")[0]], ids("yz")])
    bad = encode_word_list([ids("q"), ids("rs")])
    inputs = [_in(grpcclient, "input_ids", np.array(ids("prompt") + [0, 0], np.int32)),
              _in(grpcclient, "input_lengths", np.array([6], np.int32)),
              _in(grpcclient, "request_output_len", np.array([3], np.int32)),
              _in(grpcclient, "end_id", np.array([99999], np.int32)),
              _in(grpcclient, "pad_id", np.array([5], np.int32)),
              _in(grpcclient, "runtime_top_k", np.array([40], np.int32)),
              _in(grpcclient, "runtime_top_p", np.array([0.9], np.float32)),
              _in(grpcclient, "temperature", np.array([0.7], np.float32)),
              _in(grpcclient, "beam_width", np.array([1], np.int32)),
              _in(grpcclient, "repetition_penalty", np.array([1.2], np.float32)),
              _in(grpcclient, "presence_penalty", np.array([0.3], np.float32)),
              _in(grpcclient, "frequency_penalty", np.array([-0.4], np.float32)),
              _in(grpcclient, "len_penalty", np.array([1.5], np.float32)),
              _in(grpcclient, "min_length", np.array([2], np.int32)),
              _in(grpcclient, "random_seed", np.array([2**40 + 5], np.uint64)),
              _in(grpcclient, "stop_words_list", stop),
              _in(grpcclient, "bad_words_list", bad)]
    client.infer("trt", inputs)
    request = fake.llm("trt").requests[-1]
    assert request.prompt == ids("prompt")  # trimmed to input_lengths
    p = request.params
    assert (p.max_tokens, p.end_id, p.pad_id, p.top_k, p.seed, p.min_tokens) == (3, 99999, 5, 40, 2**40 + 5, 2)
    assert p.top_p == pytest.approx(0.9) and p.temperature == pytest.approx(0.7)
    assert p.repetition_penalty == pytest.approx(1.2) and p.presence_penalty == pytest.approx(0.3)
    assert p.frequency_penalty == pytest.approx(-0.4) and p.length_penalty == pytest.approx(1.5)
    assert (p.n, p.use_beam_search) == (1, False)
    # single-token words go to the public *_token_ids fields, multi-token words keep their exact ids
    assert p.stop_token_ids == ids("x") and p.bad_token_ids == ids("q")
    assert request.stop_words == [ids("x"), ids("yz")]
    assert request.bad_words == [ids("q"), ids("rs")]


def test_multi_token_stop_words_keep_exact_ids_without_end_id(client, fake):
    client.infer("trt", token_inputs(stop_words_list=encode_word_list([ids("cd")])))
    request = fake.llm("trt").requests[-1]
    assert request.stop_words == [ids("cd")]
    assert request.params.end_id == FakeTokenizer.eos_token_id  # set as _setup would, so the ids stay exact


def test_token_streaming_sends_deltas_then_final(client):
    items = stream(client, "trt", token_inputs(prompt="hi", output_len=4, streaming=np.array([True])))
    assert all(error is None for _, error in items)
    results = [r for r, _ in items]
    assert [_final(r) for r in results] == [False, False, False, True]
    assert [r.as_numpy("output_ids").tolist() for r in results] == [[[A]], [[A + 1]], [[A + 2]], [[A + 3]]]
    assert [r.as_numpy("sequence_length").tolist() for r in results] == [[1]] * 4
    assert results[0].as_numpy("cum_log_probs") is None  # log probs only on request


def test_stream_ending_without_a_new_token_ends_with_a_bare_final(client):
    items = stream(client, "trt", token_inputs(output_len=10, streaming=np.array([True]),
                                               end_id=np.array([A + 2], np.int32)))
    assert [r.as_numpy("output_ids").tolist() if r.as_numpy("output_ids") is not None else None
            for r, _ in items] == [[[A]], [[A + 1]], None]
    assert [_final(r) for r, _ in items] == [False, False, True]


def test_engine_refusing_a_request_is_an_internal_error(client):
    with pytest.raises(InferenceServerException, match="executor queue is gone") as info:
        client.infer("trt", [_in(grpcclient, "input_ids", np.array([REFUSE_TOKEN], np.int32))])
    assert _grpc_status(info.value) == "StatusCode.INTERNAL"


def test_token_non_streaming_one_response_with_prompt(client, http):
    # gRPC stream, streaming off: one response, the prompt and the whole generation
    (result, error), = stream(client, "trt", token_inputs(prompt="hi", output_len=3))
    assert error is None and _final(result)
    assert result.as_numpy("output_ids").tolist() == [ids("hi") + [A, A + 1, A + 2]]
    assert result.as_numpy("sequence_length").tolist() == [5]
    # HTTP and gRPC unary: streaming=true gets one response (the protocol takes one) holding what the
    # stream would have: the generated tokens, no prompt
    for module, c in ((httpclient, http), (grpcclient, client)):
        result = c.infer("trt", token_inputs(module, prompt="hi", output_len=3, streaming=np.array([True])))
        assert result.as_numpy("output_ids").tolist() == [[A, A + 1, A + 2]]
        assert result.as_numpy("sequence_length").tolist() == [3]
        result = c.infer("trt", token_inputs(module, prompt="hi", output_len=3,
                                             exclude_input_in_output=np.array([True])))
        assert result.as_numpy("output_ids").tolist() == [[A, A + 1, A + 2]]


def test_beam_search_and_log_probs(client, fake):
    result = client.infer("trt", token_inputs(prompt="hi", output_len=3, beam_width=np.array([2], np.int32),
                                              return_log_probs=np.array([True]),
                                              exclude_input_in_output=np.array([True])))
    p = fake.llm("trt").requests[-1].params
    assert (p.use_beam_search, p.n, p.best_of, p.logprobs) == (True, 2, 2, 1)
    assert result.as_numpy("output_ids").tolist() == [[A, A + 1, A + 2], [A + 1, A + 2, A + 3]]
    assert result.as_numpy("sequence_length").tolist() == [3, 3]
    np.testing.assert_allclose(result.as_numpy("output_log_probs"), [[-0.5] * 3, [-0.75] * 3])
    np.testing.assert_allclose(result.as_numpy("cum_log_probs"), [-1.5, -2.25])


def test_end_id_and_stop_words_end_generation(client):
    result = client.infer("trt", token_inputs(prompt="hi", output_len=10, end_id=np.array([A + 3], np.int32),
                                              exclude_input_in_output=np.array([True])))
    assert result.as_numpy("output_ids").tolist() == [[A, A + 1, A + 2]]
    result = client.infer("trt", token_inputs(prompt="hi", output_len=10, exclude_input_in_output=np.array([True]),
                                              stop_words_list=encode_word_list([ids("ef")])))
    assert result.as_numpy("output_ids").tolist() == [ids("abcd")]


def test_batched_model_rows(client, fake):
    started = time.monotonic()
    prompts = np.array([ids("ab"), ids("cd")], np.int32)
    inputs = [_in(grpcclient, "input_ids", prompts),
              _in(grpcclient, "input_lengths", np.array([[2], [1]], np.int32)),
              _in(grpcclient, "request_output_len", np.array([[2], [3]], np.int32))]
    result = client.infer("trt_batched", inputs)
    assert result.as_numpy("output_ids").tolist() == [[ids("ab") + [A, A + 1]], [ids("c") + [A, A + 1, A + 2]]]
    assert result.as_numpy("sequence_length").tolist() == [[4], [4]]
    inputs[2] = _in(grpcclient, "request_output_len", np.array([[1], [3]], np.int32))  # ragged: padded with -1
    result = client.infer("trt_batched", inputs)
    assert result.as_numpy("output_ids").tolist() == [[ids("ab") + [A, -1]], [ids("c") + [A, A + 1, A + 2]]]
    assert result.as_numpy("sequence_length").tolist() == [[3], [4]]
    assert [r.prompt for r in fake.llm("org/some-checkpoint").requests[-2:]] == [ids("ab"), ids("c")]
    assert time.monotonic() - started < 2, "requests waited in a dynamic batcher: they must pass straight through"
    # streamed: each response is one row's delta, marked with batch_index; one final at the end
    inputs.append(_in(grpcclient, "streaming", np.array([[True], [True]])))
    items = stream(client, "trt_batched", inputs)
    assert all(e is None for _, e in items) and _final(items[-1][0])
    got = {0: [], 1: []}
    for result, _ in items:
        if result.as_numpy("output_ids") is not None:
            got[int(result.as_numpy("batch_index")[0, 0])] += result.as_numpy("output_ids")[0, 0].tolist()
    assert got == {0: [A], 1: [A, A + 1, A + 2]}


def test_unary_model_sends_one_response_and_refuses_streaming(client):
    result = client.infer("trt_unary", token_inputs(prompt="hi", output_len=2))
    assert result.as_numpy("output_ids").tolist() == [ids("hi") + [A, A + 1]]
    items = stream(client, "trt_unary", token_inputs(prompt="hi", output_len=2, streaming=np.array([True])))
    assert "decoupled" in items[0][1].message() and "streaming" in items[0][1].message()


# == the text interface (as Triton's vLLM backend) =================================================
def test_text_streaming_sends_new_text_only(client, fake):
    items = stream(client, "trt", text_inputs(prompt="hello", params={"max_tokens": 4}, stream=True,
                                              return_finish_reason=True, return_num_output_tokens=True))
    results = [r for r, e in items if e is None]
    assert len(results) == len(items) == 4
    assert [r.as_numpy("text_output").tolist() for r in results] == [[b"a"], [b"b"], [b"c"], [b"d"]]
    assert [r.as_numpy("finish_reason").tolist() for r in results][-1] == [b"length"]
    assert [int(r.as_numpy("num_output_tokens")[0]) for r in results] == [1, 1, 1, 1]
    assert [_final(r) for r in results] == [False, False, False, True]
    assert fake.llm("trt").requests[-1].prompt == "hello"  # text goes to the engine, which tokenizes it


def test_text_non_streaming_whole_output(client, http):
    for module, c in ((grpcclient, client), (httpclient, http)):
        result = c.infer("trt", text_inputs(module, prompt="hi ", params={"max_tokens": 3},
                                            return_num_input_tokens=True, return_cumulative_logprob=True))
        assert result.as_numpy("text_output").tolist() == [b"hi abc"]  # prompt prepended, as vLLM's backend
        assert result.as_numpy("num_input_tokens").tolist() == [3]
        assert result.as_numpy("cumulative_logprob").tolist() == [-1.5]
        result = c.infer("trt", text_inputs(module, prompt="hi ", params={"max_tokens": 3},
                                            exclude_input_in_output=True))
        assert result.as_numpy("text_output").tolist() == [b"abc"]
    # stream=true over unary protocols still yields one response
    result = http.infer("trt", text_inputs(httpclient, prompt="x", params={"max_tokens": 2}, stream=True))
    assert result.as_numpy("text_output").tolist() == [b"ab"]


def test_sampling_parameters_map_to_sampling_params(client, fake):
    params = {"max_tokens": "6", "temperature": 0.5, "top_p": "0.8", "top_k": -1, "seed": 11, "n": 2,
              "best_of": 3, "stop": ["de"], "stop_token_ids": [ord("z")], "bad_words": "q",
              "repetition_penalty": 1.1, "presence_penalty": 0.2, "frequency_penalty": 0.1, "min_tokens": 1,
              "include_stop_str_in_output": "false", "ignore_eos": False, "length_penalty": 1.0, "logprobs": 2}
    result = client.infer("trt", text_inputs(prompt="p", params=params, exclude_input_in_output=True))
    request = fake.llm("trt").requests[-1]
    p = request.params
    assert (p.max_tokens, p.seed, p.n, p.best_of, p.min_tokens, p.logprobs) == (6, 11, 2, 3, 1, 2)
    assert p.temperature == 0.5 and p.top_p == pytest.approx(0.8) and p.top_k is None  # -1: top-k off
    assert (p.stop, p.stop_token_ids, p.bad) == (["de"], [ord("z")], ["q"])
    assert p.include_stop_str_in_output is False
    assert request.stop_words == [[ord("z")], ids("de")]  # tokenized by the LLM (end_id unset)
    assert result.as_numpy("text_output").tolist() == [b"abc", b"bc"]  # n=2: "de" stops both, trimmed
    # temperature 0 means greedy; end_id given: the backend tokenizes stop strings itself
    client.infer("trt", text_inputs(prompt="p", params={"temperature": 0, "stop": "xy", "end_id": 3}))
    request = fake.llm("trt").requests[-1]
    assert (request.params.top_k, request.params.temperature) == (1, None)
    assert request.stop_words == [ids("xy")]


def test_text_log_probs(client):
    items = stream(client, "trt", text_inputs(prompt="p", params={"max_tokens": 2, "logprobs": 1}, stream=True,
                                              return_logprobs=True, return_cumulative_logprob=True))
    results = [r for r, _ in items]
    assert [json.loads(r.as_numpy("logprobs")[0]) for r in results] == [
        [{str(A): {"logprob": -0.5, "rank": 1, "decoded_token": None}}],
        [{str(A + 1): {"logprob": -0.5, "rank": 1, "decoded_token": None}}]]
    assert [r.as_numpy("cumulative_logprob").tolist() for r in results] == [[-0.5], [-1.0]]


def test_request_parameters_are_the_fallback(client, fake):
    result = client.infer("trt", text_inputs(prompt="p", exclude_input_in_output=True),
                          parameters={"max_tokens": 2, "unrelated": "ignored"})
    assert result.as_numpy("text_output").tolist() == [b"ab"]
    assert fake.llm("trt").requests[-1].params.max_tokens == 2


def test_generate_extension(tideserve):
    import urllib.request

    def post(path, body):
        req = urllib.request.Request(f"http://{tideserve.http_url}/v2/models/trt/{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as response:
            return response.read().decode()

    answer = json.loads(post("generate", {"text_input": "hi ", "max_tokens": 3}))
    assert answer["text_output"] == "hi abc"
    events = [json.loads(line[len("data: "):]) for line in
              post("generate_stream", {"text_input": "hi", "max_tokens": 3, "stream": True}).splitlines()
              if line.startswith("data: ")]
    assert [e["text_output"] for e in events] == ["a", "b", "c"]


def test_text_batched(client):
    inputs = [_in(grpcclient, "text_input", np.array([[b"u"], [b"v"]], dtype=np.object_)),
              _in(grpcclient, "sampling_parameters", np.array([[b'{"max_tokens": 1}'], [b'{"max_tokens": 2}']],
                                                               dtype=np.object_))]
    result = client.infer("trt_batched", inputs)
    assert result.as_numpy("text_output").tolist() == [[b"ua"], [b"vab"]]


# == errors =========================================================================================
BAD_TOKEN_REQUESTS = [
    ({"runtime_top_p": np.array([1.5], np.float32)}, "runtime_top_p"),
    ({"temperature": np.array([-1.0], np.float32)}, "temperature"),
    ({"beam_width": np.array([0], np.int32)}, "beam_width"),
    ({"repetition_penalty": np.array([0.0], np.float32)}, "repetition_penalty"),
    ({"runtime_top_k": np.array([-3], np.int32)}, "runtime_top_k"),
    ({"stop_words_list": np.array([[1, 2], [3, 1]], np.int32)}, "stop_words_list"),
    ({"input_lengths": np.array([9], np.int32)}, "input_lengths"),
    ({"text_input": np.array([b"x"], dtype=np.object_)}, "exactly one of 'input_ids'"),
]


@pytest.mark.parametrize("extra,field", BAD_TOKEN_REQUESTS, ids=[f for _, f in BAD_TOKEN_REQUESTS])
def test_bad_token_parameters_are_invalid_argument(client, http, extra, field):
    base = {"input_ids": np.array(ids("hi"), np.int32), "request_output_len": np.array([2], np.int32)}
    base.update(extra)
    inputs = [_in(grpcclient, n, v) for n, v in base.items()]
    with pytest.raises(InferenceServerException) as info:
        client.infer("trt", inputs)
    assert _grpc_status(info.value) == "StatusCode.INVALID_ARGUMENT" and field in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        http.infer("trt", [_in(httpclient, n, v) for n, v in base.items()])
    assert info.value.status() == "400" and field in info.value.message()


BAD_TEXT_REQUESTS = [
    ({"top_p": "abc"}, "'top_p'"),
    ({"max_tokens": 0}, "'max_tokens'"),
    ({"temperature": -0.5}, "'temperature'"),
    ({"no_such_knob": 1}, "unknown key 'no_such_knob'"),
    ({"stop": 5}, "'stop'"),
    ({"n": 2}, "invalid sampling parameters"),  # TensorRT-LLM's own check: greedy with n > 1
    ({"max_tokens": 100000}, "max_seq_len"),      # generate_async's own check
]


@pytest.mark.parametrize("params,field", BAD_TEXT_REQUESTS, ids=[f for _, f in BAD_TEXT_REQUESTS])
def test_bad_sampling_parameters_are_invalid_argument(client, params, field):
    with pytest.raises(InferenceServerException) as info:
        client.infer("trt", text_inputs(prompt="hi", params=params))
    assert _grpc_status(info.value) == "StatusCode.INVALID_ARGUMENT", info.value.message()
    assert field in info.value.message()


def test_malformed_sampling_parameters(client):
    inputs = [_in(grpcclient, "text_input", np.array([b"hi"], dtype=np.object_)),
              _in(grpcclient, "sampling_parameters", np.array([b"{not json"], dtype=np.object_))]
    with pytest.raises(InferenceServerException, match="sampling_parameters: not valid JSON"):
        client.infer("trt", inputs)
    with pytest.raises(InferenceServerException, match="streaming"):
        client.infer("trt", text_inputs(prompt="hi", stream=True, exclude_input_in_output=False))


def test_model_without_tokenizer_takes_token_ids_only(client):
    with pytest.raises(InferenceServerException, match="tokenizer") as info:
        client.infer("trt_ids_only", text_inputs(prompt="hi"))
    assert "text_input" in info.value.message()
    with pytest.raises(InferenceServerException, match="multi-token words need the model's tokenizer"):
        client.infer("trt_ids_only", token_inputs(end_id=np.array([2], np.int32),
                                                  stop_words_list=encode_word_list([ids("ab")])))
    with pytest.raises(InferenceServerException, match="end_id") as info:  # the LLM API's own check
        client.infer("trt_ids_only", token_inputs())
    assert _grpc_status(info.value) == "StatusCode.INVALID_ARGUMENT"
    result = client.infer("trt_ids_only", token_inputs(prompt="hi", output_len=2, end_id=np.array([2], np.int32),
                                                       stop_words_list=encode_word_list([[A + 1]])))
    assert result.as_numpy("output_ids").tolist() == [ids("hi") + [A]]


def test_engine_error_mid_stream_fails_that_request_only(client):
    collector = StreamCollector()
    client.start_stream(callback=collector)
    try:
        failing = [_in(grpcclient, "input_ids", np.array([FAIL_TOKEN, 8], np.int32)),
                   _in(grpcclient, "request_output_len", np.array([50], np.int32)),
                   _in(grpcclient, "streaming", np.array([True]))]
        client.async_stream_infer("trt", failing, request_id="boom", enable_empty_final_response=True)
        client.async_stream_infer("trt", token_inputs(output_len=3, streaming=np.array([True])), request_id="fine",
                                  enable_empty_final_response=True)
        per_id: dict[str, list] = {"boom": [], "fine": []}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (per_id["boom"] and per_id["boom"][-1][1] is not None
                                                   and per_id["fine"] and _final(per_id["fine"][-1][0])):
            result, error = collector.items.get(timeout=10)
            rid = result.get_response().id if result is not None else ("boom" if "boom" in str(error) or
                                                                          "simulated" in error.message() else "?")
            per_id.setdefault(rid, []).append((result, error))
    finally:
        client.stop_stream()
    boom = per_id["boom"]
    assert [e for _, e in boom[:-1]] == [None, None]  # two tokens streamed, then the failure
    assert "TensorRT-LLM engine error" in boom[-1][1].message() and "simulated engine failure" in boom[-1][1].message()
    fine = per_id["fine"]
    assert all(e is None for _, e in fine) and _final(fine[-1][0])
    assert client.infer("trt", token_inputs(output_len=1)).as_numpy("output_ids") is not None


# == cancellation, unload, metrics ==================================================================
def test_cancellation_aborts_the_engine_request(client, fake, tideserve):
    fake.step_delay = 0.02
    try:
        collector = StreamCollector()
        client.start_stream(callback=collector)
        try:
            client.async_stream_infer("trt", token_inputs(prompt="cancel", output_len=1000,
                                                          streaming=np.array([True])), request_id="cancel-me")
            for _ in range(2):
                assert collector.items.get(timeout=10)[1] is None
            request = next(r for r in fake.llm("trt").requests if r.prompt == ids("cancel"))
            assert not request.aborted.is_set()
        finally:
            client.stop_stream(cancel_requests=True)
        assert request.aborted.wait(5), "the engine request was never aborted"
        deadline = time.monotonic() + 5
        # the count follows the engine's abort (the stream's end is counted after it): wait for the model's sample,
        # not only for the family, which other models' lines already show
        while (_sample(_metrics(tideserve), "tideserve:request_aborted_total", "trt") < 1
               and time.monotonic() < deadline):
            time.sleep(0.02)
        assert _sample(_metrics(tideserve), "tideserve:request_aborted_total", "trt") >= 1
    finally:
        fake.step_delay = 0.001


def test_unload_lets_requests_in_flight_finish_then_shuts_the_engine_down(client, fake):
    fake.step_delay = 0.02
    try:
        collector = StreamCollector()
        client.start_stream(callback=collector)
        try:
            client.async_stream_infer("trt_unloadable", token_inputs(prompt="long", output_len=25,
                                                                     streaming=np.array([True])),
                                      request_id="u", enable_empty_final_response=True)
            first = collector.items.get(timeout=10)
            llm = fake.llm("trt_unloadable")
            client.unload_model("trt_unloadable")  # Triton's semantics: in-flight requests complete first
            items = [first] + collector.take_until_final()
        finally:
            client.stop_stream()
    finally:
        fake.step_delay = 0.001
    assert all(e is None for _, e in items)
    assert sum(r.as_numpy("output_ids").size for r, _ in items if r.as_numpy("output_ids") is not None) == 25
    deadline = time.monotonic() + 5
    while not llm.shut_down:
        assert time.monotonic() < deadline, "the engine was not shut down on unload"
        time.sleep(0.02)
    assert not llm.requests[-1].aborted.is_set()
    client.load_model("trt_unloadable")
    assert client.is_model_ready("trt_unloadable")


def test_shutdown_aborts_requests_past_the_exit_timeout(tmp_path):
    fake = FakeTensorRTLLM()
    fake.step_delay = 0.02
    (tmp_path / "llm" / "1" / "engine").mkdir(parents=True)
    (tmp_path / "llm" / "config.pbtxt").write_text(_trt_config("llm", {"engine_dir": "engine"}))
    registry = BackendRegistry()
    registry.register("tensorrtllm", TensorRTLLMBackend.using(fake))
    running = InProcessServer(ServerOptions(model_repositories=[tmp_path], grpc_port=free_port(), allow_http=False,
                                            allow_metrics=False, exit_timeout_secs=0.2), registry)
    stopped = False
    try:
        with grpcclient.InferenceServerClient(running.grpc_url) as c:
            collector = StreamCollector()
            c.start_stream(callback=collector)
            try:
                c.async_stream_infer("llm", token_inputs(output_len=1000, streaming=np.array([True])), request_id="s")
                assert collector.items.get(timeout=10)[1] is None
                running.stop()
                stopped = True
            finally:
                c.stop_stream()
    finally:
        if not stopped:
            running.stop()
    llm = fake.llm("llm")
    assert llm.requests[-1].aborted.is_set() and llm.shut_down


def _metrics(tideserve) -> str:
    return tideserve.server.metrics.render().decode()


def _sample(text: str, name: str, model: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and f'model_name="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_llm_metrics(client, tideserve):
    client.infer("trt", token_inputs(output_len=3))
    text = _metrics(tideserve)
    assert _sample(text, "tideserve:generation_tokens_total", "trt") >= 3
    assert _sample(text, "tideserve:request_success_total", "trt") >= 1
    assert 'tideserve:time_to_first_token_seconds_count{model_name="trt"' in text
    deadline = time.monotonic() + 5  # engine state comes from the engine's iteration stats (polled)
    while _sample(_metrics(tideserve), "tideserve:kv_cache_usage_perc", "trt") != 0.25:
        assert time.monotonic() < deadline, "the engine's KV-cache usage never reached the metrics"
        time.sleep(0.05)
    assert _sample(_metrics(tideserve), "tideserve:num_requests_waiting", "trt") == 1


# == without TensorRT-LLM ==========================================================================
class _EchoInstance(ModelInstance):
    def execute(self, requests):
        return [InferenceResponse(outputs=[Tensor.from_numpy("OUT", r.inputs["IN"].data)]) for r in requests]


class _EchoModel(Model):
    instance_class = _EchoInstance


class _EchoBackend(Backend):
    model_class = _EchoModel


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is not None,
                    reason="TensorRT-LLM is installed here: the not-installed path cannot be seen")
def test_without_tensorrt_llm_the_model_is_unavailable_and_others_serve(tmp_path):
    (tmp_path / "llm" / "1" / "engine").mkdir(parents=True)
    (tmp_path / "llm" / "config.pbtxt").write_text(_trt_config("llm", {"engine_dir": "engine"}))
    (tmp_path / "echo" / "1").mkdir(parents=True)
    (tmp_path / "echo" / "config.pbtxt").write_text(
        'name: "echo"\nbackend: "echo"\ninput [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        'output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]\n')
    registry = BackendRegistry()  # "tensorrtllm" comes from the package entry point: the real backend
    registry.register("echo", _EchoBackend)
    options = ServerOptions(model_repositories=[tmp_path], grpc_port=free_port(), allow_http=False,
                            allow_metrics=False, strict_readiness=False)
    running = InProcessServer(options, registry)
    try:
        with grpcclient.InferenceServerClient(running.grpc_url) as c:
            index = {m["name"]: m for m in c.get_model_repository_index(as_json=True)["models"]}
            assert index["llm"]["state"] == "UNAVAILABLE"
            assert "TensorRT-LLM is not installed: it needs an NVIDIA GPU" in index["llm"]["reason"]
            assert "pip install tensorrt-llm" in index["llm"]["reason"]
            assert not c.is_model_ready("llm")
            result = c.infer("echo", [_in(grpcclient, "IN", np.array([7], np.int32))])
            assert result.as_numpy("OUT").tolist() == [7]
    finally:
        running.stop()
