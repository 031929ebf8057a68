"""The path of one streaming chat completion to vLLM (bench/llm_path.py): how many of tideserve's files it crosses.

The counts are the ones docs/architecture.md gives ("The path of a streaming chat completion"); a change that
adds a file to the path fails here until the document says so.
"""

from __future__ import annotations

import asyncio

from tideserve.bench.llm_path import trace

MAX_FILES = 15  # the whole request (docs/architecture.md)
MAX_DELTA_FILES = 10  # while the token deltas stream (the steady state)
MAX_DELTA_TO_FINISH_FILES = 11  # from the third chunk to the finishing one (the request's end work included)


def _within_limits(result) -> bool:
    return (len(result["total"]) <= MAX_FILES and len(result["delta"]) <= MAX_DELTA_FILES
            and len(result["delta_to_finish"]) <= MAX_DELTA_TO_FINISH_FILES)


def test_streaming_chat_completion_path():
    # A reader that falls behind (a loaded machine) has the deltas it has not taken joined into one
    # (GenerationDelta.extend, server/generation.py): a file the path crosses only then. Up to three traces, the
    # first within the limits counted; a path that grew exceeds them in every one.
    for _ in range(3):
        result = asyncio.run(trace(32))
        if _within_limits(result):
            break
    assert result["chunks"] >= 5, result["chunks"]  # role, deltas (steps the reader had not taken yet join), usage, [DONE]
    assert result["steady_chunks"] >= 3, result  # the steady state was seen (not all joined into a few chunks)
    assert len(result["total"]) <= MAX_FILES, result["total"]
    assert len(result["delta"]) <= MAX_DELTA_FILES, result["delta"]
    assert len(result["delta_to_finish"]) <= MAX_DELTA_TO_FINISH_FILES, result["delta_to_finish"]
    # a typed generation stream: no scheduler, runtime, response objects or statistics per token delta
    for name in ("server/schedulers/passthrough.py", "server/runtime.py", "server/responses.py", "server/types.py",
                 "server/stats.py", "server/backend.py", "llm_backends/vllm/backend.py", "server/openai/llm.py"):
        assert name not in result["delta"], result["delta"]
    # the way in: the model's generation entry and LLMModel are kept per model (no repository, runtime or scheduler
    # per request), LoRA only for a request naming an adapter, the OpenAI limits' checks only for what may pass them
    for name in ("server/repository.py", "server/runtime.py", "server/schedulers/base.py",
                 "server/schedulers/passthrough.py", "llm_backends/vllm/backend.py", "llm_backends/vllm/lora.py",
                 "server/openai/limits.py"):
        assert name not in result["total"], result["total"]
    # the way out of a plain answer (no tool mode, no reasoning parser): its chunks, the finishing one included, are
    # built where the deltas are read, without the answer's tool-call and reasoning reader
    assert "server/openai/chat_completion/output.py" not in result["total"], result["total"]
    # the request's end is kept for its model's statistics (one tuple), counted when they are read
    assert "server/stats.py" not in result["total"], result["total"]
    # the request path: the HTTP frontend, the OpenAI route, the DataPlane, the vLLM backend
    for name in ("server/openai/chat_completion/serving.py", "server/dataplane.py", "llm_backends/vllm/generation.py"):
        assert name in result["total"]
