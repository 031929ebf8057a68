"""Preprocess: text (or chat messages) and generation parameters in, a token-level engine's inputs out.

Per request row: ``text_input`` is encoded with the tokenizer (``add_special_tokens`` from the input,
the request parameter or the model's parameter), or, with ``apply_chat_template``, read as a JSON list
of messages, rendered with the tokenizer's chat template (generation prompt added) and encoded without
special tokens. ``stop_words`` / ``bad_words`` become Triton's ``[2, N]`` word lists: row 0 the words'
ids back to back (padded with 0), row 1 each word's exclusive end offset (padded with -1); a word that
encodes to nothing is dropped, as in Triton's preprocessing model. ``max_tokens`` (or
``request_output_len``) becomes ``request_output_len``; ``end_id`` / ``pad_id`` default to the
tokenizer's EOS / pad tokens. ``sampling_parameters`` says the same as JSON for vLLM's token interface.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from tideserve.backend_api import InferenceRequest, InferenceResponse, InvalidArgument, numpy_dtype

from .config import Settings
from .tensors import OutputBuilder, Rows, utf8


@dataclass
class Encoded:
    """One request row, ready for the engine."""

    ids: list[int]
    max_tokens: int
    stop_words: list[str]
    bad_words: list[str]
    stop_ids: list[list[int]]
    bad_ids: list[list[int]]
    end_id: int
    pad_id: int

    def sampling_parameters(self) -> str:
        values: dict[str, Any] = {"max_tokens": self.max_tokens}
        if self.stop_words:
            values["stop"] = self.stop_words
        if self.bad_words:
            values["bad_words"] = self.bad_words
        return json.dumps(values, ensure_ascii=False)


class Preprocessor:
    """Encodes requests with one tokenizer (an instance's own: encoding may touch its settings)."""

    def __init__(self, tokenizer: Any, settings: Settings, outputs: OutputBuilder, batched: bool) -> None:
        self.tokenizer = tokenizer
        self.settings = settings
        self.outputs = outputs
        self.batched = batched
        eos = tokenizer.eos_token_id
        self.end_id = -1 if eos is None else int(eos)
        pad = tokenizer.pad_token_id
        self.pad_id = self.end_id if pad is None else int(pad)
        # what the integer outputs can hold (a request value beyond it is refused, never wrapped or a 500)
        self._ranges = {name: np.iinfo(numpy_dtype(datatype)) for name, datatype in outputs.datatypes.items()
                        if name in ("request_output_len", "end_id", "pad_id")}

    def respond(self, request: InferenceRequest) -> InferenceResponse:
        rows = Rows(request, self.batched)
        return self._response([self.encode(rows, r) for r in range(rows.count)])

    # -- one row ----------------------------------------------------------------------------------
    def encode(self, rows: Rows, r: int) -> Encoded:
        text = utf8("text_input", _single(rows, "text_input", r))
        chat = rows.flag("apply_chat_template", r, False)
        add_special = rows.flag("add_special_tokens", r, False if chat else self.settings.add_special_tokens)
        if chat:
            text = self._render_chat(text)
        ids = list(self.tokenizer.encode(text, add_special_tokens=add_special))
        if not ids:
            raise InvalidArgument("input 'text_input' encodes to no tokens: a prompt needs at least one")
        name = "max_tokens" if rows.scalar("max_tokens", r) is not None else "request_output_len"
        max_tokens = rows.integer(name, r)
        if max_tokens is None:
            max_tokens = self.settings.default_max_tokens
        self._check_range(name, max_tokens, "request_output_len", low=1)
        stop_words, stop_ids = self._words(rows, "stop_words", r)
        bad_words, bad_ids = self._words(rows, "bad_words", r)
        end_id = rows.integer("end_id", r)
        pad_id = rows.integer("pad_id", r)
        for field, value in (("end_id", end_id), ("pad_id", pad_id)):
            if value is not None:
                self._check_range(field, value, field)
        return Encoded(ids, max_tokens, stop_words, bad_words, stop_ids, bad_ids,
                       self.end_id if end_id is None else end_id, self.pad_id if pad_id is None else pad_id)

    def _check_range(self, name: str, value: int, output: str, low: int | None = None) -> None:
        """Refuse a value of request field ``name`` that ``output``'s integer type cannot hold."""
        bounds = self._ranges.get(output)
        if bounds is None:
            return
        low = int(bounds.min) if low is None else max(low, int(bounds.min))
        if not low <= value <= int(bounds.max):
            raise InvalidArgument(f"'{name}' must be between {low} and {int(bounds.max)}, got {value}")

    def _render_chat(self, text: str) -> str:
        try:
            messages = json.loads(text)
        except ValueError as exc:
            raise InvalidArgument(f"input 'text_input': with apply_chat_template it must be a JSON list of "
                                  f"messages: {exc}") from None
        if isinstance(messages, dict) and "messages" in messages:
            messages = messages["messages"]
        if not (isinstance(messages, list) and messages
                and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)):
            raise InvalidArgument("input 'text_input': with apply_chat_template it must be a non-empty JSON list "
                                  "of messages, each an object with a 'role' and a 'content'")
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidArgument("apply_chat_template: the tokenizer has no chat template")
        import jinja2  # transformers renders chat templates with it

        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except (jinja2.TemplateError, ValueError, TypeError) as exc:  # the template's own errors included
            raise InvalidArgument(f"apply_chat_template: {type(exc).__name__}: {exc}") from None

    def _words(self, rows: Rows, name: str, r: int) -> tuple[list[str], list[list[int]]]:
        values = rows.values(name, r)
        if values is None:
            return [], []
        words, ids = [], []
        for value in values.tolist():
            word = utf8(name, value)
            encoded = list(self.tokenizer.encode(word, add_special_tokens=False)) if word else []
            if encoded:
                words.append(word)
                ids.append(encoded)
        return words, ids

    # -- response ---------------------------------------------------------------------------------
    def _response(self, rows: list[Encoded]) -> InferenceResponse:
        """Batched: every output gets a leading row dimension, ids padded with ``pad_id``; else one row."""
        build = self.outputs.tensor
        shape = (len(rows), 1) if self.batched else (1,)

        def column(values: list[int]) -> np.ndarray:
            return np.array(values, dtype=np.int64).reshape(shape)

        if self.batched:
            width = max(len(e.ids) for e in rows)
            ids = np.array([e.ids + [e.pad_id] * (width - len(e.ids)) for e in rows], dtype=np.int64)
            stop = _stack([word_list(e.stop_ids) for e in rows])
            bad = _stack([word_list(e.bad_ids) for e in rows])
        else:
            ids = np.array(rows[0].ids, dtype=np.int64)
            stop, bad = word_list(rows[0].stop_ids), word_list(rows[0].bad_ids)
        outputs = [
            build("input_ids", ids),
            build("input_lengths", column([len(e.ids) for e in rows])),
            build("request_output_len", column([e.max_tokens for e in rows])),
            build("stop_words_list", stop),
            build("bad_words_list", bad),
            build("end_id", column([e.end_id for e in rows])),
            build("pad_id", column([e.pad_id for e in rows])),
            self.outputs.strings("sampling_parameters", [e.sampling_parameters() for e in rows], shape),
        ]
        return InferenceResponse(outputs=outputs)


def _single(rows: Rows, name: str, r: int) -> Any:
    values = rows.values(name, r)
    if values is None:
        raise InvalidArgument(f"input '{name}' is required")
    if values.size != 1:
        raise InvalidArgument(f"input '{name}' must hold one string per request, got {values.size}")
    return values[0]


def word_list(words: list[list[int]]) -> np.ndarray:
    """Triton's ``[2, N]`` word list (N >= 1: no words is ``[[0], [-1]]``)."""
    flat = [t for word in words for t in word]
    width = max(1, len(flat))
    out = np.zeros((2, width), dtype=np.int64)
    out[1, :] = -1
    out[0, :len(flat)] = flat
    out[1, :len(words)] = np.cumsum([len(w) for w in words], dtype=np.int64) if words else []
    return out


def _stack(lists: list[np.ndarray]) -> np.ndarray:
    """``[B, 2, N]``: the rows' word lists padded to the widest (ids with 0, offsets with -1)."""
    width = max(a.shape[1] for a in lists)
    out = np.zeros((len(lists), 2, width), dtype=np.int64)
    out[:, 1, :] = -1
    for i, a in enumerate(lists):
        out[i, :, :a.shape[1]] = a
    return out
