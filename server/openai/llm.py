"""The LLM models the OpenAI frontend serves, and how a generation is asked of one through the DataPlane.

A model is served on ``/v1`` when its config has a ``text_input`` (BYTES) input and a ``text_output``
(BYTES) output: the vLLM and TensorRT-LLM backends, and any ensemble or Python model with that
interface. What else it declares decides what a request may ask for:

* ``sampling_parameters`` (a JSON object of vLLM ``SamplingParams`` names): every sampling field, ``n``;
  otherwise sampling fields go to inputs of the same (or Triton's TensorRT-LLM) name, and a field the
  model has no input for is a 400 naming it;
* ``stream`` (BOOL): deltas as the engine makes them (otherwise the model's responses are taken as
  successive pieces of the text);
* ``exclude_input_in_output``: always set true (the frontend adds the prompt itself for ``echo``);
* ``return_finish_reason`` / ``return_num_input_tokens`` / ``return_num_output_tokens`` /
  ``return_logprobs`` with their outputs: finish reasons, usage and log probabilities; without them
  usage is counted with the tokenizer files when there are any, and logprobs are a 400;
* ``return_prompt_logprobs`` with ``prompt_logprobs`` (and ``sampling_parameters``): the prompt's log
  probabilities, for ``echo`` with ``logprobs`` (otherwise that is a 400);
* config parameters ``tool_call_parser`` / ``reasoning_parser`` (else the server's ``--tool-call-parser`` /
  ``--reasoning-parser``): tool calls with ``tool_choice: "auto"`` and reasoning parsed from the output
  text (:mod:`tideserve.tool_parsers`, :mod:`tideserve.reasoning_parsers`);
* what its backend tells of its engine (``ServedModel.engine``, :class:`tideserve.generation.EngineInfo`; the
  vLLM backend's): typed requests (a :class:`~tideserve.generation.GenerationRequest`, no tensors; its
  answers are :class:`~tideserve.generation.GenerationDelta` s), structured outputs (``response_format``, named
  tools; also through an ensemble whose ``sampling_parameters`` go to such an engine), token-id prompts,
  prompts rendered from a chat template tokenized without special tokens, the context length and the
  tokenizer files. The frontend reads no engine's files.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import logging
import math
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from tritonclient.grpc import model_config_pb2 as mc

from ..datatypes import config_to_datatype, numpy_dtype
from ..errors import InvalidArgument, NotFound, ServerError, Unavailable
from ..generation import EngineInfo, GenerationDelta, GenerationRequest
from ..types import InferenceRequest, InferenceResponse, RequestedOutput, Tensor
from ..validation import conform_shape
from . import chat_template
from .errors import BadRequest, ModelNotFound, OpenAIError

log = logging.getLogger(__name__)

TEXT_INPUT, TEXT_OUTPUT = "text_input", "text_output"
# output -> the BOOL input that asks for it
_FLAGS = {"finish_reason": "return_finish_reason", "num_input_tokens": "return_num_input_tokens",
          "num_output_tokens": "return_num_output_tokens", "logprobs": "return_logprobs",
          "prompt_logprobs": "return_prompt_logprobs"}
# sampling field -> input names that take it, for models without a sampling_parameters input
_KNOBS = {
    "max_tokens": ("max_tokens", "request_output_len"),
    "temperature": ("temperature",),
    "top_p": ("top_p", "runtime_top_p"),
    "top_k": ("top_k", "runtime_top_k"),
    "seed": ("seed", "random_seed"),
    "presence_penalty": ("presence_penalty",),
    "frequency_penalty": ("frequency_penalty",),
    "repetition_penalty": ("repetition_penalty",),
    "min_tokens": ("min_tokens", "min_length"),
    "stop": ("stop", "stop_words"),
}


@dataclass(eq=False)
class LLMModel:
    """One loaded model version as the OpenAI frontend sees it (built once per version)."""

    name: str
    backend: str
    batched: bool
    structured: bool                 # what reads sampling_parameters (its engine, an ensemble step's) constrains
    input_types: dict[str, str]      # input name -> datatype
    outputs: frozenset[str]
    template: chat_template.ChatTemplate | None
    tokenizer_dir: Path | None
    _tokenizer: Any = field(default=None, repr=False)
    tool_call_parser: str | None = None  # a name in tideserve.tool_parsers.TOOL_PARSERS
    reasoning_parser: str | None = None  # a name in tideserve.reasoning_parsers.REASONING_PARSERS
    base: str | None = None  # set when ``name`` is a LoRA adapter: the model that serves it (vLLM's parent)
    max_model_len: int | None = None  # the context length, where the config or the model files say it
    input_dims: dict[str, tuple[int, ...]] = field(default_factory=dict)  # input name -> its declared dims
    typed: bool = False  # the model takes typed generation requests (tideserve.generation) instead of tensors
    token_ids: bool = False  # its engine takes token-id prompts

    @property
    def sampling_json(self) -> bool:
        return "sampling_parameters" in self.input_types

    @property
    def structured_outputs(self) -> bool:
        return self.structured and (self.typed or self.sampling_json)

    @property
    def token_prompts(self) -> bool:
        return self.typed and self.token_ids

    @property
    def logprobs(self) -> bool:
        return "return_logprobs" in self.input_types and "logprobs" in self.outputs

    @property
    def prompt_logprobs(self) -> bool:
        return self.sampling_json and self.has_flag("prompt_logprobs")

    def has_flag(self, output: str) -> bool:
        return _FLAGS[output] in self.input_types and output in self.outputs

    # -- requests -------------------------------------------------------------------------
    def start(self, dataplane, prompt: str | list[int], sampling: dict[str, Any], *, stream: bool, logprobs: bool,
              add_special_tokens: bool = True, request_id: str = "", prompt_logprobs: bool = False, priority: int = 0,
              cached_tokens: bool = False, timeout_us: int = 0, received_ns: int = 0):
        """Start the request of one prompt: its stream from the DataPlane, of typed deltas (``generate``, a model
        whose engine takes typed requests) or of responses (``infer``); raises BadRequest for what the model cannot
        take, the DataPlane's refusal. ``priority`` is its scheduling priority; ``timeout_us`` its deadline
        (``x-request-timeout-ms``: an LLM refuses it when it has not started generating by then, counted from
        ``received_ns``, when the server began to read it); ``cached_tokens`` asks a vLLM model for its
        prefix-cache hits (``usage.prompt_tokens_details``)."""
        if prompt_logprobs and not self.prompt_logprobs:
            raise BadRequest(f"model '{self.name}' does not return the prompt's log probabilities, which 'echo' with "
                             "'logprobs' needs (a vLLM model has them)", "echo")
        if logprobs and not self.logprobs:
            raise BadRequest(f"model '{self.name}' does not return log probabilities", "logprobs")
        max_tokens = sampling.get("max_tokens")
        if self.max_model_len is not None and isinstance(max_tokens, int) and max_tokens > self.max_model_len:
            # vLLM's OpenAI server refuses it (the engine, and Triton's tensor interface, stop at the context)
            raise InvalidArgument(f"invalid sampling parameter 'max_tokens': This model's maximum context length "
                                  f"is {self.max_model_len} tokens. However, you requested {max_tokens} output "
                                  f"tokens ('max_tokens' cannot be greater than max_model_len={self.max_model_len})."
                                  " Please request fewer output tokens.")
        if self.typed:
            generation = GenerationRequest(prompt, sampling, stream, add_special_tokens,
                                           self.name if self.base else None, logprobs, prompt_logprobs,
                                           cached_tokens)
            return dataplane.generate(self.base or self.name, generation, id=request_id, priority=priority,
                                      timeout_us=timeout_us, arrival_ns=received_ns if timeout_us else 0)
        inputs: dict[str, Tensor] = {}
        outputs = None
        if isinstance(prompt, str):
            inputs[TEXT_INPUT] = self._bytes(TEXT_INPUT, prompt.encode("utf-8"))
        else:
            if not self.token_prompts:
                raise BadRequest(f"model '{self.name}' takes text prompts only (token-id prompts need a vLLM "
                                 "model)", "prompt")
            inputs["input_ids"] = self._array("input_ids", prompt)
            outputs = [TEXT_OUTPUT]  # text, not the token interface's output_ids
        types = self.input_types
        if "stream" in types:
            inputs["stream"] = self._array("stream", [stream])
        if "exclude_input_in_output" in types:
            inputs["exclude_input_in_output"] = self._array("exclude_input_in_output", [True])
        asked = {"logprobs": logprobs, "prompt_logprobs": prompt_logprobs}
        for output, flag in _FLAGS.items():
            if asked.get(output, True) and self.has_flag(output):
                inputs[flag] = self._array(flag, [True])
                if outputs is not None:
                    outputs.append(output)
        if self.sampling_json:
            inputs["sampling_parameters"] = self._bytes("sampling_parameters", orjson.dumps(sampling))
        else:
            self._sampling_inputs(sampling, inputs)
        parameters: dict[str, Any] = {"lora_name": self.name} if self.base else {}  # as Triton's vLLM backend
        request = InferenceRequest(self.base or self.name, inputs, id=request_id, parameters=parameters,
                                   outputs=[RequestedOutput(o) for o in outputs] if outputs else None,
                                   priority=priority, timeout_us=timeout_us)
        request.streaming = stream
        if timeout_us and 0 < received_ns < request.arrival_ns:
            request.arrival_ns = received_ns
        return dataplane.infer(request)

    def _sampling_inputs(self, sampling: dict[str, Any], inputs: dict[str, Tensor]) -> None:
        for key, value in sampling.items():
            if value is None or (key == "n" and value == 1):
                continue
            name = next((n for n in _KNOBS.get(key, ()) if n in self.input_types), None)
            if name is None and key == "max_tokens":
                continue  # always set (16 by default): a model without a length input decides the length itself
            if name is None:
                raise BadRequest(f"model '{self.name}' does not take '{key}' (it has no sampling_parameters input "
                                 f"and no input for it)", key)
            if isinstance(value, str):
                value = [value]
            inputs[name] = (self._bytes(name, *[v.encode("utf-8") for v in value])
                            if self.input_types[name] == "BYTES" else self._array(name, np.ravel(value)))

    def _bytes(self, name: str, *values: bytes) -> Tensor:
        data = np.empty(len(values), dtype=np.object_)
        data[:] = values
        return self._shaped(name, "BYTES", data)

    def _array(self, name: str, values) -> Tensor:
        datatype = self.input_types[name]
        try:
            data = np.asarray(values, dtype=numpy_dtype(datatype))
        except (OverflowError, ValueError, TypeError) as exc:
            raise BadRequest(f"a value does not fit input '{name}' ({datatype}) of model '{self.name}': {exc}")
        return self._shaped(name, datatype, data)

    def _shaped(self, name: str, datatype: str, values: np.ndarray) -> Tensor:
        """``values`` as a batch of one ([1, n]) shaped to the input's declared dims by the rule tensors follow
        from model to model: [n] for a model that does not batch and declares [n] or [-1] (a vLLM model), [1, n]
        for a batching model or one that declares [1, n] (TensorRT-LLM style, Triton's ``mock_llm``)."""
        data = values.reshape(1, -1)
        shape = conform_shape(data.shape, self.input_dims.get(name, ()), self.batched, 1)
        if shape != data.shape:
            data = data.reshape(shape)
        return Tensor(name, datatype, data.shape, data)

    # -- tokens ---------------------------------------------------------------------------
    def tokenizer(self):
        """The ``tokenizers`` tokenizer of the model's ``tokenizer.json`` (None when there is none)."""
        if self._tokenizer is None:
            self._tokenizer = False
            path = self.tokenizer_dir / "tokenizer.json" if self.tokenizer_dir is not None else None
            if path is not None and path.is_file():
                try:
                    from tokenizers import Tokenizer

                    self._tokenizer = Tokenizer.from_file(str(path))
                except Exception as exc:  # an optional extra: usage counts fall back to 0
                    log.warning("model '%s': cannot load '%s': %s", self.name, path, exc)
        return self._tokenizer or None

    def count_tokens(self, text: str) -> int:
        tokenizer = self.tokenizer()
        return len(tokenizer.encode(text, add_special_tokens=False).ids) if tokenizer is not None and text else 0

    def decode(self, ids: list[int]) -> str:
        tokenizer = self.tokenizer()
        if tokenizer is None:
            raise BadRequest(f"echo of a token-id prompt needs the tokenizer files of model '{self.name}'", "echo")
        return tokenizer.decode(ids, skip_special_tokens=False)


@dataclass(frozen=True)
class OutputParsers:
    """The server's default output parsers (``--tool-call-parser``, ``--reasoning-parser``), for models whose
    config sets no parameter ``tool_call_parser`` / ``reasoning_parser`` (an empty value there: none)."""

    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        check_parser_names(self.tool_call_parser, self.reasoning_parser, "--tool-call-parser", "--reasoning-parser")

    def of(self, config) -> tuple[str | None, str | None]:
        """A model's parsers: its config parameters, else these defaults."""
        params = config.parameters
        tool_call = params["tool_call_parser"].string_value or None if "tool_call_parser" in params \
            else self.tool_call_parser
        reasoning = params["reasoning_parser"].string_value or None if "reasoning_parser" in params \
            else self.reasoning_parser
        return tool_call, reasoning


def check_parser_names(tool_call: str | None, reasoning: str | None, tool_field: str, reasoning_field: str) -> None:
    """ValueError naming the field of an unknown parser name and the known ones."""
    from ..reasoning_parsers import REASONING_PARSERS
    from ..tool_parsers import TOOL_PARSERS

    for field_name, value, known in ((tool_field, tool_call, TOOL_PARSERS),
                                     (reasoning_field, reasoning, REASONING_PARSERS)):
        if value and value not in known:
            raise ValueError(f"{field_name}: unknown parser '{value}' (known: {', '.join(known)})")


def describe(runtime, lookup, parsers: OutputParsers | None = None) -> LLMModel | None:
    """``runtime``'s LLMModel, or None when it is no text-generation model."""
    config = runtime.config
    input_types = {t.name: config_to_datatype(mc.DataType.Name(t.data_type)) for t in config.input}
    outputs = {t.name: config_to_datatype(mc.DataType.Name(t.data_type)) for t in config.output}
    if input_types.get(TEXT_INPUT) != "BYTES" or outputs.get(TEXT_OUTPUT) != "BYTES":
        return None
    try:
        template = chat_template.load_template(runtime, lookup)
    except Exception as exc:  # a template that does not compile: chat requests say so
        log.warning("model '%s': its chat template is unusable: %s", runtime.name, exc)
        template = None
    directory = chat_template.tokenizer_dir(runtime, lookup)
    tool_call_parser, reasoning_parser = (parsers or OutputParsers()).of(config)
    engine = runtime.engine
    sampler = _sampling_engine(runtime, lookup)
    return LLMModel(runtime.name, config.backend, config.max_batch_size > 0,
                    sampler is not None and sampler.structured_outputs,
                    input_types, frozenset(outputs), template, directory,
                    max_model_len=_context_length(runtime, engine or sampler, directory),
                    tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser,
                    input_dims={t.name: tuple(t.dims) for t in config.input},
                    typed=engine is not None and engine.typed_requests,
                    token_ids=engine is not None and engine.token_prompts)


def _context_length(runtime, engine: EngineInfo | None, directory: Path | None) -> int | None:
    """The model's context length: the ``max_model_len`` config parameter, else its engine's (an ensemble's: the
    engine its sampling parameters go to), else the ``max_position_embeddings`` of the model files'
    ``config.json``."""
    config = runtime.config
    values: list[Any] = []
    if "max_model_len" in config.parameters:
        values.append(config.parameters["max_model_len"].string_value)
    if engine is not None:
        values.append(engine.max_model_len)
    if directory is not None:
        values.append(_json_file(directory / "config.json").get("max_position_embeddings"))
    for value in values:
        try:
            length = int(value)
        except (TypeError, ValueError):
            continue
        if length > 0:
            return length
    return None


def _json_file(path: Path) -> dict:
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _sampling_engine(runtime, lookup) -> EngineInfo | None:
    """The engine that reads ``runtime``'s sampling parameters: its own, or for an ensemble the engine of the step
    its ``sampling_parameters`` input goes to."""
    config = runtime.config
    if not config.HasField("ensemble_scheduling"):
        return runtime.engine
    for step in config.ensemble_scheduling.step:
        if "sampling_parameters" in step.input_map.values():
            try:
                return lookup(step.model_name).engine
            except ServerError:
                return None
    return None


class Catalog:
    """Finds the LLM models among the DataPlane's ready models (one LLMModel per loaded version)."""

    def __init__(self, dataplane, parsers: OutputParsers | None = None) -> None:
        self.dataplane = dataplane
        self.parsers = parsers or OutputParsers()
        self._known: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._adapters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # base LLMModel -> {name: LLMModel}
        # model name -> its LLMModel, found once and kept until the repository changes (a request then looks
        # nothing up); only in the core process, whose repository says when it changes
        self._by_name: dict[str, LLMModel] = {}
        listeners = getattr(getattr(dataplane, "repository", None), "listeners", None)
        self._keep = isinstance(listeners, list)
        if self._keep:
            listeners.append(self._by_name.clear)

    def _describe(self, runtime) -> LLMModel | None:
        found = self._known.get(runtime)
        if found is None:
            found = describe(runtime, self.dataplane.model, self.parsers) or False
            self._known[runtime] = found
        return found or None

    def get(self, name: str) -> LLMModel:
        found = self._by_name.get(name)
        if found is not None:
            return found
        try:
            runtime = served_runtime(self.dataplane, name)
        except NotFound:
            adapter = self.adapter(name)
            if adapter is None:
                raise ModelNotFound(name) from None
            return self._adapter_model(self.get(adapter["model"]), name)
        llm = self._describe(runtime)
        if llm is None:
            raise ModelNotFound(name, "It is not a text-generation model (text_input -> text_output).")
        if self._keep and not runtime.steps:  # (an ensemble's readiness follows its steps': looked up each time)
            self._by_name[name] = llm
        return llm

    def _adapter_model(self, base: LLMModel, name: str) -> LLMModel:
        """``base`` as LoRA adapter ``name`` serves it (one per base and adapter: its tokenizer loads once)."""
        known = self._adapters.setdefault(base, {})
        if name not in known:
            known[name] = dataclasses.replace(base, name=name, base=base.name)
        return known[name]

    def adapter(self, name: str) -> dict[str, str] | None:
        """The LoRA adapter ``name`` (``{"name", "path", "model"}``), if a ready model serves one."""
        return next((a for a in self.dataplane.adapters() if a["name"] == name), None)

    def ready(self) -> list[LLMModel]:
        return ready_models(self.dataplane, self._describe, LLMModel)

    def default(self) -> LLMModel:
        """The model a request without ``model`` goes to: the only LLM model served."""
        ready = self.ready()
        if len(ready) != 1:
            raise BadRequest("the request names no 'model' and the server serves "
                             f"{'no' if not ready else len(ready)} text-generation models", "model")
        return ready[0]


def served_runtime(dataplane, name: str):
    """The runtime serving model ``name`` for a /v1 request: NotFound as it is (callers answer it), the other
    lookup errors in OpenAI's shape."""
    try:
        return dataplane.model(name)
    except Unavailable as exc:
        raise OpenAIError(f"The model `{name}` is not ready: {exc.message}", 503, "model") from None
    except InvalidArgument as exc:
        raise BadRequest(exc.message, "model") from None


def ready_models(dataplane, describe, kind: type) -> list:
    """The ready models (one per name) that ``describe`` makes a ``kind`` of (a catalog's view)."""
    found = []
    for row in dataplane.repository_index(ready_only=True):
        name = row["name"]
        if any(m.name == name for m in found):
            continue
        try:
            model = describe(dataplane.model(name))
        except ServerError:
            continue
        if isinstance(model, kind):
            found.append(model)
    return found


# -- responses ---------------------------------------------------------------------------------
# What one response added, per choice: a typed model's answer as it comes, a tensor model's read into the same
# shape (``tokens`` None: the model does not say how many).
Step = GenerationDelta


class StepReader:
    """Turns one request's responses into Steps (a UTF-8 character split across responses is kept whole)."""

    __slots__ = ("_decoders", "llm", "n")

    def __init__(self, llm: LLMModel, n: int) -> None:
        self.llm = llm
        self.n = n
        self._decoders: list | None = None

    def read(self, response: InferenceResponse) -> Step:
        if response.generation is not None:
            return response.generation
        n = self.n
        texts = [""] * n
        finish: list[str | None] = [None] * n
        tokens = prompt_tokens = logprobs = prompt_logprobs = None
        for tensor in response.outputs:
            name = tensor.name
            if name == TEXT_OUTPUT:
                values = tensor.data.reshape(-1)
                for i in range(min(n, values.size)):
                    texts[i] = self._text(i, values[i])
            elif name == "finish_reason":
                values = tensor.data.reshape(-1)
                for i in range(min(n, values.size)):
                    value = _str(values[i])
                    finish[i] = None if value in ("None", "") else value
            elif name == "num_output_tokens":
                tokens = [int(v) for v in tensor.data.reshape(-1)[:n]]
            elif name == "num_input_tokens":
                prompt_tokens = int(tensor.data.reshape(-1)[0])
            elif name == "logprobs":
                logprobs = [_logprobs(v) for v in tensor.data.reshape(-1)[:n]]
            elif name == "prompt_logprobs":
                values = tensor.data.reshape(-1)
                prompt_logprobs = _logprobs(values[0]) if values.size else None
        cached = response.parameters.get("num_cached_tokens")
        return Step(texts, finish, tokens, prompt_tokens, logprobs, prompt_logprobs,
                    int(cached) if cached is not None else None)

    def _text(self, i: int, value) -> str:
        if isinstance(value, str):
            return value
        raw = bytes(value)
        if self._decoders is None:
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError:
                self._decoders = [codecs.getincrementaldecoder("utf-8")("replace") for _ in range(self.n)]
        return self._decoders[i].decode(raw)


def _str(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, (bytes, np.bytes_)) else str(value)


def _logprobs(value) -> list[dict] | None:
    try:
        parsed = json.loads(_str(value))
    except ValueError:
        return None
    return parsed if isinstance(parsed, list) else None


def clamp_logprob(value) -> float:
    """A log probability JSON can carry (-inf and NaN become -9999.0, as vLLM sends them)."""
    if value is None or not isinstance(value, (int, float)) or math.isnan(value):
        return -9999.0
    return max(float(value), -9999.0)
