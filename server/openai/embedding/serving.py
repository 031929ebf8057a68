"""``POST /v1/embeddings``: one DataPlane request per input, all at once (the model's dynamic batcher
gathers them, with other clients' requests, into batches).

Text goes to the model's text interface as it is; when the request changes its tokens
(``truncate_prompt_tokens`` cuts an input, ``add_special_tokens`` false), or the model asks for it
(``openai_tokenize_in_frontend``: no ensemble hop, no tokenizer process), the frontend's token ids go to the
token interface, padded as the model's tokenizer step pads. The tokenizer counts ``usage`` and checks lengths, on
the event loop for short texts (``INLINE_CHARS``), else on a worker thread.
``dimensions`` keeps the leading values of a Matryoshka model's vector, normalised again; ``base64`` is
the vector's bytes (``embed_dtype``, ``endianness``), as vLLM encodes it.
"""

from __future__ import annotations

import asyncio
import base64
import random
import sys
import time

import numpy as np
import orjson

from ...errors import ServerError
from ..errors import BadRequest, OpenAIError, from_server_error
from ..protocol import parse
from .model import EmbeddingModel
from .protocol import EmbeddingRequest

SLICE = 64  # requests started per turn of the event loop
# Inputs up to this many characters (or token ids) in all are tokenized on the event loop (tens of µs): the hop
# to a worker thread and back costs more than that (measured: docs/performance.md, embeddings, session 5).
INLINE_CHARS = 1024


async def create_embedding(server, doc, _scope) -> bytes:
    request: EmbeddingRequest = parse(EmbeddingRequest, doc)
    catalog = server.embedders
    model = catalog.get(request.model) if request.model else catalog.default()
    _check(request, model)
    request_id = f"embd-{random.getrandbits(128):032x}"  # uuid4's os.urandom is a system call per request
    vectors, counts = await embed(server, model, request.inputs(), request_id,
                                  truncate_prompt_tokens=request.truncate_prompt_tokens,
                                  add_special_tokens=request.add_special_tokens)
    data = [{"index": i, "object": "embedding", "embedding": _encode(_dimensions(v, request.dimensions), request)}
            for i, v in enumerate(vectors)]
    usage = sum(counts)
    return orjson.dumps({"id": request_id, "object": "list", "created": int(time.time()), "model": model.name,
                         "data": data, "usage": {"prompt_tokens": usage, "total_tokens": usage}},
                        option=orjson.OPT_SERIALIZE_NUMPY)


# A request still running after this long starts watching its connection (a client gone away cancels it), as KServe
# infer does (server/http/kserve.py): the many answered sooner cost no watcher task
create_embedding.disconnect_watch_s = 0.25


def _check(request: EmbeddingRequest, model: EmbeddingModel) -> None:
    if request.use_activation is False:
        raise BadRequest(f"model '{model.name}' normalises its embeddings itself: 'use_activation' false is not "
                         "supported", "use_activation")
    dimensions = request.dimensions
    if dimensions is None:
        return
    if not model.matryoshka:
        raise BadRequest(f"Model {model.name!r} does not support Matryoshka embeddings; dimensions must be unset "
                         f"(received dimensions={dimensions}).", "dimensions")
    size = model.dimension or 0
    if not 1 <= dimensions <= size:
        raise BadRequest(f"Model {model.name!r} only supports dimensions in range [1, {size}], got {dimensions}.",
                         "dimensions")
    if model.matryoshka_dimensions is not None and dimensions not in model.matryoshka_dimensions:
        raise BadRequest(f"Model {model.name!r} only supports Matryoshka dimensions "
                         f"{list(model.matryoshka_dimensions)}, got {dimensions}.", "dimensions")


async def embed(server, model: EmbeddingModel, inputs: list[str | list[int]], request_id: str, *,
                truncate_prompt_tokens: int | None = None, add_special_tokens: bool = True
                ) -> tuple[list[np.ndarray], list[int]]:
    """Each input's vector (float32) and token count; also what ``/v1/score`` and ``/v1/rerank`` compare."""
    if model.tokenizer_loaded() and sum(len(i) for i in inputs) <= INLINE_CHARS:
        prompts, counts = _prepare(model, inputs, truncate_prompt_tokens, add_special_tokens)
    else:
        prompts, counts = await server.run_blocking(_prepare, model, inputs, truncate_prompt_tokens,
                                                    add_special_tokens)
    direct = [isinstance(i, str) and not isinstance(p, str) for i, p in zip(inputs, prompts)] if model.direct else None
    return await _embed(server.dataplane, model, prompts, request_id, direct), counts


def _prepare(model: EmbeddingModel, inputs: list[str | list[int]], truncate: int | None,
             add_special_tokens: bool) -> tuple[list[str | list[int]], list[int]]:
    """The prompts to send (text kept as text where the model may tokenize it) and each one's token count;
    blocking (tokenizes), on a worker thread. Raises BadRequest for an input the model cannot take."""
    tokenizer = model.tokenizer()
    truncate = _truncation(model, truncate)
    if tokenizer is None and (truncate is not None or not add_special_tokens) and any(
            isinstance(p, str) for p in inputs):
        field = "truncate_prompt_tokens" if truncate is not None else "add_special_tokens"
        raise BadRequest(f"model '{model.name}' has no tokenizer files the server can read, which {field} needs",
                         field)
    texts = [(i, p) for i, p in enumerate(inputs) if isinstance(p, str)]
    encoded: dict[int, list[int]] = {}
    if texts and tokenizer is not None:
        # one text (most requests): encode, which keeps the GIL; encode_batch lets it go for its ~20 µs, an
        # instance thread of the model takes it, and the event loop waits to get it back (docs/performance.md)
        encodings = ([tokenizer.encode(texts[0][1], add_special_tokens=add_special_tokens)] if len(texts) == 1 else
                     tokenizer.encode_batch([p for _, p in texts], add_special_tokens=add_special_tokens))
        encoded = {i: e.ids for (i, _), e in zip(texts, encodings)}
    vocabulary = tokenizer.get_vocab_size(with_added_tokens=True) if tokenizer is not None else None
    prompts, counts = [], []
    for i, prompt in enumerate(inputs):
        if isinstance(prompt, list):
            _check_ids(model, i, prompt, vocabulary)
        ids = encoded.get(i) if isinstance(prompt, str) else prompt
        send = prompt
        if ids is not None:
            if truncate and len(ids) > truncate:
                ids = send = ids[:truncate]
            elif model.max_model_len is not None and len(ids) > model.max_model_len:
                raise BadRequest(f"This model's maximum context length is {model.max_model_len} tokens. However, "
                                 f"you requested {len(ids)} tokens in the input for embedding generation. Please "
                                 "reduce the length of the input.", "input")
            if not add_special_tokens or model.direct:
                send = ids  # the model's own tokenizer would add them / the frontend's ids skip the ensemble
        prompts.append(send)
        counts.append(len(ids) if ids is not None else 0)
    return prompts, counts


def _truncation(model: EmbeddingModel, truncate: int | None) -> int | None:
    """``truncate_prompt_tokens`` as a token count (-1: the model's length), checked against the model."""
    limit = model.max_model_len
    if truncate is not None and limit is not None and truncate > limit:
        raise BadRequest(f"truncate_prompt_tokens value ({truncate}) is greater than max_model_len ({limit}). "
                         "Please request a smaller truncation size.", "truncate_prompt_tokens")
    return limit if truncate == -1 else truncate


def _check_ids(model: EmbeddingModel, index: int, ids: list[int], vocabulary: int | None) -> None:
    bad = next((t for t in ids if t >= vocabulary), None) if vocabulary is not None else None
    if bad is not None:
        raise BadRequest(f"input[{index}]: token id {bad} is out of vocabulary (model '{model.name}' has {vocabulary} "
                         "tokens)", "input")


async def _embed(dataplane, model: EmbeddingModel, prompts: list[str | list[int]], request_id: str,
                 direct: list[bool] | None = None) -> list:
    """Each prompt's vector (float32), the requests run concurrently. ``direct``: the inputs that were text
    of the model sent as ids to its token model, counted in the model's own statistics too."""
    tasks = []
    started = time.monotonic_ns()
    try:
        if len(prompts) == 1:  # one input (most requests): awaited here, no task and no gather
            responses = [await dataplane.infer_unary(model.request(prompts[0], f"{request_id}-0"))]
        else:
            for k, prompt in enumerate(prompts):
                if k and k % SLICE == 0:
                    await asyncio.sleep(0)
                inference = model.request(prompt, f"{request_id}-{k}")
                tasks.append(asyncio.ensure_future(dataplane.infer_unary(inference)))
            responses = await asyncio.gather(*tasks)
    except ServerError as exc:
        raise from_server_error(exc, prompt_param="input") from None
    finally:
        for task in tasks:
            task.cancel()
    vectors = []
    for prompt, response in zip(prompts, responses):
        name = model.output_name(prompt)
        tensor = next((t for t in response.outputs if t.name == name), None)
        if tensor is None:
            raise OpenAIError(f"model '{model.name}' answered without its embedding output '{name}'", 500)
        vectors.append(np.asarray(tensor.data, dtype=np.float32).reshape(-1))
    if direct is not None and any(direct) and model.runtime is not None:
        # served by the short path: counted on the model (an ensemble) as its own runs would be
        dataplane.record_frontend_runs(model.runtime(), sum(direct), time.monotonic_ns() - started)
    return vectors


def _dimensions(vector: np.ndarray, dimensions: int | None) -> np.ndarray:
    if dimensions is None or dimensions >= vector.size:
        return vector
    kept = vector[:dimensions]
    norm = float(np.linalg.norm(kept))
    return kept / max(norm, 1e-12)


def _encode(vector: np.ndarray, request: EmbeddingRequest):
    if request.encoding_format == "float":
        return vector
    dtype = np.dtype(np.float16 if request.embed_dtype == "float16" else np.float32)
    order = {"little": "<", "big": ">"}.get(request.endianness, "<" if sys.byteorder == "little" else ">")
    return base64.b64encode(vector.astype(dtype.newbyteorder(order)).tobytes()).decode("ascii")
