"""The tensor interface of the TensorRT-LLM backend: config auto-completion, request parsing, responses.

Two interfaces share one model:

* Triton's ``tensorrt_llm`` model (token ids): ``input_ids``, ``input_lengths``, ``request_output_len``,
  ``streaming``, sampling inputs, ``stop_words_list`` / ``bad_words_list`` in Triton's ``[2, N]`` layout
  -> ``output_ids``, ``sequence_length``, ``cum_log_probs``, ``output_log_probs``.
* The text interface of Triton's vLLM backend: ``text_input``, ``stream``, ``sampling_parameters`` (JSON,
  vLLM key names) -> ``text_output`` (+ optional ``finish_reason``, ``cumulative_logprob``, ...).

Nothing here imports TensorRT-LLM: a parsed request is plain data (:class:`Job`, :class:`Row`) and the
backend turns each row into one ``SamplingParams`` + ``LLM.generate_async`` call.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from tideserve.backend_api import InferenceRequest, InferenceResponse, InvalidArgument, Tensor

# -- config ---------------------------------------------------------------------------------------
# (name, config data type, dims, optional); dims exclude the batch dimension as in Triton's config.
TOKEN_INPUTS = [
    ("input_ids", mc.TYPE_INT32, [-1]),
    ("input_lengths", mc.TYPE_INT32, [1]),
    ("request_output_len", mc.TYPE_INT32, [1]),
    ("streaming", mc.TYPE_BOOL, [1]),
    ("end_id", mc.TYPE_INT32, [1]),
    ("pad_id", mc.TYPE_INT32, [1]),
    ("runtime_top_k", mc.TYPE_INT32, [1]),
    ("runtime_top_p", mc.TYPE_FP32, [1]),
    ("temperature", mc.TYPE_FP32, [1]),
    ("beam_width", mc.TYPE_INT32, [1]),
    ("repetition_penalty", mc.TYPE_FP32, [1]),
    ("presence_penalty", mc.TYPE_FP32, [1]),
    ("frequency_penalty", mc.TYPE_FP32, [1]),
    ("len_penalty", mc.TYPE_FP32, [1]),
    ("min_length", mc.TYPE_INT32, [1]),
    ("random_seed", mc.TYPE_UINT64, [1]),
    ("return_log_probs", mc.TYPE_BOOL, [1]),
    ("exclude_input_in_output", mc.TYPE_BOOL, [1]),
    ("stop_words_list", mc.TYPE_INT32, [2, -1]),
    ("bad_words_list", mc.TYPE_INT32, [2, -1]),
]
TEXT_INPUTS = [
    ("text_input", mc.TYPE_STRING, [1]),
    ("stream", mc.TYPE_BOOL, [1]),
    ("sampling_parameters", mc.TYPE_STRING, [1]),
    # exclude_input_in_output is shared with the token interface (listed above)
    ("return_finish_reason", mc.TYPE_BOOL, [1]),
    ("return_cumulative_logprob", mc.TYPE_BOOL, [1]),
    ("return_logprobs", mc.TYPE_BOOL, [1]),
    ("return_num_input_tokens", mc.TYPE_BOOL, [1]),
    ("return_num_output_tokens", mc.TYPE_BOOL, [1]),
]
OUTPUTS = [
    ("output_ids", mc.TYPE_INT32, [-1, -1]),
    ("sequence_length", mc.TYPE_INT32, [-1]),
    ("cum_log_probs", mc.TYPE_FP32, [-1]),
    ("output_log_probs", mc.TYPE_FP32, [-1, -1]),
    ("batch_index", mc.TYPE_INT32, [1]),
    ("text_output", mc.TYPE_STRING, [-1]),
    ("finish_reason", mc.TYPE_STRING, [-1]),
    ("cumulative_logprob", mc.TYPE_FP32, [-1]),
    ("logprobs", mc.TYPE_STRING, [-1]),
    ("num_input_tokens", mc.TYPE_UINT32, [1]),
    ("num_output_tokens", mc.TYPE_UINT32, [-1]),
]
SUPPORTED_INPUTS = frozenset(n for n, _, _ in TOKEN_INPUTS + TEXT_INPUTS)


def auto_complete(config: mc.ModelConfig) -> None:
    """Add every input / output of both interfaces the config does not list (all inputs optional:
    a request uses either ``input_ids`` or ``text_input``); make the model decoupled unless the config
    says otherwise. ``max_batch_size`` is left as configured (0: tensors carry no batch dimension)."""
    have_inputs = {t.name for t in config.input}
    for name, dtype, dims in TOKEN_INPUTS + TEXT_INPUTS:
        if name not in have_inputs:
            config.input.add(name=name, data_type=dtype, dims=dims, optional=True)
    have_outputs = {t.name for t in config.output}
    for name, dtype, dims in OUTPUTS:
        if name not in have_outputs:
            config.output.add(name=name, data_type=dtype, dims=dims)
    if not config.HasField("model_transaction_policy"):
        config.model_transaction_policy.decoupled = True


# -- parsed requests ------------------------------------------------------------------------------
@dataclass
class Row:
    """One generation (one row of the request's batch dimension): one engine request."""

    index: int
    prompt: list[int] | str               # token ids (token interface) or text (text interface)
    sampling: dict[str, Any]              # keyword arguments of SamplingParams
    # exact token ids of multi-token stop / bad words, pinned on SamplingParams (see backend)
    stop_word_ids: list[list[int]] = field(default_factory=list)
    bad_word_ids: list[list[int]] = field(default_factory=list)
    stop_texts: list[str] | None = None   # text stop / bad strings (text interface, or decoded ids)
    bad_texts: list[str] | None = None


@dataclass
class Job:
    """One tideserve request: its rows and how to answer."""

    text: bool                  # text interface (text_output) or token interface (output_ids)
    stream: bool                # send deltas as they come (else one response with everything)
    batched: bool               # max_batch_size > 0: tensors carry a leading batch dimension
    rows: list[Row]
    include_input: bool = False  # prepend the prompt (ids or text) to the non-streaming output
    logprobs: bool = False       # token interface: cum_log_probs / output_log_probs
    extras: dict[str, bool] = field(default_factory=dict)  # text interface: return_* flags


# -- value checks ---------------------------------------------------------------------------------
def _bad(where: str, message: str) -> InvalidArgument:
    return InvalidArgument(f"{where}: {message}")


def _as_int(where: str, value: Any) -> int:
    if isinstance(value, bool):
        raise _bad(where, f"must be an integer, got {value!r}")
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise _bad(where, f"must be an integer, got {value!r}")


def _as_float(where: str, value: Any) -> float:
    if not isinstance(value, bool):
        try:
            result = float(value.strip() if isinstance(value, str) else value)
        except (TypeError, ValueError):
            result = None
        if result is not None and math.isfinite(result):
            return result
    raise _bad(where, f"must be a finite number, got {value!r}")


def _as_bool(where: str, value: Any) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    raise _bad(where, f"must be a boolean, got {value!r}")


def _int_list(where: str, value: Any) -> list[int]:
    if isinstance(value, (int, str)) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, list):
        raise _bad(where, f"must be a list of token ids, got {value!r}")
    return [_as_int(where, v) for v in value]


def _str_list(where: str, value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise _bad(where, f"must be a string or a list of strings, got {value!r}")


def _check_range(where: str, value: float, low: float | None = None, high: float | None = None,
                 low_open: bool = False) -> None:
    if low is not None and (value < low or (low_open and value == low)):
        bound = f"> {low:g}" if low_open else f">= {low:g}"
        raise _bad(where, f"must be {bound}, got {value:g}")
    if high is not None and value > high:
        raise _bad(where, f"must be <= {high:g}, got {value:g}")


def _set_temperature(sampling: dict, where: str, temperature: float) -> None:
    _check_range(where, temperature, 0.0)
    if temperature == 0.0:  # greedy, as vLLM and OpenAI read it; TensorRT-LLM wants > 0 or greedy top_k=1
        sampling["top_k"] = 1
        sampling.pop("temperature", None)
    else:
        sampling["temperature"] = temperature


# -- Triton word lists ----------------------------------------------------------------------------
def decode_word_list(name: str, array: np.ndarray) -> list[list[int]]:
    """Triton's ``[2, N]`` word list of one row: row 0 the words' token ids back to back, row 1 the
    exclusive end offset of each word, padded with -1. Returns the words (empty ones dropped)."""
    if array.ndim != 2 or array.shape[0] != 2:
        raise InvalidArgument(f"input '{name}' must have shape [2, N] per request (token ids, end offsets), "
                              f"got {list(array.shape)}")
    ids, offsets = array[0].tolist(), array[1].tolist()
    words, start = [], 0
    for end in offsets:
        if end < 0:  # padding
            continue
        if end < start or end > len(ids):
            raise InvalidArgument(f"input '{name}': end offset {end} is out of order or past the {len(ids)} "
                                  f"token ids (offsets must be non-decreasing and <= N)")
        if end > start:
            words.append(ids[start:end])
        start = end
    return words


def encode_word_list(words: list[list[int]]) -> np.ndarray:
    """The inverse of :func:`decode_word_list`: ``[2, N]`` INT32 (client-side helper, used by tests)."""
    flat = [t for word in words for t in word]
    offsets = list(np.cumsum([len(w) for w in words])) if words else []
    width = max(len(flat), len(offsets), 1)
    out = np.zeros((2, width), np.int32)
    out[1, :] = -1
    out[0, :len(flat)] = flat
    out[1, :len(offsets)] = offsets
    return out


# -- parsing --------------------------------------------------------------------------------------
class RequestReader:
    """Reads one request's tensors row by row (``batched``: a leading batch dimension)."""

    def __init__(self, request: InferenceRequest, batched: bool, primary: str) -> None:
        self.inputs = request.inputs
        self.batched = batched
        data = self.inputs[primary].data
        if batched:
            if data.ndim < 1 or data.shape[0] < 1:
                raise InvalidArgument(f"input '{primary}' must have a batch dimension")
            self.rows = data.shape[0]
        else:
            self.rows = 1

    def has(self, name: str) -> bool:
        return name in self.inputs

    def array(self, name: str, per_row_ndim: int) -> np.ndarray:
        """``[rows, ...]`` view of an input with ``per_row_ndim`` dimensions per row."""
        data = self.inputs[name].data
        try:
            if per_row_ndim == 0:
                return data.reshape(self.rows, -1)
            if per_row_ndim == 1:
                return data.reshape(self.rows, -1)
            if per_row_ndim == 2:
                return data.reshape(self.rows, 2, -1)
        except ValueError:
            pass
        raise InvalidArgument(f"input '{name}' has shape {list(data.shape)}, which does not hold {self.rows} "
                              f"request row(s) of the expected layout")

    def scalar(self, name: str, row: int) -> Any:
        """The single value of input ``name`` for ``row`` (None when the input is absent)."""
        if name not in self.inputs:
            return None
        values = self.array(name, 0)
        if values.shape[1] != 1:
            raise InvalidArgument(f"input '{name}' must hold one value per request row, got {values.shape[1]}")
        value = values[row, 0]
        return value.item() if isinstance(value, np.generic) else value


def _flag(reader: RequestReader, name: str, row: int = 0) -> bool | None:
    value = reader.scalar(name, row)
    return None if value is None else _as_bool(f"input '{name}'", value)


def parse_token_request(request: InferenceRequest, *, batched: bool, decoupled: bool,
                        exclude_input_default: bool, tokenizer: Any) -> Job:
    """Triton ``tensorrt_llm`` interface -> Job."""
    reader = RequestReader(request, batched, "input_ids")
    ids = reader.array("input_ids", 1)
    if ids.shape[1] == 0:
        raise InvalidArgument("input 'input_ids' is empty: a prompt needs at least one token")
    asked = bool(_flag(reader, "streaming"))
    if asked and not decoupled:
        raise InvalidArgument("input 'streaming': streaming needs a decoupled model "
                              "(model_transaction_policy { decoupled: true })")
    stream = asked and request.streaming  # a unary protocol (HTTP infer, gRPC ModelInfer) takes one response
    exclude = _flag(reader, "exclude_input_in_output")
    requested = set(request.requested_output_names())
    logprobs = bool(_flag(reader, "return_log_probs")) or bool(requested & {"cum_log_probs", "output_log_probs"})
    rows = []
    for r in range(reader.rows):
        prompt = [int(t) for t in ids[r].tolist()]
        length = reader.scalar("input_lengths", r)
        if length is not None:
            length = _as_int("input 'input_lengths'", length)
            if not 1 <= length <= len(prompt):
                raise InvalidArgument(f"input 'input_lengths': {length} is outside [1, {len(prompt)}], the number "
                                      f"of token ids in 'input_ids'")
            prompt = prompt[:length]
        sampling: dict[str, Any] = {}
        value = reader.scalar("request_output_len", r)
        if value is not None:
            sampling["max_tokens"] = _as_int("input 'request_output_len'", value)
            _check_range("input 'request_output_len'", sampling["max_tokens"], 1)
        for name, key in (("end_id", "end_id"), ("pad_id", "pad_id")):
            value = reader.scalar(name, r)
            if value is not None:
                sampling[key] = _as_int(f"input '{name}'", value)
        value = reader.scalar("runtime_top_k", r)
        if value is not None:
            sampling["top_k"] = _as_int("input 'runtime_top_k'", value)
            _check_range("input 'runtime_top_k'", sampling["top_k"], 0)
        value = reader.scalar("runtime_top_p", r)
        if value is not None:
            sampling["top_p"] = _as_float("input 'runtime_top_p'", value)
            _check_range("input 'runtime_top_p'", sampling["top_p"], 0.0, 1.0)
        value = reader.scalar("temperature", r)
        if value is not None:
            _set_temperature(sampling, "input 'temperature'", _as_float("input 'temperature'", value))
        value = reader.scalar("beam_width", r)
        if value is not None:
            width = _as_int("input 'beam_width'", value)
            _check_range("input 'beam_width'", width, 1)
            if width > 1:
                sampling.update(use_beam_search=True, n=width, best_of=width)
        value = reader.scalar("repetition_penalty", r)
        if value is not None:
            sampling["repetition_penalty"] = _as_float("input 'repetition_penalty'", value)
            _check_range("input 'repetition_penalty'", sampling["repetition_penalty"], 0.0, low_open=True)
        for name, key in (("presence_penalty", "presence_penalty"), ("frequency_penalty", "frequency_penalty"),
                          ("len_penalty", "length_penalty")):
            value = reader.scalar(name, r)
            if value is not None:
                sampling[key] = _as_float(f"input '{name}'", value)
        value = reader.scalar("min_length", r)
        if value is not None:
            sampling["min_tokens"] = _as_int("input 'min_length'", value)
            _check_range("input 'min_length'", sampling["min_tokens"], 0)
        value = reader.scalar("random_seed", r)
        if value is not None:
            sampling["seed"] = _as_int("input 'random_seed'", value)
        if logprobs:
            sampling["logprobs"] = 1
        row = Row(r, prompt, sampling)
        for name, kind in (("stop_words_list", "stop"), ("bad_words_list", "bad")):
            if reader.has(name):
                words = decode_word_list(name, reader.array(name, 2)[r])
                _words_to_row(row, kind, words, name, tokenizer)
        rows.append(row)
    # Streamed output never holds the prompt; asked to stream over a unary protocol, the one response holds
    # what the stream would have (unless exclude_input_in_output says otherwise)
    include = not exclude if exclude is not None else not (exclude_input_default or asked)
    return Job(text=False, stream=stream, batched=batched, rows=rows, include_input=include, logprobs=logprobs)


def _words_to_row(row: Row, kind: str, words: list[list[int]], where: str, tokenizer: Any) -> None:
    """Single-token words -> ``stop_token_ids`` / ``bad_token_ids`` (exact, public API). Multi-token words
    need TensorRT-LLM's string fields: decoded to text for ``stop`` / ``bad``, their exact ids pinned."""
    singles = [w[0] for w in words if len(w) == 1]
    multis = [w for w in words if len(w) > 1]
    if singles:
        row.sampling[f"{kind}_token_ids"] = singles
    if multis:
        if tokenizer is None:
            raise InvalidArgument(f"input '{where}': multi-token words need the model's tokenizer (set "
                                  f"parameters tokenizer_dir); single-token words work without one")
        texts = [tokenizer.decode(w) for w in multis]
        if kind == "stop":
            row.stop_texts, row.stop_word_ids = texts, multis
        else:
            row.bad_texts, row.bad_word_ids = texts, multis


# vLLM-style keys of ``sampling_parameters`` -> (kind, SamplingParams field)
SAMPLING_KEYS: dict[str, tuple[str, str]] = {
    "max_tokens": ("int>=1", "max_tokens"),
    "min_tokens": ("int>=0", "min_tokens"),
    "temperature": ("temperature", "temperature"),
    "top_p": ("prob", "top_p"),
    "top_k": ("top_k", "top_k"),
    "min_p": ("prob", "min_p"),
    "seed": ("int", "seed"),
    "n": ("int>=1", "n"),
    "best_of": ("int>=1", "best_of"),
    "use_beam_search": ("bool", "use_beam_search"),
    "beam_width": ("beam_width", "beam_width"),
    "stop": ("strs", "stop"),
    "stop_token_ids": ("ints", "stop_token_ids"),
    "bad": ("strs", "bad"),
    "bad_words": ("strs", "bad"),
    "bad_token_ids": ("ints", "bad_token_ids"),
    "include_stop_str_in_output": ("bool", "include_stop_str_in_output"),
    "ignore_eos": ("bool", "ignore_eos"),
    "repetition_penalty": ("float>0", "repetition_penalty"),
    "presence_penalty": ("float", "presence_penalty"),
    "frequency_penalty": ("float", "frequency_penalty"),
    "length_penalty": ("float", "length_penalty"),
    "no_repeat_ngram_size": ("int>=1", "no_repeat_ngram_size"),
    "skip_special_tokens": ("bool", "skip_special_tokens"),
    "spaces_between_special_tokens": ("bool", "spaces_between_special_tokens"),
    "logprobs": ("int>=0", "logprobs"),
    "end_id": ("int", "end_id"),
    "pad_id": ("int", "pad_id"),
}


def parse_sampling_parameters(values: dict[str, Any], *, strict: bool) -> tuple[dict[str, Any], list[str] | None,
                                                                               list[str] | None]:
    """vLLM-style sampling parameters -> (SamplingParams kwargs, stop strings, bad strings).

    ``strict``: unknown keys are an error (the ``sampling_parameters`` tensor); otherwise they are
    skipped (request parameters, which also carry protocol settings)."""
    sampling: dict[str, Any] = {}
    stop = bad = None
    for key, value in values.items():
        if value is None:
            continue
        spec = SAMPLING_KEYS.get(key)
        if spec is None:
            if strict:
                raise InvalidArgument(f"sampling_parameters: unknown key '{key}' (supported: "
                                      f"{', '.join(sorted(SAMPLING_KEYS))})")
            continue
        kind, target = spec
        where = f"sampling_parameters: '{key}'"
        if kind == "int":
            sampling[target] = _as_int(where, value)
        elif kind in ("int>=0", "int>=1"):
            sampling[target] = _as_int(where, value)
            _check_range(where, sampling[target], int(kind[-1]))
        elif kind == "float":
            sampling[target] = _as_float(where, value)
        elif kind == "float>0":
            sampling[target] = _as_float(where, value)
            _check_range(where, sampling[target], 0.0, low_open=True)
        elif kind == "prob":
            sampling[target] = _as_float(where, value)
            _check_range(where, sampling[target], 0.0, 1.0)
        elif kind == "temperature":
            _set_temperature(sampling, where, _as_float(where, value))
        elif kind == "top_k":
            top_k = _as_int(where, value)
            _check_range(where, top_k, -1)
            if top_k > 0:  # vLLM: -1 (or 0) turns top-k off, which is TensorRT-LLM's default
                sampling["top_k"] = top_k
        elif kind == "beam_width":
            width = _as_int(where, value)
            _check_range(where, width, 1)
            if width > 1:
                sampling.update(use_beam_search=True, n=width, best_of=width)
        elif kind == "bool":
            sampling[target] = _as_bool(where, value)
        elif kind == "ints":
            sampling[target] = _int_list(where, value)
        elif kind == "strs":
            if target == "stop":
                stop = _str_list(where, value)
            else:
                bad = _str_list(where, value)
    return sampling, stop, bad


def parse_text_request(request: InferenceRequest, *, batched: bool, decoupled: bool) -> Job:
    """vLLM-backend text interface -> Job."""
    reader = RequestReader(request, batched, "text_input")
    texts = reader.array("text_input", 0)
    asked = bool(_flag(reader, "stream"))
    if asked and not decoupled:
        raise InvalidArgument("input 'stream': streaming needs a decoupled model "
                              "(model_transaction_policy { decoupled: true })")
    stream = asked and request.streaming  # a unary protocol (HTTP infer, gRPC ModelInfer) takes one response
    exclude = _flag(reader, "exclude_input_in_output")
    # vLLM backend's rule, on what the client asked for: the prompt is prepended unless streaming
    if exclude is False and asked:
        raise InvalidArgument("input 'exclude_input_in_output': false is not allowed when streaming "
                              "(streamed responses carry only new text)")
    include = (not exclude) if exclude is not None else not asked
    requested = set(request.requested_output_names())
    extras = {}
    for flag, output in (("return_finish_reason", "finish_reason"),
                         ("return_cumulative_logprob", "cumulative_logprob"),
                         ("return_logprobs", "logprobs"),
                         ("return_num_input_tokens", "num_input_tokens"),
                         ("return_num_output_tokens", "num_output_tokens")):
        extras[output] = bool(_flag(reader, flag)) or output in requested
    rows = []
    for r in range(reader.rows):
        if texts.shape[1] != 1:
            raise InvalidArgument(f"input 'text_input' must hold one prompt per request row, got {texts.shape[1]}")
        prompt = _utf8("text_input", texts[r, 0])
        if reader.has("sampling_parameters"):
            text = _utf8("sampling_parameters", reader.scalar("sampling_parameters", r))
            try:
                values = json.loads(text) if text.strip() else {}
            except json.JSONDecodeError as exc:
                raise InvalidArgument(f"sampling_parameters: not valid JSON: {exc}") from None
            if not isinstance(values, dict):
                raise InvalidArgument("sampling_parameters: must be a JSON object")
            sampling, stop, bad = parse_sampling_parameters(values, strict=True)
        else:  # like the vLLM backend: fall back to the request's parameters
            sampling, stop, bad = parse_sampling_parameters(dict(request.parameters), strict=False)
        if extras["logprobs"] or extras["cumulative_logprob"]:
            sampling["logprobs"] = max(1, sampling.get("logprobs") or 0)
        rows.append(Row(r, prompt, sampling, stop_texts=stop, bad_texts=bad))
    return Job(text=True, stream=stream, batched=batched, rows=rows, include_input=include, extras=extras)


def _utf8(name: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except (UnicodeDecodeError, TypeError):
        raise InvalidArgument(f"input '{name}' must be UTF-8 text") from None


def parse_request(request: InferenceRequest, *, batched: bool, decoupled: bool, exclude_input_default: bool,
                  tokenizer: Any) -> Job:
    unsupported = [n for n in request.inputs if n not in SUPPORTED_INPUTS]
    if unsupported:
        raise InvalidArgument(f"input '{unsupported[0]}' is not supported by the tideserve TensorRT-LLM backend")
    has_ids, has_text = "input_ids" in request.inputs, "text_input" in request.inputs
    if has_ids == has_text:
        raise InvalidArgument("a request needs exactly one of 'input_ids' (token ids) or 'text_input' (text), "
                              f"got {'both' if has_ids else 'neither'}")
    if has_ids:
        stray = [n for n in request.inputs if n in {x for x, _, _ in TEXT_INPUTS} and n != "exclude_input_in_output"]
        if stray:
            raise InvalidArgument(f"input '{stray[0]}' belongs to the text interface; it cannot go with 'input_ids'")
        return parse_token_request(request, batched=batched, decoupled=decoupled,
                                   exclude_input_default=exclude_input_default, tokenizer=tokenizer)
    token_only = {x for x, _, _ in TOKEN_INPUTS} - {"exclude_input_in_output"}
    stray = [n for n in request.inputs if n in token_only]
    if stray:
        raise InvalidArgument(f"input '{stray[0]}' belongs to the token-id interface; with 'text_input' use "
                              f"'sampling_parameters'")
    if tokenizer is None:
        raise InvalidArgument("input 'text_input': the model has no tokenizer, so it takes token ids only "
                              "(set parameters tokenizer_dir, or send input_ids)")
    return parse_text_request(request, batched=batched, decoupled=decoupled)


# -- responses ------------------------------------------------------------------------------------
def token_logprob(entry: Any, token: int) -> float:
    """One generated token's log probability from a ``CompletionOutput.logprobs`` entry: a float
    (older TensorRT-LLM) or a ``{token_id: Logprob}`` dict (newer)."""
    if isinstance(entry, dict):
        found = entry.get(token)
        if found is None and entry:
            found = max(entry.values(), key=lambda lp: getattr(lp, "logprob", lp))
        entry = found
    value = getattr(entry, "logprob", entry)
    return float(value) if value is not None else float("nan")


def logprobs_json(entries: list, tokens: list[int]) -> bytes:
    """vLLM backend's ``logprobs`` output element: ``[{token_id: {logprob, rank, decoded_token}}, ...]``."""
    out = []
    for entry, token in zip(entries, tokens):
        if isinstance(entry, dict):
            out.append({str(tid): {"logprob": getattr(lp, "logprob", lp), "rank": getattr(lp, "rank", None),
                                   "decoded_token": getattr(lp, "decoded_token", None)}
                        for tid, lp in entry.items()})
        else:
            out.append({str(token): {"logprob": token_logprob(entry, token), "rank": None, "decoded_token": None}})
    return json.dumps(out).encode()


def pad_stack(arrays: list[np.ndarray], pad: Any, dtype) -> np.ndarray:
    """Stack arrays of equal rank, padding each dimension to the largest."""
    if not arrays:
        return np.zeros((0,), dtype)
    shape = [max(a.shape[d] for a in arrays) for d in range(arrays[0].ndim)]
    out = np.full([len(arrays), *shape], pad, dtype=dtype)
    for i, a in enumerate(arrays):
        out[(i, *[slice(0, s) for s in a.shape])] = a
    return out


def make_response(job: Job, parts: list[dict[str, np.ndarray]], batch_index: int | None = None) -> InferenceResponse:
    """One response from the output tensors of one or more rows (``parts``, in row order).

    Batched models get a leading batch dimension (one entry per row); unbatched ones take one row.
    ``batch_index`` marks a streamed row of a multi-row request, as Triton's backend does."""
    names = list(parts[0])
    outputs = []
    for name in names:
        arrays = [p[name] for p in parts]
        pad = PADS.get(name, 0)
        if job.batched:
            data = pad_stack(arrays, pad, DTYPES[name])
        else:
            data = np.asarray(arrays[0], dtype=DTYPES[name])
        outputs.append(Tensor(name, DATATYPES[name], tuple(data.shape), data))
    if batch_index is not None:
        data = np.array([[batch_index]] if job.batched else [batch_index], np.int32)
        outputs.append(Tensor("batch_index", "INT32", tuple(data.shape), data))
    return InferenceResponse(outputs=outputs)


PADS = {"output_ids": -1, "text_output": b"", "finish_reason": b"", "logprobs": b"null"}
DATATYPES = {"output_ids": "INT32", "sequence_length": "INT32", "cum_log_probs": "FP32", "output_log_probs": "FP32",
             "text_output": "BYTES", "finish_reason": "BYTES", "cumulative_logprob": "FP32", "logprobs": "BYTES",
             "num_input_tokens": "UINT32", "num_output_tokens": "UINT32", "batch_index": "INT32"}
DTYPES = {"output_ids": np.int32, "sequence_length": np.int32, "cum_log_probs": np.float32,
          "output_log_probs": np.float32, "text_output": np.object_, "finish_reason": np.object_,
          "cumulative_logprob": np.float32, "logprobs": np.object_, "num_input_tokens": np.uint32,
          "num_output_tokens": np.uint32}
