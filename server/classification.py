"""Triton's classification extension, shared by the HTTP and gRPC frontends.

An output requested with ``classification: k`` comes back as BYTES: the top-``k`` entries of each
batch row as ``"value:index[:label]"``, labels read from the output's ``label_filename``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import InvalidArgument

_CLASSIFIABLE = frozenset({"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
                           "FP16", "FP32", "FP64"})


def classify(data: np.ndarray, datatype: str, count: int, name: str, labels: list[str] | None,
             batched: bool):
    """Triton's classification extension: top-``count`` "value:index[:label]" strings per batch row."""
    if datatype not in _CLASSIFIABLE:
        raise InvalidArgument(f"class result not available for output '{name}' due to unsupported type "
                              f"'{datatype}'")
    if data.size > 1_000_000:
        raise InvalidArgument(f"classification output tensor '{name}' too large")
    batched = batched and data.ndim > 0
    if data.size == 0:
        shape = (data.shape[0], 0) if batched else (0,)
        return np.empty(shape, dtype=np.object_), "BYTES"
    rows = data.reshape(data.shape[0], -1) if batched else data.reshape(1, -1)
    k = min(count, rows.shape[1])
    floating = data.dtype.kind == "f"
    results = []
    for row in rows:
        order = np.argsort(-row.astype(np.float64), kind="stable")[:k]
        for index in order:
            value = row[index]
            text = f"{float(value):f}:{index}" if floating else f"{int(value)}:{index}"
            if labels is not None and index < len(labels):
                text += f":{labels[index]}"
            results.append(text.encode())
    out = np.empty(len(results), dtype=np.object_)
    out[:] = results
    shape = (rows.shape[0], k) if batched else (k,)
    return out.reshape(shape), "BYTES"


def read_labels(model_path: Path, label_filename: str) -> list[str] | None:
    if not label_filename:
        return None
    try:
        return (model_path / label_filename).read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
