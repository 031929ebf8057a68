"""The requests of ``/tokenize`` (a prompt, or chat messages as ``/v1/chat/completions`` takes them) and
``/detokenize``, with vLLM's field names and defaults."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from ..chat_completion.protocol import ChatCompletionRequest
from ..protocol import OpenAIModel

TokenId = Annotated[int, Field(ge=0, le=2**63 - 1)]


class TokenizeCompletionRequest(OpenAIModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # BOS and the like, as a completion's prompt gets them
    return_token_strs: bool | None = False


class TokenizeChatRequest(ChatCompletionRequest):
    """The messages rendered with the model's chat template, as a chat completion renders them."""

    add_special_tokens: bool = False  # the template writes its own
    return_token_strs: bool | None = False


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[TokenId]
