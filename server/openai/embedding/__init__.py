"""``POST /v1/embeddings`` on the models whose config marks them as embedding models (see :mod:`.model`)."""

from .model import EmbedderCatalog, EmbeddingModel
from .serving import create_embedding

__all__ = ["EmbedderCatalog", "EmbeddingModel", "create_embedding"]
