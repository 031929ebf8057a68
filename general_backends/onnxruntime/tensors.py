"""ONNX Runtime tensor types and shapes in Triton's terms, and the BYTES <-> string conversion.

ONNX string tensors reach Python as object arrays of ``str``; the server's BYTES tensors are
object arrays of ``bytes``. Strings cross as UTF-8 (the only encoding ONNX Runtime's Python API
passes), so a BYTES element that is not valid UTF-8 is refused with the input's name.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tideserve.backend_api import InvalidArgument

# ONNX Runtime's ``NodeArg.type`` -> Triton config datatype
_CONFIG_TYPES = {
    "tensor(bool)": "TYPE_BOOL",
    "tensor(uint8)": "TYPE_UINT8",
    "tensor(uint16)": "TYPE_UINT16",
    "tensor(uint32)": "TYPE_UINT32",
    "tensor(uint64)": "TYPE_UINT64",
    "tensor(int8)": "TYPE_INT8",
    "tensor(int16)": "TYPE_INT16",
    "tensor(int32)": "TYPE_INT32",
    "tensor(int64)": "TYPE_INT64",
    "tensor(float16)": "TYPE_FP16",
    "tensor(float)": "TYPE_FP32",
    "tensor(double)": "TYPE_FP64",
    "tensor(bfloat16)": "TYPE_BF16",
    "tensor(string)": "TYPE_STRING",
}


@dataclass(frozen=True)
class GraphTensor:
    """One input or output of the ONNX graph: ``dims`` has -1 for every dynamic dimension."""

    name: str
    onnx_type: str  # e.g. "tensor(float)"
    dims: tuple[int, ...]

    @property
    def config_type(self) -> str:
        """Triton's name for the type (``TYPE_FP32``), or ``TYPE_INVALID`` if Triton has none."""
        return _CONFIG_TYPES.get(self.onnx_type, "TYPE_INVALID")

    @property
    def batchable(self) -> bool:
        """Whether the first dimension is variable, as batching requires."""
        return bool(self.dims) and self.dims[0] == -1


def graph_tensor(node_arg) -> GraphTensor:
    """A ``GraphTensor`` from ONNX Runtime's ``NodeArg`` (symbolic and unknown dims become -1)."""
    dims = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in (node_arg.shape or ()))
    return GraphTensor(node_arg.name, node_arg.type, dims)


def to_onnx(name: str, array: np.ndarray) -> np.ndarray:
    """An input array as ONNX Runtime takes it: BYTES (object arrays of bytes) become str."""
    if array.dtype != np.object_:
        return array
    flat = array.ravel()
    out = np.empty(flat.size, dtype=np.object_)
    try:
        out[:] = [item.decode("utf-8") if isinstance(item, (bytes, bytearray)) else str(item) for item in flat]
    except UnicodeDecodeError as exc:
        raise InvalidArgument(
            f"input '{name}': element is not valid UTF-8 ({exc.reason} at byte {exc.start}); ONNX string "
            f"tensors pass through ONNX Runtime as UTF-8 text") from None
    return out.reshape(array.shape)


def from_onnx(array: np.ndarray) -> np.ndarray:
    """An output array as the server sends it: ONNX strings become UTF-8 ``bytes``."""
    if array.dtype != np.object_ and array.dtype.kind != "U":
        return array
    flat = array.ravel()
    out = np.empty(flat.size, dtype=np.object_)
    out[:] = [item if isinstance(item, bytes) else str(item).encode("utf-8") for item in flat]
    return out.reshape(array.shape)
