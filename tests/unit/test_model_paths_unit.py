"""Model paths stay inside the model repository, without a server: a model's local paths and the vLLM engine's
paths are confined to it (or to an allowed root)."""

from __future__ import annotations

import pytest

from tideserve.backend import ModelContext
from tideserve.errors import InvalidArgument


def test_allowed_root_admits_a_directory_outside(model_paths_layout, tmp_path):
    _root, repo, outside, _marker = model_paths_layout
    ctx = ModelContext("add_sub", 1, None, repo / "add_sub")
    with pytest.raises(InvalidArgument, match="tokenizer_dir"):
        ctx.local_path(str(outside / "tokenizer"), "parameter 'tokenizer_dir'")
    allowed = ModelContext("add_sub", 1, None, repo / "add_sub", allowed_roots=(outside,))
    assert allowed.local_path(str(outside / "tokenizer"), "tokenizer_dir") == (outside / "tokenizer").resolve()
    assert allowed.local_path(str(tmp_path / "absent"), "tokenizer_dir") is None


def test_vllm_engine_paths_are_confined(model_paths_layout, tmp_path):
    from tideserve.llm_backends.vllm.config import _resolve_path

    _root, repo, outside, _marker = model_paths_layout
    ctx = ModelContext("llm", 1, None, repo / "add_sub")
    with pytest.raises(InvalidArgument, match="engine argument 'model'"):
        _resolve_path(str(outside), ctx, "model")
    with pytest.raises(InvalidArgument, match="engine argument 'tokenizer'"):
        _resolve_path("../../../outside", ctx, "tokenizer")
    with pytest.raises(InvalidArgument, match="model id"):
        _resolve_path("a/b/../../../etc", ctx, "model")
    assert _resolve_path("facebook/opt-125m", ctx, "model") == "facebook/opt-125m"  # a hub id stays one
    assert _resolve_path(".", ctx, "model") == str((repo / "add_sub" / "1").resolve())
