"""LoRA adapters of the vllm backend without an engine: declarations, path confinement, selection."""

from __future__ import annotations

import asyncio
import json

import pytest
from tritonclient.grpc import model_config_pb2 as mc

from tideserve.backend import ModelContext
from tideserve.errors import InvalidArgument, NotFound
from tideserve.llm_backends.vllm.lora import Adapters, declared_adapters, lora_enabled


def _context(tmp_path, allowed=()) -> ModelContext:
    model_path = tmp_path / "repository" / "llm"
    (model_path / "1").mkdir(parents=True)
    return ModelContext("llm", 1, mc.ModelConfig(name="llm", backend="vllm"), model_path, allowed_roots=tuple(allowed))


def _adapter(directory):
    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text("{}")
    return directory


def test_multi_lora_json_and_lora_modules_resolve_inside_the_repository(tmp_path):
    ctx = _context(tmp_path)
    sql = _adapter(ctx.version_path / "adapters" / "sql")
    chat = _adapter(ctx.model_path / "shared" / "chat")
    (ctx.version_path / "multi_lora.json").write_text(json.dumps({"sql": "./adapters/sql"}))
    kwargs = {"model": "x", "enable_lora": "true", "lora_modules": [f"chat={chat}", {"name": "sql2", "path": str(sql)}]}
    assert declared_adapters(ctx, kwargs) == {"chat": str(chat), "sql2": str(sql), "sql": str(sql)}
    assert "lora_modules" not in kwargs  # no engine argument
    assert lora_enabled({"enable_lora": True}) and not lora_enabled({})


@pytest.mark.parametrize(("kwargs", "multi", "error", "words"), [
    ({"lora_modules": ["a=./a"]}, None, InvalidArgument, "'enable_lora': true"),
    ({"enable_lora": True, "lora_modules": ["a=./missing"]}, None, NotFound, "No adapter found for ./missing"),
    ({"enable_lora": True, "lora_modules": ["a=/etc"]}, None, InvalidArgument, "outside the model repository"),
    ({"enable_lora": True, "lora_modules": ["a=../../../outside"]}, None, InvalidArgument, "outside the model"),
    ({"enable_lora": True, "lora_modules": [7]}, None, InvalidArgument, "neither 'name=path'"),
    ({"enable_lora": True, "lora_modules": ["a=./a", "a=./a"]}, None, InvalidArgument, "appears twice"),
    ({"enable_lora": True, "lora_modules": "a=./a"}, None, InvalidArgument, "must be a list"),
    ({"enable_lora": True, "lora_modules": ["a=./a"]}, '{"a": "./a"}', InvalidArgument, "declared both"),
    ({"enable_lora": True}, "[1]", InvalidArgument, "JSON object of adapter name"),
    ({"enable_lora": True}, "{nope", InvalidArgument, "failed to parse"),
])
def test_bad_declarations_name_what_is_wrong(tmp_path, kwargs, multi, error, words):
    ctx = _context(tmp_path)
    _adapter(ctx.version_path / "a")
    _adapter(tmp_path / "outside")
    if multi is not None:
        (ctx.version_path / "multi_lora.json").write_text(multi)
    with pytest.raises(error) as info:
        declared_adapters(ctx, {"model": "x", **kwargs})
    assert words in info.value.message


def test_an_allowed_root_may_hold_adapters(tmp_path):
    outside = _adapter(tmp_path / "outside" / "a")
    ctx = _context(tmp_path, allowed=[tmp_path / "outside"])
    assert declared_adapters(ctx, {"enable_lora": True, "lora_modules": {"a": str(outside)}}) == {"a": str(outside)}


def test_selection_errors_name_the_parameter():
    assert Adapters("llm", enabled=True).select(None) is None
    for adapters, name, words in [(Adapters("llm", enabled=False), "a", "serves no LoRA adapters"),
                                  (Adapters("llm", enabled=True), "a", "has no LoRA adapter 'a' (its adapters: none)"),
                                  (Adapters("llm", enabled=True), 3, "must be a string")]:
        with pytest.raises(InvalidArgument, match="'lora_name'") as info:
            adapters.select(name)
        assert words in info.value.message


def test_unloading_an_unknown_adapter_is_not_found():
    with pytest.raises(NotFound, match="cannot be found"):
        asyncio.run(Adapters("llm", enabled=True).unload("a"))

