"""Reading a tokenizer model's request tensors row by row, and building its output tensors."""

from __future__ import annotations

from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from tideserve.backend_api import InferenceRequest, InvalidArgument, Tensor, config_to_datatype, numpy_dtype

TRUE = ("1", "true", "t", "yes", "y", "on")
FALSE = ("0", "false", "f", "no", "n", "off")


class Rows:
    """One request's inputs as rows: ``batch_size`` rows for a batched model, else one."""

    def __init__(self, request: InferenceRequest, batched: bool) -> None:
        self.request = request
        self.batched = batched
        self.count = request.batch_size if batched else 1

    def has(self, name: str) -> bool:
        return name in self.request.inputs

    def values(self, name: str, row: int) -> np.ndarray | None:
        """The flat values of input ``name`` in ``row`` (None when the request lacks it)."""
        tensor = self.request.inputs.get(name)
        if tensor is None:
            return None
        data = np.asarray(tensor.data)
        if self.batched:
            return data.reshape(data.shape[0], -1)[row]
        return data.reshape(-1)

    def scalar(self, name: str, row: int, parameter: bool = True) -> Any:
        """The one value of input ``name`` in ``row``; else the request parameter of that name (when
        ``parameter``); else None."""
        values = self.values(name, row)
        if values is None:
            return self.request.parameters.get(name) if parameter else None
        if values.size != 1:
            raise InvalidArgument(f"input '{name}' must hold one value per request, got {values.size}")
        value = values[0]
        return value.item() if isinstance(value, np.generic) else value

    def flag(self, name: str, row: int, default: bool) -> bool:
        return as_bool(name, self.scalar(name, row), default)

    def integer(self, name: str, row: int) -> int | None:
        value = self.scalar(name, row)
        if value is None:
            return None
        if isinstance(value, (bool, float)) or not isinstance(value, (int, str)):
            raise InvalidArgument(f"'{name}' must be an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:
            raise InvalidArgument(f"'{name}' must be an integer, got {value!r}") from None


def as_bool(name: str, value: Any, default: bool) -> bool:
    if value is None:
        return default
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, (str, bytes)):
        text = (value.decode() if isinstance(value, bytes) else value).strip().lower()
        if text in TRUE:
            return True
        if text in FALSE:
            return False
    raise InvalidArgument(f"'{name}' must be a boolean, got {value!r}")


def utf8(name: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except (UnicodeDecodeError, TypeError):
        raise InvalidArgument(f"input '{name}' must be UTF-8 text") from None


class OutputBuilder:
    """Output tensors with the data types the model's config declares."""

    def __init__(self, config: mc.ModelConfig) -> None:
        self.datatypes = {t.name: config_to_datatype(mc.DataType.Name(t.data_type)) for t in config.output}

    def tensor(self, name: str, array: np.ndarray) -> Tensor:
        datatype = self.datatypes[name]
        data = np.asarray(array, dtype=numpy_dtype(datatype))
        return Tensor(name, datatype, tuple(data.shape), data)

    def strings(self, name: str, texts: list[str], shape: tuple[int, ...]) -> Tensor:
        data = np.empty(len(texts), dtype=np.object_)
        data[:] = [t.encode("utf-8") for t in texts]
        return self.tensor(name, data.reshape(shape))
