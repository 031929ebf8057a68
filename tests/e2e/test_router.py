"""End to end: two tideserve replicas of the tiny Llama behind vLLM's router (``vllm-router``), driven by the
official ``openai`` client through the router: round robin reaches both, a session stays on one replica, the
cache_aware policy keeps a shared prefix on one replica, and rolling restarts drop nothing.

Both replicas serve the same model (vLLM CPU engine, 1 GiB of KV cache each), started once for the module (two
engine starts, side by side); the router probes each replica's ``/v2/health/ready`` and forwards ``/v1`` requests
as its policy says. Which replica served a request is read from each replica's own metrics
(``tideserve:request_success_total``). The rolling restarts come last (they restart the replicas).

Rolling restarts: the replicas behind ``vllm-router`` (round robin, readiness probed each second, retries on).
Three rolling restarts, one replica, the other, the first again: streams run through the router to
both; one replica gets SIGTERM while they run and while new requests keep arriving; it drains and exits 0, and is
started again on the same ports (the router's worker URL) while more requests come; once ready the router's health
check takes it back. Every stream already running finishes (the replica drains them), the new requests go to the
other replica (readiness false at once; a request that still reaches the stopping replica gets 503, which the
router retries elsewhere; one that finds the port closed is retried as well), and no client sees an error.
"""

from __future__ import annotations

import functools
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from llm_fixtures import metric_value, vllm_env, write_vllm_model
from support import free_port, start_server, stop_servers, wait_http_ok
from tideserve.bench.router import router_command, start_router

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "llm"
STREAM_TOKENS = 400
LABELS = {"model_name": MODEL, "version": "1"}
MESSAGES = [{"role": "user", "content": "Name a color."}]
IGNORE_EOS = {"ignore_eos": True}  # a random model may end early; exact lengths are checked


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("rolling")
    tiny = tiny_model
    write_vllm_model(tmp / "models", MODEL, {"model": str(tiny), "dtype": "float32", "max_model_len": 1024,
                                             "enforce_eager": True, "max_num_seqs": 4})
    start = functools.partial(start_server, [tmp / "models"], "--allowed-model-root", str(tiny),
                              "--exit-timeout-secs", "120", "--enable-prompt-tokens-details", tmp_dir=tmp,
                              env=vllm_env(tmp), ready_timeout=780)
    with ThreadPoolExecutor(2) as pool:  # both engines start at once
        futures = [pool.submit(start) for _ in range(2)]
    started = _Replicas(f.result() for f in futures if f.exception() is None)
    started.start = start
    try:
        for future in futures:
            if future.exception() is not None:
                raise future.exception()
        yield started
    finally:
        stop_servers(started)  # side by side


class _Replicas(list):
    """The running replicas; :meth:`restart` starts one again on its ports once it has exited."""

    start = None

    def restart(self, index: int):
        old = self[index]
        self[index] = self.start(ports=(old.http_port, old.grpc_port, old.metrics_port))
        return self[index]


def _start_router(replicas, tmp_path_factory, policy: str):
    port = free_port()
    command = router_command(port, [s.base_url for s in replicas], policy) + [
        "--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--health-success-threshold", "1",
        "--retry-max-retries", "5", "--retry-initial-backoff-ms", "100"]
    log = tmp_path_factory.mktemp("router_log") / "router.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    wait_http_ok(proc, f"http://127.0.0.1:{port}/health", log, timeout=120)
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def router(replicas, tmp_path_factory):
    proc, url = _start_router(replicas, tmp_path_factory, "round_robin")
    yield url
    proc.terminate()
    proc.wait(30)


def test_cache_aware_policy_keeps_a_prefix_on_one_replica(replicas, tmp_path_factory):
    """vllm-router's cache_aware policy sends prompts with a shared prefix to the replica that has it cached:
    after the first, every request finds its system prompt in the prefix cache (round robin would send every
    other one to the replica that has not seen it)."""
    proc, url = _start_router(replicas, tmp_path_factory, "cache_aware")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        system = "You answer questions about the harbor. " + "The harbor has ships and cranes. " * 20
        cached = []
        for user in range(6):
            answer = client.chat.completions.create(
                model=MODEL, max_tokens=2, messages=[{"role": "system", "content": system},
                                                     {"role": "user", "content": f"Question {user}?"}])
            cached.append(answer.usage.prompt_tokens_details.cached_tokens)
        assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture()
def plain_router(replicas, tmp_path_factory):
    """The router as tideserve.bench.router starts it (round robin, its default health checks)."""
    log = tmp_path_factory.mktemp("router_log") / "router.log"
    proc, port = start_router([s.base_url for s in replicas], log, policy="round_robin")
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(30)


def _served(replicas) -> list[float]:
    return [metric_value(s.metrics(), "tideserve:request_success_total", **LABELS) or 0.0 for s in replicas]


def test_openai_client_through_the_router_reaches_both_replicas(replicas, plain_router):
    before = _served(replicas)
    with openai.OpenAI(base_url=f"{plain_router}/v1", api_key="unused", max_retries=0, timeout=120) as client:
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


@pytest.mark.timeout(1500)
def test_rolling_restarts_fail_no_stream(replicas, router):
    """Three rolling restarts (one replica, the other, the first again) while streams run through the router: 64
    streams and more in all, every one ends with its full token count, no client sees an error."""
    client = openai.OpenAI(base_url=f"{router}/v1", api_key="none", max_retries=0, timeout=300)
    results: dict[str, object] = {}
    expected: dict[str, int] = {}
    lock = threading.Lock()

    def stream(name: str, tokens: int) -> None:
        try:
            chunks = client.completions.create(model=MODEL, prompt=f"Story {name}", stream=True, max_tokens=tokens,
                                               extra_body={"ignore_eos": True},
                                               stream_options={"include_usage": True})
            usage = [c.usage.completion_tokens for c in chunks if c.usage is not None]
            outcome: object = usage[-1] if usage else "no usage"
        except Exception as exc:  # noqa: BLE001 (reported below)
            outcome = exc
        with lock:
            results[name] = outcome

    def launch(name: str, tokens: int) -> threading.Thread:
        expected[name] = tokens
        thread = threading.Thread(target=stream, args=(name, tokens))
        thread.start()
        return thread

    def in_flight(server) -> int:
        return httpx.get(f"{server.base_url}/load", timeout=10).json()["server_load"]

    def served(server) -> float:
        return metric_value(server.metrics(), "nv_inference_request_success", model=MODEL, version="1") or 0

    threads: list[threading.Thread] = []
    for restart, index in enumerate((0, 1, 0)):
        stopping, staying = replicas[index], replicas[1 - index]
        running = [launch(f"r{restart}-before-{i}", STREAM_TOKENS) for i in range(8)]
        threads += running
        deadline = time.monotonic() + 120  # both replicas run some
        while not (in_flight(stopping) and in_flight(staying)):
            assert time.monotonic() < deadline, "the router did not spread the streams over both replicas"
            time.sleep(0.05)
        stopping.process.send_signal(signal.SIGTERM)
        for i in range(6):  # new requests while the replica drains: none may fail
            threads.append(launch(f"r{restart}-draining-{i}", 16))
            time.sleep(0.25)
        assert stopping.process.wait(180) == 0, stopping.log()[-3000:]
        # the same ports again, so the router's worker URL finds the new process
        with ThreadPoolExecutor(1) as pool:
            starting = pool.submit(replicas.restart, index)
            for i in range(4):  # requests while the replica is down: the other serves them
                threads.append(launch(f"r{restart}-down-{i}", 16))
                time.sleep(1.0)
            restarted = starting.result()
        deadline = time.monotonic() + 120  # the router's health check takes it back
        probe = 0
        while not served(restarted):
            assert time.monotonic() < deadline, "the router sent nothing to the restarted replica"
            thread = launch(f"r{restart}-back-{probe}", 8)
            thread.join(120)
            threads.append(thread)
            probe += 1
    threads += [launch(f"last-{i}", 16) for i in range(max(8, 64 - len(expected)))]
    for thread in threads:
        thread.join(300)
    assert len(expected) >= 64
    failed = {name: outcome for name, outcome in results.items() if outcome != expected[name]}
    assert not failed and results.keys() == expected.keys(), (failed, set(expected) - set(results))
    assert all(served(server) for server in replicas)  # the last streams reached both
