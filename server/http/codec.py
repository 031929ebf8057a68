"""KServe v2 / Triton HTTP wire format <-> core types, with the binary tensor data extension.

Everything here is plain functions over ``bytes`` and dicts parsed by ``orjson``: no pydantic, no
per-request objects beyond the core's own. Every problem with a request raises
:class:`~tideserve.errors.InvalidArgument` naming the tensor or field, so the frontend answers 400.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import orjson
from tritonclient.grpc import model_config_pb2 as mc

from ..datatypes import DATATYPES, config_to_datatype, element_size, from_raw, numpy_dtype, to_raw
from ..errors import InvalidArgument
from ..limits import TensorLimits
from ..types import InferenceRequest, InferenceResponse, RequestedOutput, Tensor

MAX_JSON_DEPTH = 64  # default nesting limit of a request's arrays and objects (--http-max-json-depth)
DEFAULT_TENSOR_LIMITS = TensorLimits()
# Nesting level, in an infer request, of an input's "data" array and of an input's or an output's
# "parameters" object (the root object is level 1, "inputs" 2, an input 3).
_TENSOR_FIELD_DEPTH = 4

# Python type of a parsed JSON value -> its JSON name, for error messages.
_JSON_NAMES = {str: "string", bool: "boolean", int: "integer", float: "number", list: "array",
               dict: "object", type(None): "null"}

# Which JSON value types each datatype accepts in "data".
_BOOL_KINDS = frozenset({bool})
_INT_KINDS = frozenset({int})
_FLOAT_KINDS = frozenset({int, float})
_STR_KINDS = frozenset({str})
_ACCEPTED: dict[str, tuple[frozenset, str]] = {"BOOL": (_BOOL_KINDS, "booleans"), "BYTES": (_STR_KINDS, "strings")}
for _dt in ("UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"):
    _ACCEPTED[_dt] = (_INT_KINDS, "integers")
for _dt in ("FP16", "FP32", "FP64"):
    _ACCEPTED[_dt] = (_FLOAT_KINDS, "numbers")

# Which JSON value types a flat "data" array of each non-BYTES datatype may hold (decode_request's direct path).
_FLAT_KINDS = {datatype: kinds for datatype, (kinds, _) in _ACCEPTED.items() if datatype != "BYTES"}

# Request parameters with a meaning of their own (the rest pass through to the model).
_SEQUENCE_FLAGS = ("sequence_start", "sequence_end")

_JSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY

# datatype -> bytes per element (0 for BYTES) and numpy dtype, looked up once per input
_ITEMSIZE = {dt: element_size(dt) for dt in DATATYPES}
_NUMPY = {dt: numpy_dtype(dt) for dt in DATATYPES if dt != "BF16"}


@dataclass(slots=True)
class OutputOptions:
    """How one requested output goes back: binary or JSON, and an optional classification."""

    binary: bool | None = None  # None: the request's default (binary_data_output)
    class_count: int = 0


_DEFAULT_OUTPUT = OutputOptions()  # shared by the outputs that ask for nothing or only binary_data (read only)
_BINARY_OUTPUT = OutputOptions(True)
_JSON_OUTPUT = OutputOptions(False)


@dataclass(slots=True)
class DecodedRequest:
    request: InferenceRequest
    binary_output: bool                      # request-level "binary_data_output"
    outputs: dict[str, OutputOptions] | None  # per requested output, None if none were named
    classify: bool = False                    # some output asks for classification


# -- helpers ---------------------------------------------------------------------------------
def _json_name(value: Any) -> str:
    return _JSON_NAMES.get(type(value), type(value).__name__)


def _show(value: Any) -> str:
    """A JSON value, shortened, for an error message."""
    try:
        text = orjson.dumps(value, default=str).decode()
    except TypeError:
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_uint(value: Any) -> bool:
    return type(value) is int and value >= 0


def _too_deep(limit: int) -> str:
    return f"nests arrays and objects deeper than {limit} levels (--http-max-json-depth)"


def _flatten(data: list, name: str, max_depth: int, depth: int = _TENSOR_FIELD_DEPTH) -> list:
    if depth > max_depth:
        raise InvalidArgument(f"input '{name}': 'data' {_too_deep(max_depth)}")
    out: list = []
    for item in data:
        if type(item) is list:
            out.extend(_flatten(item, name, max_depth, depth + 1))
        else:
            out.append(item)
    return out


def check_json_depth(value: Any, limit: int, what: str, depth: int = 1) -> None:
    """InvalidArgument naming ``what`` if the arrays and objects of ``value``, itself at nesting level
    ``depth`` (the document's root is level 1), nest deeper than ``limit`` levels."""
    if type(value) is not dict and type(value) is not list:
        return
    stack = [(value, depth)]
    while stack:
        node, level = stack.pop()
        if level > limit:
            raise InvalidArgument(f"{what} {_too_deep(limit)}")
        for item in (node.values() if type(node) is dict else node):
            if type(item) is dict or type(item) is list:
                stack.append((item, level + 1))


def parse_json(buffer: bytes | memoryview, what: str = "request", max_depth: int | None = None) -> Any:
    """The parsed JSON; with ``max_depth``, refused when it nests deeper than that (orjson's own limit is 1024)."""
    try:
        doc = orjson.loads(buffer)
    except orjson.JSONDecodeError as exc:
        raise InvalidArgument(f"failed to parse the {what} JSON: {exc}") from None
    if max_depth is not None:
        raw = buffer if type(buffer) is bytes else bytes(buffer)
        # a document nests no deeper than its count of opening brackets: most skip the walk
        if raw.count(b"[") + raw.count(b"{") > max_depth:
            check_json_depth(doc, max_depth, f"the {what} JSON")
    return doc


def _json_tensor_data(name: str, datatype: str, shape: list[int] | tuple[int, ...], count: int, data: Any,
                      max_depth: int) -> np.ndarray:
    """A tensor given as JSON "data" (flat or nested, row-major) -> numpy array of ``shape``."""
    if type(data) is not list:
        raise InvalidArgument(f"input '{name}': 'data' must be an array, got {_json_name(data)}")
    accepted = _ACCEPTED.get(datatype)
    if accepted is None:
        raise InvalidArgument(f"input '{name}': {datatype} data cannot be given as JSON; "
                              "send it in the binary tensor data format")
    kinds = set(map(type, data))
    flat = data
    if list in kinds:
        flat = _flatten(data, name, max_depth)
        kinds = set(map(type, flat))
    allowed, description = accepted
    if not kinds <= allowed:
        bad = next(x for x in flat if type(x) not in allowed)
        raise InvalidArgument(f"input '{name}': {datatype} 'data' must hold {description}, "
                              f"got {_json_name(bad)} {_show(bad)}")
    if len(flat) != count:
        raise InvalidArgument(f"input '{name}': shape {list(shape)} needs {count} elements, "
                              f"'data' holds {len(flat)}")
    if type(shape) is not tuple:
        shape = tuple(shape)  # numpy reshapes to a tuple faster than to a list
    if datatype == "BYTES":
        array = np.empty(count, dtype=np.object_)
        array[:] = [s.encode("utf-8") for s in flat]
        return array.reshape(shape)
    try:
        array = np.array(flat, _NUMPY[datatype])
    except (OverflowError, ValueError, TypeError) as exc:
        raise InvalidArgument(f"input '{name}': 'data' does not fit {datatype}: {exc}") from None
    return array.reshape(shape)


def _bad_shape(name: str, shape: Any) -> None:
    raise InvalidArgument(f"input '{name}': 'shape' must be an array of non-negative integers, "
                          f"got {_show(shape)}")


# -- requests --------------------------------------------------------------------------------
def _request_parameters(params: dict) -> tuple[bool, int, int, dict[str, Any]]:
    """A request's "parameters" object: (binary_data_output, priority, timeout in us, what the model sees)."""
    binary_output = False
    priority = 0
    timeout_us = 0
    parameters: dict[str, Any] = {}
    for key, value in params.items():
        if key == "binary_data_output":
            if type(value) is not bool:
                raise InvalidArgument(f"parameter 'binary_data_output' must be a boolean, got {_json_name(value)}")
            binary_output = value
        elif key == "priority":
            if not _is_uint(value):
                raise InvalidArgument(f"parameter 'priority' must be a non-negative integer, got {_show(value)}")
            priority = value
        elif key == "timeout":
            if not _is_uint(value):
                raise InvalidArgument(f"parameter 'timeout' must be a non-negative integer (microseconds), "
                                      f"got {_show(value)}")
            timeout_us = value
        elif key == "sequence_id":
            if not (_is_uint(value) or type(value) is str):
                raise InvalidArgument(f"parameter 'sequence_id' must be a non-negative integer or a string, "
                                      f"got {_show(value)}")
            parameters[key] = value
        elif key in _SEQUENCE_FLAGS:
            if type(value) is not bool:
                raise InvalidArgument(f"parameter '{key}' must be a boolean, got {_json_name(value)}")
            parameters[key] = value
        elif key.startswith("triton_"):
            raise InvalidArgument(f"parameter '{key}': keys starting with 'triton_' are reserved for "
                                  "server use and cannot be specified")
        elif type(value) in (str, int, bool, float):
            parameters[key] = value
        else:
            raise InvalidArgument(f"parameter '{key}' has invalid type {_json_name(value)}; it must be a "
                                  "string, integer, boolean or number")
    return binary_output, priority, timeout_us, parameters


# The usual JSON request, typed: msgspec checks the document's structure and its fields' types as it parses (no dict
# per object, no Python check per field). Anything else about it is checked by _decode_typed; a document it does not
# take whole goes the general way (decode_request's orjson path), which also words every error. No unknown field is
# taken: each value of the document is then parsed (msgspec skips an unknown field's value with fewer checks than
# orjson makes) and within _TYPED_DEPTH levels.
class _InputDoc(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    datatype: str
    shape: list[int]
    data: Any = None
    parameters: dict | None = None


class _OutputDoc(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    parameters: dict | None = None


class _RequestDoc(msgspec.Struct, forbid_unknown_fields=True):
    inputs: list[_InputDoc]
    id: str = ""
    parameters: dict | None = None
    outputs: list[_OutputDoc] | None = None


_TYPED_DECODER = msgspec.json.Decoder(_RequestDoc)
_TYPED_DEPTH = 4  # the deepest nesting _decode_typed takes: an input's "data" or "shape", an output's "parameters"
_SCALARS = (str, int, bool, float)


def _decode_typed(model_name: str, model_version: str, body: bytes, limits: TensorLimits,
                  max_json_depth: int) -> DecodedRequest | None:
    """:func:`decode_request` of a JSON-only body whose inputs are flat numeric or boolean "data" arrays within the
    limits, with no input parameters, outputs with at most "binary_data" and request parameters of scalars (what
    perf_analyzer and most clients send): the same request, or None where the general path must decide (anything
    else, every error included: it then parses the body again)."""
    if max_json_depth < _TYPED_DEPTH:
        return None
    try:
        doc = _TYPED_DECODER.decode(body)
    except (msgspec.MsgspecError, ValueError, RecursionError):  # not UTF-8: UnicodeDecodeError; nested past
        # msgspec's own depth limit: RecursionError (the general path answers it 400)
        return None
    params = doc.parameters
    if params is None:
        binary_output, priority, timeout_us, parameters = False, 0, 0, {}
    else:
        for value in params.values():
            if type(value) not in _SCALARS:
                return None
        binary_output, priority, timeout_us, parameters = _request_parameters(params)
    inputs: dict[str, Tensor] = {}
    max_rank, max_elements = limits.max_rank, limits.max_elements
    for item in doc.inputs:
        name, datatype, shape, data = item.name, item.datatype, item.shape, item.data
        if not name or name in inputs or item.parameters is not None or type(data) is not list:
            return None
        kinds = _FLAT_KINDS.get(datatype)
        if kinds is None:
            return None
        count = 1
        for dim in shape:
            if dim < 0:
                return None
            count *= dim
        if (not count or count > max_elements or len(shape) > max_rank or len(data) != count
                or not set(map(type, data)) <= kinds):
            return None
        try:
            array = np.array(data, _NUMPY[datatype])
        except (OverflowError, ValueError, TypeError):
            return None
        shape = tuple(shape)
        if len(shape) != 1:
            array.shape = shape  # in place (a new array): fewer instructions than reshape's argument parsing
        inputs[name] = Tensor(name, datatype, shape, array)
    outputs = None
    requested = None
    if doc.outputs is not None:
        outputs = {}
        requested = []
        for item in doc.outputs:
            name = item.name
            if not name or name in outputs:
                return None
            oparams = item.parameters
            if oparams:
                binary = oparams.get("binary_data")
                if len(oparams) != 1 or type(binary) is not bool:
                    return None
                outputs[name] = _BINARY_OUTPUT if binary else _JSON_OUTPUT
                requested.append(RequestedOutput(name, oparams))
            else:
                outputs[name] = _DEFAULT_OUTPUT
                requested.append(RequestedOutput(name))
    request = InferenceRequest(model_name, inputs, model_version=model_version, id=doc.id, outputs=requested,
                               parameters=parameters, priority=priority, timeout_us=timeout_us)
    return DecodedRequest(request, binary_output, outputs, False)


def decode_request(model_name: str, model_version: str, body: bytes, header_length: int | None,
                   limits: TensorLimits = DEFAULT_TENSOR_LIMITS,
                   max_json_depth: int = MAX_JSON_DEPTH) -> DecodedRequest:
    """Parse an infer request body: JSON, optionally followed by binary tensor data.

    The document has a fixed structure, so its nesting is checked where it is free: an input's
    ``data`` arrays and the values of input and output ``parameters``.
    """
    if header_length is None or header_length == len(body):
        # (a JSON-only body that names its JSON part's length anyway, as perf_analyzer's JSON tensors do, is the
        # same document: binary data it cannot have, an input that says it has some goes the general way)
        typed = _decode_typed(model_name, model_version, body, limits, max_json_depth)
        if typed is not None:
            return typed
    if header_length is None:
        header = body
        binary_len = 0
    else:
        if header_length < 0 or header_length > len(body):
            raise InvalidArgument(f"Inference-Header-Content-Length {header_length} is outside the request "
                                  f"body of {len(body)} bytes")
        header = memoryview(body)[:header_length]
        binary_len = len(body) - header_length
    doc = parse_json(header, "request")
    if type(doc) is not dict:
        raise InvalidArgument(f"the inference request must be a JSON object, got {_json_name(doc)}")

    request_id = doc.get("id", "")
    if type(request_id) is not str:
        raise InvalidArgument(f"'id' must be a string, got {_json_name(request_id)}")

    # -- request parameters
    params = doc.get("parameters")
    if params is None:
        binary_output, priority, timeout_us, parameters = False, 0, 0, {}
    else:
        if type(params) is not dict:
            raise InvalidArgument(f"request 'parameters' must be an object, got {_json_name(params)}")
        binary_output, priority, timeout_us, parameters = _request_parameters(params)

    # -- inputs
    inputs_json = doc.get("inputs")
    if type(inputs_json) is not list:
        if inputs_json is None:
            raise InvalidArgument("the inference request has no 'inputs' array")
        raise InvalidArgument(f"'inputs' must be an array, got {_json_name(inputs_json)}")
    inputs: dict[str, Tensor] = {}
    view = memoryview(body) if binary_len else None
    offset = header_length or 0
    end = len(body)
    for index, item in enumerate(inputs_json):
        if type(item) is not dict:
            raise InvalidArgument(f"inputs[{index}] must be an object, got {_json_name(item)}")
        name = item.get("name")
        if type(name) is not str or not name:
            raise InvalidArgument(f"inputs[{index}] needs a 'name' string")
        if name in inputs:
            raise InvalidArgument(f"input '{name}' appears more than once in the request")
        datatype = item.get("datatype")
        if type(datatype) is not str:
            raise InvalidArgument(f"input '{name}': 'datatype' must be a string, got {_json_name(datatype)}")
        itemsize = _ITEMSIZE.get(datatype)
        if itemsize is None:
            raise InvalidArgument(f"input '{name}': unknown datatype '{datatype[:40]}'")
        shape = item.get("shape")
        if type(shape) is not list:
            _bad_shape(name, shape)
        count = 1
        for dim in shape:
            if type(dim) is not int or dim < 0:
                _bad_shape(name, shape)
            count *= dim
        if len(shape) > limits.max_rank or count > limits.max_elements or not count:
            limits.check(f"input '{name}'", shape, count)
        tparams = item.get("parameters")
        size = None
        extra_params = None
        if tparams is not None:
            if type(tparams) is not dict:
                raise InvalidArgument(f"input '{name}': 'parameters' must be an object, got {_json_name(tparams)}")
            size = tparams.get("binary_data_size")
            if len(tparams) > (size is not None):
                extra_params = {k: v for k, v in tparams.items() if k != "binary_data_size"}
                check_json_depth(extra_params, max_json_depth, f"input '{name}': 'parameters'",
                                 _TENSOR_FIELD_DEPTH)
        has_data = "data" in item
        if tparams is not None and "shared_memory_region" in tparams:
            if has_data or size is not None:
                raise InvalidArgument(f"input '{name}' must set only one of 'data', 'binary_data_size' in "
                                      "'parameters' or 'shared_memory_region' in 'parameters'")
            # the DataPlane reads the data from the region (server/shared_memory.py)
            inputs[name] = Tensor(name, datatype, tuple(shape), None, dict(tparams))
            continue
        if size is not None:
            if has_data:
                raise InvalidArgument(f"input '{name}': set either 'data' or 'binary_data_size', not both")
            if not _is_uint(size):
                raise InvalidArgument(f"input '{name}': 'binary_data_size' must be a non-negative integer, got "
                                      f"{_show(size)}")
            if header_length is None and size:
                raise InvalidArgument(
                    f"input '{name}' has binary data but the request has no Inference-Header-Content-Length "
                    "header giving the size of its JSON part")
            if offset + size > end:
                raise InvalidArgument(f"input '{name}': binary_data_size is {size} bytes but only "
                                      f"{end - offset} bytes of binary data remain in the request body")
            chunk = view[offset:offset + size] if size else b""
            offset += size
            if itemsize:
                if size != count * itemsize:
                    raise InvalidArgument(f"input '{name}': binary_data_size is {size} bytes, but a {datatype} "
                                          f"tensor of shape {shape} needs {count * itemsize}")
                if datatype == "BF16":
                    raise InvalidArgument(f"input '{name}': BF16 tensors are not supported")
                # the dtype by position (numpy's frombuffer parses keywords slowly: ~1k instructions more per call), the
                # shape set in place (a new view: fewer instructions than reshape's argument parsing)
                array = np.frombuffer(chunk, _NUMPY[datatype])
                array.shape = shape
            elif count == 0 and not size:
                array = np.empty(shape, dtype=np.object_)
            else:
                array = from_raw(chunk, datatype, tuple(shape), name)
        elif has_data:
            shape = tuple(shape)
            data = item["data"]
            kinds = _FLAT_KINDS.get(datatype)
            if (kinds is not None and type(data) is list and len(data) == count
                    and set(map(type, data)) <= kinds):  # flat numbers or booleans (the usual JSON tensor)
                try:
                    array = np.array(data, _NUMPY[datatype])
                except (OverflowError, ValueError, TypeError):  # the general path says what does not fit
                    array = _json_tensor_data(name, datatype, shape, count, data, max_json_depth)
                else:
                    if len(shape) != 1:
                        array.shape = shape
            else:
                array = _json_tensor_data(name, datatype, shape, count, data, max_json_depth)
        else:
            raise InvalidArgument(f"input '{name}' has neither 'data' nor a 'binary_data_size' parameter")
        tensor = Tensor(name, datatype, shape if type(shape) is tuple else tuple(shape), array)
        if extra_params:
            tensor.parameters = extra_params
        inputs[name] = tensor
    if offset != end and header_length is not None:
        raise InvalidArgument(f"the request body has {end - offset} bytes of binary data that no input's "
                              f"binary_data_size accounts for (model '{model_name}')")

    # -- requested outputs
    outputs = None
    requested = None
    classify = False
    outputs_json = doc.get("outputs")
    if outputs_json is not None:
        if type(outputs_json) is not list:
            raise InvalidArgument(f"'outputs' must be an array, got {_json_name(outputs_json)}")
        outputs = {}
        requested = []
        for index, item in enumerate(outputs_json):
            if type(item) is not dict:
                raise InvalidArgument(f"outputs[{index}] must be an object, got {_json_name(item)}")
            name = item.get("name")
            if type(name) is not str or not name:
                raise InvalidArgument(f"outputs[{index}] needs a 'name' string")
            options = _DEFAULT_OUTPUT
            oparams = item.get("parameters")
            if oparams is not None:
                if type(oparams) is not dict:
                    raise InvalidArgument(f"output '{name}': 'parameters' must be an object, "
                                          f"got {_json_name(oparams)}")
                binary = oparams.get("binary_data")
                classes = oparams.get("classification")
                if len(oparams) > (binary is not None) + (classes is not None):  # more than those two scalars
                    check_json_depth(oparams, max_json_depth, f"output '{name}': 'parameters'", _TENSOR_FIELD_DEPTH)
                if binary is not None:
                    if type(binary) is not bool:
                        raise InvalidArgument(f"output '{name}': 'binary_data' must be a boolean, "
                                              f"got {_json_name(binary)}")
                    options = _BINARY_OUTPUT if binary else _JSON_OUTPUT
                if classes is not None:
                    if not _is_uint(classes):
                        raise InvalidArgument(f"output '{name}': 'classification' must be a non-negative "
                                              f"integer, got {_show(classes)}")
                    if classes:
                        options = OutputOptions(binary, classes)
                        classify = True
            if name in outputs:  # Triton's core refuses a request that names an output twice
                raise InvalidArgument(f"output '{name}' already exists in request")
            outputs[name] = options
            requested.append(RequestedOutput(name, oparams) if oparams else RequestedOutput(name))

    request = InferenceRequest(model_name, inputs, model_version=model_version, id=request_id,
                               outputs=requested, parameters=parameters, priority=priority,
                               timeout_us=timeout_us)
    return DecodedRequest(request, binary_output, outputs, classify)


def decode_raw_request(model_name: str, model_version: str, body: bytes, config) -> DecodedRequest:
    """``Inference-Header-Content-Length: 0``: the body is the raw data of the model's only input; for a BYTES input
    (shape [1]) the body is its one element, as in Triton. Errors in Triton's words."""
    if len(config.input) != 1:
        raise InvalidArgument(f"Raw request must only have 1 input (found 1) to be deduced but got "
                              f"{len(config.input)} inputs in '{model_name}' model configuration")
    spec = config.input[0]
    datatype = config_to_datatype(mc.DataType.Name(spec.data_type))
    dims = list(spec.dims)
    if datatype == "BYTES":
        if dims != [1]:
            raise InvalidArgument(f"For BYTE datatype raw input '{spec.name}', the model must have input shape [1]")
        body = len(body).to_bytes(4, "little") + bytes(body)  # the one element, serialized as BYTES tensors are
    else:
        variable = [i for i, d in enumerate(dims) if d == -1]
        if len(variable) > 1:
            raise InvalidArgument(f"The shape of the raw input '{spec.name}' can not be deduced because there are "
                                  "more than one variable-sized dimension")
        itemsize = element_size(datatype)
        fixed = math.prod(d for d in dims if d != -1) * itemsize
        if variable:
            if fixed == 0 or len(body) % fixed:
                raise InvalidArgument(f"raw binary request of {len(body)} bytes does not fit input "
                                      f"'{spec.name}' ({datatype}, dims {dims})")
            dims[variable[0]] = len(body) // fixed
    shape = ([1] if config.max_batch_size > 0 else []) + dims
    array = from_raw(body, datatype, tuple(shape), spec.name)
    request = InferenceRequest(model_name, {spec.name: Tensor(spec.name, datatype, tuple(shape), array)},
                               model_version=model_version)
    return DecodedRequest(request, True, None)


# -- responses -------------------------------------------------------------------------------
def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


def dumps(value: Any) -> bytes:
    return orjson.dumps(value, default=_json_default, option=_JSON_OPTIONS)


def _bytes_as_json(name: str, array: np.ndarray) -> list[str]:
    out = []
    for item in array.ravel():
        if type(item) is bytes:
            try:
                out.append(item.decode("utf-8"))
            except UnicodeDecodeError:
                raise InvalidArgument(f"output '{name}' holds bytes that are not valid UTF-8 and cannot be "
                                      "returned as JSON; request it with 'binary_data': true") from None
        else:
            out.append(item if type(item) is str else str(item))
    return out


def encode_response(response: InferenceResponse, decoded: DecodedRequest, classifier=None) -> tuple[bytes, int | None]:
    """Response JSON (and binary output data); the header length when binary data follows it."""
    default_binary = decoded.binary_output
    requested = decoded.outputs
    outputs = []
    buffers = []
    for tensor in response.outputs:
        binary = default_binary
        class_count = 0
        if requested is not None:
            options = requested.get(tensor.name)
            if options is not None:
                if options.binary is not None:
                    binary = options.binary
                class_count = options.class_count
        array = tensor.data
        if array is None:  # written to a shared memory region: the answer carries no data
            entry = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
            if tensor.parameters:
                entry["parameters"] = dict(tensor.parameters)
            outputs.append(entry)
            continue
        if type(array) is not np.ndarray:
            array = np.asarray(array, dtype=np.object_ if tensor.datatype == "BYTES" else None)
        datatype = tensor.datatype
        if class_count:
            if classifier is None:
                raise InvalidArgument(f"output '{tensor.name}': classification is not available")
            array = classifier(tensor.name, datatype, array, class_count)
            datatype = "BYTES"
        elif datatype != "BYTES" and datatype != "BF16":
            dtype = _NUMPY.get(datatype)
            if dtype is None:
                dtype = numpy_dtype(datatype)  # an unknown datatype: its error
            if array.dtype != dtype:
                array = array.astype(dtype)
        entry: dict[str, Any] = {"name": tensor.name, "datatype": datatype, "shape": list(array.shape)}
        if tensor.parameters:
            entry["parameters"] = dict(tensor.parameters)
        if binary:
            raw = to_raw(array, datatype)
            if "parameters" in entry:
                entry["parameters"]["binary_data_size"] = len(raw)
            else:
                entry["parameters"] = {"binary_data_size": len(raw)}
            if raw:
                buffers.append(raw)
        elif datatype == "BYTES":
            entry["data"] = _bytes_as_json(tensor.name, array)
        elif datatype == "BF16":
            raise InvalidArgument(f"output '{tensor.name}': BF16 outputs can only be returned as binary data")
        else:
            entry["data"] = array.ravel()  # contiguous, as orjson needs (a copy only where it is not)
        outputs.append(entry)
    doc: dict[str, Any] = {}
    if response.id:
        doc["id"] = response.id
    doc["model_name"] = response.model_name
    doc["model_version"] = response.model_version
    if response.parameters:
        doc["parameters"] = response.parameters
    doc["outputs"] = outputs
    header = dumps(doc)
    if not buffers:
        return header, None
    return b"".join([header, *buffers]), len(header)
