"""Engine outputs (vLLM ``RequestOutput`` deltas) to response tensors, as Triton's vLLM backend shapes them.

Each output tensor has one element per completion (``n`` of the sampling parameters): the text (or
the token ids, for ``n`` = 1), the finish reason (``"None"`` until finished), the cumulative log
probability, the log probabilities of the new tokens as JSON, the number of new tokens. A streamed
response carries what the step added; the one response of a non-streamed request carries it all.

``prompt_logprobs`` (one element) is the JSON list of the prompt's log probabilities (vLLM's
``prompt_logprobs`` sampling parameter), one entry per prompt token in the format of ``logprobs``, the
prompt token first; the first token has no log probability (``"logprob": null``, as vLLM's ``None``). A
streamed request gets it once, with the first response that has it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tideserve.backend_api import GenerationDelta, GenerationRequest, InferenceResponse, InvalidArgument, Tensor

from .inputs import GenerateInputs


@dataclass
class Completion:
    """What one completion (one of ``n``) added, or has added so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None

    def extend(self, other: Completion) -> None:
        self.text += other.text
        self.token_ids.extend(other.token_ids)
        if other.logprobs is not None:
            self.logprobs = (self.logprobs or []) + other.logprobs
        if other.cumulative_logprob is not None:
            self.cumulative_logprob = other.cumulative_logprob
        if other.finish_reason is not None:  # (a step without this choice, n > 1, leaves its reason)
            self.finish_reason = other.finish_reason


def completions(output: Any, n: int, want_logprobs: bool) -> list[Completion]:
    """The ``n`` completions' deltas in one ``RequestOutput`` (indexes absent from it added nothing)."""
    found = [Completion() for _ in range(n)]
    for item in output.outputs:
        if item.index >= n:
            continue
        found[item.index] = Completion(
            text=item.text or "",
            token_ids=list(item.token_ids),
            logprobs=_logprobs(item.logprobs) if want_logprobs and item.logprobs is not None else None,
            cumulative_logprob=item.cumulative_logprob,
            finish_reason=None if item.finish_reason is None else str(item.finish_reason))
    return found


def _logprobs(entries) -> list[dict]:
    return [{str(token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for token_id, lp in entry.items()} for entry in entries]


def prompt_logprobs(entries, prompt_ids: list[int], decode: Callable[[int], str] | None) -> list[dict]:
    """vLLM's ``prompt_logprobs`` (None for the first token) as the JSON entries of the ``prompt_logprobs``
    output: the first token named, with a null log probability."""
    out = []
    for position, entry in enumerate(entries):
        if entry is None:
            token_id = prompt_ids[position] if position < len(prompt_ids) else -1
            token = decode(token_id) if decode is not None and token_id >= 0 else None
            out.append({str(token_id): {"logprob": None, "rank": None, "decoded_token": token}})
        else:
            out.extend(_logprobs([entry]))
    return out


class ResponseBuilder:
    """Builds the responses of one request from its engine outputs: tensors for Triton's tensor interface
    (``GenerateInputs``), ``GenerationDelta`` s for a typed request (``GenerationRequest``)."""

    def __init__(self, inputs: GenerateInputs | GenerationRequest, n: int, output_dtypes: dict[str, np.dtype],
                 decode: Callable[[int], str] | None = None) -> None:
        self.typed = isinstance(inputs, GenerationRequest)
        self.prepend = not self.typed and inputs.prepend_input  # a whole answer starts with the prompt
        self.decode = decode  # token id -> text, for the prompt's first token
        self.n = n
        self.dtypes = output_dtypes
        self.want = _typed_fields(inputs) if self.typed else inputs.outputs
        self.want_logprobs = "logprobs" in self.want
        self.want_prompt_logprobs = "prompt_logprobs" in self.want
        self.want_cumulative = self.typed and "cumulative_logprob" in self.want  # (a typed delta's field)
        if "output_ids" in self.want and n != 1:
            raise InvalidArgument("output 'output_ids' needs sampling parameter n = 1")
        self.total = [Completion() for _ in range(n)]
        self.prompt_text = ""
        self.prompt_ids: list[int] = []
        self.prompt_logprobs: list[dict] | None = None
        self._prompt_logprobs_sent = False

    def delta(self, output: Any) -> InferenceResponse:
        """The response of one streamed step."""
        self._note_prompt(output)
        if self.typed:  # straight from the engine's output: one representation per step
            return InferenceResponse(generation=self._step_delta(output))
        return self._response(completions(output, self.n, self.want_logprobs), prepend=False, whole=False)

    def step(self, output: Any) -> GenerationDelta:
        """A typed request's delta of one streamed step (no response around it)."""
        if not self.prompt_ids:
            self._note_prompt(output)
        elif self.prompt_logprobs is None and self.want_prompt_logprobs:
            self._note_prompt(output)
        return self._step_delta(output)

    def _step_delta(self, output: Any) -> GenerationDelta:
        n = self.n
        texts, finish, tokens = [""] * n, [None] * n, [0] * n
        logprobs = [None] * n if self.want_logprobs else None
        cumulative = [None] * n if self.want_cumulative else None
        for item in output.outputs:
            i = item.index
            if i >= n:
                continue
            texts[i] = item.text or ""
            if item.finish_reason is not None:
                finish[i] = str(item.finish_reason)
            tokens[i] = len(item.token_ids)
            if logprobs is not None and item.logprobs is not None:
                logprobs[i] = _logprobs(item.logprobs)
            if cumulative is not None:
                cumulative[i] = item.cumulative_logprob
        return GenerationDelta(texts, finish, tokens, len(self.prompt_ids), logprobs,
                               self._prompt_logprobs_once(False) if self.want_prompt_logprobs else None,
                               cumulative_logprobs=cumulative)

    def add(self, output: Any) -> None:
        """Keep one step for the whole (non-streamed) response."""
        self._note_prompt(output)
        for total, step in zip(self.total, completions(output, self.n, self.want_logprobs)):
            total.extend(step)

    def whole(self) -> InferenceResponse:
        return self._response(self.total, prepend=self.prepend, whole=True)

    def _note_prompt(self, output: Any) -> None:
        if not self.prompt_ids and output.prompt_token_ids:
            self.prompt_ids = list(output.prompt_token_ids)
            self.prompt_text = output.prompt or ""
        entries = getattr(output, "prompt_logprobs", None)
        if entries is not None and self.prompt_logprobs is None and "prompt_logprobs" in self.want:
            self.prompt_logprobs = prompt_logprobs(entries, self.prompt_ids, self.decode)

    def _response(self, parts: list[Completion], prepend: bool, whole: bool) -> InferenceResponse:
        if self.typed:
            return InferenceResponse(generation=self._delta(parts, whole))
        want = self.want
        tensors = []
        if "text_output" in want:
            prefix = self.prompt_text if prepend else ""
            tensors.append(_bytes("text_output", [prefix + p.text for p in parts]))
        if "output_ids" in want:
            ids = (self.prompt_ids if prepend else []) + parts[0].token_ids
            tensors.append(_array("output_ids", ids, self.dtypes.get("output_ids", np.int32)))
        if "finish_reason" in want:
            tensors.append(_bytes("finish_reason", [str(p.finish_reason) for p in parts]))
        if "cumulative_logprob" in want:
            values = [math.nan if p.cumulative_logprob is None else p.cumulative_logprob for p in parts]
            tensors.append(_array("cumulative_logprob", values, np.float32))
        if "logprobs" in want:
            tensors.append(_bytes("logprobs", [json.dumps(p.logprobs) for p in parts]))
        if "num_input_tokens" in want:
            tensors.append(_array("num_input_tokens", [len(self.prompt_ids)], np.uint32))
        if "prompt_logprobs" in want and not self._prompt_logprobs_sent and (self.prompt_logprobs is not None
                                                                               or whole):
            tensors.append(_bytes("prompt_logprobs", [json.dumps(self.prompt_logprobs)]))
            self._prompt_logprobs_sent = True
        if "num_output_tokens" in want:
            tensors.append(_array("num_output_tokens", [len(p.token_ids) for p in parts], np.uint32))
        return InferenceResponse(outputs=tensors)

    def _delta(self, parts: list[Completion], whole: bool) -> GenerationDelta:
        """The whole answer to a typed request: the same fields as the tensors, as they are."""
        return GenerationDelta([p.text for p in parts], [p.finish_reason for p in parts],
                               [len(p.token_ids) for p in parts], len(self.prompt_ids),
                               [p.logprobs for p in parts] if self.want_logprobs else None,
                               self._prompt_logprobs_once(whole),
                               cumulative_logprobs=[p.cumulative_logprob for p in parts] if self.want_cumulative
                               else None)

    def _prompt_logprobs_once(self, whole: bool) -> list[dict] | None:
        """The prompt's log probabilities with the first response that has them (a whole answer: always)."""
        if "prompt_logprobs" in self.want and not self._prompt_logprobs_sent and (self.prompt_logprobs is not None
                                                                                    or whole):
            self._prompt_logprobs_sent = True
            return self.prompt_logprobs
        return None


def _typed_fields(generation: GenerationRequest) -> set[str]:
    """The fields of a typed request's deltas to fill, named as the tensor interface's outputs."""
    want = {"text_output"}
    if generation.logprobs:
        want.add("logprobs")
    if generation.prompt_logprobs:
        want.add("prompt_logprobs")
    if generation.cumulative_logprob:
        want.add("cumulative_logprob")
    return want


def _bytes(name: str, values: list[str]) -> Tensor:
    data = np.empty(len(values), dtype=np.object_)
    data[:] = [v.encode("utf-8") for v in values]
    return Tensor(name, "BYTES", data.shape, data)


def _array(name: str, values: list, dtype) -> Tensor:
    return Tensor.from_numpy(name, np.asarray(values, dtype=dtype))
