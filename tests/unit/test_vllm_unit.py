"""The vllm backend's pieces without an engine: config auto-completion, engine arguments, request
reading, sampling parameters, response building and the pass-through scheduler."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2 as mc

from tideserve.llm_backends.vllm import config as vllm_config
from tideserve.llm_backends.vllm.inputs import parse_inputs
from tideserve.llm_backends.vllm.outputs import ResponseBuilder
from tideserve import config as config_module
from tideserve.backend import ModelContext
from tideserve.errors import InvalidArgument, Unavailable
from tideserve.types import InferenceRequest, RequestedOutput, Tensor



def _config(text: str = 'backend: "vllm"') -> mc.ModelConfig:
    from pathlib import Path

    config = config_module.parse_text(f'name: "llm"\n{text}')
    return config_module.normalize(config, "llm", Path("."))


# -- config -------------------------------------------------------------------------------------
def test_auto_complete_adds_triton_vllm_tensors_and_policy():
    config = _config()
    vllm_config.auto_complete(config)
    config_module.validate(config)
    inputs = {t.name: t for t in config.input}
    assert inputs["text_input"].data_type == mc.TYPE_STRING and list(inputs["text_input"].dims) == [1]
    assert inputs["input_ids"].data_type == mc.TYPE_INT32 and list(inputs["input_ids"].dims) == [-1]
    assert all(t.optional for t in config.input)
    outputs = {t.name: t for t in config.output}
    assert outputs["text_output"].data_type == mc.TYPE_STRING and list(outputs["text_output"].dims) == [-1]
    assert outputs["num_input_tokens"].data_type == mc.TYPE_UINT32
    assert config.model_transaction_policy.decoupled
    assert config.max_batch_size == 0
    assert config.instance_group[0].kind == mc.ModelInstanceGroup.KIND_MODEL


def test_auto_complete_keeps_what_the_config_declares():
    config = _config('backend: "vllm"\ninput [{ name: "text_input" data_type: TYPE_STRING dims: [1] }]\n'
                     'output [{ name: "output_ids" data_type: TYPE_INT64 dims: [-1] }]')
    vllm_config.auto_complete(config)
    assert not next(t for t in config.input if t.name == "text_input").optional
    assert next(t for t in config.output if t.name == "output_ids").data_type == mc.TYPE_INT64
    assert len([t for t in config.input if t.name == "text_input"]) == 1


@pytest.mark.parametrize("text, words", [
    ('backend: "vllm"\nmax_batch_size: 8', "max_batch_size must be 0"),
    ('backend: "vllm"\ninstance_group [{ count: 2 kind: KIND_CPU }]', "one engine"),
])
def test_auto_complete_rejects_batching_and_instances(text, words):
    with pytest.raises(InvalidArgument, match=words):
        vllm_config.auto_complete(_config(text))


def _context(tmp_path, engine_args, parameters: dict | None = None) -> ModelContext:
    (tmp_path / "1").mkdir()
    if engine_args is not None:
        (tmp_path / "1" / "model.json").write_text(json.dumps(engine_args))
    config = _config()
    for key, value in (parameters or {}).items():
        config.parameters[key].string_value = value
    return ModelContext("llm", 1, config, tmp_path)


DEFAULTS = {"model": "facebook/opt-125m", "dtype": "auto", "max_model_len": None, "enforce_eager": False,
            "gpu_memory_utilization": 0.9, "tensor_parallel_size": 1, "hf_overrides": None}


def test_engine_kwargs_read_model_json_and_overrides(tmp_path):
    (tmp_path / "1" / "weights").mkdir(parents=True)
    ctx = ModelContext("llm", 1, _config(), tmp_path)
    (tmp_path / "1" / "model.json").write_text(json.dumps({"model": "weights", "dtype": "float32"}))
    ctx.config.parameters["max_model_len"].string_value = "512"
    ctx.config.parameters["enforce_eager"].string_value = "true"
    ctx.config.parameters["gpu_memory_utilization"].string_value = "0.5"
    ctx.config.parameters["hf_overrides"].string_value = '{"rope_theta": 1000}'
    ctx.config.parameters["REPORT_CUSTOM_METRICS"].string_value = "true"  # not an engine argument: ignored
    kwargs = vllm_config.engine_kwargs(ctx, DEFAULTS)
    assert kwargs == {"model": str((tmp_path / "1" / "weights").resolve()), "dtype": "float32", "max_model_len": 512,
                      "enforce_eager": True, "gpu_memory_utilization": 0.5, "hf_overrides": {"rope_theta": 1000}}


def test_engine_kwargs_paths(tmp_path):
    ctx = _context(tmp_path, {"model": "org/name", "tokenizer": "./tok"})
    kwargs = vllm_config.engine_kwargs(ctx, DEFAULTS)
    assert kwargs["model"] == "org/name"  # not a local directory: a model id
    assert kwargs["tokenizer"] == str((tmp_path / "1" / "tok").resolve())


def test_engine_kwargs_errors(tmp_path):
    with pytest.raises(Unavailable, match="model.json"):
        vllm_config.engine_kwargs(_context(tmp_path, None), DEFAULTS)
    (tmp_path / "1" / "model.json").write_text("{not json")
    with pytest.raises(InvalidArgument, match="failed to parse"):
        vllm_config.engine_kwargs(ModelContext("llm", 1, _config(), tmp_path), DEFAULTS)
    (tmp_path / "1" / "model.json").write_text('{"model": "x"}')
    ctx = ModelContext("llm", 1, _config(), tmp_path)
    ctx.config.parameters["enforce_eager"].string_value = "maybe"
    with pytest.raises(InvalidArgument, match="enforce_eager"):
        vllm_config.engine_kwargs(ctx, DEFAULTS)


@pytest.mark.parametrize("parameters, health_check, report_metrics", [
    ({}, False, True),  # Triton's health-check default; vllm:* on by default (Triton: off)
    ({"ENABLE_VLLM_HEALTH_CHECK": "true", "REPORT_CUSTOM_METRICS": "false"}, True, False),
    ({"ENABLE_VLLM_HEALTH_CHECK": "True", "REPORT_CUSTOM_METRICS": "TRUE"}, True, True),  # any case, as Triton
    ({"ENABLE_VLLM_HEALTH_CHECK": "0", "REPORT_CUSTOM_METRICS": " 0 "}, False, False),
])
def test_backend_options_from_config_parameters(parameters, health_check, report_metrics):
    config = _config()
    for key, value in parameters.items():
        config.parameters[key].string_value = value
    options = vllm_config.backend_options(config)
    assert (options.health_check, options.report_metrics) == (health_check, report_metrics)


@pytest.mark.parametrize("engine_args, parameters, exported", [
    ({}, {}, True),
    ({"disable_log_stats": True}, {"REPORT_CUSTOM_METRICS": "true"}, False),  # Triton's L0_backend_vllm/metrics_test
    ({"disable_log_stats": "true"}, {}, False),
    ({"disable_log_stats": False}, {"REPORT_CUSTOM_METRICS": "false"}, False),
])
def test_disable_log_stats_turns_the_vllm_families_off(tmp_path, engine_args, parameters, exported):
    ctx = _context(tmp_path, {"model": "x", **engine_args}, parameters)
    kwargs = vllm_config.engine_kwargs(ctx, {**DEFAULTS, "disable_log_stats": False})
    options = vllm_config.backend_options(ctx.config)
    assert vllm_config.exports_engine_families(options, kwargs) is exported


@pytest.mark.parametrize("key", ["ENABLE_VLLM_HEALTH_CHECK", "REPORT_CUSTOM_METRICS"])
def test_backend_options_refuse_values_that_are_not_booleans(key):
    config = _config()
    config.parameters[key].string_value = "yes"
    with pytest.raises(InvalidArgument, match=f"'{key}' must be \"true\" or \"false\", got 'yes'"):
        vllm_config.backend_options(config)


# -- request reading ----------------------------------------------------------------------------
def _request(parameters=None, outputs=None, **inputs) -> InferenceRequest:
    tensors = {}
    for name, value in inputs.items():
        if isinstance(value, str):
            tensors[name] = Tensor.from_numpy(name, np.array([value.encode()], dtype=np.object_))
        else:
            tensors[name] = Tensor.from_numpy(name, np.asarray(value))
    return InferenceRequest("llm", tensors, parameters=parameters or {},
                            outputs=[RequestedOutput(o) for o in outputs or []])


def test_parse_inputs_follows_triton_prepend_rules():
    plain = parse_inputs(_request(text_input="hi"))
    assert plain.prompt == "hi" and not plain.stream and plain.prepend_input
    assert plain.outputs == {"text_output"}
    streamed = parse_inputs(_request(text_input="hi", stream=[True]))
    assert streamed.stream and not streamed.prepend_input
    excluded = parse_inputs(_request(text_input="hi", exclude_input_in_output=[True]))
    assert not excluded.prepend_input
    with pytest.raises(InvalidArgument) as info:
        parse_inputs(_request(text_input="hi", stream=[True], exclude_input_in_output=[False]))
    # Triton's vLLM backend's text
    assert info.value.message == ("Error generating stream: When streaming, `exclude_input_in_output` = False "
                                  "is not allowed.")
    tokens = parse_inputs(_request(input_ids=np.array([3, 4, 5], dtype=np.int64)))
    assert tokens.prompt == [3, 4, 5] and not tokens.prepend_input and tokens.outputs == {"output_ids"}


def test_parse_inputs_flags_and_sampling_sources():
    request = _request(parameters={"stream": True, "max_tokens": 4, "return_finish_reason": True,
                                   "sequence_id": 0, "temperature": 0.5},
                       outputs=["num_output_tokens"], text_input="hi",
                       sampling_parameters=json.dumps({"temperature": 0}), return_logprobs=[True])
    inputs = parse_inputs(request)
    assert inputs.stream
    assert inputs.sampling == {"max_tokens": 4, "temperature": 0}  # the tensor wins
    # num_output_tokens is asked for as an output but its flag is not set: as with Triton's vLLM backend, no tensor
    assert inputs.outputs == {"text_output", "finish_reason", "logprobs"}


def test_asking_for_every_output_gives_the_flagged_ones_only():
    """perf_analyzer / genai-perf ask for every output the model declares (cumulative_logprob would be NaN)."""
    every = ["text_output", "output_ids", "finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens",
             "num_output_tokens"]
    assert parse_inputs(_request(text_input="hi", outputs=every)).outputs == {"text_output", "output_ids"}
    flagged = parse_inputs(_request(text_input="hi", outputs=every, return_num_output_tokens=[True]))
    assert flagged.outputs == {"text_output", "output_ids", "num_output_tokens"}


@pytest.mark.parametrize("request_, words", [
    (lambda: _request(), "exactly one"),
    (lambda: _request(text_input="a", input_ids=np.array([1], dtype=np.int32)), "exactly one"),
    (lambda: _request(input_ids=np.array([], dtype=np.int32)), "empty"),
    (lambda: _request(text_input="a", sampling_parameters="[1, 2]"), "JSON object"),
    (lambda: _request(text_input="a", sampling_parameters="{oops"), "not valid JSON"),
    (lambda: _request(text_input="a", parameters={"stream": 3}), "'stream'"),
])
def test_parse_inputs_errors(request_, words):
    with pytest.raises(InvalidArgument, match=words):
        parse_inputs(request_())


# -- responses ----------------------------------------------------------------------------------
def _output(texts, ids, finished=False, reasons=None, prompt="Hi", prompt_ids=(7, 8)):
    outs = [SimpleNamespace(index=i, text=t, token_ids=list(ids[i]), logprobs=None, cumulative_logprob=None,
                            finish_reason=(reasons or [None] * len(texts))[i]) for i, t in enumerate(texts)]
    return SimpleNamespace(outputs=outs, finished=finished, prompt=prompt, prompt_token_ids=list(prompt_ids))


def test_response_builder_streams_deltas_and_accumulates():
    inputs = parse_inputs(_request(text_input="Hi", return_num_output_tokens=[True], return_finish_reason=[True],
                                   return_num_input_tokens=[True], return_cumulative_logprob=[True]))
    builder = ResponseBuilder(inputs, 1, {})
    first = builder.delta(_output([" a"], [[1]]))
    assert first.output("text_output").data.tolist() == [b" a"]
    assert first.output("finish_reason").data.tolist() == [b"None"]
    assert first.output("num_input_tokens").data.tolist() == [2]
    assert np.isnan(first.output("cumulative_logprob").data[0])

    builder = ResponseBuilder(inputs, 1, {})
    builder.add(_output([" a"], [[1]]))
    builder.add(_output([" b c"], [[2, 3]], finished=True, reasons=["length"]))
    whole = builder.whole()
    assert whole.output("text_output").data.tolist() == [b"Hi a b c"]  # the prompt, then the text
    assert whole.output("num_output_tokens").data.tolist() == [3]
    assert whole.output("finish_reason").data.tolist() == [b"length"]


def test_response_builder_n_completions_and_token_ids():
    inputs = parse_inputs(_request(text_input="Hi", exclude_input_in_output=[True]))
    builder = ResponseBuilder(inputs, 2, {})
    step = SimpleNamespace(outputs=[_output(["x"], [[1]]).outputs[0]], finished=False, prompt="Hi",
                           prompt_token_ids=[7])
    step.outputs[0].index = 1  # only the second completion moved this step
    assert builder.delta(step).output("text_output").data.tolist() == [b"", b"x"]

    inputs = parse_inputs(_request(input_ids=np.array([7, 8], dtype=np.int32), exclude_input_in_output=[False]))
    builder = ResponseBuilder(inputs, 1, {"output_ids": np.dtype(np.int64)})
    builder.add(_output(["a"], [[1, 2]], prompt=None))
    tensor = builder.whole().output("output_ids")
    assert tensor.datatype == "INT64" and tensor.data.tolist() == [7, 8, 1, 2]
    with pytest.raises(InvalidArgument, match="n = 1"):
        ResponseBuilder(inputs, 2, {})



def test_response_builder_prompt_logprobs_once():
    """``prompt_logprobs``: vLLM's list (None first) as JSON, the first token named with a null logprob; a
    stream carries it once, with the first response that has it."""
    lp = SimpleNamespace(logprob=-1.5, rank=3, decoded_token=" b")
    top = SimpleNamespace(logprob=-0.5, rank=1, decoded_token=" c")
    inputs = parse_inputs(_request(text_input="Hi", stream=[True], return_prompt_logprobs=[True]))
    assert "prompt_logprobs" in inputs.outputs
    builder = ResponseBuilder(inputs, 1, {}, decode=lambda token: f"<{token}>")
    first = _output([" a"], [[1]], prompt_ids=(7, 8))
    first.prompt_logprobs = [None, {8: lp, 9: top}]
    entries = json.loads(builder.delta(first).output("prompt_logprobs").data[0])
    assert entries == [{"7": {"logprob": None, "rank": None, "decoded_token": "<7>"}},
                       {"8": {"logprob": -1.5, "rank": 3, "decoded_token": " b"},
                        "9": {"logprob": -0.5, "rank": 1, "decoded_token": " c"}}]
    assert builder.delta(_output([" x"], [[2]])).output("prompt_logprobs") is None
    whole = ResponseBuilder(parse_inputs(_request(text_input="Hi", return_prompt_logprobs=[True])), 1, {})
    whole.add(_output([" a"], [[1]]))  # no prompt_logprobs asked of the engine: null
    assert whole.whole().output("prompt_logprobs").data.tolist() == [b"null"]

# -- sampling parameters ------------------------------------------------------------------------
def test_sampling_parameters_convert_and_name_bad_fields():
    from vllm.sampling_params import RequestOutputKind

    from tideserve.llm_backends.vllm.generation import make_sampling_params

    params = make_sampling_params({"temperature": "0.5", "max_tokens": "7", "stop": "END", "ignore_eos": "true"})
    assert (params.temperature, params.max_tokens, params.stop, params.ignore_eos) == (0.5, 7, ["END"], True)
    assert params.output_kind == RequestOutputKind.DELTA
    for raw, field in [({"temperature": -1}, "temperature"), ({"max_tokens": 0}, "max_tokens"),
                       ({"max_tokens": 2.5}, "max_tokens"), ({"bogus": 1}, "bogus"), ({"min_p": 3}, "min_p"),
                       ({"output_kind": 2}, "output_kind"), ({"lora_name": "x"}, "lora_name"),
                       ({"_eos_token_id": 1}, "_eos_token_id")]:
        with pytest.raises(InvalidArgument, match=f"'{field}'"):
            make_sampling_params(raw)


def test_max_tokens_beyond_the_context_window_is_cut_to_it():
    """Triton's tensor interface: no error (the engine stops at the context length), no huge value to the core."""
    from tideserve.llm_backends.vllm.generation import fit_to_context, make_sampling_params

    for raw, expected in [(512, 512), (100, 100), (2**64, 512), (None, None)]:
        params = make_sampling_params({"max_tokens": raw})
        fit_to_context(params, 512)
        assert params.max_tokens == expected


# -- the scheduler ------------------------------------------------------------------------------
async def test_pass_through_scheduler_runs_requests_concurrently():
    from tideserve.schedulers import PassThroughScheduler

    started, release = [], asyncio.Event()

    class Runtime:
        slots = ("slot",)
        model = None
        config = mc.ModelConfig()

        async def execute(self, slot, requests):
            started.extend(requests)
            await release.wait()

    scheduler = PassThroughScheduler(Runtime())
    await scheduler.start()
    requests = [_request(text_input="x") for _ in range(5)]
    for request in requests:
        scheduler.enqueue(request)
    await asyncio.sleep(0.01)
    assert started == requests  # all running at once, none waiting for another
    release.set()
    await scheduler.stop()


# -- tokenizing ---------------------------------------------------------------------------------
async def test_prompts_arriving_together_are_tokenized_in_one_hand_off():
    """A burst of prompts crosses to the renderer's thread in a few hand-offs, not one each; each prompt gets its
    own engine input, and a prompt that fails fails alone (issue 21: the first tokens of a 128-stream burst)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from tideserve.llm_backends.vllm.generation import _Tokenizing

    calls, threads = [], set()

    hand_offs = []

    class Counting(ThreadPoolExecutor):
        def submit(self, fn, batch, *args):
            hand_offs.append(len(batch))
            return super().submit(fn, batch, *args)

    class Renderer:
        _executor = Counting(1)

        def render_cmpl(self, prompts, tok_params):
            threads.add(threading.get_ident())
            calls.append(prompts[0])
            if prompts[0] == "bad":
                raise ValueError("too long")
            return [{"type": "token", "prompt_token_ids": [len(prompts[0])], "params": tok_params}]

    renderer = Renderer()
    tokenizing = _Tokenizing(renderer)
    prompts = [f"prompt {i}" for i in range(50)] + ["bad"]
    results = await asyncio.gather(*(tokenizing.render(p, "params") for p in prompts), return_exceptions=True)
    assert [r["prompt_token_ids"] for r in results[:50]] == [[len(p)] for p in prompts[:50]]
    assert isinstance(results[50], ValueError) and str(results[50]) == "too long"
    assert sum(hand_offs) == 51 and len(hand_offs) <= 2  # one hand-off for the burst (two at most)
    assert threads and threading.get_ident() not in threads  # never on the loop's thread
    # one at a time afterwards: each in its own hand-off, promptly
    assert (await tokenizing.render("alone", None))["prompt_token_ids"] == [5]
    assert hand_offs[-1] == 1
    tokenizing.close()
    Renderer._executor.shutdown()


async def test_a_cancelled_prompt_does_not_stop_the_others():
    from tideserve.llm_backends.vllm.generation import _Tokenizing

    class Renderer:  # no executor of its own: the tokenizing makes one
        def render_cmpl(self, prompts, tok_params):
            return [prompts[0].upper()]

    tokenizing = _Tokenizing(Renderer())
    first = asyncio.ensure_future(tokenizing.render("a", None))
    second = asyncio.ensure_future(tokenizing.render("b", None))
    await asyncio.sleep(0)
    first.cancel()
    assert await second == "B"
    assert first.cancelled()
    assert await tokenizing.render("c", None) == "C"
    tokenizing.close()


async def test_prompts_fail_rather_than_hang_when_the_tokenizer_thread_is_gone():
    from concurrent.futures import ThreadPoolExecutor

    from tideserve.llm_backends.vllm.generation import _Tokenizing

    class Renderer:
        _executor = ThreadPoolExecutor(1)

        def render_cmpl(self, prompts, tok_params):
            return [prompts[0]]

    Renderer._executor.shutdown()
    tokenizing = _Tokenizing(Renderer())
    results = await asyncio.wait_for(asyncio.gather(*(tokenizing.render(p, None) for p in "ab"),
                                                    return_exceptions=True), 5)
    assert all(isinstance(r, RuntimeError) for r in results)


# -- a streamed request's steps without vLLM's per-step output objects ---------------------------------------------
class _Detokenizer:
    """vLLM's incremental detokenizer as a request's state reads it for an output: the text not handed out yet."""

    def __init__(self) -> None:
        self.output_text = ""
        self._offset = 0

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        text, self._offset = self.output_text[self._offset:], len(self.output_text)
        return text

    def num_output_tokens(self) -> int:  # (read by the finishing step)
        return 0


class _Logprobs:
    """vLLM's logprobs processor as a request's state reads it for an output."""

    def __init__(self) -> None:
        self.logprobs: list | None = []
        self.cumulative_logprob: float | None = 0.0
        self.prompt_logprobs: list | None = [None, {8: -1.0}]
        self.prompt_token_id_logprobs = None

    def pop_prompt_logprobs(self):
        found = self.prompt_logprobs
        if found:
            self.prompt_logprobs = []
        return found

    def pop_prompt_token_id_logprobs(self):
        found, self.prompt_token_id_logprobs = self.prompt_token_id_logprobs, None
        return found


def _request_state(logprobs: bool):
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.output_processor import RequestState

    processor = _Logprobs()
    if not logprobs:
        processor.logprobs = None
    return RequestState("r-1", "llm-1", None, 0, None, RequestOutputKind.DELTA, "Hi", [7, 8], None, processor,
                        _Detokenizer(), 16, 0.0, None, False, 1)


@pytest.mark.parametrize("logprobs", [True, False])
def test_step_outputs_read_what_vllms_request_output_holds(logprobs):
    """A streamed typed request's unfinished steps reach its sink without vLLM's ``RequestOutput``: each step reads
    as the one vLLM's ``make_request_output`` makes from the same state (text, tokens, log probabilities, the
    prompt's log probabilities once); the finishing step is vLLM's own output, after which the state's method is
    vLLM's again."""
    from tideserve.llm_backends.vllm import generation

    assert generation._STEP_OUTPUTS  # this vLLM's make_request_output takes the arguments the stand-in takes
    theirs, ours = _request_state(logprobs), _request_state(logprobs)
    seen: list[dict] = []

    def fields(output) -> dict:
        (completion,) = output.outputs
        return {"request_id": output.request_id, "prompt": output.prompt, "prompt_ids": output.prompt_token_ids,
                "prompt_logprobs": output.prompt_logprobs, "finished": output.finished,
                "cached": output.num_cached_tokens, "metrics": output.metrics, "index": completion.index,
                "text": completion.text, "token_ids": list(completion.token_ids), "logprobs": completion.logprobs,
                "cumulative": completion.cumulative_logprob, "finish_reason": completion.finish_reason}

    sink = SimpleNamespace(put=lambda output: seen.append(fields(output)))
    generation._StepOutputs.install(ours, sink)
    assert "make_request_output" in vars(ours)
    steps = [(" a", [5]), (" b c", [6, 7]), ("", [])]
    for text, tokens in steps:
        for state in (theirs, ours):
            state.detokenizer.output_text += text
            if state.logprobs_processor.logprobs is not None:
                state.logprobs_processor.logprobs.extend({token: -0.5} for token in tokens)
                state.logprobs_processor.cumulative_logprob -= 0.5 * len(tokens)
        expected = fields(theirs.make_request_output(list(tokens), None, None, None))
        assert ours.make_request_output(list(tokens), None, None, None) is None  # (handed to the sink)
        assert seen.pop() == expected
    last = ours.make_request_output([9], None, "length", None)
    assert last.finished and last.outputs[0].finish_reason == "length" and last.outputs[0].token_ids == [9]
    assert "make_request_output" not in vars(ours) and not seen
