"""The example text classifier's head: a logistic regression on MiniLM sentence embeddings.

The labelled sentences are ``model_repository/text_classifier_data.jsonl`` (one JSON object a line:
``{"text": ..., "label": ...}``); the labels, in the order of the ``scores`` output, are
``model_repository/text_classifier/labels.txt``. :func:`train_head` embeds the sentences with the very
ONNX encoder the server runs (``text_encoder/1/model.onnx``, through ONNX Runtime) and fits
scikit-learn's ``LogisticRegression`` (multinomial); :func:`write_head` writes it as an ONNX graph::

    scores = Softmax(embedding @ weights + bias)        embedding FP32 [batch, 384] -> scores FP32 [batch, k]

which is ``LogisticRegression.predict_proba``. :func:`head_parameters` reads ``weights`` and ``bias``
back, so anyone can run the head by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

RECIPE = "text-classifier-head-v1"  # bump when the training or the graph changes
C = 10.0  # inverse regularisation: embeddings are unit vectors, so the logits need large weights
INPUT, OUTPUT = "embedding", "scores"


def read_data(path: Path) -> tuple[list[str], list[str]]:
    """The sentences and their labels."""
    texts, labels = [], []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row.get("text"), str) or not isinstance(row.get("label"), str):
            raise TypeError(f"{path}:{number}: each line needs a string 'text' and a string 'label'")
        texts.append(row["text"])
        labels.append(row["label"])
    return texts, labels


def read_labels(path: Path) -> list[str]:
    return [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def embed(texts: list[str], encoder: Path, tokenizer: Path, max_length: int = 256) -> np.ndarray:
    """Sentence embeddings of ``texts`` from the ONNX encoder, tokenized as the ``text_tokenizer`` model does."""
    import onnxruntime

    from .minilm import minilm_inputs, minilm_tokenizer

    session = onnxruntime.InferenceSession(str(encoder), providers=["CPUExecutionProvider"])
    feeds = minilm_inputs(texts, minilm_tokenizer(max_length, tokenizer))
    return session.run(["sentence_embedding"], feeds)[0]


def train_head(embeddings: np.ndarray, labels: list[str], label_names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """``(weights [dim, k], bias [k])`` of a logistic regression; class ``i`` is ``label_names[i]``."""
    from sklearn.linear_model import LogisticRegression

    unknown = sorted(set(labels) - set(label_names))
    if unknown:
        raise ValueError(f"labels {unknown} of the data are not in the label file {label_names}")
    target = np.array([label_names.index(label) for label in labels])
    model = LogisticRegression(C=C, max_iter=2000, random_state=0).fit(embeddings, target)
    if list(model.classes_) != list(range(len(label_names))):
        raise ValueError(f"every label needs examples: the data has {sorted(set(labels))}")
    return model.coef_.T.astype(np.float32), model.intercept_.astype(np.float32)


def write_head(path: Path, weights: np.ndarray, bias: np.ndarray) -> Path:
    """The head as ONNX (opset 17): ``scores = Softmax(embedding @ weights + bias)``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    dim, classes = weights.shape
    graph = helper.make_graph(
        [helper.make_node("MatMul", [INPUT, "weights"], ["logits_raw"]),
         helper.make_node("Add", ["logits_raw", "bias"], ["logits"]),
         helper.make_node("Softmax", ["logits"], [OUTPUT], axis=-1)],
        "text_classifier_head",
        [helper.make_tensor_value_info(INPUT, TensorProto.FLOAT, ["batch", dim])],
        [helper.make_tensor_value_info(OUTPUT, TensorProto.FLOAT, ["batch", classes])],
        initializer=[numpy_helper.from_array(np.ascontiguousarray(weights, np.float32), "weights"),
                     numpy_helper.from_array(np.ascontiguousarray(bias, np.float32), "bias")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="tideserve-examples")
    model.ir_version = 8  # readable by every onnxruntime >= 1.14
    onnx.checker.check_model(model)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    onnx.save(model, str(partial))
    partial.replace(path)
    return path


def head_parameters(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """``(weights, bias)`` of a head written by :func:`write_head`."""
    import onnx
    from onnx import numpy_helper

    found = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    return found["weights"], found["bias"]


def softmax_head(embeddings: np.ndarray, weights: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """The head in numpy (float32, as the graph computes it)."""
    logits = embeddings.astype(np.float32) @ weights + bias
    logits = logits - logits.max(axis=-1, keepdims=True)
    exp = np.exp(logits)
    return exp / exp.sum(axis=-1, keepdims=True)
