"""``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info`` (vLLM's shapes), with the tokenizer
files of an LLM model."""

from .serving import detokenize, tokenize, tokenizer_info

__all__ = ["detokenize", "tokenize", "tokenizer_info"]
