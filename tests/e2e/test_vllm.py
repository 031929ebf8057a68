"""End to end: the vllm backend in a real tideserve process, driven by Triton's clients.

One engine (start-up is ~40 s on a CPU even with ``enforce_eager``), the session's (``vllm_server`` in
tests/conftest.py, shared with the other modules that need the same engine arguments): a tiny random Llama
made offline, float32 so greedy outputs match Hugging Face ``transformers`` token for token. A second model with a bad path shows a failed engine start leaves the server serving.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from llm_fixtures import (
    VLLM_BAD_MODEL,
    VLLM_MAX_MODEL_LEN,
    VLLM_MODEL,
    GrpcStream,
    cancel_a_running_generation,
    llm_inputs,
    load_model,
    metric_value,
    wait_engine_idle,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(240),
]

MODEL = VLLM_MODEL
BAD_MODEL = VLLM_BAD_MODEL
MAX_MODEL_LEN = VLLM_MAX_MODEL_LEN
PROMPTS = ["Hello world", "The quick brown fox", "Once upon a time there was"]
GREEDY = {"temperature": 0, "ignore_eos": True}


# -- fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm_server(vllm_server):
    """The session's vLLM server (``vllm_server`` in tests/conftest.py, shared with other modules): it starts
    with no model (explicit mode); both models then load through the repository API while a probe times the
    health endpoint: the engine starts off the event loop."""
    wait_engine_idle(vllm_server)
    return vllm_server


@pytest.fixture(scope="session")
def hf_greedy(tiny_model):
    """``prompt, n -> the n token ids`` Hugging Face greedy ``generate`` makes (EOS does not stop it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model.eval()

    def generate(prompt: str, n: int) -> tuple[list[int], list[int]]:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        config = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                                  pad_token_id=tokenizer.pad_token_id)
        with torch.no_grad():
            out = model.generate(ids, generation_config=config)
        return ids[0].tolist(), out[0, ids.shape[1]:].tolist()

    generate.tokenizer = tokenizer
    return generate


@pytest.fixture()
def grpc_client(llm_server):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(llm_server.grpc_url)
    yield client
    client.close()


@pytest.fixture()
def http_client(llm_server):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(llm_server.http_url, network_timeout=120)
    yield client
    client.close()


def unary_text(client, module, prompt, sampling, **kw) -> str:
    result = client.infer(MODEL, llm_inputs(module, prompt, sampling=sampling, **kw))
    return result.as_numpy("text_output")[0].decode()


# -- the model ----------------------------------------------------------------------------------
def test_config_is_auto_completed(llm_server):
    with urllib.request.urlopen(f"{llm_server.base_url}/v2/models/{MODEL}/config") as r:
        config = json.loads(r.read())
    assert config["backend"] == "vllm"
    assert config["max_batch_size"] == 0
    assert config["model_transaction_policy"]["decoupled"] is True
    assert [g["kind"] for g in config["instance_group"]] == ["KIND_MODEL"]
    inputs = {t["name"]: t for t in config["input"]}
    assert inputs["text_input"]["data_type"] == "TYPE_STRING"
    assert {"stream", "sampling_parameters", "exclude_input_in_output", "return_finish_reason",
            "return_cumulative_logprob", "return_logprobs", "return_num_input_tokens",
            "return_num_output_tokens", "input_ids"} <= set(inputs)
    outputs = {t["name"] for t in config["output"]}
    assert {"text_output", "output_ids", "finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens",
            "num_output_tokens"} <= outputs


def test_server_answers_while_the_engine_starts(llm_server):
    assert len(llm_server.health_latencies) > 20  # the probe ran all through the engine start-up
    # a blocking start would stall it for the whole engine start (40 s or more); a loaded machine, seconds at most
    assert max(llm_server.health_latencies) < 10.0
    assert MODEL not in llm_server.load_errors


def test_bad_model_path_is_unavailable_with_the_engine_message(llm_server, http_client):
    code, message = llm_server.load_errors[BAD_MODEL]
    assert code in (400, 503) and "no_such_weights" in message
    req = urllib.request.Request(f"{llm_server.base_url}/v2/repository/index", data=b"{}", method="POST")
    with urllib.request.urlopen(req) as r:
        index = {m["name"]: m for m in json.loads(r.read())}
    bad = index[BAD_MODEL]
    assert bad["state"] == "UNAVAILABLE"
    assert "vLLM engine failed to start" in bad["reason"] and "no_such_weights" in bad["reason"]
    assert index[MODEL]["state"] == "READY"
    assert not http_client.is_model_ready(BAD_MODEL)
    assert http_client.is_model_ready(MODEL)
    assert unary_text(http_client, _http(), "Hello", {"max_tokens": 2})


# -- correctness against transformers -----------------------------------------------------------
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_and_text_match_transformers(grpc_client, hf_greedy, prompt):
    import tritonclient.grpc as grpcclient

    prompt_ids, expected = hf_greedy(prompt, 24)
    sampling = {**GREEDY, "max_tokens": 24}
    result = grpc_client.infer(MODEL, llm_inputs(grpcclient, prompt_ids, sampling=sampling))
    assert result.as_numpy("output_ids").tolist() == expected  # the token interface

    text = hf_greedy.tokenizer.decode(expected, skip_special_tokens=True)
    assert unary_text(grpc_client, grpcclient, prompt, sampling, exclude_input=True) == text
    # Triton's default for a non-streamed request repeats the prompt
    assert unary_text(grpc_client, grpcclient, prompt, sampling) == prompt + text


def test_token_interface_can_return_the_prompt_ids(grpc_client, hf_greedy):
    import tritonclient.grpc as grpcclient

    prompt_ids, expected = hf_greedy(PROMPTS[0], 6)
    result = grpc_client.infer(MODEL, llm_inputs(grpcclient, prompt_ids, sampling={**GREEDY, "max_tokens": 6},
                                                 exclude_input=False))
    assert result.as_numpy("output_ids").tolist() == prompt_ids + expected


# -- streaming and unary ------------------------------------------------------------------------
def test_grpc_stream_sends_deltas_then_final(llm_server, grpc_client):
    import tritonclient.grpc as grpcclient

    sampling = {**GREEDY, "max_tokens": 32}
    whole = unary_text(grpc_client, grpcclient, PROMPTS[1], sampling, exclude_input=True)
    stream = GrpcStream(llm_server.grpc_url)
    try:
        stream.send(MODEL, "s1", llm_inputs(grpcclient, PROMPTS[1], stream=True, sampling=sampling,
                                            return_num_output_tokens=True, return_finish_reason=True))
        result = stream.wait_all()["s1"]
    finally:
        stream.close()
    assert result.error is None
    assert result.finals[-1] and not any(result.finals[:-1])
    assert len(result.texts) > 2
    assert result.text == whole  # increments concatenate to the whole text
    assert sum(len(t) for t in result.texts) == len(whole)  # each carries only what is new
    counts = [int(r.as_numpy("num_output_tokens")[0]) for r in result.results]
    assert sum(counts) == 32 and max(counts) < 32
    reasons = [r.as_numpy("finish_reason")[0].decode() for r in result.results]
    assert reasons[-1] == "length" and set(reasons[:-1]) <= {"None"}


def test_unary_protocols_get_one_response_with_the_whole_text(grpc_client, http_client):
    import tritonclient.grpc as grpcclient

    sampling = {**GREEDY, "max_tokens": 16}
    whole = unary_text(grpc_client, grpcclient, PROMPTS[2], sampling, exclude_input=True)
    # stream=true over a protocol that takes one response: still one response, the whole text
    assert unary_text(http_client, _http(), PROMPTS[2], sampling, stream=True) == whole
    assert unary_text(grpc_client, grpcclient, PROMPTS[2], sampling, stream=True) == whole
    assert unary_text(http_client, _http(), PROMPTS[2], sampling) == PROMPTS[2] + whole


def test_request_parameters_are_sampling_parameters(http_client):
    httpclient = _http()
    inputs = llm_inputs(httpclient, PROMPTS[0], return_num_output_tokens=True, return_finish_reason=True)
    result = http_client.infer(MODEL, inputs, parameters={"max_tokens": 5, "temperature": 0, "ignore_eos": True})
    assert int(result.as_numpy("num_output_tokens")[0]) == 5
    assert result.as_numpy("finish_reason")[0].decode() == "length"


def test_concurrent_streams_interleave_and_each_gets_its_own_text(llm_server, grpc_client):
    import tritonclient.grpc as grpcclient

    prompts = [f"Stream number {i} begins with" for i in range(16)]
    sampling = {**GREEDY, "max_tokens": 24}
    expected = {}
    threads = [threading.Thread(target=lambda i=i: expected.__setitem__(
        f"r{i}", unary_text(grpc_client, grpcclient, prompts[i], sampling, exclude_input=True))) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(expected.values())) > 1

    stream = GrpcStream(llm_server.grpc_url)
    try:
        for i, prompt in enumerate(prompts):
            stream.send(MODEL, f"r{i}", llm_inputs(grpcclient, prompt, stream=True, sampling=sampling))
        results = stream.wait_all()
    finally:
        stream.close()
    for request_id, result in results.items():
        assert result.error is None, request_id
        assert result.text == expected[request_id], request_id
        assert result.finals[-1]
    first_final = next(i for i, (_, final) in enumerate(stream.events) if final)
    started = {request_id for request_id, _ in stream.events[:first_final]}
    assert len(started) >= 8  # the engine ran them together, not one after another


# -- stop conditions ----------------------------------------------------------------------------
def test_max_tokens_and_stop_strings(grpc_client):
    import tritonclient.grpc as grpcclient

    sampling = {**GREEDY, "max_tokens": 40}
    result = grpc_client.infer(MODEL, llm_inputs(grpcclient, PROMPTS[0], sampling={**sampling, "max_tokens": 7},
                                                 exclude_input=True, return_num_output_tokens=True,
                                                 return_finish_reason=True))
    assert int(result.as_numpy("num_output_tokens")[0]) == 7
    assert result.as_numpy("finish_reason")[0].decode() == "length"

    whole = unary_text(grpc_client, grpcclient, PROMPTS[0], sampling, exclude_input=True)
    stop = _pick_stop_string(whole)
    result = grpc_client.infer(MODEL, llm_inputs(grpcclient, PROMPTS[0], sampling={**sampling, "stop": [stop]},
                                                 exclude_input=True, return_finish_reason=True))
    assert result.as_numpy("text_output")[0].decode() == whole[:whole.index(stop)]
    assert result.as_numpy("finish_reason")[0].decode() == "stop"


def _pick_stop_string(text: str) -> str:
    """Two ASCII letters from the second half of ``text`` (where they first appear there)."""
    for start in range(len(text) // 3, len(text) - 2):
        candidate = text[start:start + 2]
        if candidate.isascii() and candidate.isalpha() and text.index(candidate) > 0:
            return candidate
    raise AssertionError(f"no ASCII stop string in {text!r} (the seeded tiny model's greedy text changed)")


# -- cancellation and engine metrics ------------------------------------------------------------
def test_cancelled_stream_aborts_the_engine_request(llm_server):
    import tritonclient.grpc as grpcclient

    labels = {"model_name": MODEL, "version": "1"}
    before = metric_value(llm_server.metrics(), "tideserve:request_aborted_total", **labels) or 0.0
    stream = GrpcStream(llm_server.grpc_url)
    stream.send(MODEL, "long", llm_inputs(grpcclient, PROMPTS[0], stream=True,
                                          sampling={**GREEDY, "max_tokens": MAX_MODEL_LEN - 16}))
    while len(stream.results["long"].texts) < 3:
        stream.poll(60)
    running = metric_value(llm_server.metrics(), "tideserve:num_requests_running", **labels)
    assert running == 1
    cancelled_at = time.monotonic()
    stream.close(cancel=True)

    deadline = cancelled_at + 10
    while True:
        text = llm_server.metrics()
        aborted = metric_value(text, "tideserve:request_aborted_total", **labels) or 0.0
        running = metric_value(text, "tideserve:num_requests_running", **labels)
        kv_usage = metric_value(text, "tideserve:kv_cache_usage_perc", **labels)
        if aborted == before + 1 and running == 0 and kv_usage == 0:
            break
        assert time.monotonic() < deadline, (aborted, running, kv_usage)
        time.sleep(0.1)
    assert time.monotonic() - cancelled_at < 5  # far sooner than the ~500 tokens would have taken


def test_stop_stream_with_cancel_gets_only_the_clients_cancellation(llm_server):
    """Triton's request_cancellation test: the callback gets the client's CANCELLED and nothing from the server
    (the generation asks for more tokens than the context holds, which is no error on this interface)."""
    from tritonclient.utils import InferenceServerException

    received = cancel_a_running_generation(llm_server, MODEL)
    assert len(received) == 1, received
    result, error = received[0]
    assert result is None and isinstance(error, InferenceServerException)
    assert error.status() == "StatusCode.CANCELLED"
    log = llm_server.log()
    assert "[vllm] Cancelling the request" in log and "[vllm] Successfully cancelled the request" in log


def test_max_tokens_beyond_the_context_stops_at_the_context_length(grpc_client):
    """As Triton's vLLM backend (vLLM's engine): no error, the answer ends where the context does."""
    import tritonclient.grpc as grpcclient

    result = grpc_client.infer(MODEL, llm_inputs(grpcclient, PROMPTS[0], return_finish_reason=True,
                                                 return_num_input_tokens=True, return_num_output_tokens=True,
                                                 sampling={**GREEDY, "max_tokens": 2**64}))
    assert result.as_numpy("finish_reason")[0].decode() == "length"
    prompt_tokens = int(result.as_numpy("num_input_tokens")[0])
    assert int(result.as_numpy("num_output_tokens")[0]) == MAX_MODEL_LEN - prompt_tokens


def test_llm_metrics_are_recorded(llm_server, http_client):
    labels = {"model_name": MODEL, "version": "1"}
    unary_text(http_client, _http(), "Metrics please", {**GREEDY, "max_tokens": 8})
    text = llm_server.metrics()
    for name in ("tideserve:time_to_first_token_seconds_count", "tideserve:inter_token_latency_seconds_count",
                 "tideserve:e2e_request_latency_seconds_count", "tideserve:request_queue_time_seconds_count",
                 "tideserve:generation_tokens_total", "tideserve:prompt_tokens_total",
                 "tideserve:request_success_total"):
        assert (metric_value(text, name, **labels) or 0) > 0, name
    assert metric_value(text, "nv_inference_request_success", model=MODEL, version="1") > 0
    # the generation runs inside the instance's execute: compute time is the request's time, not ~0
    assert metric_value(text, "nv_inference_compute_infer_duration_us", model=MODEL, version="1") > 0
    stats = http_client.get_inference_statistics(MODEL)["model_stats"][0]["inference_stats"]
    assert int(stats["compute_infer"]["ns"]) >= int(stats["success"]["ns"]) // 2, stats


# -- bad requests -------------------------------------------------------------------------------
@pytest.mark.parametrize("sampling, field", [
    ({"temperature": -1}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"stop": 5}, "stop"),
    ({"no_such_knob": 1}, "no_such_knob"),
])
def test_bad_sampling_parameters_are_400_naming_the_field(grpc_client, http_client, sampling, field):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as info:
        http_client.infer(MODEL, llm_inputs(_http(), "Hello", sampling=sampling))
    assert info.value.status() == "400"
    assert f"'{field}'" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        grpc_client.infer(MODEL, llm_inputs(grpcclient, "Hello", sampling=sampling))
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert f"'{field}'" in info.value.message()


def test_bad_requests_are_400(http_client):
    from tritonclient.utils import InferenceServerException

    httpclient = _http()
    cases = [
        (llm_inputs(httpclient, "Hi", stream=True, exclude_input=False), "exclude_input_in_output"),
        (llm_inputs(httpclient, "x" * 5000, sampling={"max_tokens": 4}), "maximum"),
        ([], "text_input"),
    ]
    for inputs, words in cases:
        with pytest.raises(InferenceServerException) as info:
            http_client.infer(MODEL, inputs)
        assert info.value.status() == "400", info.value.message()
        assert words in info.value.message()


# -- the generate extension ---------------------------------------------------------------------
def _post(server, path: str, body: dict):
    req = urllib.request.Request(f"{server.base_url}/v2/models/{MODEL}/{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    return urllib.request.urlopen(req, timeout=60)


def test_generate_returns_the_whole_text(llm_server, grpc_client):
    import tritonclient.grpc as grpcclient

    sampling = {**GREEDY, "max_tokens": 12}
    whole = unary_text(grpc_client, grpcclient, PROMPTS[1], sampling, exclude_input=True)
    with _post(llm_server, "generate", {"text_input": PROMPTS[1], "parameters": {"stream": False, **sampling}}) as r:
        body = json.loads(r.read())
    assert body["model_name"] == MODEL
    assert body["text_output"] == PROMPTS[1] + whole


def test_generate_stream_sends_sse_deltas(llm_server, grpc_client):
    import tritonclient.grpc as grpcclient

    sampling = {**GREEDY, "max_tokens": 24}
    whole = unary_text(grpc_client, grpcclient, PROMPTS[2], sampling, exclude_input=True)
    events = []
    with _post(llm_server, "generate_stream", {"text_input": PROMPTS[2], "stream": True,
                                               "parameters": {**sampling, "return_num_output_tokens": True}}) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        for line in r:
            if line.startswith(b"data:"):
                events.append(json.loads(line[5:]))
    # streamed (deltas that come while the frontend writes the last one are joined, as vLLM's output collector
    # joins them for a reader that lags: on a busy machine 24 tokens came as 1 + 23 once)
    assert len(events) >= 2
    assert "".join(e["text_output"] for e in events) == whole
    assert sum(e["num_output_tokens"] for e in events) == 24


def test_generate_bad_parameter_is_400(llm_server):
    with pytest.raises(urllib.error.HTTPError) as info:
        _post(llm_server, "generate", {"text_input": "Hi", "parameters": {"temperature": -3}})
    assert info.value.code == 400
    assert "'temperature'" in json.loads(info.value.read())["error"]


def _http():
    import tritonclient.http as httpclient

    return httpclient


def test_asking_for_every_output_gives_the_flagged_ones_only(grpc_client):
    """perf_analyzer and genai-perf ask for every output the model declares; as with Triton's vLLM backend only
    text_output comes back unless a return_* flag asks for more (no NaN cumulative_logprob)."""
    import tritonclient.grpc as grpcclient

    config = grpc_client.get_model_config(MODEL, as_json=True)["config"]
    outputs = [grpcclient.InferRequestedOutput(o["name"]) for o in config["output"]]
    result = grpc_client.infer(MODEL, llm_inputs(grpcclient, "Hi", sampling={**GREEDY, "max_tokens": 2},
                                                 exclude_input=True), outputs=outputs)
    names = {o.name for o in result.get_response().outputs}
    assert names == {"text_output", "output_ids"}


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, name) of the processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                found.append((int(entry.name), name))
    return found


def _ready(server, name: str) -> int:
    try:
        with urllib.request.urlopen(f"{server.base_url}/v2/models/{name}/ready", timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_dead_engine_takes_the_model_out_of_readiness_and_a_load_brings_it_back(llm_server):
    """Kill the engine core process: the model becomes UNAVAILABLE with the reason, requests get 503, the
    server lives on; an explicit load starts a new engine. (Runs last in this file: it restarts the engine.)"""
    cores = [pid for pid, name in _children(llm_server.process.pid) if name.startswith("VLLM::EngineCor")]
    assert len(cores) == 1, _children(llm_server.process.pid)
    os.kill(cores[0], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while _ready(llm_server, MODEL) == 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _ready(llm_server, MODEL) != 200
    with urllib.request.urlopen(f"{llm_server.base_url}/v2/repository/index", data=b"{}", timeout=10) as r:
        row = next(m for m in json.loads(r.read()) if m["name"] == MODEL)
    assert row["state"] == "UNAVAILABLE" and "engine core process died" in row["reason"]
    with pytest.raises(urllib.error.HTTPError) as info:
        _post(llm_server, "generate", {"text_input": "Hi", "parameters": {"max_tokens": 2}})
    assert info.value.code == 503
    assert "engine core process died" in json.loads(info.value.read())["error"]
    with urllib.request.urlopen(f"{llm_server.base_url}/v2/health/live", timeout=10) as r:
        assert r.status == 200

    llm_server.load_errors = {}
    load_model(llm_server, MODEL)
    assert llm_server.load_errors == {}
    assert _ready(llm_server, MODEL) == 200
    with _post(llm_server, "generate", {"text_input": "Hi", "parameters": {**GREEDY, "max_tokens": 2}}) as r:
        assert json.loads(r.read())["text_output"]
