"""The embeddings request: OpenAI's fields, with vLLM's extensions (``truncate_prompt_tokens``,
``add_special_tokens``, ``embed_dtype``, ``endianness``)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from ..errors import BadRequest
from ..protocol import OpenAIModel

TokenId = Annotated[int, Field(ge=0, le=2**63 - 1)]
MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request


class EmbeddingRequest(OpenAIModel):
    model: str | None = None
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM extensions
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    add_special_tokens: bool = True
    embed_dtype: Literal["float32", "float16"] = "float32"  # of base64 values
    endianness: Literal["native", "big", "little"] = "native"
    use_activation: bool | None = None  # normalisation: the models here normalise in the model

    def inputs(self) -> list[str | list[int]]:
        """One entry per input: text, or token ids."""
        value = self.input
        if not value:  # OpenAI: the input cannot be an empty string (or list)
            raise BadRequest("'input' must not be empty", "input")
        if isinstance(value, str):
            return [value]
        if isinstance(value[0], int):
            return [list(value)]
        if len(value) > MAX_INPUTS:
            raise BadRequest(f"'input' holds {len(value)} inputs; at most {MAX_INPUTS} in one request", "input")
        for i, item in enumerate(value):
            if isinstance(item, list) and not item:
                raise BadRequest(f"input[{i}] is an empty list of token ids", "input")
            if item == "":
                raise BadRequest(f"input[{i}] is an empty string", "input")
        return list(value)
