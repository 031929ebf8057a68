"""The completions request (OpenAI's legacy ``/v1/completions`` plus vLLM's sampling extensions)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from ..errors import BadRequest
from ..limits import OpenAILimits
from ..protocol import SamplingRequest

TokenId = Annotated[int, Field(ge=0)]


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]] | None = None
    max_tokens: int | None = Field(16, ge=0)  # 0: only with echo (the prompt's log probabilities)
    logprobs: int | None = Field(None, ge=0)  # at most OpenAILimits.max_logprobs
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    add_special_tokens: bool = True  # vLLM extension: BOS and the like when tokenizing the prompt
    prompt_logprobs: int | None = Field(None, ge=0)  # vLLM extension: choices[].prompt_logprobs, vLLM's shape

    def prompts(self, limits: OpenAILimits) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids (at most ``limits.max_prompts``)."""
        prompt = self.prompt
        if prompt is None or prompt == "" or prompt == []:
            raise BadRequest("'prompt' must be a non-empty string, list of strings, or token ids", "prompt")
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], int):
            return [list(prompt)]
        limits.check_prompt_count(len(prompt))
        for item in prompt:
            if len(item) == 0:
                raise BadRequest("'prompt' must not hold an empty prompt", "prompt")
        return list(prompt)

    def check_completion(self, limits: OpenAILimits) -> None:
        self.check(self.max_tokens, "max_tokens", limits)
        limits.check_logprobs(self.logprobs, "logprobs")
        if self.prompt_logprobs is not None:  # the limits are read only where a check may fail
            limits.check_logprobs(self.prompt_logprobs, "prompt_logprobs")
        if self.max_tokens == 0 and not self.echo:
            raise BadRequest("'max_tokens' must be at least 1 (0 only with 'echo': the prompt alone)", "max_tokens")
        if self.suffix is not None:
            if self.echo:
                raise BadRequest("Echo is unsupported with suffix.", "suffix")
            raise BadRequest("suffix is only supported for models with FIM completion rendering; the models of "
                             "this server have none", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise BadRequest("'best_of' other than n is not supported", "best_of")

    @property
    def echo_logprobs(self) -> bool:
        """Whether the echoed prompt has log probabilities (``echo`` with ``logprobs``, as vLLM)."""
        return bool(self.echo) and self.logprobs is not None

    @property
    def prompt_logprobs_count(self) -> int | None:
        """How many of the most likely tokens the engine reports per prompt token (None: the prompt's log
        probabilities are not asked for)."""
        counts = [k for k in (self.logprobs if self.echo_logprobs else None, self.prompt_logprobs) if k is not None]
        return max(counts) if counts else None

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens`` 0: the answer is the prompt (the engine still makes one token)."""
        return bool(self.echo) and self.max_tokens == 0
