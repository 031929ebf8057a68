"""The typed LLM request and its outputs: how a frontend asks an LLM backend for a generation without tensors.

Triton's tensor interface (``text_input``, a ``sampling_parameters`` JSON string, ``return_*`` flags, one output
tensor per field) stays for KServe clients and ensembles; a backend converts it once, at that edge. The OpenAI
frontend instead hands a model that takes them (``Model.engine_info()``, published to frontends as
``ServedModel.engine``, says ``typed_requests``) an :class:`InferenceRequest` with no inputs and a
:class:`GenerationRequest`, and reads each response's :class:`GenerationDelta`. Both are msgspec structs: they
cross the frontend-worker link as they are, with no conversion.
"""

from __future__ import annotations

from typing import Any

import msgspec


class EngineInfo(msgspec.Struct, array_like=True, omit_defaults=True):
    """What an LLM backend tells frontends about its engine (``Model.engine_info``): asked of the model, never read
    from its files by a frontend."""

    typed_requests: bool = False  # it takes GenerationRequest (``request.generation``) beside its tensors
    tokenizer_dir: str | None = None  # local tokenizer files (chat template, token counts, echo of token ids)
    max_model_len: int | None = None  # the context length
    structured_outputs: bool = False  # ``sampling["structured_outputs"]`` (JSON schema, regex, choice, grammar)
    token_prompts: bool = False  # prompts given as token ids
    adapters: bool = False  # it takes LoRA adapters (``Model.lora_adapters`` is a list, not None)
    # --frontend-workers N with --frontend-direct on: what frontend worker i (client index i, 1..N) needs to reach
    # the engine core through an engine client of its own (opaque to frontends; workers/engines.py reads it)
    engine_clients: bytes | None = None


class GenerationRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One prompt's generation."""

    prompt: str | list[int]  # text, or token ids
    sampling: dict[str, Any]  # vLLM ``SamplingParams`` field names (``n``, ``max_tokens``, ``structured_outputs``...)
    stream: bool = True  # a response per engine step with what it added; else one response with the whole text
    add_special_tokens: bool = True  # false for a prompt rendered from a chat template (it carries its own)
    lora_name: str | None = None  # the LoRA adapter to generate with
    logprobs: bool = False  # the log probabilities of the output tokens (``sampling["logprobs"]`` says how many)
    prompt_logprobs: bool = False  # the prompt tokens' log probabilities (``echo`` with ``logprobs``)
    cached_tokens: bool = False  # report how many prompt tokens the prefix cache served
    cumulative_logprob: bool = False  # each choice's cumulative log probability so far (Triton's output of the name)


class GenerationDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one response added, per choice (``n`` entries each; one response has everything when not streamed)."""

    texts: list[str]
    finish: list[str | None]  # the finish reason of each choice once it finished ("stop", "length", ...)
    tokens: list[int] | None = None  # new output tokens per choice
    prompt_tokens: int | None = None
    logprobs: list[list[dict] | None] | None = None  # vLLM's entries: {token_id: {logprob, rank, decoded_token}}
    prompt_logprobs: list[dict] | None = None  # the prompt's, once (the first token's logprob is null)
    cached_tokens: int | None = None  # prompt tokens the prefix cache served (when asked for), on the last
    cumulative_logprobs: list[float | None] | None = None  # per choice, so far (when asked for; None: none yet)

    def extend(self, later: GenerationDelta) -> None:
        """Add what the next delta of the same request added (two engine steps as one, as vLLM's output collector
        merges the outputs its reader has not taken yet)."""
        texts, finish = self.texts, self.finish
        for i, text in enumerate(later.texts):
            if text:
                texts[i] += text
            if later.finish[i] is not None:
                finish[i] = later.finish[i]
        if later.tokens is not None:
            self.tokens = later.tokens if self.tokens is None else [a + b for a, b in zip(self.tokens, later.tokens)]
        if self.prompt_tokens is None:
            self.prompt_tokens = later.prompt_tokens
        if later.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = later.logprobs
            else:
                self.logprobs = [a if b is None else b if a is None else a + b
                                 for a, b in zip(self.logprobs, later.logprobs)]
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
        if later.cached_tokens is not None:
            self.cached_tokens = later.cached_tokens
        if later.cumulative_logprobs is not None:
            if self.cumulative_logprobs is None:
                self.cumulative_logprobs = later.cumulative_logprobs
            else:
                self.cumulative_logprobs = [a if b is None else b
                                            for a, b in zip(self.cumulative_logprobs, later.cumulative_logprobs)]


__all__ = ["EngineInfo", "GenerationDelta", "GenerationRequest"]
