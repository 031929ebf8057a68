"""What a request asks of the engine, read from its tensors and parameters (Triton's vLLM interface).

The prompt is ``text_input`` (one string) or ``input_ids`` (token ids). ``stream``,
``exclude_input_in_output`` and the ``return_*`` flags are BOOL tensors; a request parameter of the
same name stands in for an absent tensor (the generate endpoint puts them there). Sampling
parameters are the request parameters (the generate endpoint's ``parameters``) overridden by the
``sampling_parameters`` tensor, a JSON object, as Triton's backend reads them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tideserve.backend_api import InferenceRequest, InvalidArgument

# Extra outputs and the flag that asks for each.
RETURN_FLAGS = {
    "finish_reason": "return_finish_reason",
    "cumulative_logprob": "return_cumulative_logprob",
    "logprobs": "return_logprobs",
    "num_input_tokens": "return_num_input_tokens",
    "num_output_tokens": "return_num_output_tokens",
    "prompt_logprobs": "return_prompt_logprobs",
}
STREAM = "stream"
EXCLUDE_INPUT = "exclude_input_in_output"
# Request parameter (no tensor): false tokenizes the prompt without BOS / special tokens (a prompt
# rendered from a chat template carries its own).
ADD_SPECIAL_TOKENS = "add_special_tokens"
# Request parameter (no tensor): true adds the response parameter ``num_cached_tokens`` (prompt tokens the
# prefix cache served) to the final response; the OpenAI frontend asks for it for usage.prompt_tokens_details.
RETURN_CACHED_TOKENS = "return_num_cached_tokens"
# Request parameters that are not sampling parameters.
NOT_SAMPLING = frozenset({STREAM, EXCLUDE_INPUT, ADD_SPECIAL_TOKENS, RETURN_CACHED_TOKENS, *RETURN_FLAGS.values(),
                          "sequence_id", "sequence_start", "sequence_end"})


@dataclass
class GenerateInputs:
    prompt: str | list[int]
    stream: bool
    prepend_input: bool  # the whole (non-streamed) answer starts with the prompt
    sampling: dict[str, Any]
    outputs: set[str] = field(default_factory=set)  # the output tensors to build (typed: the fields to fill)
    add_special_tokens: bool = True
    cached_tokens: bool = False  # report the prefix cache's hits

    @property
    def token_interface(self) -> bool:
        return not isinstance(self.prompt, str)


def parse_inputs(request: InferenceRequest) -> GenerateInputs:
    """Read a request; raise InvalidArgument naming the tensor or parameter that is wrong."""
    prompt = _prompt(request)
    stream = _flag(request, STREAM, False)
    token_interface = not isinstance(prompt, str)
    exclude = _flag(request, EXCLUDE_INPUT, None)
    if exclude is None:
        # Triton: the whole answer repeats the prompt unless streaming; token ids never do by default
        prepend = not stream and not token_interface
    else:
        prepend = not exclude
    if prepend and stream:
        # Triton's vLLM backend's words (its request errors begin "Error generating stream: ")
        raise InvalidArgument(f"Error generating stream: When streaming, `{EXCLUDE_INPUT}` = False is not allowed.")
    requested = request.requested_output_names()
    # token ids in: output_ids out, unless the client asks for text_output (then n > 1 works too)
    outputs = {"output_ids"} if token_interface and "text_output" not in requested else {"text_output"}
    outputs.update(name for name, flag in RETURN_FLAGS.items() if _flag(request, flag, False))
    # As Triton's vLLM backend: the extra outputs come with their return_* flag only. A client that asks for
    # every output of the model (perf_analyzer does) gets no NaN cumulative_logprob it did not ask for.
    outputs.update(name for name in requested if name not in RETURN_FLAGS)
    return GenerateInputs(prompt, stream, prepend, _sampling(request), outputs,
                          bool(_flag(request, ADD_SPECIAL_TOKENS, True)))


def _prompt(request: InferenceRequest) -> str | list[int]:
    text = request.inputs.get("text_input")
    ids = request.inputs.get("input_ids")
    if (text is None) == (ids is None):
        raise InvalidArgument("the request needs exactly one of the inputs 'text_input' (a string) and "
                              "'input_ids' (token ids)")
    if ids is not None:
        data = np.asarray(ids.data)
        if data.dtype.kind not in "iu":
            raise InvalidArgument(f"input 'input_ids' must hold integers, got {ids.datatype}")
        if data.size == 0:
            raise InvalidArgument("input 'input_ids' is empty: the prompt needs at least one token")
        return [int(x) for x in data.reshape(-1)]
    values = text.data.reshape(-1)
    if values.size != 1:
        raise InvalidArgument(f"input 'text_input' must hold one string, got {values.size} elements")
    value = values[0]
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidArgument(f"input 'text_input' is not valid UTF-8: {exc}") from None
    return str(value)


def _flag(request: InferenceRequest, name: str, default: bool | None) -> bool | None:
    tensor = request.inputs.get(name)
    if tensor is not None:
        values = np.asarray(tensor.data).reshape(-1)
        if values.size != 1:
            raise InvalidArgument(f"input '{name}' must hold one boolean, got {values.size} elements")
        return bool(values[0])
    value = request.parameters.get(name)
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise InvalidArgument(f"parameter '{name}' must be a boolean, got {value!r}")


def _sampling(request: InferenceRequest) -> dict[str, Any]:
    sampling = {k: v for k, v in request.parameters.items() if k not in NOT_SAMPLING}
    tensor = request.inputs.get("sampling_parameters")
    if tensor is not None:
        values = tensor.data.reshape(-1)
        if values.size != 1:
            raise InvalidArgument(f"input 'sampling_parameters' must hold one JSON string, got {values.size} elements")
        raw = values[0]
        try:
            parsed = json.loads(bytes(raw).decode("utf-8") if isinstance(raw, (bytes, np.bytes_)) else str(raw))
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidArgument(f"input 'sampling_parameters' is not valid JSON: {exc}") from None
        if not isinstance(parsed, dict):
            raise InvalidArgument("input 'sampling_parameters' must be a JSON object of sampling parameters")
        sampling.update(parsed)
    return sampling
