"""The example deployment (``model_repository/``) and the model builders it shares with tests and benchmarks.

Everything here is made locally, from packages already installed: nothing is downloaded.

* :mod:`tideserve.bench.examples.prepare` -- makes the example repository's generated files on first start
  (``python -m tideserve.bench.examples.prepare model_repository``; ``make serve`` runs it);
* :mod:`tideserve.bench.examples.minilm` -- the all-MiniLM-L6-v2 sentence encoder exported to ONNX, and its tokenizer;
* :mod:`tideserve.bench.examples.text_classifier` -- the classification head trained on MiniLM embeddings of
  ``model_repository/text_classifier_data.jsonl``, written as an ONNX graph;
* :mod:`tideserve.bench.examples.tree_models` -- XGBoost / LightGBM / scikit-learn tree models on scikit-learn's
  bundled datasets, written as Triton FIL model directories;
* the tiny Llama comes from :mod:`tideserve.bench.examples.tiny_llama`.

Heavy imports (torch, transformers, scikit-learn) happen inside the functions that need them.
"""
