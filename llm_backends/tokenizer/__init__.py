"""The ``tokenizer`` backend: preprocess (text to token ids) and postprocess (token ids to text) models
that let a token-level engine serve text clients, as Triton's TensorRT-LLM ensembles do.

    backend: "tokenizer"
    parameters { key: "mode" value { string_value: "postprocess" } }
    parameters { key: "tokenizer_dir" value { string_value: "../../llama" } }

See ``README.md`` in this package for the tensors, the parameters and the streaming contract.
"""

from .backend import TokenizerBackend

__all__ = ["TokenizerBackend"]
