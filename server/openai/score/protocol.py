"""The score and rerank requests, with vLLM's field names (text inputs only)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from ..errors import BadRequest
from ..protocol import OpenAIModel

Texts = str | list[str]
MAX_TEXTS = 2048  # distinct texts in one request, as /v1/embeddings takes at most
# vLLM's names of the two sides of a score request, in the order it tries them
PAIRS = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))


class ScoreRequest(OpenAIModel):
    model: str | None = None
    queries: Texts | None = None
    documents: Texts | None = None
    items: Texts | None = None
    data_1: Texts | None = None
    data_2: Texts | None = None
    text_1: Texts | None = None
    text_2: Texts | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    user: str | None = None

    def sides(self) -> tuple[list[str], list[str]]:
        """The two lists of texts, 1:1, 1:N or N:N."""
        for first, second in PAIRS:
            one, two = getattr(self, first), getattr(self, second)
            if one is not None and two is not None:
                return pair(one, two, first)
        raise BadRequest("a score request needs 'queries' and 'documents' (or 'items'; or 'data_1' and 'data_2'; "
                         "or 'text_1' and 'text_2')", "queries")


class RerankRequest(OpenAIModel):
    model: str | None = None
    query: str
    documents: Texts
    top_n: int = Field(0, ge=0)
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    user: str | None = None


def pair(one: Texts, two: Texts, name: str) -> tuple[list[str], list[str]]:
    first = [one] if isinstance(one, str) else list(one)
    second = [two] if isinstance(two, str) else list(two)
    if not first:
        raise BadRequest("At least one text element must be given", name)
    if not second:
        raise BadRequest("At least one text_pair element must be given", name)
    if len(first) > 1 and len(first) != len(second):
        raise BadRequest("Input lengths must be either 1:1, 1:N or N:N", name)
    return first, second
