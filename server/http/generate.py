"""Triton's generate extension: ``POST /v2/models/<m>[/versions/<v>]/generate`` and ``/generate_stream``.

The request is one flat JSON object (Triton's ``extension_generate.md`` and ``HandleGenerate`` /
``ConvertGenerateRequest`` in ``src/http_server.cc``):

* a field named like one of the model's inputs becomes that input tensor, with the datatype the
  model config declares and a shape fitted to the declared dims (see :func:`fit_shape`);
* ``id`` is the request id; ``parameters`` is an object whose entries are mapped the same way
  (an entry named like an input becomes that tensor, e.g. ``max_tokens`` of a TensorRT-LLM ensemble);
* any other field is a request parameter (string, number or boolean); anything else is a 400 that
  names the field.

The answer is one JSON object per response: ``id`` (when set), ``model_name``, ``model_version``,
the response parameters, and one field per output tensor (one element: the bare value, else a flat
array). ``/generate`` asks the model for one response (``request.streaming = False``) and answers
exactly one object, or an error when the model sends none or several (as Triton does).
``/generate_stream`` is ``text/event-stream``: one ``data: {json}\\n\\n`` event per response as it
arrives; a bare FINAL flag sends no event. Like Triton, the HTTP status is chosen by the first
response (a model error there gives its status, with the error as the event); a model error after
that is a ``data: {"error": "..."}`` event under status 200. Failures before inference (bad
request, unknown model, request rejected) are ``{"error": ...}`` JSON with the error's status.

A client that disconnects cancels the request (the model sees ``request.is_cancelled()``).

To a model that takes typed LLM requests (``ServedModel.engine.typed_requests``: the vllm backend), a request that
names only what a :class:`~tideserve.generation.GenerationRequest` carries goes as one through
``DataPlane.generate``, and its deltas are written as the events above (see "the typed path" below);
``TIDESERVE_GENERATE_TENSORS=1`` sends every request as tensors.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
from sse_starlette.sse import EventSourceResponse
from starlette.routing import Route
from tritonclient.grpc import model_config_pb2 as mc

from ..asgi import (
    JSON_HEADER,
    ClientGone,
    RefusalNow,
    cancel_on_disconnect,
    deadline_late_header,
    error_body,
    received_ns,
    send_error,
    send_response,
)
from ..datatypes import config_to_datatype, element_size, numpy_dtype
from ..errors import DeadlinePassed, InvalidArgument, QueueFull, ServerError, Unsupported, as_server_error
from ..generation import GenerationDelta, GenerationRequest
from ..responses import content_responses
from ..serving import ServingInterface
from ..types import InferenceRequest, InferenceResponse, Tensor
from . import codec
from .body import BodyReader

log = logging.getLogger(__name__)

GENERATE = "/generate"
GENERATE_STREAM = "/generate_stream"
MODEL_ROUTES = ("/v2/models/{model_name}", "/v2/models/{model_name}/versions/{model_version}")
SSE_CONTENT_TYPE = (b"content-type", b"text/event-stream; charset=utf-8")  # as the event stream's
SSE_PING_S = 0  # keep-alive comments between events; Triton sends none, so neither do we by default

_PARAMETERS = "parameters"
_SEQUENCE_FLAGS = ("sequence_start", "sequence_end")
# Requests to a model that takes typed LLM requests go as one (see "the typed path"); false: every request's tensors
TYPED_PATH = os.environ.get("TIDESERVE_GENERATE_TENSORS", "") not in ("1", "true")
_INT_TYPES = frozenset({"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"})
_FLOAT_TYPES = frozenset({"FP16", "FP32", "FP64"})


@dataclass(slots=True)
class InputSpec:
    name: str
    datatype: str
    shape: list[int]  # as in the model metadata: a leading -1 batch dim when max_batch_size > 0


def input_specs(config: mc.ModelConfig) -> dict[str, InputSpec]:
    batch = [-1] if config.max_batch_size > 0 else []
    return {t.name: InputSpec(t.name, config_to_datatype(mc.DataType.Name(t.data_type)), batch + list(t.dims))
            for t in config.input}


# -- request ---------------------------------------------------------------------------------
def _where(field: str, nested: bool) -> str:
    return f"'{_PARAMETERS}.{field}'" if nested else f"'{field}'"


def _flatten(value: list, where: str, depth: int = 0) -> tuple[list, tuple[int, ...] | None]:
    """Nested arrays -> (row-major elements, their shape, or None when the nesting is ragged)."""
    if depth >= codec.MAX_JSON_DEPTH:
        raise InvalidArgument(f"field {where}: arrays nest deeper than {codec.MAX_JSON_DEPTH} levels")
    if not any(type(item) is list for item in value):
        return value, (len(value),)
    flat: list = []
    shapes = set()
    for item in value:
        if type(item) is list:
            inner, shape = _flatten(item, where, depth + 1)
            flat.extend(inner)
            shapes.add(shape)
        else:
            flat.append(item)
            shapes.add(None)
    if len(shapes) == 1 and None not in shapes:
        return flat, (len(value), *shapes.pop())
    return flat, None


def fit_shape(count: int, declared: list[int], given: tuple[int, ...] | None = None) -> list[int] | None:
    """The tensor shape for ``count`` elements under the declared shape, or None if they do not fit.

    A nested JSON array whose shape matches the declared dims keeps that shape. Otherwise Triton's
    rule applies: the fixed dims take their sizes, the innermost variable dim takes the remaining
    elements and every other variable dim is 1 (a batched model gets a batch of 1).
    """
    if given is not None and len(given) == len(declared) and \
            all(d == -1 or d == g for g, d in zip(given, declared)):
        return list(given)
    if count == 0:
        if 0 not in declared and -1 not in declared:
            return None
        shape = [1 if d == -1 else d for d in declared]
        if 0 not in shape:
            shape[len(declared) - 1 - declared[::-1].index(-1)] = 0
        return shape
    remaining = count
    for dim in declared:
        if dim != -1:
            if dim == 0 or remaining % dim:
                return None
            remaining //= dim
    shape = list(declared)
    for i in range(len(shape) - 1, -1, -1):
        if shape[i] == -1:
            shape[i] = remaining
            remaining = 1
    return shape if remaining == 1 else None


def _describe(datatype: str) -> tuple[frozenset, str, str]:
    """The JSON types a datatype takes, their name, and Triton's words for a value of another type."""
    if datatype == "BYTES":
        return frozenset({str}), "strings", "attempt to access JSON non-string as string"
    if datatype == "BOOL":
        return frozenset({bool}), "booleans", "attempt to access JSON non-boolean as boolean"
    if datatype in _INT_TYPES:
        kind = "unsigned-integer" if datatype.startswith("U") else "signed-integer"
        return frozenset({int}), "integers", f"attempt to access JSON non-{kind} as {kind}"
    return frozenset({int, float}), "numbers", "attempt to access JSON non-number as number"


def _to_tensor(spec: InputSpec, value: Any, where: str, model_name: str) -> tuple[Tensor, int]:
    """A field's JSON value -> the input tensor and its size in bytes."""
    name, datatype = spec.name, spec.datatype
    if datatype not in _INT_TYPES and datatype not in _FLOAT_TYPES and datatype not in ("BOOL", "BYTES"):
        raise InvalidArgument(f"field {where}: input '{name}' of model '{model_name}' is {datatype}, which "
                              "cannot be given in a generate request")
    given = None
    if type(value) is list:
        flat, given = _flatten(value, where)
    else:
        flat = [value]
    allowed, description, triton_words = _describe(datatype)
    for item in flat:
        if type(item) not in allowed:
            raise InvalidArgument(f"field {where}: {triton_words}: input '{name}' of model '{model_name}' is "
                                  f"{datatype} and takes {description} (a value or an array), got "
                                  f"{codec._json_name(item)} {codec._show(item)}")
    count = len(flat)
    shape = fit_shape(count, spec.shape, given)
    if shape is None:
        raise InvalidArgument(f"field {where}: {count} value(s) do not fit the shape {spec.shape} of input "
                              f"'{name}' of model '{model_name}'")
    if datatype == "BYTES":
        encoded = [s.encode("utf-8") for s in flat]
        array = np.empty(count, dtype=np.object_)
        array[:] = encoded
        size = sum(len(b) for b in encoded) + 4 * count
    else:
        try:
            array = np.array(flat, dtype=numpy_dtype(datatype))
        except (OverflowError, ValueError, TypeError) as exc:
            raise InvalidArgument(f"field {where}: a value does not fit input '{name}' ({datatype}): "
                                  f"{exc}") from None
        size = count * element_size(datatype)
    array = array.reshape(shape)
    return Tensor(name, datatype, tuple(shape), array), size


class _RequestBuilder:
    def __init__(self, model_name: str, config: mc.ModelConfig, max_input_size: int) -> None:
        self.model_name = model_name
        self.specs = input_specs(config)
        self.max_input_size = max_input_size
        self.inputs: dict[str, Tensor] = {}
        self.parameters: dict[str, Any] = {}
        self.priority = 0
        self.timeout_us = 0
        self.consumed = 0
        self.seen: set[str] = set()  # parameter keys given so far

    def field(self, key: str, value: Any, nested: bool) -> None:
        where = _where(key, nested)
        spec = self.specs.get(key)
        if spec is not None:
            if key in self.inputs:
                raise InvalidArgument(f"input '{key}' is given both as a field and in '{_PARAMETERS}'")
            tensor, size = _to_tensor(spec, value, where, self.model_name)
            if size + self.consumed > self.max_input_size:
                raise InvalidArgument(
                    f"request size of {self.consumed} bytes with input '{key}' of size {size} bytes exceeds the "
                    f"maximum allowed input size of {self.max_input_size}; use --http-max-input-size to "
                    "increase the limit")
            self.consumed += size
            self.inputs[key] = tensor
        else:
            self.parameter(key, value, where)

    def parameter(self, key: str, value: Any, where: str) -> None:
        """A field that is no input: a request parameter (string, number or boolean)."""
        kind = type(value)
        if kind not in (str, int, float, bool):  # Triton's words first ("Converting keyword: ..." when nested)
            nested = f"Converting keyword: '{_PARAMETERS}': " if where.startswith(f"'{_PARAMETERS}.") else ""
            raise InvalidArgument(
                f"{nested}parameter '{key}' has invalid type. It should be a string, a number or a boolean: field "
                f"{where} is not an input of model '{self.model_name}' and is not a valid parameter, got "
                f"{codec._json_name(value)}")
        if key.startswith("triton_"):
            raise InvalidArgument(f"parameter {where}: keys starting with 'triton_' are reserved for server use "
                                  "and cannot be specified")
        if key in self.seen:
            raise InvalidArgument(f"parameter '{key}' is given both as a field and in '{_PARAMETERS}'")
        self.seen.add(key)
        if key == "priority":
            if not codec._is_uint(value):
                raise InvalidArgument(f"parameter {where} must be a non-negative integer, got {codec._show(value)}")
            self.priority = value
        elif key == "timeout":
            if not codec._is_uint(value):
                raise InvalidArgument(f"parameter {where} must be a non-negative integer (microseconds), "
                                      f"got {codec._show(value)}")
            self.timeout_us = value
        elif key == "sequence_id":
            if not (codec._is_uint(value) or kind is str):
                raise InvalidArgument(f"parameter {where} must be a non-negative integer or a string, "
                                      f"got {codec._show(value)}")
            self.parameters[key] = value
        elif key in _SEQUENCE_FLAGS:
            if kind is not bool:
                raise InvalidArgument(f"parameter {where} must be a boolean, got {codec._json_name(value)}")
            self.parameters[key] = value
        else:
            self.parameters[key] = value


def parse_generate_body(body: bytes, max_json_depth: int = codec.MAX_JSON_DEPTH) -> Any:
    return codec.parse_json(body, "generate request", max_json_depth) if body.strip() else {}


def decode_generate_request(model_name: str, model_version: str, body: bytes, config: mc.ModelConfig,
                            max_input_size: int, max_json_depth: int = codec.MAX_JSON_DEPTH,
                            doc: Any = None) -> InferenceRequest:
    """Parse a generate request body (``doc``: parsed already) into an InferenceRequest for ``config``'s model."""
    if doc is None:
        doc = parse_generate_body(body, max_json_depth)
    if type(doc) is not dict:
        raise InvalidArgument(f"the generate request must be a JSON object, got {codec._json_name(doc)}")
    duplicate = _duplicate_key(body, doc)
    if duplicate is not None:
        raise InvalidArgument(f"input '{duplicate}' already exists in request")
    builder = _RequestBuilder(model_name, config, max_input_size)
    request_id = ""
    for key, value in doc.items():
        if key == _PARAMETERS:
            if key in builder.specs:
                raise InvalidArgument(f"Keyword '{_PARAMETERS}' for nested schema also given as input tensor name "
                                      f"of model '{model_name}'")
            if type(value) is not dict:
                raise InvalidArgument(f"Expected JSON object for keyword: '{_PARAMETERS}', got "
                                      f"{codec._json_name(value)}")
            for inner_key, inner_value in value.items():
                builder.field(inner_key, inner_value, True)
            continue
        if key == "id":
            if type(value) is not str:
                raise InvalidArgument(f"field 'id' must be a string, got {codec._json_name(value)}")
            request_id = value
            if key not in builder.specs:
                continue
        builder.field(key, value, False)
    request = InferenceRequest(model_name, builder.inputs, model_version=model_version, id=request_id,
                               parameters=builder.parameters, priority=builder.priority,
                               timeout_us=builder.timeout_us)
    return request


def _duplicate_key(body: bytes, doc: dict) -> str | None:
    """The first field the request's top-level object names twice (JSON parsers keep the last), or None.
    Each key found once in the raw body cannot repeat: only otherwise is the body parsed again, keeping pairs."""
    raw = body if type(body) is bytes else bytes(body)
    if all(raw.count(b'"%s"' % key.encode()) == 1 for key in doc):
        return None
    objects: list[list] = []

    def keep_pairs(pairs):
        objects.append(pairs)  # inner objects first: the last one is the top level
        return dict(pairs)

    json.loads(raw, object_pairs_hook=keep_pairs)
    seen = set()
    for key, _ in objects[-1]:
        if key in seen:
            return key
        seen.add(key)
    return None


# -- response --------------------------------------------------------------------------------
def _tensor_json(tensor: Tensor) -> Any:
    array = tensor.data
    if type(array) is not np.ndarray:
        array = np.asarray(array, dtype=np.object_ if tensor.datatype == "BYTES" else None)
    if tensor.datatype == "BF16":
        raise InvalidArgument(f"output '{tensor.name}': BF16 outputs cannot be returned by generate")
    flat = array.ravel()
    if tensor.datatype == "BYTES":
        values = [item.decode("utf-8", "replace") if isinstance(item, (bytes, bytearray, np.bytes_))
                  else str(item) for item in flat]
    else:
        values = flat.tolist()
    return values[0] if len(values) == 1 else values


def generate_response_doc(response: InferenceResponse) -> dict[str, Any]:
    """A response as the generate extension returns it (first name wins, as in Triton: metadata,
    then response parameters, then output tensors)."""
    doc: dict[str, Any] = {}
    if response.id:
        doc["id"] = response.id
    doc["model_name"] = response.model_name
    doc["model_version"] = response.model_version
    for key, value in response.parameters.items():
        doc.setdefault(key, value)
    for tensor in response.outputs:
        if tensor.name not in doc:
            doc[tensor.name] = _tensor_json(tensor)
    return doc


def encode_generate_response(response: InferenceResponse) -> bytes:
    return codec.dumps(generate_response_doc(response))


def _event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


def _response_event(response: InferenceResponse) -> bytes | None:
    """The SSE event for one response (None for a bare FINAL flag)."""
    if response.error is not None:
        return _event(error_body(as_server_error(response.error).message))
    if response.empty:
        return None
    try:
        return _event(encode_generate_response(response))
    except ServerError as exc:
        return _event(error_body(exc.message))


class _EventStream(EventSourceResponse):
    """sse-starlette's response without its process-wide uvicorn shutdown hook: the Server ends
    streams itself (it drains in-flight requests, then aborts them with an error event)."""

    @staticmethod
    async def _listen_for_exit_signal() -> None:
        await asyncio.Event().wait()

    async def _listen_for_exit_signal_with_grace(self) -> None:
        await asyncio.Event().wait()


# -- the typed path ----------------------------------------------------------------------------
# A request to a model whose engine takes typed requests (``ServedModel.engine.typed_requests``) and that has
# Triton's LLM tensor interface (the vllm backend's, ``llm_backends/vllm/inputs.py``) becomes one GenerationRequest
# here, with no tensors: no tensor decode, validation or instance execute, and the model's sampling parameters read
# once. Its deltas are written as the JSON events the tensor path writes for the same request (the same fields, in
# the same order, with the same values). A request that uses anything a GenerationRequest does not carry (token ids,
# images, prompt log probabilities, sequence parameters, a value in an unusual form such as a flag given as an
# array or a string) takes the tensor path, which also words every malformed request's error.
_TEXT_INPUT = "text_input"
_SAMPLING_INPUT = "sampling_parameters"
_STREAM = "stream"
_EXCLUDE = "exclude_input_in_output"
_ADD_SPECIAL_TOKENS = "add_special_tokens"
_LORA_NAME = "lora_name"
# the return flags, in the order the tensor path writes their outputs
_RETURNS = (("return_finish_reason", "finish_reason"), ("return_cumulative_logprob", "cumulative_logprob"),
            ("return_logprobs", "logprobs"), ("return_num_input_tokens", "num_input_tokens"),
            ("return_num_output_tokens", "num_output_tokens"))
_RETURN_FLAGS = frozenset(flag for flag, _ in _RETURNS)
_FLAGS = frozenset({_STREAM, _EXCLUDE, _ADD_SPECIAL_TOKENS, *_RETURN_FLAGS})
_TYPED_INPUTS = frozenset({_TEXT_INPUT, _SAMPLING_INPUT, _STREAM, _EXCLUDE, *_RETURN_FLAGS})
_TENSOR_ONLY = frozenset({"return_num_cached_tokens", "return_prompt_logprobs", "sequence_id", *_SEQUENCE_FLAGS})
_SCALARS = (str, int, float, bool)
_NAN = float("nan")


class _Fallback(Exception):
    """The request needs the tensor path."""


@dataclass(slots=True)
class TypedGenerate:
    """A generate request on the typed path: the request (its model, typed generation, id, priority and deadline)
    and what its answers carry."""

    model_name: str
    generation: GenerationRequest
    request_id: str
    priority: int
    timeout_us: int
    model_version: str  # the version that answers
    prefix: str  # the whole answer starts with the prompt (``exclude_input_in_output`` false, not streamed)
    returns: tuple[str, ...]  # the extra outputs asked for, in the tensor path's order

    def doc(self, delta: GenerationDelta) -> dict[str, Any]:
        """One answer's JSON object, as :func:`generate_response_doc` writes the tensor path's response."""
        doc: dict[str, Any] = {}
        if self.request_id:
            doc["id"] = self.request_id
        doc["model_name"] = self.model_name
        doc["model_version"] = self.model_version
        texts = delta.texts
        if self.prefix:
            texts = [self.prefix + text for text in texts]
        doc["text_output"] = _bare(texts)
        n = len(texts)
        for name in self.returns:
            if name == "finish_reason":
                doc[name] = _bare([str(reason) for reason in delta.finish])
            elif name == "cumulative_logprob":  # FP32, as the tensor (null for none yet, as NaN is written)
                values = delta.cumulative_logprobs or [None] * n
                doc[name] = _bare([_NAN if v is None else float(np.float32(v)) for v in values])
            elif name == "logprobs":  # a JSON string per choice
                doc[name] = _bare([json.dumps(entries) for entries in (delta.logprobs or [None] * n)])
            elif name == "num_input_tokens":
                doc[name] = delta.prompt_tokens or 0
            else:  # num_output_tokens
                doc[name] = _bare(delta.tokens if delta.tokens is not None else [0] * n)
        return doc

    def event(self, delta: GenerationDelta) -> bytes:
        return _event(codec.dumps(self.doc(delta)))


def _bare(values: list) -> Any:
    return values[0] if len(values) == 1 else values


def typed_generate_request(served, model_name: str, model_version: str, body: bytes, doc: Any,
                           max_input_size: int) -> TypedGenerate | None:
    """The typed request for a generate request, or None when it takes the tensor path (see above)."""
    engine = getattr(served, "engine", None)
    if engine is None or not engine.typed_requests or type(doc) is not dict:
        return None
    names = _input_names(served.config)
    if _TEXT_INPUT not in names or _duplicate_key(body, doc) is not None:
        return None
    fields = _TypedFields(names, max_input_size)
    try:
        for key, value in doc.items():
            if key == _PARAMETERS:
                if key in names or type(value) is not dict:
                    raise _Fallback
                for inner_key, inner_value in value.items():
                    fields.field(inner_key, inner_value)
            elif key == "id":
                if type(value) is not str or key in names:
                    raise _Fallback
                fields.request_id = value
            else:
                fields.field(key, value)
        return fields.build(model_name, model_version, str(served.version))
    except _Fallback:
        return None


_names: dict[int, tuple[mc.ModelConfig, frozenset[str]]] = {}  # id(config) -> (config, its input names)


def _input_names(config: mc.ModelConfig) -> frozenset[str]:
    """The names of the model's inputs, read once per config (not per request)."""
    known = _names.get(id(config))
    if known is not None and known[0] is config:
        return known[1]
    if len(_names) >= 64:  # configs of models reloaded or unloaded
        _names.clear()
    names = frozenset(t.name for t in config.input)
    _names[id(config)] = (config, names)
    return names


class _TypedFields:
    __slots__ = ("consumed", "flags", "max_input_size", "names", "priority", "prompt", "request_id", "sampling",
                 "sampling_json", "seen", "timeout_us")

    def __init__(self, names: frozenset[str], max_input_size: int) -> None:
        self.names = names
        self.max_input_size = max_input_size
        self.consumed = 0  # the input tensors' bytes, as the tensor path counts them against max_input_size
        self.prompt: str | None = None
        self.sampling_json: dict | None = None
        self.flags: dict[str, bool] = {}
        self.sampling: dict[str, Any] = {}
        self.request_id = ""
        self.priority = 0
        self.timeout_us = 0
        self.seen: set[str] = set()

    def field(self, key: str, value: Any) -> None:
        if key in self.seen:
            raise _Fallback
        self.seen.add(key)
        if key in self.names:
            if key not in _TYPED_INPUTS:
                raise _Fallback  # token ids, an image, prompt log probabilities...
            self.consumed += 4 + len(value.encode("utf-8")) if type(value) is str else 1
            if self.consumed > self.max_input_size:
                raise _Fallback
            if key == _TEXT_INPUT:
                if type(value) is not str:
                    raise _Fallback
                self.prompt = value
            elif key == _SAMPLING_INPUT:
                if type(value) is not str:
                    raise _Fallback
                try:
                    parsed = json.loads(value)
                except ValueError:
                    raise _Fallback from None
                if type(parsed) is not dict:
                    raise _Fallback
                self.sampling_json = parsed
            elif type(value) is bool:
                self.flags[key] = value
            else:
                raise _Fallback
            return
        kind = type(value)
        if kind not in _SCALARS or key in _TENSOR_ONLY or key.startswith("triton_"):
            raise _Fallback
        if key in _FLAGS:
            if kind is not bool:
                raise _Fallback
            self.flags[key] = value
        elif key == "priority":
            if not codec._is_uint(value):
                raise _Fallback
            self.priority = value
        elif key == "timeout":
            if not codec._is_uint(value):
                raise _Fallback
            self.timeout_us = value
        else:
            self.sampling[key] = value

    def build(self, model_name: str, model_version: str, served_version: str) -> TypedGenerate:
        if self.prompt is None:
            raise _Fallback
        flags = self.flags
        stream = flags.get(_STREAM, False)
        exclude = flags.get(_EXCLUDE)
        prepend = not stream if exclude is None else not exclude
        if prepend and stream:  # refused: the tensor path words it
            raise _Fallback
        sampling = self.sampling
        if self.sampling_json is not None:
            sampling.update(self.sampling_json)
        lora = sampling.pop(_LORA_NAME, None)
        if lora is not None and type(lora) is not str:
            raise _Fallback
        generation = GenerationRequest(self.prompt, sampling, stream=stream,
                                       add_special_tokens=flags.get(_ADD_SPECIAL_TOKENS, True), lora_name=lora,
                                       logprobs=flags.get("return_logprobs", False),
                                       cumulative_logprob=flags.get("return_cumulative_logprob", False))
        returns = tuple(name for flag, name in _RETURNS if flags.get(flag, False))
        return TypedGenerate(model_name, generation, self.request_id, self.priority, self.timeout_us,
                             served_version, self.prompt if prepend else "", returns)


# -- handling --------------------------------------------------------------------------------
class GenerateRoute:
    """``/generate`` or ``/generate_stream`` as a plain ASGI app for the router."""

    def __init__(self, dataplane: ServingInterface, body: BodyReader, streaming: bool) -> None:
        self.dataplane = dataplane
        self.body = body
        self.streaming = streaming

    async def __call__(self, scope, receive, send) -> None:
        params = scope["path_params"]
        await handle_generate(self.dataplane, self.body, scope, receive, send, params["model_name"],
                              params.get("model_version", ""), self.streaming)


def mount(app, dataplane, body: BodyReader) -> None:
    """Add ``/generate`` and ``/generate_stream``, of a model and of one of its versions, to ``app``."""
    for suffix, streaming in ((GENERATE, False), (GENERATE_STREAM, True)):
        route = GenerateRoute(dataplane, body, streaming)
        for model in MODEL_ROUTES:
            app.router.routes.append(Route(model + suffix, route, methods=["POST"]))


async def handle_generate(dataplane, reader: BodyReader, scope, receive, send, model_name: str, model_version: str,
                          streaming: bool) -> None:
    try:
        served = dataplane.model(model_name, model_version)
        body = await reader.read_request(scope, receive)
        doc = parse_generate_body(body, reader.max_json_depth)
        typed = typed_generate_request(served, model_name, model_version, body, doc, reader.max_input_size) \
            if TYPED_PATH else None
        traceparent = None
        for key, value in scope["headers"]:
            if key == b"traceparent":
                traceparent = value.decode("latin-1")
        # (Triton's 'timeout' counts from when the request reached the server)
        if typed is not None:
            if not streaming:
                typed.generation.stream = False  # one answer
            stream = dataplane.generate(model_name, typed.generation, model_version=model_version, id=typed.request_id,
                                        priority=typed.priority, timeout_us=typed.timeout_us,
                                        arrival_ns=received_ns(scope) if typed.timeout_us else 0,
                                        trace_context=traceparent)
            if not streaming:
                with cancel_on_disconnect(receive):
                    delta = await _one_delta(stream)
                payload = codec.dumps(typed.doc(delta))
        else:
            request = decode_generate_request(model_name, model_version, body, served.config, reader.max_input_size,
                                              reader.max_json_depth, doc)
            request.trace_context = traceparent
            if request.timeout_us and 0 < received_ns(scope) < request.arrival_ns:
                request.arrival_ns = received_ns(scope)
            if not streaming:
                request.streaming = False  # the model's one response
                with cancel_on_disconnect(receive):
                    response = await _one_response(dataplane.infer(request))
                payload = encode_generate_response(response)
            else:
                stream = dataplane.infer(request)
    except ServerError as exc:
        log.debug("generate request for model '%s' failed: %s", model_name, exc.message)
        await send_error(send, exc.http_code, exc.message, exc.retry_after_s, exc)
        return
    except ClientGone:
        return
    except Exception as exc:  # a bug, not bad input: report it without a stack trace
        log.exception("HTTP generate request for model '%s' failed", model_name)
        await send_error(send, 500, f"internal error: {type(exc).__name__}: {exc}")
        return
    if not streaming:
        await send_response(send, 200, payload, [JSON_HEADER])
        return
    if typed is not None:
        await _typed_stream(typed, stream, scope, receive, send)
        return
    await _stream(stream, scope, receive, send)


async def _one_delta(stream) -> GenerationDelta:
    """The one answer of a typed ``/generate`` (its model's error raised)."""
    whole = None
    try:
        async for delta in stream:
            if whole is None:
                whole = delta
            else:
                whole.extend(delta)
    finally:
        await stream.aclose()
    if whole is None:
        raise Unsupported("generate expects model to produce exactly 1 response, use generate stream for model that "
                          f"generates various number of responses (model '{stream.model_name}' sent 0)")
    return whole


async def _first_of(stream, receive, refusal: RefusalNow, keep=None) -> Any:
    """The stream's first item, waited for with the client watched (with ``keep``: the first ``keep(item)`` that is
    not None); None when the stream ended without one. Where anything is raised (the model's error, ``ClientGone``
    when the client went away, a cancellation) the stream is closed and it propagates. ``refusal`` is disarmed on
    the way out: from then on the handler answers."""
    try:
        with cancel_on_disconnect(receive):
            async for item in stream:
                if keep is None:
                    return item
                kept = keep(item)
                if kept is not None:
                    return kept
        return None
    except BaseException:
        await stream.aclose()
        raise
    finally:
        refusal.armed = False


def _first_event(response: InferenceResponse) -> tuple[bytes, Any] | None:
    """:func:`_first_of`'s ``keep`` for the tensor path: a response's event and its error (None: no event)."""
    event = _response_event(response)
    return None if event is None else (event, response.error)


async def _answer_first_error(send, refusal: RefusalNow, error: ServerError, event: bool) -> None:
    """The whole answer of a stream whose first response is ``error`` (its stream closed): nothing where
    ``refusal`` wrote it already (at the deadline itself); else as its one event (``event``) or a JSON error."""
    if refusal.done:
        return
    if not event:
        await send_error(send, error.http_code, error.message, error.retry_after_s, error)
        return
    body, headers = _error_answer(error)
    await send_response(send, error.http_code, body, headers)


async def _typed_stream(typed: TypedGenerate, stream, scope, receive, send) -> None:
    """:func:`_stream` for a typed request: its deltas as the tensor path's events."""
    refusal = RefusalNow(send, _refusal_answer)  # armed until the stream's first delta
    refusal.watch(stream)
    try:
        first = await _first_of(stream, receive, refusal)
    except ClientGone:
        return
    except ServerError as exc:  # the model's error first (as the tensor path's first response): the whole answer;
        # refused before it was scheduled (max_queue_size: a frontend worker learns it here) as a JSON error, a
        # deadline's refusal as the model's first response
        await _answer_first_error(send, refusal, exc,
                                  event=not isinstance(exc, QueueFull) or isinstance(exc, DeadlinePassed))
        return

    async def events():
        try:
            if first is not None:
                yield typed.event(first)
                async for delta in stream:
                    yield typed.event(delta)
        except ServerError as exc:
            yield _event(error_body(exc.message))
        except Exception as exc:
            log.exception("generate_stream for model '%s' failed", typed.model_name)
            yield _event(error_body(f"internal error: {type(exc).__name__}: {exc}"))
        finally:
            await stream.aclose()

    try:
        await _EventStream(events(), ping=SSE_PING_S, sep="\n")(scope, receive, send)
    finally:
        await stream.aclose()


async def _one_response(stream) -> InferenceResponse:
    """The one response ``/generate`` answers with (its model's error raised); Unsupported in Triton's words
    for a model that sends none or several."""
    responses = await content_responses(stream)
    if len(responses) != 1:
        raise Unsupported("generate expects model to produce exactly 1 response, use generate stream for model that "
                          f"generates various number of responses (model '{stream.request.model_name}' sent "
                          f"{len(responses)})")
    return responses[0]


def _error_answer(error: ServerError) -> tuple[bytes, list]:
    """The whole answer of a stream whose first response is ``error``: its one event and the headers."""
    headers = [SSE_CONTENT_TYPE, (b"cache-control", b"no-store"), (b"x-accel-buffering", b"no")]
    if error.retry_after_s is not None:  # when to retry
        headers.append((b"retry-after", str(error.retry_after_s).encode()))
    if (late := deadline_late_header(error)) is not None:
        headers.append(late)
    return _event(error_body(error.message)), headers


def _refusal_answer(error: ServerError) -> tuple[int, bytes, list]:
    """:class:`~tideserve.asgi.RefusalNow`'s answer: the status, the one event, the headers."""
    return (error.http_code, *_error_answer(error))


async def _stream(stream, scope, receive, send) -> None:
    """Server-sent events, one per response; the first response decides the status (as in Triton)."""
    refusal = RefusalNow(send, _refusal_answer)  # armed until the stream's first response
    refusal.watch(stream)
    try:
        found = await _first_of(stream, receive, refusal, _first_event)
    except ClientGone:
        return
    except ServerError as exc:  # refused before it was scheduled (a frontend worker learns it here)
        await _answer_first_error(send, refusal, exc, event=False)
        return
    first: list[bytes] = []
    if found is not None:
        event, error = found
        if error is not None:  # the first response is the error (a refusal: queue full, deadline): the whole
            await stream.aclose()  # answer at once, its one event, the error's status (no stream left to keep open)
            await _answer_first_error(send, refusal, as_server_error(error), event=True)
            return
        first.append(event)

    async def events():
        try:
            for event in first:
                yield event
            async for response in stream:
                event = _response_event(response)
                if event is not None:
                    yield event
        except ServerError as exc:
            yield _event(error_body(exc.message))
        except Exception as exc:
            log.exception("generate_stream for model '%s' failed", stream.request.model_name)
            yield _event(error_body(f"internal error: {type(exc).__name__}: {exc}"))
        finally:
            await stream.aclose()  # a disconnect cancels the request; after the final response a no-op

    try:
        await _EventStream(events(), ping=SSE_PING_S, sep="\n")(scope, receive, send)
    finally:
        await stream.aclose()  # also when the response failed before iterating the events
