"""``POST /score`` / ``/v1/score`` and ``/rerank`` / ``/v1/rerank`` (vLLM's shapes) on embedding models: the
cosine similarity of the two texts' embeddings, as vLLM scores with an embedding model."""

from .serving import create_rerank, create_score

__all__ = ["create_rerank", "create_score"]
