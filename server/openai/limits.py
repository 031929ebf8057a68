"""What one OpenAI request may ask for: the ``tideserve --openai-*`` flags, and the checks that apply them.

A request over a limit is a 400 naming the field (OpenAI's error shape). The limits bound the work one
request can make the server do: prompts (each one DataPlane request), prompt tokens, choices, log
probabilities and the time a chat template may take to render. Prompt tokens are counted with the model's
tokenizer (``tokenizer.json``) only when the text could hold more than the limit (more than a quarter as
many characters: a token covers at least one UTF-8 byte, a character at most four); a model without
tokenizer files counts UTF-8 bytes. Counting runs on a worker thread, never on the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import BadRequest

# Special tokens (BOS and the like) a tokenizer may add to one prompt, on top of one token per UTF-8 byte.
_SPECIAL_TOKENS_PER_PROMPT = 4
# A rendered chat prompt longer than this many characters per allowed prompt token cannot fit the token
# limit (tokens of this length are rare in any vocabulary): rendering stops there.
CHARS_PER_TOKEN_BOUND = 32


@dataclass(frozen=True)
class OpenAILimits:
    """Limits of one ``/v1`` request (each a ``tideserve`` flag)."""

    max_prompts: int = 256
    """Prompts in one completions request (``prompt`` as a list): each is one DataPlane request."""
    max_prompt_tokens: int = 262_144
    """Prompt tokens of one request, all its prompts together (a chat request: the rendered prompt)."""
    max_n: int = 128
    """Choices per prompt (``n``; OpenAI's own maximum is 128)."""
    max_logprobs: int = 20
    """``logprobs`` (completions) and ``top_logprobs`` (chat); vLLM's engine default ``max_logprobs`` is 20."""
    chat_template_timeout_s: float = 2.0
    """How long rendering one chat template may take before the request is refused."""
    prompt_tokens_details: bool = False
    """Not a limit: ``usage.prompt_tokens_details.cached_tokens`` (prompt tokens the engine's prefix cache
    served) in every answer of a vLLM model, as vLLM's ``--enable-prompt-tokens-details`` adds it."""

    max_rendered_chars: int = field(init=False, repr=False, compare=False)
    """The longest chat prompt a template may render (from ``max_prompt_tokens``)."""
    uncounted_chars: int = field(init=False, repr=False, compare=False)
    """The longest text prompt that cannot hold more tokens than the limit, whatever the tokenizer: one that long
    or shorter needs no count (a request's hot path skips :meth:`check_prompts_fit` for it)."""

    def __post_init__(self) -> None:
        for name in ("max_prompts", "max_prompt_tokens", "max_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be at least 0, got {self.max_logprobs}")
        if not self.chat_template_timeout_s > 0:
            raise ValueError(f"chat_template_timeout_s must be positive, got {self.chat_template_timeout_s}")
        object.__setattr__(self, "max_rendered_chars", self.max_prompt_tokens * CHARS_PER_TOKEN_BOUND)
        object.__setattr__(self, "uncounted_chars",
                           max((self.max_prompt_tokens - _SPECIAL_TOKENS_PER_PROMPT) // 4, 0))

    # -- checks ---------------------------------------------------------------------------------
    def check_n(self, n: int) -> None:
        if n > self.max_n:
            raise BadRequest(f"'n' must be at most {self.max_n} on this server, got {n}", "n")

    def check_logprobs(self, count: int | None, field: str) -> None:
        if count is not None and count > self.max_logprobs:
            raise BadRequest(f"Requested sample logprobs of {count}, which is greater than max allowed: "
                             f"{self.max_logprobs}", field)

    def check_prompt_count(self, count: int) -> None:
        if count > self.max_prompts:
            raise BadRequest(f"'prompt' holds {count} prompts; this server takes at most {self.max_prompts} in one "
                             "request", "prompt")

    def may_exceed_tokens(self, prompts: list[str | list[int]]) -> bool:
        """Whether ``prompts`` could hold more tokens than the limit (else no count is needed)."""
        bound = 0
        for prompt in prompts:
            bound += (4 * len(prompt) if isinstance(prompt, str) else len(prompt)) + _SPECIAL_TOKENS_PER_PROMPT
        return bound > self.max_prompt_tokens

    async def check_prompts_fit(self, llm, prompts: list[str | list[int]], param: str, run_blocking) -> None:
        """Refuse ``prompts`` holding more tokens than the limit; a count, when one is needed, runs on a worker
        thread (``run_blocking(fn, *args)``)."""
        if self.may_exceed_tokens(prompts):
            self.check_prompt_tokens(await run_blocking(count_prompt_tokens, llm, prompts), param)

    def check_prompt_tokens(self, counted: int, param: str) -> None:
        if counted > self.max_prompt_tokens:
            what = "the prompts hold" if param == "prompt" else "the rendered prompt holds"
            raise BadRequest(f"{what} {counted} tokens; this server takes at most {self.max_prompt_tokens} prompt "
                             "tokens in one request", param)


def count_prompt_tokens(llm, prompts: list[str | list[int]]) -> int:
    """The prompts' tokens: token ids as they are, text with the model's tokenizer (UTF-8 bytes without one).
    Blocking: call it on a worker thread."""
    ids = sum(len(p) for p in prompts if not isinstance(p, str))
    texts = [p for p in prompts if isinstance(p, str)]
    if not texts:
        return ids
    tokenizer = llm.tokenizer()
    if tokenizer is None:
        return ids + sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    return ids + sum(len(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=True))

