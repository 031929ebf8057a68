"""``pb_utils.Tensor`` and Triton's datatype tables for Python models.

A Tensor is a name plus a numpy array. BYTES tensors are numpy object arrays of ``bytes``: strings
a model hands over are encoded as UTF-8 once, when the tensor is made, so what leaves the model is
always bytes. Fixed-size tensors wrap the model's array without copying it.
"""

from __future__ import annotations

import enum
import struct
from typing import Any

import numpy as np

from tideserve.backend_api import Tensor as CoreTensor

from .errors import TritonModelException


class DataType(enum.IntEnum):
    """``TRITONSERVER_DataType``: what :meth:`Tensor.triton_dtype` returns."""

    INVALID = 0
    BOOL = 1
    UINT8 = 2
    UINT16 = 3
    UINT32 = 4
    UINT64 = 5
    INT8 = 6
    INT16 = 7
    INT32 = 8
    INT64 = 9
    FP16 = 10
    FP32 = 11
    FP64 = 12
    BYTES = 13
    BF16 = 14


_NUMPY_OF_TYPE = {
    DataType.BOOL: np.bool_, DataType.UINT8: np.uint8, DataType.UINT16: np.uint16,
    DataType.UINT32: np.uint32, DataType.UINT64: np.uint64, DataType.INT8: np.int8,
    DataType.INT16: np.int16, DataType.INT32: np.int32, DataType.INT64: np.int64,
    DataType.FP16: np.float16, DataType.FP32: np.float32, DataType.FP64: np.float64,
    DataType.BYTES: np.object_,
}
_TYPE_OF_NUMPY = {np.dtype(v): k for k, v in _NUMPY_OF_TYPE.items()}

# config spelling (``TYPE_FP32``) -> numpy type, as Triton's utilities publish it
TRITON_STRING_TO_NUMPY = {
    "TYPE_BOOL": bool, "TYPE_UINT8": np.uint8, "TYPE_UINT16": np.uint16, "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64, "TYPE_INT8": np.int8, "TYPE_INT16": np.int16, "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64, "TYPE_FP16": np.float16, "TYPE_FP32": np.float32, "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}


def triton_to_numpy_type(data_type: int):
    """``TRITONSERVER_DataType`` number -> numpy type (None if it has none)."""
    return _NUMPY_OF_TYPE.get(data_type)


def numpy_to_triton_type(data_type) -> int | None:
    """numpy dtype or type -> ``TRITONSERVER_DataType`` number (None if unsupported)."""
    try:
        dtype = np.dtype(data_type)
    except TypeError:
        return None
    if dtype.kind == "S":
        return int(DataType.BYTES)
    found = _TYPE_OF_NUMPY.get(dtype)
    return None if found is None else int(found)


def triton_string_to_numpy(triton_type_string: str):
    return TRITON_STRING_TO_NUMPY[triton_type_string]


def serialize_byte_tensor(input_tensor: np.ndarray):
    """BYTES array -> each element as a 4-byte little-endian length and its bytes, in C order.

    Returns ``()`` for an empty array and None for an array that is not of bytes or objects.
    """
    if input_tensor.size == 0:
        return ()
    if input_tensor.dtype != np.object_ and input_tensor.dtype.type != np.bytes_:
        return None
    parts = []
    for item in input_tensor.ravel(order="C"):
        raw = _as_bytes(item)
        parts.append(struct.pack("<I", len(raw)))
        parts.append(raw)
    return b"".join(parts)


def deserialize_bytes_tensor(encoded_tensor) -> np.ndarray:
    """Inverse of :func:`serialize_byte_tensor`: a flat object array of ``bytes``."""
    view = memoryview(encoded_tensor).cast("B")
    items = []
    offset = 0
    while offset < len(view):
        (length,) = struct.unpack_from("<I", view, offset)
        offset += 4
        items.append(bytes(view[offset:offset + length]))
        offset += length
    out = np.empty(len(items), dtype=np.object_)
    out[:] = items
    return out


def _as_bytes(item: Any) -> bytes:
    if isinstance(item, bytes):
        return item
    if isinstance(item, str):
        return item.encode("utf-8")
    if isinstance(item, (bytearray, memoryview, np.bytes_)):
        return bytes(item)
    return str(item).encode("utf-8")


def _bytes_array(array: np.ndarray) -> np.ndarray:
    """An object array of ``bytes`` with the shape of ``array`` (str, numbers... encoded)."""
    if array.dtype == np.object_ and all(type(x) is bytes for x in array.flat):
        return array
    out = np.empty(array.shape, dtype=np.object_)
    flat = out.reshape(-1)
    for index, item in enumerate(array.flat):
        flat[index] = _as_bytes(item)
    return out


class _Capsule:
    """Lets ``np.from_dlpack`` read a bare DLPack capsule (CPU memory only)."""

    def __init__(self, capsule) -> None:
        self._capsule = capsule

    def __dlpack__(self, stream=None, **_kwargs):
        return self._capsule

    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU


class Tensor:
    """A named tensor given to or made by a Python model: ``Tensor(name, numpy_array)``."""

    __slots__ = ("_array", "_datatype", "_name")

    def __init__(self, name: str, data) -> None:
        if not isinstance(name, str):
            raise TypeError(f"Tensor name must be a str, got {type(name).__name__}")
        array = data if isinstance(data, np.ndarray) else np.asarray(data)
        kind = array.dtype.kind
        if kind in ("O", "S", "U"):
            array = _bytes_array(array)
            datatype = "BYTES"
        else:
            found = _TYPE_OF_NUMPY.get(array.dtype)
            if found is None:
                raise TritonModelException(
                    f"tensor '{name}': numpy dtype {array.dtype} has no Triton datatype")
            datatype = found.name
            if not array.flags.c_contiguous:
                array = np.ascontiguousarray(array)
        self._name = name
        self._array = array
        self._datatype = datatype

    # -- Triton's API --------------------------------------------------------------------
    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        array = self._array
        if not array.flags.writeable:  # e.g. an input read straight from a request body
            array = self._array = array.copy()  # Triton's inputs are writable: models may edit them in place
        return array

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def triton_dtype(self) -> int:
        return int(DataType[self._datatype])

    def is_cpu(self) -> bool:
        return True

    def to_dlpack(self):
        if self._datatype == "BYTES":
            raise TritonModelException(f"tensor '{self._name}': BYTES tensors cannot be exported through DLPack")
        return self.as_numpy().__dlpack__()  # DLPack cannot export read-only memory

    def __dlpack__(self, stream=None, **kwargs):
        return self.to_dlpack()

    def __dlpack_device__(self):
        return (1, 0)

    @staticmethod
    def from_dlpack(name: str, dlpack_object) -> Tensor:
        """A Tensor from a DLPack capsule or from any object with ``__dlpack__`` (CPU memory)."""
        source = dlpack_object if hasattr(dlpack_object, "__dlpack__") else _Capsule(dlpack_object)
        if hasattr(source, "__dlpack_device__"):
            device_type = source.__dlpack_device__()[0]
            if device_type not in (1, 3):  # kDLCPU, kDLCUDAHost
                if hasattr(dlpack_object, "cpu"):  # e.g. a torch tensor on a GPU
                    return Tensor.from_dlpack(name, dlpack_object.cpu())
                raise TritonModelException(
                    f"tensor '{name}': only CPU tensors can be imported through DLPack here")
        array = np.from_dlpack(source)
        if not array.flags.c_contiguous:
            raise TritonModelException(f"tensor '{name}': DLPack tensors must be contiguous in C order")
        return Tensor(name, array)

    def __repr__(self) -> str:
        return f"Tensor(name={self._name!r}, datatype={self._datatype}, shape={list(self._array.shape)})"

    # -- conversion to and from the server's tensors ----------------------------------------
    @classmethod
    def _wrap(cls, tensor: CoreTensor) -> Tensor:
        """A view of a server tensor (no copy, no checks)."""
        out = object.__new__(cls)
        out._name = tensor.name
        out._array = tensor.data
        out._datatype = tensor.datatype
        return out

    def _core(self) -> CoreTensor:
        return CoreTensor(self._name, self._datatype, self._array.shape, self._array)
