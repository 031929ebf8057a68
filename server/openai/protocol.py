"""Request schema pieces shared by the endpoints (pydantic), and the fields' translation to the engine.

Field names, defaults and ranges follow OpenAI's API reference; the vLLM extensions (``top_k``,
``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``...) follow vLLM's
server. Unknown fields are ignored, as OpenAI-compatible servers do. Sampling goes to the engine under
vLLM ``SamplingParams`` names (the ``sampling_parameters`` JSON of the text interface).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import ServerError
from .errors import BadRequest, from_server_error
from .limits import OpenAILimits

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class StreamOptions(OpenAIModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage in every chunk


class JsonSchema(OpenAIModel):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class SamplingRequest(OpenAIModel):
    """The fields completions and chat completions share."""

    model: str | None = None
    n: int = Field(1, ge=1)  # at most OpenAILimits.max_n
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM extensions
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: dict[str, Any] | None = None  # vLLM StructuredOutputsParams: options, or a constraint
    # vLLM: the request's priority when the model schedules by priority (lower first); ignored otherwise
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)

    def check(self, max_tokens: int | None, max_tokens_field: str, limits: OpenAILimits) -> None:
        """Cross-field checks and the server's limits (the per-field ranges are in the schema)."""
        if self.n != 1:  # (max_n is at least 1)
            limits.check_n(self.n)
        if self.stream_options is not None and self.stream_options.model_dump(exclude_unset=True) and not self.stream:
            raise BadRequest("Stream options can only be defined when `stream=True`.", "stream_options")
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise BadRequest(f"min_tokens ({self.min_tokens}) must be <= {max_tokens_field} ({max_tokens})",
                             "min_tokens")
        if self.logit_bias:  # every bad entry named at once, as vLLM does
            bad = [f"{key!r}: {value}" for key, value in self.logit_bias.items()
                   if not key.lstrip("-").isdigit() or not -100 <= value <= 100]
            if bad:
                raise BadRequest(f"logit_bias maps token ids to values in [-100, 100]; invalid: {', '.join(bad[:20])}"
                                 f"{f' (and {len(bad) - 20} more)' if len(bad) > 20 else ''}", "logit_bias")
        if self.response_format is not None and self.response_format.type == "json_schema" and (
                self.response_format.json_schema is None or self.response_format.json_schema.json_schema is None):
            raise BadRequest("When response_format type is 'json_schema', the 'json_schema' field (with its 'schema') "
                             "must be provided.", "response_format")

    def constraint(self) -> dict | None:
        """The structured output asked for: ``response_format``, with vLLM's ``structured_outputs`` options."""
        return self.structured(structured_output(self.response_format))

    def structured(self, constraint: dict | None) -> dict | None:
        """``constraint`` with the request's ``structured_outputs`` entries (which may be a constraint too:
        ``choice``, ``regex``, ``grammar``) under it."""
        if not self.structured_outputs:
            return constraint
        return {**self.structured_outputs, **(constraint or {})}

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
        """The engine's sampling parameters (vLLM names): only what the client set, plus max_tokens and the
        structured output (:meth:`constraint`)."""
        out: dict[str, Any] = {"max_tokens": max_tokens}
        if self.n != 1:
            out["n"] = self.n
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "top_k", "min_p",
                     "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.stop:
            out["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        if self.stop_token_ids:
            out["stop_token_ids"] = self.stop_token_ids
        if self.min_tokens:
            out["min_tokens"] = self.min_tokens
        if self.ignore_eos:
            out["ignore_eos"] = True
        if self.include_stop_str_in_output:
            out["include_stop_str_in_output"] = True
        if not self.skip_special_tokens:
            out["skip_special_tokens"] = False
        if not self.spaces_between_special_tokens:
            out["spaces_between_special_tokens"] = False
        if self.logit_bias:
            out["logit_bias"] = self.logit_bias  # token id (as a string) -> bias
        if logprobs is not None:
            out["logprobs"] = logprobs
        structured = self.constraint()
        if structured is not None:
            out["structured_outputs"] = structured
        return out


def structured_output(response_format: ResponseFormat | None) -> dict | None:
    """vLLM ``StructuredOutputsParams`` for a ``response_format`` (None for text)."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"json_object": True}
    return {"json": response_format.json_schema.json_schema}


def parse(model: type[BaseModel], doc: Any, reader=None) -> Any:
    """Validate a request body; a bad field is a 400 naming it (``param``). ``doc`` is the parsed JSON, or the body's
    bytes (a route whose handler ``takes_bytes``) with the port's ``reader`` (its JSON limits): a valid body then
    goes straight into the model, no dict between; any other is answered as the parsed JSON would be."""
    if isinstance(doc, (bytes, bytearray)):
        if doc.count(b"[") + doc.count(b"{") <= reader.max_json_depth:  # it nests no deeper than the limit
            try:
                return model.model_validate_json(doc)
            except ValidationError:
                pass  # answered below, in the words the parsed JSON gets
        try:
            doc = reader.parse_json(doc, "request body")
        except ServerError as exc:
            raise from_server_error(exc) from None
    if not isinstance(doc, dict):
        raise BadRequest("the request body must be a JSON object")
    try:
        return model.model_validate(doc)
    except ValidationError as exc:
        error = exc.errors()[0]
        param = _param(error["loc"])
        given = error.get("input")
        shown = "" if isinstance(given, (dict, list)) or given is None else f" (got {given!r:.80})"
        raise BadRequest(f"Invalid value for '{param}': {error['msg']}{shown}", param) from None


def _param(loc: tuple) -> str:
    """``("messages", 2, "content")`` -> ``messages[2].content`` (pydantic's union tags dropped)."""
    param = str(loc[0]) if loc else ""
    for part in loc[1:]:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part in _FIELD_NAMES:
            param += f".{part}"
        else:
            break
    return param


_FIELD_NAMES = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "type", "text", "function",
                          "arguments", "parameters", "json_schema", "schema", "include_usage", "id"})
