"""Sampling parameters from a request's JSON into vLLM's ``SamplingParams``, with errors that name the field.

Keys are ``SamplingParams`` fields (as Triton's vLLM backend takes them). Values may be JSON-typed or
strings that convert (``"0.7"``, ``"true"``: Triton's clients send strings). An unknown key, a value of
the wrong type and any of vLLM's own range checks (``temperature`` < 0, ``max_tokens`` < 1...) raise
:class:`~tideserve.errors.InvalidArgument`.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import RequestOutputKind, SamplingParams

from tideserve.backend_api import InvalidArgument

# Fields that are the engine's business, not the client's.
_INTERNAL = frozenset({"output_kind", "skip_clone", "output_text_buffer_length"})
ALLOWED = frozenset(f.name for f in msgspec.structs.fields(SamplingParams)
                    if not f.name.startswith("_") and f.name not in _INTERNAL)
_AT_FIELD = re.compile(r" - at `\$\.([A-Za-z0-9_]+)[^`]*`$")


def make_sampling_params(raw: dict[str, Any]) -> SamplingParams:
    """``SamplingParams`` streaming deltas (RequestOutputKind.DELTA) from a request's sampling dict."""
    for key in raw:
        if key not in ALLOWED:
            raise InvalidArgument(f"unknown sampling parameter '{key}'; the vllm backend takes the fields of "
                                  "vLLM's SamplingParams (e.g. max_tokens, temperature, top_p, top_k, stop, seed)")
    values = dict(raw)
    if isinstance(values.get("structured_outputs"), str):  # Triton's backend takes it as a JSON string
        try:
            values["structured_outputs"] = json.loads(values["structured_outputs"])
        except ValueError as exc:
            raise InvalidArgument(f"sampling parameter 'structured_outputs' is not valid JSON: {exc}") from None
    try:
        params = msgspec.convert(values, SamplingParams, strict=False)
    except msgspec.ValidationError as exc:
        message = str(exc)
        match = _AT_FIELD.search(message)
        if match:
            message = message[:match.start()]
            raise InvalidArgument(f"invalid sampling parameter '{match.group(1)}': {message}") from None
        raise InvalidArgument(f"invalid sampling parameters: {message}") from None
    except VLLMValidationError as exc:
        name = exc.parameter or _named_field(str(exc))
        where = f" '{name}'" if name else "s"
        raise InvalidArgument(f"invalid sampling parameter{where}: {exc}") from None
    except (TypeError, ValueError) as exc:
        name = _named_field(str(exc))
        where = f" '{name}'" if name else "s"
        raise InvalidArgument(f"invalid sampling parameter{where}: {exc}") from None
    params.output_kind = RequestOutputKind.DELTA
    return params


def fit_to_context(params: SamplingParams, max_model_len: int) -> None:
    """``max_tokens`` beyond the context window is no error on Triton's tensor interface (as Triton's vLLM
    backend, the engine stops at the context length): cut it to the window, so no value is too large to pass
    to the engine core."""
    if params.max_tokens is not None and params.max_tokens > max_model_len:
        params.max_tokens = max_model_len


def _named_field(message: str) -> str | None:
    """The sampling field a vLLM message starts with (``"min_p must be in [0, 1]..."``), if any."""
    first = message.split(" ", 1)[0].strip("`'\":")
    return first if first in ALLOWED else None
