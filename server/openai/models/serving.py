"""The served models: every ready LLM model (see :mod:`tideserve.openai.llm`), one entry per name."""

from __future__ import annotations

import time

import orjson

from ..llm import LLMModel


def _card(llm: LLMModel, created: int) -> dict:
    return {"id": llm.name, "object": "model", "created": created, "owned_by": "tideserve", "root": llm.name,
            "parent": None}


async def list_models(server, _doc, _scope) -> bytes:
    created = int(time.time())
    return orjson.dumps({"object": "list", "data": [_card(llm, created) for llm in server.catalog.ready()]})


async def get_model(server, _doc, scope) -> bytes:
    return orjson.dumps(_card(server.catalog.get(scope["path_params"]["model"]), int(time.time())))
