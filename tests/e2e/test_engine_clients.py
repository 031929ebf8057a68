"""An engine client in each frontend worker (``--frontend-workers 2 --frontend-direct on``, workers/engines.py): the
vLLM engine core takes requests from the core's client and one per worker, and a worker runs its typed generations
(OpenAI chat and completions, the generate extension) on its own client, with no hop to the core per token."""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest
import tritonclient.http as httpclient
from llm_fixtures import llm_inputs, vllm_env, write_vllm_model
from support import start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "llm"
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Name a color."}]
CLIENT_UP = re.compile(r"frontend worker (\d) runs its generations on engine client (\d)")


@pytest.fixture(scope="module")
def llm_server(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("engine_clients")
    write_vllm_model(tmp / "models", MODEL, {"model": str(tiny_model), "dtype": "float32", "max_model_len": 512,
                                             "enforce_eager": True})
    server = start_server([tmp / "models"], "--frontend-workers", "2", "--frontend-direct", "on",
                          "--log-verbose", "1", "--model-control-mode", "explicit", "--load-model", MODEL,
                          "--allowed-model-root", str(tiny_model), tmp_dir=tmp, ready_timeout=540,
                          # both workers take HTTP connections, whatever the cores (workers/balance.py)
                          env={**vllm_env(tmp), "TIDESERVE_HTTP_FILL_CONNECTIONS": "0"})
    try:
        server.log_at_ready = server.log()
        yield server
    finally:
        server.stop()


def test_the_worker_clients_are_built_before_ready(llm_server):
    """Each worker builds its engine client for the models loaded at start before the server is ready, so a
    generation right after ready runs on a worker's client, not relayed through the core."""
    assert set(CLIENT_UP.findall(llm_server.log_at_ready)) == {("0", "1"), ("1", "2")}, llm_server.log_at_ready
    runs_before = len(re.findall(r"runs on this worker's engine client (\d)", llm_server.log()))
    with openai.OpenAI(base_url=f"{llm_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        reply = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 4
    assert _worker_runs(llm_server, runs_before), llm_server.log()[-4000:]


def _success_count(server) -> int:
    stats = httpx.get(f"{server.base_url}/v2/models/{MODEL}/stats", timeout=30).json()
    return stats["model_stats"][0]["inference_stats"]["success"]["count"]


def _worker_runs(server, since: int = 0) -> set[str]:
    """The client indexes the workers ran requests on (their debug log), from the ``since``-th such line on."""
    return set(re.findall(r"runs on this worker's engine client (\d)", server.log())[since:])


def _core_text(server, max_tokens: int) -> str:
    """A greedy generation through Triton's tensor interface: the core's own engine client runs it."""
    with httpclient.InferenceServerClient(server.http_url) as client:
        inputs = llm_inputs(httpclient, PROMPT, stream=False, exclude_input=True,
                            sampling={"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True})
        result = client.infer(MODEL, inputs)
    return result.as_numpy("text_output")[0].decode()


def test_streams_through_both_workers_match_the_core(llm_server):
    before = _success_count(llm_server)
    expected = _core_text(llm_server, 12)
    texts, chats = [], []
    runs_before = len(re.findall(r"runs on this worker's engine client (\d)", llm_server.log()))
    # two clients open at once: their connections go to different workers (TIDESERVE_HTTP_FILL_CONNECTIONS 0: a
    # worker accepts only while it holds no more connections than the other)
    with openai.OpenAI(base_url=f"{llm_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120) as one, \
            openai.OpenAI(base_url=f"{llm_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120) as two:
        for i in range(8):
            c = (one, two)[i % 2]
            chunks = list(c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True}))
            texts.append("".join(chunk.choices[0].text for chunk in chunks if chunk.choices))
            stream = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            chats.append("".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices))
    assert texts == [expected] * len(texts)
    assert len(set(chats)) == 1 and chats[0]
    # the generations ran in the workers, on both of their clients, and the core counts them in its statistics
    assert _worker_runs(llm_server, runs_before) == {"1", "2"}, llm_server.log()[-4000:]
    counted = before + 1 + 2 * len(texts)
    deadline = time.monotonic() + 10
    while _success_count(llm_server) < counted:
        assert time.monotonic() < deadline, (before, _success_count(llm_server))
        time.sleep(0.1)
    assert _success_count(llm_server) == counted


def _metric_sums(url: str) -> dict[str, float]:
    """Each sample name's sum over the model's samples (all label sets) of a /metrics scrape; the gauges'
    sample counts under ``("count", name)``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url, timeout=30).text
    sums: dict = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model_name") != MODEL:
                continue
            sums[sample.name] = sums.get(sample.name, 0) + sample.value
            if family.type == "gauge":
                sums[("count", sample.name)] = sums.get(("count", sample.name), 0) + 1
    return sums


def _counted_alike(url: str, timeout: float = 20) -> dict[str, float]:
    """A scrape once tideserve's request and token totals of the model equal vLLM's own (its engine counts every
    client's generations as they finish; a worker's counts reach the core in the message its generation's end
    sends): fails naming both if they do not within ``timeout`` seconds."""
    pairs = [("tideserve:request_success_total", "vllm:request_success_total"),
             ("tideserve:generation_tokens_total", "vllm:generation_tokens_total")]
    deadline = time.monotonic() + timeout
    while True:
        sums = _metric_sums(url)
        if all(sums.get(ours, 0) == sums.get(theirs, 0) for ours, theirs in pairs):
            return sums
        assert time.monotonic() < deadline, {name: sums.get(name) for pair in pairs for name in pair}
        time.sleep(0.2)


def test_vllm_families_count_the_requests_of_every_client(llm_server):
    """vLLM's own vllm:* families on /metrics (metrics port and HTTP port) count the generations the workers ran on
    their engine clients too, each once, and the engine's gauges stay one value."""
    urls = [f"http://127.0.0.1:{llm_server.metrics_port}/metrics", f"{llm_server.base_url}/metrics"]
    counted = ("vllm:request_success_total", "vllm:generation_tokens_total", "vllm:e2e_request_latency_seconds_count",
               "vllm:time_to_first_token_seconds_count", "vllm:request_generation_tokens_sum",
               "tideserve:request_success_total", "tideserve:generation_tokens_total", "tideserve:request_aborted_total")
    # every earlier generation counted in full (a worker's last stream's success and tokens come without waiting
    # for its next generation): tideserve's totals equal the engine's own
    before = _counted_alike(urls[0])
    runs_before = re.findall(r"runs on this worker's engine client (\d)", llm_server.log())
    _core_text(llm_server, 7)  # on the core's own client
    requests, tokens = 1, 7
    # two clients open at once: the second's connection goes to the worker that holds none (workers/balance.py:
    # with TIDESERVE_HTTP_FILL_CONNECTIONS 0 each worker accepts only while it holds no more than the others)
    with openai.OpenAI(base_url=f"{llm_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120) as one, \
            openai.OpenAI(base_url=f"{llm_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120) as two:
        for i in range(6):
            c = (one, two)[i % 2]
            if i in (1, 4):
                chunks = list(c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True}))
                assert chunks
            else:
                reply = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                             extra_body={"ignore_eos": True})
                assert reply.usage.completion_tokens == 5
            requests, tokens = requests + 1, tokens + 5
    runs = re.findall(r"runs on this worker's engine client (\d)", llm_server.log())[len(runs_before):]
    assert set(runs) == {"1", "2"}, runs  # both workers ran some on their own clients
    expected = {"vllm:request_success_total": requests, "vllm:generation_tokens_total": tokens,
                "vllm:e2e_request_latency_seconds_count": requests, "vllm:time_to_first_token_seconds_count": requests,
                "vllm:request_generation_tokens_sum": tokens, "tideserve:request_success_total": requests,
                "tideserve:generation_tokens_total": tokens, "tideserve:request_aborted_total": 0}
    for url in urls:
        deadline = time.monotonic() + 20  # the workers' increments come with their next message to the core
        while True:
            after = _metric_sums(url)
            moved = {name: after.get(name, 0) - before.get(name, 0) for name in counted}
            if moved == expected or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        # (on a mismatch: which worker's messages brought which LLM counts, and the requests' placement)
        assert moved == expected, (url, moved, re.findall(r"frontend worker \d's LLM counters moved .*|request \S+ "
                                                          r"runs on this worker's engine client \d",
                                                          llm_server.log())[-40:])
        # the engine's gauges: one sample each for the model, the idle engine's
        for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
            assert after.get(("count", gauge)) == 1, (gauge, after.get(("count", gauge)))
        assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0


def test_generate_extension_on_a_worker_client(llm_server):
    expected = _core_text(llm_server, 6)
    body = {"text_input": PROMPT, "parameters": {"max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                                 "exclude_input_in_output": True}}
    reply = httpx.post(f"{llm_server.base_url}/v2/models/{MODEL}/generate", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    assert reply.json()["text_output"] == expected


def test_a_closed_stream_is_aborted_through_the_worker_client(llm_server):
    aborted = re.compile(r"\[worker \d+\]: \[vllm\] Successfully cancelled the request")
    seen = len(aborted.findall(llm_server.log()))
    stats = httpx.get(f"{llm_server.base_url}/v2/models/{MODEL}/stats", timeout=30).json()["model_stats"][0]
    failed = stats["inference_stats"]["fail"]["count"]
    with httpx.Client(timeout=120) as client:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 400, "stream": True, "ignore_eos": True}
        with client.stream("POST", f"{llm_server.base_url}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            for _ in range(3):
                next(lines)
        # the connection is closed here, mid-stream
    deadline = time.monotonic() + 60
    while len(aborted.findall(llm_server.log())) <= seen:
        assert time.monotonic() < deadline, llm_server.log()[-4000:]
        time.sleep(0.1)
    while True:
        stats = httpx.get(f"{llm_server.base_url}/v2/models/{MODEL}/stats", timeout=30).json()["model_stats"][0]
        if stats["inference_stats"]["fail"]["count"] > failed:
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)
    # the engine is free again: the next request runs at once
    with openai.OpenAI(base_url=f"{llm_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        assert c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text


def _workers(server) -> list:
    import psutil

    found = []
    for child in psutil.Process(server.process.pid).children():
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "tideserve.workers.main" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:  # gone meanwhile
            pass
    return found


def test_a_worker_that_dies_mid_stream_leaves_the_engine_serving(llm_server):
    import threading

    workers = _workers(llm_server)
    assert len(workers) == 2
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 300, "stream": True, "ignore_eos": True}
    ended: list[str] = []

    def stream() -> None:
        try:
            with httpx.Client(timeout=120) as client:
                with client.stream("POST", f"{llm_server.base_url}/v1/chat/completions", json=body) as response:
                    for _ in response.iter_lines():
                        pass
            ended.append("finished")
        except httpx.HTTPError as exc:
            ended.append(type(exc).__name__)

    threads = [threading.Thread(target=stream) for _ in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(2)
    workers[0].kill()
    for thread in threads:
        thread.join(180)
    assert len(ended) == 4, ended  # each stream ended: finished, or cut with its worker
    deadline = time.monotonic() + 120
    while len([w for w in _workers(llm_server) if w.pid != workers[0].pid]) < 2:  # the core started another
        assert time.monotonic() < deadline
        time.sleep(0.5)
    with openai.OpenAI(base_url=f"{llm_server.base_url}/v1", api_key="unused", max_retries=2, timeout=120) as c:
        for _ in range(4):
            assert c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text
    assert llm_server.process.poll() is None


def test_unload_closes_the_worker_clients_cleanly(llm_server):
    with openai.OpenAI(base_url=f"{llm_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        assert c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text
        start = len(llm_server.log())
        with httpclient.InferenceServerClient(llm_server.http_url) as triton:
            triton.unload_model(MODEL)
            deadline = time.monotonic() + 120
            while any(row.get("state") == "READY" for row in triton.get_model_repository_index()):
                assert time.monotonic() < deadline
                time.sleep(0.2)
        with pytest.raises(openai.NotFoundError):
            c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
    assert httpx.get(f"{llm_server.base_url}/v2/health/live", timeout=10).status_code == 200
    time.sleep(1)
    log = llm_server.log()[start:]
    assert "EngineDeadError" not in log and "Traceback" not in log, log[-4000:]
