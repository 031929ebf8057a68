"""The embedding models the OpenAI frontend serves, and how an input becomes a DataPlane request of one.

A model is served on ``/v1/embeddings`` when its config has the parameter ``openai_task: "embed"``. Its
interface:

* text: its one BYTES input (``text``, ``text_input`` or the only BYTES input) takes one string per
  request (dims ``[1]``, batched or not);
* the embedding: the output named by the parameter ``openai_embedding_output``, else its only
  floating-point output (FP32, FP16 or FP64), one vector per request;
* token ids: an ``input_ids`` input (INT32 or INT64; with an ``attention_mask`` input it is sent as ones)
  on the model itself, or on the model the parameter ``openai_token_model`` names (e.g. the encoder step
  of a tokenizer -> encoder ensemble), with the embedding output of the same rule;
* ``max_model_len`` (parameter; else the model files' ``max_position_embeddings``): longer inputs are a 400
  unless the request sets ``truncate_prompt_tokens``, as vLLM answers;
* ``openai_tokenize_in_frontend: "true"`` (an ensemble with a ``openai_token_model``): text is tokenized in the
  frontend (it does so anyway, for usage and lengths) and its ids go straight to the token model, padded with
  a mask to a multiple of ``openai_pad_to_multiple_of`` (else the tokenizer step's ``pad_to_multiple_of``
  parameter; unpadded where the token model's ``pad_batch_inputs`` names ``input_ids`` and ``attention_mask``:
  its batcher then batches any lengths and pads each batch to its longest), skipping the ensemble and its
  tokenizer step. The config's author vouches that the tokenizer
  step does what the frontend does with the same ``tokenizer.json`` (special tokens added, no truncation
  within ``max_model_len``, padding with id 0 and mask 0). The ensemble's statistics still count each such
  request (success, one execution) where the model runs in this process;
* ``is_matryoshka: "true"`` (and optionally ``matryoshka_dimensions: "64,128,256"``): the request's
  ``dimensions`` keep that many leading values, normalised again, as vLLM does; other models refuse
  ``dimensions``.

The tokenizer files (``tokenizer.json``, found as for chat templates: the ``tokenizer_dir`` parameter or
an ensemble step's) count the usage and check lengths; without them usage counts only token-id inputs.
"""

from __future__ import annotations

import json
import logging
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from ...batching import PAD_PARAMETER
from ...datatypes import config_to_datatype, numpy_dtype
from ...errors import NotFound, ServerError
from ...types import InferenceRequest, RequestedOutput, Tensor
from .. import chat_template
from ..errors import BadRequest, ModelNotFound, OpenAIError
from ..llm import ready_models, served_runtime

log = logging.getLogger(__name__)

TASK_PARAMETER, TASK = "openai_task", "embed"
TOKEN_MODEL_PARAMETER = "openai_token_model"
OUTPUT_PARAMETER = "openai_embedding_output"
_FLOATS = ("FP32", "FP16", "FP64")
_TEXT_NAMES = ("text", "text_input")


@dataclass(frozen=True)
class Interface:
    """One model's input (text, or token ids) and embedding output."""

    model: str
    input: str
    datatype: str
    batched: bool
    output: str
    attention_mask: str | None = None  # its datatype, when the model takes one
    pads_batches: bool = False  # the model pads its batches (pad_batch_inputs): ids go unpadded


@dataclass(eq=False)
class EmbeddingModel:
    """One loaded embedding model as the OpenAI frontend sees it (built once per version)."""

    name: str
    text: Interface | None
    tokens: Interface | None
    dimension: int | None
    max_model_len: int | None
    matryoshka: bool
    matryoshka_dimensions: tuple[int, ...] | None
    tokenizer_dir: Path | None
    direct: bool = False  # text: the frontend's ids go to the token model (openai_tokenize_in_frontend)
    pad_to_multiple_of: int | None = None  # token ids sent padded (mask 0) to a multiple of this
    runtime: Any = field(default=None, repr=False)  # weakref.ref to the model's runtime (its statistics)
    _tokenizer: Any = field(default=None, repr=False)

    def tokenizer(self):
        """The ``tokenizers`` tokenizer of the model's ``tokenizer.json`` (None without one); blocking."""
        if self._tokenizer is None:
            self._tokenizer = False
            path = self.tokenizer_dir / "tokenizer.json" if self.tokenizer_dir is not None else None
            if path is not None and path.is_file():
                try:
                    from tokenizers import Tokenizer

                    tokenizer = Tokenizer.from_file(str(path))
                    tokenizer.no_truncation()
                    tokenizer.no_padding()
                    self._tokenizer = tokenizer
                except Exception as exc:  # an optional extra: usage then counts token-id inputs only
                    log.warning("model '%s': cannot load '%s': %s", self.name, path, exc)
        return self._tokenizer or None

    def tokenizer_loaded(self) -> bool:
        """Whether :meth:`tokenizer` answers without reading files (loaded, or known to be absent)."""
        return self._tokenizer is not None

    def request(self, prompt: str | list[int], request_id: str) -> InferenceRequest:
        """The DataPlane request of one input: text to the text interface, token ids to the token one."""
        if isinstance(prompt, str):
            if self.text is None:
                raise BadRequest(f"model '{self.name}' takes token ids only", "input")
            face = self.text
            data = np.empty(1, dtype=np.object_)
            data[0] = prompt.encode("utf-8")
            inputs = {face.input: _tensor(face.input, "BYTES", data, face.batched)}
        else:
            face = self.tokens
            if face is None:
                raise BadRequest(f"model '{self.name}' takes text only: it has no 'input_ids' input and its config "
                                 f"names no '{TOKEN_MODEL_PARAMETER}'", "input")
            ids = np.asarray(prompt, dtype=numpy_dtype(face.datatype))
            if face.attention_mask is not None:
                mask = np.ones(ids.shape, dtype=numpy_dtype(face.attention_mask))
                multiple = self.pad_to_multiple_of
                if multiple and ids.size % multiple:  # requests of similar lengths share a shape to batch
                    pad = multiple - ids.size % multiple
                    ids, mask = np.pad(ids, (0, pad)), np.pad(mask, (0, pad))
                inputs = {face.input: _tensor(face.input, face.datatype, ids, face.batched),
                          "attention_mask": _tensor("attention_mask", face.attention_mask, mask, face.batched)}
            else:
                inputs = {face.input: _tensor(face.input, face.datatype, ids, face.batched)}
        return InferenceRequest(face.model, inputs, id=request_id, outputs=[RequestedOutput(face.output)])

    def output_name(self, prompt: str | list[int]) -> str:
        return (self.text if isinstance(prompt, str) else self.tokens).output


def _tensor(name: str, datatype: str, data: np.ndarray, batched: bool) -> Tensor:
    if batched:
        data = data.reshape(1, -1)
    return Tensor(name, datatype, data.shape, data)


# -- describing a model ------------------------------------------------------------------------
def _types(tensors) -> dict[str, str]:
    return {t.name: config_to_datatype(mc.DataType.Name(t.data_type)) for t in tensors}


def _parameter(config, key: str) -> str | None:
    return config.parameters[key].string_value if key in config.parameters else None


def _embedding_output(config) -> tuple[str, int | None]:
    outputs = _types(config.output)
    named = _parameter(config, OUTPUT_PARAMETER)
    if named is not None:
        if named not in outputs:
            raise ValueError(f"parameter '{OUTPUT_PARAMETER}' names output '{named}', which the model does not have")
        name = named
    else:
        floats = [n for n, t in outputs.items() if t in _FLOATS]
        if len(floats) != 1:
            raise ValueError(f"it has {len(floats)} floating-point outputs; name the embedding with the parameter "
                             f"'{OUTPUT_PARAMETER}'")
        name = floats[0]
    dims = next(list(t.dims) for t in config.output if t.name == name)
    return name, (dims[-1] if dims and dims[-1] > 0 else None)


def _text_interface(name: str, config, output: str) -> Interface | None:
    inputs = _types(config.input)
    texts = [n for n in _TEXT_NAMES if inputs.get(n) == "BYTES"] or [n for n, t in inputs.items() if t == "BYTES"]
    if not texts or (len(texts) > 1 and texts[0] not in _TEXT_NAMES):
        return None
    return Interface(name, texts[0], "BYTES", config.max_batch_size > 0, output)


def _token_interface(name: str, config, output: str) -> Interface | None:
    inputs = _types(config.input)
    if inputs.get("input_ids") not in ("INT32", "INT64"):
        return None
    mask = inputs.get("attention_mask")
    mask = mask if mask in ("INT32", "INT64") else None
    padded = {n.strip() for n in (_parameter(config, PAD_PARAMETER) or "").split(",")}
    return Interface(name, "input_ids", inputs["input_ids"], config.max_batch_size > 0, output, mask,
                     "input_ids" in padded and (mask is None or "attention_mask" in padded))


def describe(runtime, lookup) -> EmbeddingModel | None:
    """``runtime``'s EmbeddingModel; None when its config does not mark it as one. A marked model whose
    interface does not fit raises ValueError saying why."""
    config = runtime.config
    if (_parameter(config, TASK_PARAMETER) or "").strip().lower() != TASK:
        return None
    output, dimension = _embedding_output(config)
    text = _text_interface(runtime.name, config, output)
    tokens = _token_interface(runtime.name, config, output)
    token_model = _parameter(config, TOKEN_MODEL_PARAMETER)
    if tokens is None and token_model:
        inner = lookup(token_model).config  # raises ServerError while that model is not ready
        inner_output, _ = _embedding_output(inner)
        tokens = _token_interface(token_model, inner, inner_output)
        if tokens is None:
            raise ValueError(f"its '{TOKEN_MODEL_PARAMETER}' model '{token_model}' has no 'input_ids' input")
    if text is None and tokens is None:
        raise ValueError("it has neither a text (BYTES) input nor an 'input_ids' input")
    directory = chat_template.tokenizer_dir(runtime, lookup)
    max_model_len = _max_model_len(config, directory)
    direct, multiple = _direct(runtime, lookup, text, tokens, directory, max_model_len)
    if tokens is not None and tokens.pads_batches:
        multiple = None  # its batcher batches ids of any length and pads each batch to its longest
    return EmbeddingModel(runtime.name, text, tokens, dimension, max_model_len,
                          (_parameter(config, "is_matryoshka") or "").strip().lower() in ("true", "1"),
                          _dimensions(_parameter(config, "matryoshka_dimensions")), directory,
                          direct, multiple, weakref.ref(runtime))


def _direct(runtime, lookup, text, tokens, directory, max_model_len) -> tuple[bool, int | None]:
    """Whether text goes to the token model as the frontend's ids (``openai_tokenize_in_frontend``), and the
    multiple token ids are padded to. The tokenizer step (the ensemble's step taking the text input) may state
    ``pad_to_multiple_of`` and ``max_length``; a ``max_length`` below ``max_model_len`` (it would truncate
    what the frontend accepts whole) keeps text on the ensemble."""
    config = runtime.config
    wanted = (_parameter(config, "openai_tokenize_in_frontend") or "").strip().lower() in ("true", "1")
    multiple = _positive(_parameter(config, "openai_pad_to_multiple_of"))
    if not wanted or text is None or tokens is None or tokens.model == runtime.name or directory is None:
        return False, multiple
    step_config = None
    for step in config.ensemble_scheduling.step:
        if text.input in step.input_map.values():
            try:
                step_config = lookup(step.model_name).config
            except ServerError:
                step_config = None
            break
    if step_config is not None:
        if multiple is None:
            multiple = _positive(_parameter(step_config, "pad_to_multiple_of"))
        length = _positive(_parameter(step_config, "max_length"))
        if length is not None and (max_model_len is None or length < max_model_len):
            log.warning("model '%s': its tokenizer step truncates at %d tokens, beyond max_model_len %s: text "
                        "keeps going through the ensemble", runtime.name, length, max_model_len)
            return False, multiple
    return True, multiple


def _positive(value: str | None) -> int | None:
    try:
        return int(value) if value is not None and int(value) > 0 else None
    except ValueError:
        return None


def _max_model_len(config, directory: Path | None) -> int | None:
    value = _parameter(config, "max_model_len")
    if value is None and directory is not None:
        try:
            value = json.loads((directory / "config.json").read_text(encoding="utf-8")).get("max_position_embeddings")
        except (OSError, ValueError, AttributeError):
            value = None
    try:
        return int(value) if value is not None and int(value) > 0 else None
    except (TypeError, ValueError):
        return None


def _dimensions(value: str | None) -> tuple[int, ...] | None:
    if not value:
        return None
    return tuple(int(v) for v in value.replace(" ", "").split(",") if v)


class EmbedderCatalog:
    """Finds the embedding models among the DataPlane's ready models (one EmbeddingModel per loaded version)."""

    def __init__(self, dataplane) -> None:
        self.dataplane = dataplane
        self._known: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _describe(self, runtime) -> EmbeddingModel | str | None:
        found = self._known.get(runtime)
        if found is None:
            try:
                found = describe(runtime, self.dataplane.model) or False
            except ServerError as exc:  # a step it needs is not ready: ask again next time
                return f"a model it needs is not ready: {exc.message}"
            except ValueError as exc:
                found = f"its config marks it as an embedding model, but {exc}"
                log.warning("model '%s': %s", runtime.name, found)
            self._known[runtime] = found
        return found or None

    def get(self, name: str) -> EmbeddingModel:
        try:
            runtime = served_runtime(self.dataplane, name)
        except NotFound:
            raise ModelNotFound(name) from None
        found = self._describe(runtime)
        if found is None:
            raise ModelNotFound(name, f"It is not an embedding model (config parameter {TASK_PARAMETER}: "
                                      f"\"{TASK}\").")
        if isinstance(found, str):
            raise OpenAIError(f"The model `{name}` cannot serve embeddings: {found}", 503, "model")
        return found

    def ready(self) -> list[EmbeddingModel]:
        return ready_models(self.dataplane, self._describe, EmbeddingModel)

    def default(self) -> EmbeddingModel:
        """The model a request without ``model`` goes to: the only embedding model served."""
        ready = self.ready()
        if len(ready) != 1:
            raise BadRequest("the request names no 'model' and the server serves "
                             f"{'no' if not ready else len(ready)} embedding models", "model")
        return ready[0]
