"""The model configuration of a tokenizer model: its parameters and auto-completed tensors.

``parameters`` (string values, as in Triton's preprocessing / postprocessing models; a ``${...}``
template placeholder counts as unset):

* ``mode``: ``preprocess`` (text to token ids) or ``postprocess`` (token ids to text); required.
* ``tokenizer_dir``: the Hugging Face tokenizer files; relative to the version directory, then to the
  model directory. Default: whichever of the two holds ``tokenizer_config.json`` or ``tokenizer.json``.
* ``trust_remote_code``: let ``AutoTokenizer`` run the directory's own code (default false).
* ``add_special_tokens`` (preprocess): add BOS / EOS as the tokenizer's post-processor says (default
  true; a chat-template prompt never gets them: the template writes its own).
* ``default_max_tokens`` (preprocess): ``request_output_len`` when a request gives none (default 16).
* ``skip_special_tokens`` (postprocess): leave special tokens (EOS...) out of the text (default true).
* ``drop_incomplete_tail`` (postprocess): leave out a trailing incomplete UTF-8 character (its
  replacement characters) when a text ends, as vLLM's detokenizer does, instead of ``decode``'s
  replacement characters (default false).
* ``max_sequences`` / ``sequence_idle_timeout_s`` (postprocess): bounds of the streaming state table
  (default 16384 sequences, 300 s without a request).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from tideserve.backend_api import InvalidArgument, ModelContext, Unavailable


class Mode(str, enum.Enum):
    PREPROCESS = "preprocess"
    POSTPROCESS = "postprocess"


# (name, config data type, dims, optional); dims exclude the batch dimension, as in Triton's config.
PREPROCESS_INPUTS = [
    ("text_input", mc.TYPE_STRING, [1], False),
    ("max_tokens", mc.TYPE_INT32, [1], True),
    ("request_output_len", mc.TYPE_INT32, [1], True),
    ("stop_words", mc.TYPE_STRING, [-1], True),
    ("bad_words", mc.TYPE_STRING, [-1], True),
    ("apply_chat_template", mc.TYPE_BOOL, [1], True),
    ("add_special_tokens", mc.TYPE_BOOL, [1], True),
    ("end_id", mc.TYPE_INT32, [1], True),
    ("pad_id", mc.TYPE_INT32, [1], True),
]
PREPROCESS_OUTPUTS = [
    ("input_ids", mc.TYPE_INT32, [-1]),
    ("input_lengths", mc.TYPE_INT32, [1]),
    ("request_output_len", mc.TYPE_INT32, [1]),
    ("stop_words_list", mc.TYPE_INT32, [2, -1]),
    ("bad_words_list", mc.TYPE_INT32, [2, -1]),
    ("end_id", mc.TYPE_INT32, [1]),
    ("pad_id", mc.TYPE_INT32, [1]),
    ("sampling_parameters", mc.TYPE_STRING, [1]),  # the same as vLLM sampling parameters (JSON)
]
# output_ids is optional so that a request may carry only sequence_end (flush a stream's held-back text).
POSTPROCESS_INPUTS = [
    ("output_ids", mc.TYPE_INT32, [-1], True),
    ("sequence_length", mc.TYPE_INT32, [-1], True),
]
POSTPROCESS_OUTPUTS = [
    ("text_output", mc.TYPE_STRING, [-1]),
]
INTEGER_TYPES = {mc.TYPE_INT8, mc.TYPE_INT16, mc.TYPE_INT32, mc.TYPE_INT64,
                 mc.TYPE_UINT8, mc.TYPE_UINT16, mc.TYPE_UINT32, mc.TYPE_UINT64}
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")


@dataclass(frozen=True)
class Settings:
    """What a tokenizer model's ``parameters`` say (see the module docstring)."""

    mode: Mode
    tokenizer_dir: Path
    trust_remote_code: bool = False
    add_special_tokens: bool = True
    default_max_tokens: int = 16
    skip_special_tokens: bool = True
    max_sequences: int = 16384
    sequence_idle_timeout_s: float = 300.0
    drop_incomplete_tail: bool = False

    @classmethod
    def from_context(cls, ctx: ModelContext) -> Settings:
        where = f"model '{ctx.name}'"

        def param(key: str) -> str | None:
            value = ctx.parameter(key)
            if value is None or not value.strip() or (value.startswith("${") and value.endswith("}")):
                return None
            return value.strip()

        mode = (param("mode") or "").lower().removesuffix("ing")  # "preprocessing" works too
        if mode not in (Mode.PREPROCESS.value, Mode.POSTPROCESS.value):
            raise InvalidArgument(f"{where}: parameters mode must be 'preprocess' or 'postprocess', got "
                                  f"{param('mode')!r}")
        return cls(
            mode=Mode(mode),
            tokenizer_dir=_tokenizer_dir(ctx, param("tokenizer_dir")),
            trust_remote_code=_bool(where, "trust_remote_code", param("trust_remote_code"), False),
            add_special_tokens=_bool(where, "add_special_tokens", param("add_special_tokens"), True),
            skip_special_tokens=_bool(where, "skip_special_tokens", param("skip_special_tokens"), True),
            default_max_tokens=_number(where, "default_max_tokens", param("default_max_tokens"), 16, int),
            max_sequences=_number(where, "max_sequences", param("max_sequences"), 16384, int),
            sequence_idle_timeout_s=_number(where, "sequence_idle_timeout_s", param("sequence_idle_timeout_s"),
                                            300.0, float),
            drop_incomplete_tail=_bool(where, "drop_incomplete_tail", param("drop_incomplete_tail"), False),
        )


def _tokenizer_dir(ctx: ModelContext, value: str | None) -> Path:
    if value is None:
        for candidate in (ctx.version_path, ctx.model_path):
            if any((candidate / name).exists() for name in TOKENIZER_FILES):
                return candidate
        raise Unavailable(f"model '{ctx.name}': no tokenizer files ({' or '.join(TOKENIZER_FILES)}) in "
                          f"{ctx.version_path} or {ctx.model_path}; set parameters tokenizer_dir")
    path = Path(value).expanduser()
    candidates = [path] if path.is_absolute() else [ctx.version_path / path, ctx.model_path / path]
    for candidate in candidates:
        if candidate.is_dir():
            return ctx.check_file(candidate, "parameter 'tokenizer_dir'", value)
    raise Unavailable(f"model '{ctx.name}': tokenizer_dir '{value}' is not a directory (looked at "
                      f"{', '.join(str(c) for c in candidates)})")


def _bool(where: str, key: str, value: str | None, default: bool) -> bool:
    if value is None:
        return default
    lowered = value.lower()
    if lowered in ("1", "true", "t", "yes", "y", "on"):
        return True
    if lowered in ("0", "false", "f", "no", "n", "off"):
        return False
    raise InvalidArgument(f"{where}: parameters {key} must be true or false, got '{value}'")


def _number(where: str, key: str, value: str | None, default, kind):
    if value is None:
        return default
    try:
        number = kind(value)
    except ValueError:
        number = None
    if number is None or not number > 0:
        raise InvalidArgument(f"{where}: parameters {key} must be a positive {kind.__name__}, got '{value}'")
    return number


def auto_complete(config: mc.ModelConfig, mode: Mode) -> None:
    """Add the tensors of ``mode`` the config leaves out; reject tensors the mode does not know or
    declared with a data type of the wrong kind."""
    if mode is Mode.PREPROCESS:
        inputs, outputs = PREPROCESS_INPUTS, PREPROCESS_OUTPUTS
    else:
        inputs, outputs = POSTPROCESS_INPUTS, POSTPROCESS_OUTPUTS
    name = config.name
    known = {n for n, *_ in inputs}
    for tensor in config.input:
        if tensor.name not in known:
            raise InvalidArgument(f"model '{name}': input '{tensor.name}' is not an input of a tokenizer "
                                  f"{mode.value} model (known: {', '.join(sorted(known))})")
    known_out = {n for n, *_ in outputs}
    for tensor in config.output:
        if tensor.name not in known_out:
            raise InvalidArgument(f"model '{name}': output '{tensor.name}' is not an output of a tokenizer "
                                  f"{mode.value} model (known: {', '.join(sorted(known_out))})")
    present = {t.name for t in config.input}
    for tensor_name, data_type, dims, optional in inputs:
        if tensor_name not in present:
            config.input.add(name=tensor_name, data_type=data_type, dims=dims, optional=optional)
    present = {t.name for t in config.output}
    for tensor_name, data_type, dims in outputs:
        if tensor_name not in present:
            config.output.add(name=tensor_name, data_type=data_type, dims=dims)
    expected = {n: t for n, t, *_ in inputs}
    _check_types(name, "input", config.input, expected)
    _check_types(name, "output", config.output, {n: t for n, t, _ in outputs})


def _check_types(model: str, kind: str, tensors, expected: dict[str, int]) -> None:
    """A tensor the config declares keeps its data type if it is of the same kind (any integer type
    for an integer tensor: outputs are cast to it)."""
    for tensor in tensors:
        want = expected[tensor.name]
        ok = tensor.data_type in INTEGER_TYPES if want in INTEGER_TYPES else tensor.data_type == want
        if not ok:
            wanted = "an integer data type" if want in INTEGER_TYPES else mc.DataType.Name(want)
            raise InvalidArgument(f"model '{model}': {kind} '{tensor.name}' must have {wanted}, got "
                                  f"{mc.DataType.Name(tensor.data_type)}")
