"""KServe v2 gRPC messages <-> core requests and responses.

Only wire-format translation lives here: every check that depends on the model (input names,
datatypes against the config, shapes, batch size) is the DataPlane's. What this module checks
is what only the wire format can get wrong: tensor data that does not match its own declared
datatype and shape, raw and typed contents mixed, malformed parameters.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from ..classification import classify
from ..datatypes import DATATYPES, from_raw, to_raw
from ..errors import InvalidArgument, ServerError
from ..limits import TensorLimits
from ..types import InferenceRequest, InferenceResponse, RequestedOutput, Tensor

ModelInferRequest = pb.ModelInferRequest
ModelInferResponse = pb.ModelInferResponse

# Which ``InferTensorContents`` field carries each datatype (FP16 / BF16 have none: raw only).
CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
# The numpy type each typed field is read as before narrowing to the datatype.
_FIELD_DTYPE = {
    "bool_contents": np.bool_,
    "int_contents": np.int32,
    "int64_contents": np.int64,
    "uint_contents": np.uint32,
    "uint64_contents": np.uint64,
    "fp32_contents": np.float32,
    "fp64_contents": np.float64,
}
_NUMPY = {
    "BOOL": np.dtype(np.bool_), "INT8": np.dtype(np.int8), "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32), "INT64": np.dtype(np.int64), "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16), "UINT32": np.dtype(np.uint32), "UINT64": np.dtype(np.uint64),
    "FP32": np.dtype(np.float32), "FP64": np.dtype(np.float64),
}

# Request parameter keys starting with "triton_" that clients may set (Triton rejects the others).
TRITON_REQUEST_PARAMS = ("triton_enable_empty_final_response",)
DEFAULT_TENSOR_LIMITS = TensorLimits()


# -- parameters ------------------------------------------------------------------------------
def param_value(param) -> Any:
    """Python value of an ``InferParameter`` (None if no value is set)."""
    which = param.WhichOneof("parameter_choice")
    return getattr(param, which) if which is not None else None


def params_to_dict(params) -> dict[str, Any]:
    # a protobuf map iterates its keys in C; its items() is the Python Mapping mixin's
    return {key: param_value(params[key]) for key in params} if len(params) else {}


def set_param(target, key: str, value: Any) -> None:
    """Store ``value`` as ``target[key]`` in the ``InferParameter`` field matching its type."""
    if value is None:
        return
    param = target[key]
    if isinstance(value, (bool, np.bool_)):
        param.bool_param = bool(value)
    elif isinstance(value, (int, np.integer)):
        value = int(value)
        if value > 0x7FFFFFFFFFFFFFFF:
            param.uint64_param = value
        else:
            param.int64_param = value
    elif isinstance(value, (float, np.floating)):
        param.double_param = float(value)
    elif isinstance(value, bytes):
        param.string_param = value.decode("utf-8", "replace")
    else:
        param.string_param = str(value)


class StreamOptions:
    """Per-request options of the gRPC frontend itself (not passed to the model)."""

    __slots__ = ("enable_empty_final",)

    def __init__(self) -> None:
        self.enable_empty_final = False


def _typed(param, key: str, kinds: tuple[str, ...], expected: str):
    which = param.WhichOneof("parameter_choice")
    if which not in kinds:
        raise InvalidArgument(f"invalid value type for '{key}' parameter, expected {expected}.")
    return getattr(param, which)


def _request_parameters(msg, request: InferenceRequest, options: StreamOptions) -> None:
    params: dict[str, Any] = {}
    parameters = msg.parameters
    for key in parameters:
        param = parameters[key]
        if key == "priority":
            value = _typed(param, key, ("int64_param", "uint64_param"), "int64_param or uint64_param")
            if value < 0:
                raise InvalidArgument("invalid value for 'priority', expected value >= 0.")
            request.priority = value
        elif key == "timeout":
            value = _typed(param, key, ("int64_param",), "int64_param")
            if value < 0:
                raise InvalidArgument("invalid value for 'timeout', expected value >= 0.")
            request.timeout_us = value
        elif key == "sequence_id":
            params[key] = _typed(param, key, ("int64_param", "uint64_param", "string_param"),
                                 "int64_param or string_param")
        elif key in ("sequence_start", "sequence_end"):
            params[key] = _typed(param, key, ("bool_param",), "bool_param")
        elif key.startswith("triton_"):
            if key not in TRITON_REQUEST_PARAMS:
                raise InvalidArgument(
                    "parameter keys starting with 'triton_' are reserved for Triton usage. Only the "
                    f"following keys starting with 'triton_' are allowed: {' '.join(TRITON_REQUEST_PARAMS)}")
            options.enable_empty_final = _typed(param, key, ("bool_param",), "bool_param")
        else:
            value = param_value(param)
            if value is None:
                raise InvalidArgument(f"parameter '{key}' has no value")
            params[key] = value
    request.parameters = params


# -- inputs ----------------------------------------------------------------------------------
def _where(name: str, model: str) -> str:
    return f"input '{name}' for model '{model}'"


def _check_header(tensor, model: str, limits: TensorLimits) -> tuple[str, str, tuple[int, ...], int]:
    name = tensor.name
    datatype = tensor.datatype
    if datatype not in DATATYPES:
        raise InvalidArgument(f"{_where(name, model)} has unsupported datatype '{datatype}'")
    shape = tuple(tensor.shape)
    count = 1
    for dim in shape:
        if dim < 0:
            raise InvalidArgument(f"{_where(name, model)} has invalid shape {list(shape)}: "
                                  "dimensions must be >= 0")
        count *= dim
    if len(shape) > limits.max_rank or count > limits.max_elements or not count:
        limits.check(_where(name, model), shape, count)
    return name, datatype, shape, count


def _element_count(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _from_contents(contents, name: str, datatype: str, shape: tuple[int, ...], model: str) -> np.ndarray:
    fields = contents.ListFields()
    expected = CONTENTS_FIELD.get(datatype)
    if expected is None:
        raise InvalidArgument(f"{_where(name, model)}: datatype {datatype} has no typed contents field; "
                              "send its data in raw_input_contents")
    count = _element_count(shape)
    if not fields:
        if count:
            raise InvalidArgument(f"{_where(name, model)}: contents holds 0 elements, shape {list(shape)} "
                                  f"needs {count}")
        return np.empty(shape, dtype=_NUMPY.get(datatype, np.object_))
    if len(fields) > 1:
        raise InvalidArgument(f"{_where(name, model)}: contents sets "
                              f"{' and '.join(f.name for f, _ in fields)}; set only {expected}")
    field, values = fields[0]
    if field.name != expected:
        raise InvalidArgument(f"{_where(name, model)} has datatype {datatype}, whose typed data goes in "
                              f"contents.{expected}, but the request sets contents.{field.name}")
    if len(values) != count:
        raise InvalidArgument(f"{_where(name, model)}: contents.{expected} holds {len(values)} elements, "
                              f"shape {list(shape)} needs {count}")
    if datatype == "BYTES":
        data = np.empty(count, dtype=np.object_)
        data[:] = list(values)
        return data.reshape(shape)
    data = np.fromiter(values, dtype=_FIELD_DTYPE[expected], count=count)
    target = _NUMPY[datatype]
    if data.dtype != target:
        data = data.astype(target)  # INT8/INT16/UINT8/UINT16 ride in 32-bit fields
    return data.reshape(shape)


def decode_request(msg, options: StreamOptions | None = None,
                   limits: TensorLimits = DEFAULT_TENSOR_LIMITS) -> InferenceRequest:
    """ModelInferRequest -> InferenceRequest; InvalidArgument naming the tensor on bad data (or on a shape
    past ``limits``)."""
    model = msg.model_name
    raws = msg.raw_input_contents
    raw_count = len(raws)
    raw_index = 0
    inputs: dict[str, Tensor] = {}
    for tensor in msg.inputs:
        name, datatype, shape, count = _check_header(tensor, model, limits)
        if name in inputs:
            raise InvalidArgument(f"{_where(name, model)} appears more than once in the request")
        params = params_to_dict(tensor.parameters) if len(tensor.parameters) else {}
        if params and "shared_memory_region" in params:
            if tensor.HasField("contents"):
                raise InvalidArgument(f"unexpected 'content' provided when using shared memory for input tensor "
                                      f"'{name}' for model '{model}'")
            # the DataPlane reads the data from the region (server/shared_memory.py)
            inputs[name] = Tensor(name, datatype, shape, None, params)
            continue
        if tensor.HasField("contents"):
            if raw_count:
                raise InvalidArgument(f"contents field must not be specified when using raw_input_contents "
                                      f"for '{name}' for model '{model}'")
            data = _from_contents(tensor.contents, name, datatype, shape, model)
        else:
            if raw_index >= raw_count:
                raise InvalidArgument(f"unable to find data for input tensor '{name}' for model '{model}' "
                                      "in request.")
            raw = raws[raw_index]
            dtype = _NUMPY.get(datatype)
            if dtype is not None and len(raw) == count * dtype.itemsize:  # the common case, as from_raw reads it
                # the dtype by position (numpy's frombuffer parses keywords slowly: ~1k instructions more per
                # call), the shape set in place (a fresh view: fewer instructions than reshape's argument parsing)
                data = np.frombuffer(raw, dtype)
                data.shape = shape
            else:  # BYTES, FP16, or a size that does not fit: from_raw reads it or names the problem
                try:
                    data = from_raw(raw, datatype, shape, name)
                except ValueError as exc:  # e.g. a shape whose element count overflows int64
                    raise InvalidArgument(f"{_where(name, model)}: data does not fit shape {list(shape)}: "
                                          f"{exc}") from None
            raw_index += 1
        inputs[name] = Tensor(name, datatype, shape, data, params)
    if raw_index != raw_count:
        raise InvalidArgument(f"model '{model}': the request has {raw_count} raw_input_contents for "
                              f"{len(inputs)} input(s) {list(inputs)}; send one per input, in input order")
    outputs = [RequestedOutput(o.name, params_to_dict(o.parameters) if len(o.parameters) else {})
               for o in msg.outputs] if msg.outputs else None
    if outputs is not None and len(outputs) > 1:
        seen = set()
        for output in outputs:
            if output.name in seen:
                raise InvalidArgument(f"output '{output.name}' already exists in request")
            seen.add(output.name)
    request = InferenceRequest(model, inputs, model_version=msg.model_version, id=msg.id, outputs=outputs)
    if len(msg.parameters):
        _request_parameters(msg, request, options if options is not None else StreamOptions())
    return request


# -- the common request on its bytes ---------------------------------------------------------
# A ModelInferRequest as clients serialize it (fields in number order): model_name (1), model_version (2), id (3),
# parameters (4), inputs (5), outputs (6), then raw_input_contents (7). For a request whose inputs and outputs carry
# no parameters and whose inputs' data are raw contents, what comes before the raw contents is the same from one
# request to the next but for the id: its "skeleton" (perf_analyzer's requests, for one, all carry the same request
# parameter, triton_enable_empty_final_response). Once a request of that skeleton passed decode_request, the next ones
# are read straight from their bytes: the skeleton compared, the id and each raw content's length read, the inputs as
# arrays over the request's own bytes, the request parameters as the first one's were decoded.
_SKELETONS_MAX = 16


class _Skeleton:
    __slots__ = ("head", "tail", "limits", "model", "version", "inputs", "outputs", "parameters", "priority",
                 "timeout_us", "empty_final")

    def __init__(self, head: bytes, tail: bytes, limits: TensorLimits, request: InferenceRequest,
                 options: StreamOptions) -> None:
        self.head = head  # model_name and model_version fields
        self.tail = tail  # parameters, inputs and outputs fields (after the id)
        self.limits = limits
        self.model = request.model_name
        self.version = request.model_version
        # what the request parameters decoded to (their values are scalars: a shallow copy per request)
        self.parameters = dict(request.parameters)
        self.priority = request.priority
        self.timeout_us = request.timeout_us
        self.empty_final = options.enable_empty_final
        # (name, datatype, shape, numpy dtype, element count, byte size) per input, in the raw contents' order
        self.inputs = tuple((t.name, t.datatype, t.shape, t.data.dtype, t.data.size, t.data.nbytes)
                            for t in request.inputs.values())
        self.outputs = tuple(o.name for o in request.outputs) if request.outputs else None


_SKELETONS: list[_Skeleton] = []


def _read_varint(data: bytes, position: int) -> tuple[int, int]:
    """(value, position after it) of the varint at ``position``; IndexError past the end."""
    value = shift = 0
    while True:
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7


def decode_request_bytes(data: bytes, limits: TensorLimits = DEFAULT_TENSOR_LIMITS,
                         options: StreamOptions | None = None) -> InferenceRequest | None:
    """The request ``data`` (a serialized ModelInferRequest) holds, read from its bytes when its skeleton is known
    (see above), its frontend options set in ``options``; None otherwise: the caller parses and decodes it
    (:func:`decode_request`), then may :func:`learn_skeleton` from it."""
    if type(data) is not bytes:
        return None
    for skeleton in _SKELETONS:
        head = skeleton.head
        if not data.startswith(head) or skeleton.limits is not limits:
            continue
        try:
            position = len(head)
            request_id = ""
            if data[position] == 0x1A:  # id (3)
                size, position = _read_varint(data, position + 1)
                request_id = data[position:position + size].decode()
                position += size
            if not data.startswith(skeleton.tail, position):
                continue
            position += len(skeleton.tail)
            inputs = {}
            for name, datatype, shape, dtype, count, nbytes in skeleton.inputs:
                if data[position] != 0x3A:  # raw_input_contents (7)
                    return None
                size, position = _read_varint(data, position + 1)
                if size != nbytes or position + size > len(data):
                    return None  # decode_request names the problem
                inputs[name] = Tensor(name, datatype, shape,
                                      np.frombuffer(data, dtype, count, position).reshape(shape), {})
                position += size
        except (IndexError, UnicodeDecodeError):
            return None
        if position != len(data):
            return None
        outputs = skeleton.outputs
        if options is not None:
            options.enable_empty_final = skeleton.empty_final
        return InferenceRequest(skeleton.model, inputs, model_version=skeleton.version, id=request_id,
                                outputs=[RequestedOutput(name, {}) for name in outputs] if outputs else None,
                                parameters=dict(skeleton.parameters) if skeleton.parameters else None,
                                priority=skeleton.priority, timeout_us=skeleton.timeout_us)
    return None


def learn_skeleton(data: bytes, msg, request: InferenceRequest, limits: TensorLimits = DEFAULT_TENSOR_LIMITS,
                   options: StreamOptions | None = None) -> None:
    """Remember the skeleton of ``data`` (``msg`` parsed from it; ``request`` and ``options``, what decode_request
    made of it) when it is of the common shape: raw contents for every input, no parameters on inputs or outputs,
    fields in number order."""
    if type(data) is not bytes or not request.inputs or len(msg.raw_input_contents) != len(request.inputs):
        return
    if "sequence_id" in request.parameters:  # a sequence's requests differ in their parameters: forms not kept
        return
    for tensor in msg.inputs:
        if len(tensor.parameters) or tensor.HasField("contents") or tensor.datatype not in _NUMPY:
            return
    for output in msg.outputs:
        if len(output.parameters):
            return
    # the top-level fields: model_name / model_version, id, then parameters / inputs / outputs, then only raw
    # contents
    fields, position = [], 0
    try:
        while position < len(data):
            tag, start = _read_varint(data, position)
            if tag & 7 != 2:
                return
            size, body = _read_varint(data, start)
            fields.append((tag >> 3, position, body + size))
            position = body + size
    except IndexError:
        return
    numbers = [number for number, _, _ in fields]
    if (numbers.count(1) != 1 or numbers != sorted(numbers) or numbers.count(7) != len(request.inputs)
            or not set(numbers) <= {1, 2, 3, 4, 5, 6, 7}):
        return
    if numbers.count(2) > 1 or numbers.count(3) > 1:
        return
    head_end = max((end for number, _, end in fields if number <= 2), default=0)
    tail_start = next((start for number, start, _ in fields if number >= 4), len(data))
    tail_end = next(start for number, start, _ in fields if number == 7)
    skeleton = _Skeleton(data[:head_end], data[tail_start:tail_end], limits, request,
                         options if options is not None else StreamOptions())
    for known in _SKELETONS:
        if known.head == skeleton.head and known.tail == skeleton.tail and known.limits is limits:
            return
    if len(_SKELETONS) >= _SKELETONS_MAX:
        del _SKELETONS[0]
    _SKELETONS.append(skeleton)


# -- outputs ---------------------------------------------------------------------------------
def encode_response(response: InferenceResponse, msg=None):
    """Fill (or make) a ModelInferResponse; tensor data always goes in ``raw_output_contents``."""
    if msg is None:
        msg = ModelInferResponse()
    msg.model_name = response.model_name
    msg.model_version = response.model_version
    msg.id = response.id
    if response.parameters:
        for key, value in response.parameters.items():
            set_param(msg.parameters, key, value)
    raws = []
    for tensor in response.outputs:
        data = tensor.data
        datatype = tensor.datatype
        if data is None:  # written to a shared memory region: an empty raw entry keeps the outputs' order
            out = msg.outputs.add(name=tensor.name, datatype=datatype, shape=tensor.shape)
            for key, value in (tensor.parameters or {}).items():
                set_param(out.parameters, key, value)
            raws.append(b"")
            continue
        if not isinstance(data, np.ndarray):
            data = np.asarray(data, dtype=np.object_ if datatype == "BYTES" else _NUMPY.get(datatype))
        else:
            expected = _NUMPY.get(datatype)
            if expected is not None and data.dtype != expected:
                data = data.astype(expected)  # e.g. float64 data in an FP32 tensor: send what it declares
        out = msg.outputs.add(name=tensor.name, datatype=datatype, shape=data.shape)
        if tensor.parameters:
            for key, value in tensor.parameters.items():
                set_param(out.parameters, key, value)
        raws.append(to_raw(data, datatype))
    if raws:
        msg.raw_output_contents.extend(raws)
    return msg


# -- outputs as bytes: the serialized ModelInferResponse without a message --------------------
def varint(n: int) -> bytes:
    """``n`` (>= 0) as a protobuf varint."""
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _string_field(number: int, value: str) -> bytes:
    """A length-delimited field (wire type 2) holding ``value`` (proto3: nothing for an empty string)."""
    if not value:
        return b""
    data = value.encode()
    return varint(number << 3 | 2) + varint(len(data)) + data


def _output_field(name: str, datatype: str, shape: tuple[int, ...]) -> bytes:
    """``outputs`` (5): one InferOutputTensor with its name (1), datatype (2) and packed shape (3)."""
    dims = b"".join(varint(dim) for dim in shape)
    body = _string_field(1, name) + _string_field(2, datatype) + (b"\x1a" + varint(len(dims)) + dims if dims else b"")
    return b"\x2a" + varint(len(body)) + body


_CACHE_MAX = 4096  # entries of each cache below; cleared when full (model names, versions and shapes are few)
_HEADS: dict[tuple[str, str], bytes] = {}
_OUTPUTS: dict[tuple[str, str, tuple[int, ...]], bytes] = {}
_RAW_TAG = b"\x32"  # raw_output_contents (6), length-delimited


def encode_response_bytes(response: InferenceResponse) -> bytes | None:
    """The serialized ModelInferResponse that :func:`encode_response` would make, built as bytes: the model
    name and version and each output's header come from a cache, the raw contents are appended as they are.
    None when the response needs the message (parameters on it or on an output, an output in shared memory)."""
    if response.parameters:
        return None
    key = (response.model_name, response.model_version)
    head = _HEADS.get(key)
    if head is None:
        if len(_HEADS) >= _CACHE_MAX:
            _HEADS.clear()
        head = _HEADS[key] = _string_field(1, key[0]) + _string_field(2, key[1])
    parts = [head, _string_field(3, response.id)]
    raws = []
    for tensor in response.outputs:
        data = tensor.data
        if data is None or tensor.parameters:
            return None
        datatype = tensor.datatype
        if type(data) is not np.ndarray:
            data = np.asarray(data, dtype=np.object_ if datatype == "BYTES" else _NUMPY.get(datatype))
        else:
            expected = _NUMPY.get(datatype)
            if expected is not None and data.dtype != expected:
                data = data.astype(expected)
        out_key = (tensor.name, datatype, data.shape)
        field = _OUTPUTS.get(out_key)
        if field is None:
            if len(_OUTPUTS) >= _CACHE_MAX:
                _OUTPUTS.clear()
            field = _OUTPUTS[out_key] = _output_field(*out_key)
        parts.append(field)
        raw = to_raw(data, datatype)
        raws.append(_RAW_TAG + varint(len(raw)))
        raws.append(raw)
    parts += raws
    return b"".join(parts)


def requested_classifications(request: InferenceRequest) -> dict[str, int] | None:
    """``{output name: top-k}`` for outputs requested with the ``classification`` parameter."""
    found = None
    for output in request.outputs:
        count = output.parameters.get("classification") if output.parameters else None
        if count is None:
            continue
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise InvalidArgument(f"output '{output.name}': 'classification' must be an integer >= 1, "
                                  f"got {count!r}")
        found = found or {}
        found[output.name] = count
    return found


def apply_classification(response: InferenceResponse, counts: dict[str, int], batched: bool,
                         labels_of) -> None:
    """Replace the outputs named in ``counts`` by their classification results (in place)."""
    outputs = []
    for tensor in response.outputs:
        count = counts.get(tensor.name)
        if count is not None:
            data, datatype = classify(np.asarray(tensor.data), tensor.datatype, count, tensor.name,
                                      labels_of(tensor.name), batched)
            tensor = Tensor(tensor.name, datatype, data.shape, data, tensor.parameters)
        outputs.append(tensor)
    response.outputs = outputs


def error_message(exc: BaseException) -> tuple[str, str]:
    """(grpc.StatusCode member name, message) for any exception."""
    if isinstance(exc, ServerError):
        return exc.status.grpc_name, exc.message
    return "INTERNAL", f"{type(exc).__name__}: {exc}"
