"""The path of one streaming chat completion to vLLM (bench/llm_path.py): how many of tideserve's files it crosses.

The counts are the ones docs/architecture.md gives ("The path of a streaming chat completion"); a change that
adds a file to the path fails here until the document says so.
"""

from __future__ import annotations

import asyncio

from tideserve.bench.llm_path import trace

MAX_FILES = 30  # the whole request (docs/architecture.md)
MAX_DELTA_FILES = 20  # while the token deltas stream


def test_streaming_chat_completion_path():
    result = asyncio.run(trace(16))
    assert result["chunks"] >= 5, result["chunks"]  # role, deltas (steps the reader had not taken yet join), usage, [DONE]
    assert len(result["total"]) <= MAX_FILES, result["total"]
    assert len(result["delta"]) <= MAX_DELTA_FILES, result["delta"]
    # the request path: the HTTP frontend, the OpenAI route, the DataPlane, the vLLM backend
    for name in ("server/openai/chat_completion/serving.py", "server/dataplane.py", "llm_backends/vllm/generation.py"):
        assert name in result["total"]
