"""End to end: what routers and autoscalers read, and LLM admission control, on a real server.

One vLLM engine for the module (the tiny random Llama, ``max_num_seqs`` 2, priority scheduling) with
``max_queue_size`` 2: at most 4 requests in flight. Checked: vLLM's own ``vllm:*`` families (names,
types, labels, buckets) on the metrics port and on ``GET /metrics`` of the HTTP port, beside
``nv_inference_*`` and ``tideserve:*``, moving after requests; ``GET /health``; a flood answered with
503 + ``Retry-After`` (HTTP), UNAVAILABLE (gRPC) and OpenAI's error shape, counted as REJECTED while the
admitted requests complete; a request's priority deciding which waiting request the engine runs first;
``usage.prompt_tokens_details.cached_tokens``. The access checks of ``/metrics`` and ``/health`` run on a
server without an engine.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest
from llm_fixtures import llm_inputs, metric_value, vllm_env, write_vllm_model
from prometheus_client.parser import text_string_to_metric_families
from support import start_server

from tideserve.bench import toy_repository

MODEL = "llm_q"
MAX_NUM_SEQS = 2
MAX_QUEUE_SIZE = 2
LONG = {"max_tokens": 200, "ignore_eos": True, "temperature": 0}  # a generation that keeps the engine busy
LONGER = {**LONG, "max_tokens": 400}
CONFIG = f'''backend: "vllm"
parameters {{ key: "max_queue_size" value {{ string_value: "{MAX_QUEUE_SIZE}" }} }}
'''

# vLLM's families a router or autoscaler reads: name -> type
VLLM_FAMILIES = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter", "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter", "vllm:request_success": "counter", "vllm:num_preemptions": "counter",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram", "vllm:request_generation_tokens": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
}

slow_vllm = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
]


@pytest.fixture(scope="module")
def llm_server(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("llm_metrics")
    tiny = tiny_model
    repository = tmp / "models"
    write_vllm_model(repository, MODEL, {"model": str(tiny), "dtype": "float32", "max_model_len": 2048,
                                         "enforce_eager": True, "max_num_seqs": MAX_NUM_SEQS,
                                         "scheduling_policy": "priority"}, config=CONFIG)
    server = start_server([repository], "--allowed-model-root", str(tiny), "--enable-prompt-tokens-details",
                          tmp_dir=tmp, env=vllm_env(tmp), ready_timeout=600)
    try:
        yield server
    finally:
        server.stop()


def _generate(server, prompt: str, parameters: dict, timeout: float = 300) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v2/models/{MODEL}/generate",
                      json={"text_input": prompt, "parameters": parameters}, timeout=timeout)


def _families(text: str) -> dict:
    return {family.name: family for family in text_string_to_metric_families(text)}


def _scrape(url: str, **kwargs) -> str:
    response = httpx.get(url, timeout=10, **kwargs)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return response.text


def _wait_for(read, timeout: float = 10.0):
    """The engine's logger records a step after its outputs: poll until ``read()`` is true."""
    deadline = time.monotonic() + timeout
    while not (value := read()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


# -- metrics --------------------------------------------------------------------------------------
@pytest.mark.usefixtures("llm_server")
class TestMetrics:
    pytestmark = slow_vllm

    def test_vllm_families_on_both_ports_move_after_requests(self, llm_server):
        metrics_url = f"http://127.0.0.1:{llm_server.metrics_port}/metrics"
        before = _scrape(metrics_url)
        labels = {"model_name": MODEL, "engine": "0"}
        done_before = metric_value(before, "vllm:request_success_total", finished_reason="length", **labels) or 0
        prompt_before = metric_value(before, "vllm:prompt_tokens_total", **labels) or 0
        for prompt in ("Hello world", "The quick brown fox"):
            response = _generate(llm_server, prompt, {"max_tokens": 8, "ignore_eos": True, "temperature": 0})
            assert response.status_code == 200, response.text

        def counted() -> str | None:
            text = _scrape(metrics_url)
            done = metric_value(text, "vllm:request_success_total", finished_reason="length", **labels) or 0
            return text if done >= done_before + 2 else None

        after = _wait_for(counted)
        assert after, "vllm:request_success_total did not count the two requests"
        assert metric_value(after, "vllm:prompt_tokens_total", **labels) > prompt_before
        assert metric_value(after, "vllm:generation_tokens_total", **labels) >= 16
        assert metric_value(after, "vllm:time_to_first_token_seconds_count", **labels) >= 2
        families = _families(after)
        for name, kind in VLLM_FAMILIES.items():
            assert name in families, f"{name} is missing"
            assert families[name].type == kind, (name, families[name].type)
            assert all(s.labels.get("model_name") == MODEL for s in families[name].samples), name
        # vLLM's own buckets, from the engine's logger (not recomputed here)
        from vllm.v1.metrics.buckets import histogram_buckets

        ttft = {float(s.labels["le"]) for s in families["vllm:time_to_first_token_seconds"].samples
                if s.name.endswith("_bucket")}
        assert ttft == {*map(float, histogram_buckets("time_to_first_token")), float("inf")}
        # finish reasons as vLLM labels them
        reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
        assert {"stop", "length", "abort"} <= reasons
        # the server's own families stay
        assert metric_value(after, "nv_inference_request_success", model=MODEL, version="1") >= 2
        assert metric_value(after, "tideserve:request_success_total", model_name=MODEL, version="1") >= 2

        # the HTTP port serves the same registry
        on_http = _families(_scrape(f"{llm_server.base_url}/metrics"))
        assert set(on_http) == set(families)

    def test_health(self, llm_server):
        response = httpx.get(f"{llm_server.base_url}/health", timeout=10)
        assert (response.status_code, response.content) == (200, b"")


# -- admission control ----------------------------------------------------------------------------
class _Flood:
    """``count`` generate requests at once; their responses, in order."""

    def __init__(self, server, count: int, parameters: dict) -> None:
        async def one(client: httpx.AsyncClient, i: int) -> httpx.Response:
            return await client.post(f"{server.base_url}/v2/models/{MODEL}/generate",
                                     json={"text_input": f"Request {i}", "parameters": parameters})

        async def run() -> list[httpx.Response]:
            limits = httpx.Limits(max_connections=count)
            async with httpx.AsyncClient(timeout=180, limits=limits) as client:
                return await asyncio.gather(*(one(client, i) for i in range(count)))

        self.responses = asyncio.run(run())


@pytest.mark.usefixtures("llm_server")
class TestAdmission:
    pytestmark = slow_vllm

    def test_flood_gets_503_with_retry_after_and_admitted_requests_complete(self, llm_server):
        metrics = llm_server.metrics()
        rejected_before = metric_value(metrics, "nv_inference_request_failure", model=MODEL, version="1",
                                       reason="REJECTED") or 0
        flood = _Flood(llm_server, 4 * (MAX_NUM_SEQS + MAX_QUEUE_SIZE), LONG)
        codes = [r.status_code for r in flood.responses]
        admitted = [r for r in flood.responses if r.status_code == 200]
        rejected = [r for r in flood.responses if r.status_code == 503]
        assert len(admitted) + len(rejected) == len(codes), codes
        assert MAX_NUM_SEQS + MAX_QUEUE_SIZE <= len(admitted) < len(codes), codes
        for response in rejected:
            assert response.headers["retry-after"] == "1"
            assert "max_queue_size 2" in response.json()["error"]
        for response in admitted:
            assert response.json()["text_output"]
        after = llm_server.metrics()
        assert metric_value(after, "nv_inference_request_failure", model=MODEL, version="1",
                            reason="REJECTED") == rejected_before + len(rejected)

    def test_grpc_and_openai_answer_a_full_queue(self, llm_server):
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        # fill the engine and the queue with long generations, then ask once more on each protocol
        fillers = [threading.Thread(target=_generate, args=(llm_server, f"Filler {i}", LONGER))
                   for i in range(MAX_NUM_SEQS + MAX_QUEUE_SIZE)]
        for thread in fillers:
            thread.start()
        try:
            assert _wait_for(lambda: _in_flight(llm_server) >= MAX_NUM_SEQS + MAX_QUEUE_SIZE, timeout=60)
            client = grpcclient.InferenceServerClient(llm_server.grpc_url)
            with pytest.raises(InferenceServerException) as caught:
                client.infer(MODEL, llm_inputs(grpcclient, "Hello", sampling={"max_tokens": 4}))
            assert caught.value.status() == "StatusCode.UNAVAILABLE"
            assert "max_queue_size" in caught.value.message()

            oai = openai.OpenAI(base_url=f"{llm_server.base_url}/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.APIStatusError) as refused:
                oai.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
            assert refused.value.status_code == 503
            assert refused.value.response.headers["retry-after"] == "1"
            error = refused.value.response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert (error["type"], error["code"]) == ("Service Unavailable", 503)  # vLLM's answer to overload
        finally:
            for thread in fillers:
                thread.join(timeout=180)

    def test_priority_decides_which_waiting_request_runs_first(self, llm_server):
        """Two long generations fill the engine; a request of priority 5 (OpenAI) then one of priority 1
        (generate) wait. vLLM runs the lower value first: the later request starts first. The fillers differ in
        length, so one slot frees first (two freed in one step would start both waiting requests together)."""
        fillers = [threading.Thread(target=_generate,
                                    args=(llm_server, f"Filler {i}", {**LONGER, "max_tokens": 1000 * (i + 1)}))
                   for i in range(MAX_NUM_SEQS)]
        for thread in fillers:
            thread.start()
        first_token: dict[str, float] = {}

        def low():  # sent first, served last
            oai = openai.OpenAI(base_url=f"{llm_server.base_url}/v1", api_key="unused", max_retries=0)
            stream = oai.completions.create(model=MODEL, prompt="Low", max_tokens=4, stream=True,
                                            extra_body={"priority": 5})
            for _ in stream:
                first_token.setdefault("low", time.monotonic())

        def high():
            with httpx.stream("POST", f"{llm_server.base_url}/v2/models/{MODEL}/generate_stream", timeout=120,
                              json={"text_input": "High", "stream": True,
                                    "parameters": {"max_tokens": 4, "priority": 1}}) as response:
                assert response.status_code == 200
                for _ in response.iter_lines():
                    first_token.setdefault("high", time.monotonic())

        try:
            assert _wait_for(lambda: _in_flight(llm_server) >= MAX_NUM_SEQS, timeout=60)
            waiting = [threading.Thread(target=low)]
            waiting[0].start()
            assert _wait_for(lambda: _in_flight(llm_server) >= MAX_NUM_SEQS + 1, timeout=60)
            waiting.append(threading.Thread(target=high))
            waiting[1].start()
            for thread in waiting:
                thread.join(timeout=180)
        finally:
            for thread in fillers:
                thread.join(timeout=180)
        assert first_token["high"] < first_token["low"], first_token


def _in_flight(server) -> int:
    """Requests in the engine, running or waiting, as its last step reported them (vllm:* gauges)."""
    text = server.metrics()
    labels = {"model_name": MODEL, "engine": "0"}
    return int((metric_value(text, "vllm:num_requests_running", **labels) or 0)
               + (metric_value(text, "vllm:num_requests_waiting", **labels) or 0))


# -- prefix cache in usage ------------------------------------------------------------------------
@pytest.mark.usefixtures("llm_server")
class TestCachedTokens:
    pytestmark = slow_vllm

    def test_usage_reports_cached_prompt_tokens(self, llm_server):
        oai = openai.OpenAI(base_url=f"{llm_server.base_url}/v1", api_key="unused", max_retries=0)
        prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * 12)
        first = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        second = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert first.usage.prompt_tokens_details is not None
        assert second.usage.prompt_tokens_details.cached_tokens > 0  # the same prompt's blocks were cached
        assert second.usage.prompt_tokens_details.cached_tokens <= second.usage.prompt_tokens
        metrics = llm_server.metrics()
        assert metric_value(metrics, "vllm:prefix_cache_hits_total", model_name=MODEL) > 0


# -- access checks, no engine ---------------------------------------------------------------------
def test_metrics_on_the_http_port_behind_the_api_key_and_health_open(tmp_path):
    server = start_server([toy_repository.write(tmp_path / "models")], "--api-key", "secret",
                          "--api-key-scope", "all", tmp_dir=tmp_path)
    try:
        refused = httpx.get(f"{server.base_url}/metrics", timeout=10)
        assert refused.status_code == 401
        assert "error" in refused.json()
        text = _scrape(f"{server.base_url}/metrics", headers={"Authorization": "Bearer secret"})
        assert "nv_inference_request_success" in _families(text)
        health = httpx.get(f"{server.base_url}/health", timeout=10)
        assert (health.status_code, health.content) == (200, b"")
    finally:
        server.stop()

