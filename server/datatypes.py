"""KServe v2 / Triton tensor datatypes and their numpy and wire representations."""

from __future__ import annotations

import math
import struct

import numpy as np

from .errors import InvalidArgument

# Triton datatype name -> numpy dtype (BYTES is an object array of ``bytes``).
_NUMPY_OF = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(np.object_),
}

_DATATYPE_OF = {v: k for k, v in _NUMPY_OF.items() if k != "BYTES"}

DATATYPES = frozenset(_NUMPY_OF) | {"BF16"}


def numpy_dtype(datatype: str) -> np.dtype:
    try:
        return _NUMPY_OF[datatype]
    except KeyError:
        raise InvalidArgument(f"unsupported datatype '{datatype}'") from None


def datatype_of(array: np.ndarray) -> str:
    """Triton datatype name for a numpy array (strings and bytes map to BYTES)."""
    if array.dtype.kind in ("O", "S", "U"):
        return "BYTES"
    try:
        return _DATATYPE_OF[array.dtype]
    except KeyError:
        raise InvalidArgument(f"numpy dtype {array.dtype} has no tensor datatype") from None


def config_to_datatype(data_type: str) -> str:
    """``TYPE_FP32`` (model config) -> ``FP32`` (protocol); ``TYPE_STRING`` -> ``BYTES``."""
    name = data_type[5:] if data_type.startswith("TYPE_") else data_type
    return "BYTES" if name == "STRING" else name


def datatype_to_config(datatype: str) -> str:
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def element_size(datatype: str) -> int:
    """Bytes per element of a fixed-size datatype (0 for BYTES)."""
    if datatype == "BYTES":
        return 0
    if datatype == "BF16":
        return 2
    return numpy_dtype(datatype).itemsize


def serialize_bytes(array: np.ndarray) -> bytes:
    """BYTES tensor -> concatenation of (4-byte little-endian length, bytes) per element."""
    parts = []
    for item in array.ravel(order="C"):
        raw = item if isinstance(item, bytes) else str(item).encode("utf-8")
        parts.append(struct.pack("<I", len(raw)))
        parts.append(raw)
    return b"".join(parts)


def deserialize_bytes(buffer: bytes | memoryview, name: str = "") -> np.ndarray:
    """Inverse of :func:`serialize_bytes`; returns a flat object array of ``bytes``."""
    view = memoryview(buffer)
    items = []
    offset = 0
    total = len(view)
    while offset < total:
        if offset + 4 > total:
            raise InvalidArgument(f"input '{name}': truncated BYTES element length at offset {offset}")
        (length,) = struct.unpack_from("<I", view, offset)
        offset += 4
        if offset + length > total:
            raise InvalidArgument(
                f"input '{name}': BYTES element of {length} bytes runs past the end of the buffer")
        items.append(bytes(view[offset:offset + length]))
        offset += length
    out = np.empty(len(items), dtype=np.object_)
    out[:] = items
    return out


def to_raw(array: np.ndarray, datatype: str) -> bytes:
    """Tensor contents in the binary wire format (row-major, little-endian)."""
    if datatype == "BYTES":
        return serialize_bytes(array)
    return np.ascontiguousarray(array).tobytes()


def from_raw(buffer: bytes | memoryview, datatype: str, shape: tuple[int, ...], name: str) -> np.ndarray:
    """Binary wire format -> numpy array, checking the size against the shape."""
    count = math.prod(shape)
    if datatype == "BYTES":
        flat = deserialize_bytes(buffer, name)
        if flat.size != count:
            raise InvalidArgument(
                f"input '{name}': expected {count} BYTES elements for shape {list(shape)}, got {flat.size}")
        return flat.reshape(shape)
    if datatype == "BF16":
        raise InvalidArgument(f"input '{name}': BF16 tensors are not supported")
    dtype = numpy_dtype(datatype)
    expected = count * dtype.itemsize
    if len(buffer) != expected:
        raise InvalidArgument(
            f"input '{name}': unexpected byte size {len(buffer)}, expecting {expected} "
            f"for {datatype} tensor of shape {list(shape)}")
    return np.frombuffer(buffer, dtype).reshape(shape)
