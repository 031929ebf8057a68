"""The served models: every ready LLM model (see :mod:`tideserve.openai.llm`), one entry per name, then each
LoRA adapter of those models with its base model as ``parent`` and its directory as ``root`` (as vLLM lists
them), then every ready embedding model (see :mod:`tideserve.openai.embedding.model`)."""

from __future__ import annotations

import time

import orjson

from ..errors import ModelNotFound
from ..llm import LLMModel


def _card(llm: LLMModel, created: int) -> dict:
    return {"id": llm.name, "object": "model", "created": created, "owned_by": "tideserve", "root": llm.name,
            "parent": None}


def _adapter_card(adapter: dict[str, str], created: int) -> dict:
    return {"id": adapter["name"], "object": "model", "created": created, "owned_by": "tideserve",
            "root": adapter["path"], "parent": adapter["model"]}


async def list_models(server, _doc, _scope) -> bytes:
    created = int(time.time())
    cards = [_card(llm, created) for llm in server.catalog.ready()]
    served = {card["id"] for card in cards}
    cards += [_adapter_card(a, created) for a in server.dataplane.adapters() if a["model"] in served]
    cards += [_card(model, created) for model in server.embedders.ready()] if server.embedders is not None else []
    return orjson.dumps({"object": "list", "data": cards})


async def get_model(server, _doc, scope) -> bytes:
    name = scope["path_params"]["model"]
    try:
        llm = server.catalog.get(name)
    except ModelNotFound:
        if server.embedders is None:
            raise
        return orjson.dumps(_card(server.embedders.get(name), int(time.time())))
    adapter = server.catalog.adapter(name) if llm.base else None
    created = int(time.time())
    return orjson.dumps(_adapter_card(adapter, created) if adapter else _card(llm, created))
