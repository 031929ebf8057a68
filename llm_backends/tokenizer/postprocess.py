"""Postprocess: token ids in, text out; stateful per sequence when a stream comes in pieces.

A plain request is decoded whole: ``output_ids`` (trimmed to ``sequence_length`` where given; negative
ids, padding, skipped) -> ``text_output``, one string per beam. A request with the parameter
``sequence_id`` is one piece of a stream (an ensemble sends each response of a streaming LLM step as
its own request): its ids are added to that sequence's :class:`IncrementalDetokenizer` and
``text_output`` holds exactly the text that became final, so the pieces concatenate to the whole
text. ``sequence_start`` starts the state afresh; ``sequence_end`` flushes what was held back and
drops the state, as does a cancelled piece. A sequence with no state that does not start (evicted,
or its start was lost) starts afresh with a warning. With ``drop_incomplete_tail`` a text never ends
with an incomplete UTF-8 character (replacement characters), whole or streamed, as with vLLM's
detokenizer.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import numpy as np

from tideserve.backend_api import Cancelled, InferenceRequest, InferenceResponse, InvalidArgument

from .config import Settings
from .detokenizer import REPLACEMENT, Decode, SequenceTable
from .tensors import OutputBuilder, Rows, as_bool

log = logging.getLogger(__name__)

SEQUENCE_ID = "sequence_id"
SEQUENCE_START = "sequence_start"
SEQUENCE_END = "sequence_end"


def decoder(tokenizer: Any, skip_special_tokens: bool) -> Decode:
    """``ids -> text`` without clean-up of tokenization spaces (which no stream could reproduce):
    the Rust tokenizer's own decode where there is one, else the Python tokenizer's."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return partial(tokenizer.decode, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


class Postprocessor:
    """Decodes requests; the sequence table is the model's, shared by its instances."""

    def __init__(self, tokenizer: Any, settings: Settings, table: SequenceTable, outputs: OutputBuilder,
                 batched: bool) -> None:
        self.settings = settings
        self.table = table
        self.outputs = outputs
        self.batched = batched
        self._decoders = {skip: decoder(tokenizer, skip) for skip in (True, False)}

    def respond(self, request: InferenceRequest) -> InferenceResponse:
        rows = Rows(request, self.batched)
        params = request.parameters
        skip = as_bool("skip_special_tokens", params.get("skip_special_tokens"), self.settings.skip_special_tokens)
        decode = self._decoders[skip]
        if SEQUENCE_ID in params and request.is_cancelled():  # the ensemble request was cancelled or failed
            self.table.end(params[SEQUENCE_ID])
            raise Cancelled(f"sequence {params[SEQUENCE_ID]!r} was cancelled; its state is freed")
        beams = [self._beams(rows, r) for r in range(rows.count)]
        if SEQUENCE_ID in params:
            if len(beams) != 1 or len(beams[0]) != 1:
                raise InvalidArgument("a request of a sequence (parameter sequence_id) holds one row of "
                                      f"output_ids, got {sum(len(b) for b in beams)}")
            texts = [[self._stream(params, decode, beams[0][0])]]
        else:
            texts = [[self._whole(decode, ids) for ids in row] for row in beams]
        width = max(len(t) for t in texts)
        if any(len(t) != width for t in texts):
            raise InvalidArgument("every row of output_ids must hold the same number of beams")
        flat = [text for row in texts for text in row]
        shape = (len(texts), width) if self.batched else (width,)
        return InferenceResponse(outputs=[self.outputs.strings("text_output", flat, shape)])

    def _whole(self, decode: Decode, ids: list[int]) -> str:
        text = decode(ids)
        return text.rstrip(REPLACEMENT) if self.settings.drop_incomplete_tail else text

    def _beams(self, rows: Rows, r: int) -> list[list[int]]:
        """Row ``r``'s token ids, one list per beam (``output_ids`` of shape [..., tokens])."""
        tensor = rows.request.inputs.get("output_ids")
        if tensor is None:
            return [[]]
        data = np.asarray(tensor.data)
        if self.batched:
            data = data[r]
        if data.ndim == 0:
            raise InvalidArgument("input 'output_ids' must have a token dimension")
        beams = data.reshape(int(np.prod(data.shape[:-1])), data.shape[-1])
        lengths = rows.values("sequence_length", r)
        if lengths is not None and lengths.size != beams.shape[0]:
            raise InvalidArgument(f"input 'sequence_length' holds {lengths.size} lengths for {beams.shape[0]} "
                                  f"beam(s) of output_ids")
        result = []
        for b, beam in enumerate(beams):
            if lengths is not None:
                length = int(lengths[b])
                if not 0 <= length <= beam.size:
                    raise InvalidArgument(f"input 'sequence_length': {length} is outside [0, {beam.size}]")
                beam = beam[:length]
            result.append([int(t) for t in beam.tolist() if t >= 0])
        return result

    def _stream(self, params: dict, decode: Decode, ids: list[int]) -> str:
        key = params[SEQUENCE_ID]
        start = as_bool(SEQUENCE_START, params.get(SEQUENCE_START), False)
        end = as_bool(SEQUENCE_END, params.get(SEQUENCE_END), False)
        table = self.table
        state = table.start(key) if start else table.get(key)
        if state is None:
            log.warning("sequence %r has no decoding state (it was dropped after %.0f s idle or as least recently "
                        "used, or it never started): starting it afresh", key, table.idle_timeout_s)
            state = table.start(key)
        try:
            # drop_incomplete_tail: the end flushes only complete characters, as any other step does
            return state.push(decode, ids, final=end and not self.settings.drop_incomplete_tail)
        finally:
            if end:
                table.end(key)
