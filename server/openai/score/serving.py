"""Scores of text pairs with an embedding model: every distinct text embedded once (through
:func:`..embedding.serving.embed`, so the model's batcher gathers them), then the cosine similarity of each
pair. ``/score`` answers ``{"data": [{"index", "object": "score", "score"}], "usage"}`` in pair order;
``/rerank`` answers ``{"results": [{"index", "document": {"text"}, "relevance_score"}], "usage"}``, most
relevant first, the first ``top_n`` (0: all). Usage counts each text's tokens once per pair, as vLLM does.
"""

from __future__ import annotations

import time
import uuid

import numpy as np
import orjson

from ..embedding.serving import embed
from ..errors import BadRequest
from ..protocol import parse
from .protocol import MAX_TEXTS, RerankRequest, ScoreRequest, pair


async def create_score(server, doc, _scope) -> bytes:
    request: ScoreRequest = parse(ScoreRequest, doc)
    first, second = request.sides()
    model, scores, usage = await _scores(server, request.model, first, second, request.truncate_prompt_tokens,
                                         "score")
    return orjson.dumps({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                         "model": model, "data": [{"index": i, "object": "score", "score": s}
                                                  for i, s in enumerate(scores)],
                         "usage": {"prompt_tokens": usage, "total_tokens": usage}})


async def create_rerank(server, doc, _scope) -> bytes:
    request: RerankRequest = parse(RerankRequest, doc)
    queries, documents = pair(request.query, request.documents, "documents")
    model, scores, usage = await _scores(server, request.model, queries, documents, request.truncate_prompt_tokens,
                                         "rerank")
    results = [{"index": i, "document": {"text": d, "multi_modal": None}, "relevance_score": s}
               for i, (d, s) in enumerate(zip(documents, scores))]
    results.sort(key=lambda r: r["relevance_score"], reverse=True)
    if 0 < request.top_n < len(results):
        results = results[:request.top_n]
    return orjson.dumps({"id": f"rerank-{uuid.uuid4().hex}", "model": model,
                         "usage": {"prompt_tokens": usage, "total_tokens": usage}, "results": results})


async def _scores(server, name: str | None, first: list[str], second: list[str], truncate: int | None,
                  kind: str) -> tuple[str, list[float], int]:
    catalog = server.embedders
    model = catalog.get(name) if name else catalog.default()
    texts = list(dict.fromkeys([*first, *second]))  # each distinct text embedded once
    if len(texts) > MAX_TEXTS:
        raise BadRequest(f"the request holds {len(texts)} distinct texts; at most {MAX_TEXTS} in one request",
                         "documents")
    vectors, counts = await embed(server, model, texts, f"{kind}-{uuid.uuid4().hex}",
                                  truncate_prompt_tokens=truncate)
    at = {text: i for i, text in enumerate(texts)}
    if len(first) == 1:
        first = first * len(second)
    scores, usage = [], 0
    for one, two in zip(first, second):
        a, b = vectors[at[one]], vectors[at[two]]
        norm = max(float(np.linalg.norm(a)) * float(np.linalg.norm(b)), 1e-8)
        scores.append(float(np.dot(a, b)) / norm)
        usage += counts[at[one]] + counts[at[two]]
    return model.name, scores, usage
