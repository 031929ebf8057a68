"""End to end: two tideserve replicas of the tiny Llama behind vLLM's router (``vllm-router``), driven by
the official ``openai`` client through the router.

Both replicas serve the same model (vLLM CPU engine, 1 GiB of KV cache each); the router probes each
replica's ``/v2/health/ready`` and forwards ``/v1`` requests as its policy says. Which replica served a
request is read from each replica's own metrics (``tideserve:request_success_total``).
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from llm_fixtures import metric_value, vllm_env, write_vllm_model
from support import start_server

from tideserve.bench.router import start_router

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),  # two engines start on a busy 2-core machine
]

MODEL = "llm"
LABELS = {"model_name": MODEL, "version": "1"}
MESSAGES = [{"role": "user", "content": "Name a color."}]
IGNORE_EOS = {"ignore_eos": True}  # a random model may end early; exact lengths are checked


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("router")
    model = tiny_model
    write_vllm_model(tmp / "models", MODEL, {"model": str(model), "dtype": "float32", "max_model_len": 256,
                                             "enforce_eager": True, "max_num_seqs": 8})
    start = functools.partial(start_server, [tmp / "models"], "--allowed-model-root", str(model), tmp_dir=tmp,
                              env=vllm_env(tmp), ready_timeout=780)
    with ThreadPoolExecutor(2) as pool:  # both engines start at once
        futures = [pool.submit(start) for _ in range(2)]
    started = [f.result() for f in futures if f.exception() is None]
    try:
        for future in futures:
            if future.exception() is not None:
                raise future.exception()
        yield started
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="module")
def router(replicas, tmp_path_factory):
    log = tmp_path_factory.mktemp("router_log") / "router.log"
    proc, port = start_router([s.base_url for s in replicas], log, policy="round_robin")
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(30)


def _served(replicas) -> list[float]:
    return [metric_value(s.metrics(), "tideserve:request_success_total", **LABELS) or 0.0 for s in replicas]


def test_openai_client_through_the_router_reaches_both_replicas(replicas, router):
    before = _served(replicas)
    with openai.OpenAI(base_url=f"{router}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        assert [m.id for m in client.models.list().data] == [MODEL]
        chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                              extra_body=IGNORE_EOS)
        assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 4
        chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                                     stream=True, stream_options={"include_usage": True},
                                                     extra_body=IGNORE_EOS))
        assert chunks[-1].usage.completion_tokens == 4
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
        completion = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0,
                                               extra_body=IGNORE_EOS)
        assert completion.usage.completion_tokens == 4
        pieces = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0,
                                                stream=True, extra_body=IGNORE_EOS))
        assert "".join(p.choices[0].text for p in pieces if p.choices) == completion.choices[0].text
    after = _served(replicas)
    served = [a - b for a, b in zip(after, before)]
    assert sum(served) == 4 and served == [2, 2], served  # round robin: two requests each


def test_session_affinity_pins_a_session_to_one_replica(replicas, tmp_path):
    """``consistent_hash`` (the KV-cache-reuse policy for multi-turn chats) sends every request of one
    session (``X-Session-ID``) to the same replica; different sessions spread over both."""
    proc, port = start_router([s.base_url for s in replicas], tmp_path / "router.log", policy="consistent_hash")
    try:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                           timeout=120) as client:
            picks = []
            for session in range(12):  # all on one replica by chance: 2 in 4096
                before = _served(replicas)
                for _ in range(2):
                    client.completions.create(model=MODEL, prompt="Hello", max_tokens=1,
                                              extra_headers={"X-Session-ID": f"session-{session}"})
                served = [a - b for a, b in zip(_served(replicas), before)]
                assert sorted(served) == [0, 2], served  # both requests of the session on one replica
                picks.append(served.index(2))
        assert set(picks) == {0, 1}, picks
    finally:
        proc.terminate()
        proc.wait(30)

