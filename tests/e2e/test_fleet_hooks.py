"""End to end: what LLM fleets read from a replica, on one real vLLM engine (the tiny random Llama).

Checked with real clients: the Gateway API Inference Extension's model-server metrics on ``/metrics`` of both
ports (prometheus_client's parser: names, types, labels, values moving while requests run); the engine's
KV-cache events over ZMQ (pyzmq + msgpack: a prompt's blocks stored, then cleared by ``POST
/reset_prefix_cache``, and replayed); ``GET /load`` and the ORCA ``endpoint-load-metrics`` header; queue
deadlines (Triton's ``timeout`` over gRPC, ``x-request-timeout-ms`` over ``/v1``): refused with 503 /
UNAVAILABLE + Retry-After when the engine has not started them, counted as REJECTED, while one that started
(its first token came, or the engine had a place for it at its deadline) runs on; and last, a SIGTERM while streams run (this ends the module's server): every stream finishes,
readiness turns false at once, new requests are refused.

One engine for the module: ``max_num_seqs`` 2, so two long generations keep it busy and a third waits.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec
import numpy as np
import openai
import pytest
from llm_fixtures import metric_value, vllm_env, write_vllm_model
from prometheus_client.parser import text_string_to_metric_families
from support import free_port, start_server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
]

MODEL = "llm"
MAX_NUM_SEQS = 2
TOPIC = "kv"
ENGINE_NICE = 5  # the engine's processes run below the server's loop (config parameter engine_nice)
LONG = {"max_tokens": 1950, "ignore_eos": True, "temperature": 0}  # keeps the engine busy for a while
# The protocol's metrics: name -> (type, labels each sample carries besides model_name)
PROTOCOL_METRICS = {
    "vllm:num_requests_waiting": ("gauge", set()),
    "vllm:num_requests_running": ("gauge", set()),
    "vllm:kv_cache_usage_perc": ("gauge", set()),
    "vllm:cache_config_info": ("gauge", {"block_size", "num_gpu_blocks"}),
    "vllm:lora_requests_info": ("gauge", {"running_lora_adapters", "waiting_lora_adapters", "max_lora"}),
}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("fleet")
    tiny = tiny_model  # the session's (made once)
    events_port, replay_port = free_port(), free_port()
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events_port}",
                 "replay_endpoint": f"tcp://*:{replay_port}", "topic": TOPIC}
    write_vllm_model(tmp / "models", MODEL, {
        "model": str(tiny), "dtype": "float32", "max_model_len": 2048, "enforce_eager": True,
        "max_num_seqs": MAX_NUM_SEQS, "enable_prefix_caching": True, "kv_events_config": kv_events,
        "enable_lora": True, "max_loras": 1, "max_lora_rank": 8},
        config='backend: "vllm"\nparameters { key: "engine_nice" value { string_value: "%d" } }\n' % ENGINE_NICE)
    probe = tmp / "deadline-probe.json"  # the deadline counts the server keeps for measurements (engine.DeadlineProbe)
    server = start_server([tmp / "models"], "--allowed-model-root", str(tiny), "--exit-timeout-secs", "120",
                          tmp_dir=tmp, env={**vllm_env(tmp), "TIDESERVE_DEADLINE_PROBE_FILE": str(probe)},
                          ready_timeout=600)
    server.events_port, server.replay_port, server.probe = events_port, replay_port, probe
    try:
        yield server
    finally:
        server.stop()


def _client(server, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, **kwargs)


def _families(text: str) -> dict:
    return {family.name: family for family in text_string_to_metric_families(text)}


def _wait_for(read, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (value := read()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


class _Busy:
    """``MAX_NUM_SEQS`` long generations running in the engine (streams over /generate_stream) until the block
    ends, when the client closes them (the engine aborts them)."""

    def __init__(self, server) -> None:
        self.server = server
        self.stop = threading.Event()
        self.first = threading.Semaphore(0)  # released by each stream at its first event
        self.pool = ThreadPoolExecutor(MAX_NUM_SEQS)
        self.futures = [self.pool.submit(self._stream) for _ in range(MAX_NUM_SEQS)]

    def _stream(self) -> int:
        body = {"text_input": "Tell me a long story", "parameters": {**LONG, "stream": True}}
        events = 0
        try:
            with httpx.stream("POST", f"{self.server.base_url}/v2/models/{MODEL}/generate_stream", json=body,
                              timeout=300) as response:
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    events += line.startswith("data:")
                    if events == 1:
                        self.first.release()
                    if self.stop.is_set():
                        break
        finally:
            if events == 0:
                self.first.release()  # (the block's exit reports it)
        return events

    def __enter__(self) -> _Busy:
        # this block's own streams generating (the engine has them, not the last block's, still being aborted)
        for _ in self.futures:
            self.first.acquire(timeout=60)
        load = _wait_for(lambda: (r := _load(self.server))["num_requests_running"] == MAX_NUM_SEQS and r)
        assert load, f"the engine never ran {MAX_NUM_SEQS} requests: {_load(self.server)}"
        return self

    def __exit__(self, *exc) -> None:
        running = [not f.done() for f in self.futures]
        self.stop.set()
        for future in self.futures:
            assert future.result() > 0
        self.pool.shutdown()
        assert all(running), "a long generation ended inside the block: the engine was not kept busy"


def _load(server, **params) -> dict:
    response = httpx.get(f"{server.base_url}/load", params=params, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


# -- 1. the model-server protocol's metrics ---------------------------------------------------------------
def test_protocol_metrics_on_both_ports_with_vllm_types_and_labels(fleet):
    # vLLM writes vllm:lora_requests_info from its first engine step on
    _client(fleet).completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    for url in (f"{fleet.base_url}/metrics", f"http://127.0.0.1:{fleet.metrics_port}/metrics"):
        families = _families(httpx.get(url, timeout=10).text)
        for name, (kind, labels) in PROTOCOL_METRICS.items():
            assert name in families, f"{name} missing from {url}"
            family = families[name]
            assert family.type == kind, (name, family.type)
            samples = [s for s in family.samples if s.labels.get("model_name") == MODEL]
            assert samples, f"{name} has no sample of model_name={MODEL}"
            for sample in samples:
                assert labels <= set(sample.labels), (name, sample.labels)
        info = [s for s in families["vllm:cache_config_info"].samples if s.labels["model_name"] == MODEL][0]
        assert int(info.labels["block_size"]) > 0 and int(info.labels["num_gpu_blocks"]) > 0
        lora = [s for s in families["vllm:lora_requests_info"].samples if s.labels["model_name"] == MODEL]
        assert all(s.labels["max_lora"] == "1" for s in lora)


def test_protocol_metrics_move_while_requests_run(fleet):
    def value(text: str, name: str) -> float:
        return metric_value(text, name, model_name=MODEL)

    idle = fleet.metrics()
    assert value(idle, "vllm:num_requests_running") == 0
    assert value(idle, "vllm:kv_cache_usage_perc") == 0
    lora_before = max((s.value for s in _families(idle)["vllm:lora_requests_info"].samples), default=0.0)
    with _Busy(fleet):
        # a third request waits: the engine runs MAX_NUM_SEQS at once
        extra = threading.Thread(target=httpx.post, args=(f"{fleet.base_url}/v2/models/{MODEL}/generate",),
                                 kwargs={"json": {"text_input": "Hi", "parameters": {"max_tokens": 4}}, "timeout": 300})
        extra.start()
        busy = _wait_for(lambda: t if value(t := fleet.metrics(), "vllm:num_requests_waiting") >= 1 else None)
        assert busy, "vllm:num_requests_waiting never counted the third request"
        assert value(busy, "vllm:num_requests_running") == MAX_NUM_SEQS
        assert value(busy, "vllm:kv_cache_usage_perc") > 0
        assert max(s.value for s in _families(busy)["vllm:lora_requests_info"].samples) > lora_before
    extra.join(300)
    settled = _wait_for(lambda: t if value(t := fleet.metrics(), "vllm:num_requests_running") == 0 else None)
    assert settled and value(settled, "vllm:num_requests_waiting") == 0


# -- 2. KV-cache events -----------------------------------------------------------------------------------
def test_kv_events_stored_then_cleared_by_reset_prefix_cache_and_replayed(fleet):
    import zmq
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{fleet.events_port}")
    sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
    events: list = []
    sequences: list[int] = []

    def receive(until, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not until() and time.monotonic() < deadline:
            if sub.poll(200):
                topic, seq, payload = sub.recv_multipart()
                assert topic == TOPIC.encode()
                sequences.append(int.from_bytes(seq, "big"))
                events.extend(decoder.decode(payload).events)

    try:
        time.sleep(1.0)  # a SUB socket sees only what is published after it joined
        block_size = int([s for s in _families(fleet.metrics())["vllm:cache_config_info"].samples
                          if s.labels["model_name"] == MODEL][0].labels["block_size"])
        prompt = [int(t) for t in np.random.default_rng(7).integers(10, 200, size=block_size * 2 + 5)]
        completion = _client(fleet).completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        assert completion.choices[0].finish_reason == "length"
        receive(lambda: sum(len(e.token_ids) for e in events if isinstance(e, BlockStored)) >= 2 * block_size)
        stored = [e for e in events if isinstance(e, BlockStored)]
        tokens = [t for e in stored for t in e.token_ids]
        assert tokens[:2 * block_size] == prompt[:2 * block_size], "the stored blocks are not the prompt's"
        hashes = {h for e in stored for h in e.block_hashes}

        reset = httpx.post(f"{fleet.base_url}/reset_prefix_cache", timeout=30)
        assert reset.status_code == 200 and reset.json() == {"success": True}, reset.text
        # vLLM publishes the events of a step after it: the reset's with the engine's next step
        _client(fleet).completions.create(model=MODEL, prompt="Hello", max_tokens=1)
        receive(lambda: any(isinstance(e, AllBlocksCleared) or (isinstance(e, BlockRemoved)
                                                                and hashes & set(e.block_hashes)) for e in events))
        assert any(isinstance(e, AllBlocksCleared | BlockRemoved) for e in events), events

        # replay: the buffered batches from the first sequence number on, then the end marker
        replay = context.socket(zmq.DEALER)
        replay.connect(f"tcp://127.0.0.1:{fleet.replay_port}")
        replay.send_multipart([b"", sequences[0].to_bytes(8, "big")])
        replayed = []
        while replay.poll(10_000):
            _, _topic, _seq, payload = replay.recv_multipart()
            if not payload:
                break
            replayed.extend(decoder.decode(payload).events)
        assert any(isinstance(e, BlockStored) for e in replayed)
        replay.close(0)

        # a model of its own: the reset names it; a model with no engine cannot
        named = httpx.post(f"{fleet.base_url}/reset_prefix_cache", params={"model": MODEL}, timeout=30)
        assert named.status_code == 200 and named.json() == {"success": True}
        unknown = httpx.post(f"{fleet.base_url}/reset_prefix_cache", params={"model": "nope"}, timeout=30)
        assert unknown.status_code == 404 and "error" in unknown.json()
    finally:
        sub.close(0)
        context.term()


# -- 3. load report ---------------------------------------------------------------------------------------
def test_load_report_and_orca_header(fleet):
    idle = _load(fleet)
    assert idle["server_load"] == 0 and idle["num_requests_running"] == 0
    assert [m["model_name"] for m in idle["models"]] == [MODEL]
    assert _load(fleet, model=MODEL)["models"][0]["kv_cache_usage_perc"] == 0
    with _Busy(fleet):
        # the engine's figures are those of its last step: its blocks show from the step after it scheduled them
        busy = _wait_for(lambda: (r := _load(fleet, model=MODEL))["kv_cache_usage_perc"] > 0 and r, 10)
        assert busy, _load(fleet, model=MODEL)
        assert busy["server_load"] >= MAX_NUM_SEQS and busy["num_requests_running"] == MAX_NUM_SEQS
    # (a request sent now would wait for a slot of the engine: the ORCA header is read once it is free again)
    client = _client(fleet)
    for fmt in ("TEXT", "JSON"):
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt="Hello", max_tokens=2, extra_headers={"endpoint-load-metrics-format": fmt})
        header = raw.headers["endpoint-load-metrics"]
        assert header.startswith(fmt + " ") and "kv_cache_usage_perc" in header
        assert "num_requests_waiting" in header
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        extra_headers={"endpoint-load-metrics-format": "TEXT"})
    assert re.fullmatch(r"TEXT named_metrics\.kv_cache_usage_perc=[0-9.e-]+, named_metrics\.num_requests_waiting=[0-9.]+",
                        raw.headers["endpoint-load-metrics"])
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert "endpoint-load-metrics" not in raw.headers  # not asked for
    missing = httpx.get(f"{fleet.base_url}/load", params={"model": "nope"}, timeout=10)
    assert missing.status_code == 404 and "error" in missing.json()


def test_engine_processes_run_at_the_configured_nice_value(fleet):
    import psutil

    server = psutil.Process(fleet.process.pid)
    assert os.getpriority(os.PRIO_PROCESS, server.pid) == 0  # the server's loop keeps its priority
    engines = [p for p in server.children(recursive=True) if "EngineCore" in " ".join(p.cmdline()) + p.name()]
    assert engines, [(p.pid, p.name(), p.cmdline()) for p in server.children(recursive=True)]
    for proc in engines:
        for thread in proc.threads():
            assert os.getpriority(os.PRIO_PROCESS, thread.id) == ENGINE_NICE, (proc.name(), thread.id)


# -- 4. queue deadlines -----------------------------------------------------------------------------------
def test_deadline_refuses_requests_the_engine_has_not_started(fleet):
    import tritonclient.grpc as grpcclient
    from llm_fixtures import llm_inputs

    labels = {"model": MODEL, "version": "1"}
    rejected_before = metric_value(fleet.metrics(), "nv_inference_request_failure", reason="REJECTED", **labels) or 0
    with _Busy(fleet):
        # gRPC, Triton's request parameter 'timeout' (microseconds)
        grpc = grpcclient.InferenceServerClient(fleet.grpc_url)
        started = time.monotonic()
        with pytest.raises(grpcclient.InferenceServerException) as refused:
            grpc.infer(MODEL, llm_inputs(grpcclient, "Hello", sampling={"max_tokens": 4}), timeout=300_000)
        assert time.monotonic() - started >= 0.3
        assert refused.value.status() == "StatusCode.UNAVAILABLE"
        assert "did not start generating within its deadline of 300 ms" in refused.value.message()
        grpc.close()
    # each protocol under a busy engine of its own: a fast engine finishes a long generation in a couple of seconds
    with _Busy(fleet):
        # /v1, the x-request-timeout-ms header: OpenAI's error shape, 503 + Retry-After
        with pytest.raises(openai.APIStatusError) as refused_v1:
            _client(fleet).completions.create(model=MODEL, prompt="Hello", max_tokens=4,
                                              extra_headers={"x-request-timeout-ms": "300"})
        assert refused_v1.value.status_code == 503
        assert refused_v1.value.response.headers["retry-after"] == "1"
        _assert_refused_after_the_deadline(refused_v1.value.response.headers)
        assert "deadline" in refused_v1.value.body["message"] if isinstance(refused_v1.value.body, dict) else True
    with _Busy(fleet):
        # KServe generate: Triton's 'timeout' parameter
        generate = httpx.post(f"{fleet.base_url}/v2/models/{MODEL}/generate", timeout=60,
                              json={"text_input": "Hello", "parameters": {"max_tokens": 4, "timeout": 200_000}})
        assert generate.status_code == 503 and generate.headers["retry-after"] == "1"
        assert "deadline" in generate.json()["error"]
        _assert_refused_after_the_deadline(generate.headers)
        # generate_stream: the refusal is the first response, so the status (and Retry-After) are the stream's
        streamed = httpx.post(f"{fleet.base_url}/v2/models/{MODEL}/generate_stream", timeout=60,
                              json={"text_input": "Hello", "parameters": {"max_tokens": 4, "timeout": 200_000}})
        assert streamed.status_code == 503 and streamed.headers["retry-after"] == "1"
        assert streamed.headers["content-type"] == "text/event-stream; charset=utf-8"
        assert streamed.text.startswith("data: {") and "deadline" in streamed.text  # its one event, whole
        _assert_refused_after_the_deadline(streamed.headers)
        # the refused requests left the engine (its load is what its last step reported: poll for the next)
        load = _wait_for(lambda: (lambda load: load if load["num_requests_waiting"] == 0 else None)(
            _load(fleet, model=MODEL)), timeout=30)
        assert load, _load(fleet, model=MODEL)
    rejected = metric_value(fleet.metrics(), "nv_inference_request_failure", reason="REJECTED", **labels)
    assert rejected >= rejected_before + 4

    # a header that is no number is a 400; one that started generating runs on past its deadline
    with pytest.raises(openai.BadRequestError):
        _client(fleet).completions.create(model=MODEL, prompt="Hello", max_tokens=4,
                                          extra_headers={"x-request-timeout-ms": "soon"})
    stream = _client(fleet).completions.create(model=MODEL, prompt="Hello", stream=True, max_tokens=200,
                                               extra_body={"ignore_eos": True},
                                               extra_headers={"x-request-timeout-ms": "2000"})
    chunks = [c for c in stream if c.choices]
    assert chunks[-1].choices[0].finish_reason == "length"


def _assert_refused_after_the_deadline(headers) -> None:
    """The server's own account of a refusal at a deadline: its timer and its answer, never before the deadline
    (microseconds after it)."""
    fields = dict(part.strip().split("=") for part in headers["tideserve-deadline-late-us"].split(","))
    assert 0 <= int(fields["timer"]) <= int(fields["answer"]), fields


def test_deadline_on_responses_and_messages(fleet):
    """``x-request-timeout-ms`` on ``/v1/responses`` (OpenAI's error shape) and ``/v1/messages`` (Anthropic's,
    ``overloaded_error``), whole or streamed: 503 + Retry-After while the engine has no room."""
    import anthropic

    # each request under a busy engine of its own: a fast engine finishes a long generation in a couple of seconds
    for stream in (False, True):
        with _Busy(fleet):
            with pytest.raises(openai.APIStatusError) as refused:
                _client(fleet).responses.create(model=MODEL, input="Hello", max_output_tokens=4, stream=stream,
                                                store=False, extra_headers={"x-request-timeout-ms": "300"})
            assert refused.value.status_code == 503 and refused.value.response.headers["retry-after"] == "1"
            assert "deadline" in refused.value.body["message"]
    with anthropic.Anthropic(base_url=fleet.base_url, api_key="none", max_retries=0) as claude:
        for stream in (False, True):
            with _Busy(fleet):
                with pytest.raises(anthropic.APIStatusError) as refused_messages:
                    claude.messages.create(model=MODEL, max_tokens=4, stream=stream,
                                           messages=[{"role": "user", "content": "Hello"}],
                                           extra_headers={"x-request-timeout-ms": "300"})
                answer = refused_messages.value.response
                assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
                body = answer.json()
                assert body["type"] == "error" and body["error"]["type"] == "overloaded_error"
                assert "deadline" in body["error"]["message"]
                if stream:
                    # the refused requests left the engine (its load is what its last step reported: poll for
                    # the next)
                    left = _wait_for(lambda: (lambda load: load if load["num_requests_waiting"] == 0 else None)(
                        _load(fleet, model=MODEL)), timeout=30)
                    assert left, _load(fleet, model=MODEL)


def test_deadline_refusal_written_at_the_deadline(fleet):
    """A deadline refusal is written where the server refuses it (the deadline's timer), not when the handler's
    task next runs: on one kept-alive connection, generate_stream's, /v1/completions' (streamed) and
    /v1/chat/completions' refusals come whole (status, Retry-After, the error in the protocol's shape), each
    counted once as REJECTED and never as CANCELED, and the connection serves the next request after them."""
    labels = {"model": MODEL, "version": "1"}

    def failures(reason: str) -> float:
        return metric_value(fleet.metrics(), "nv_inference_request_failure", reason=reason, **labels) or 0

    with httpx.Client(base_url=fleet.base_url, timeout=60) as client:
        with _Busy(fleet):
            rejected, cancelled = failures("REJECTED"), failures("CANCELED")
            streamed = client.post(f"/v2/models/{MODEL}/generate_stream",
                                   json={"text_input": "Hello", "parameters": {"max_tokens": 4, "timeout": 200_000}})
            assert streamed.status_code == 503 and streamed.headers["retry-after"] == "1"
            assert streamed.text.startswith("data: {") and "deadline" in streamed.text
            _assert_refused_after_the_deadline(streamed.headers)
            completion = client.post("/v1/completions", headers={"x-request-timeout-ms": "200"},
                                     json={"model": MODEL, "prompt": "Hello", "max_tokens": 4, "stream": True})
            chat = client.post("/v1/chat/completions", headers={"x-request-timeout-ms": "200"},
                               json={"model": MODEL, "max_tokens": 4,
                                     "messages": [{"role": "user", "content": "Hello"}]})
            for answer in (completion, chat):
                assert answer.status_code == 503 and answer.headers["retry-after"] == "1", answer.text
                assert answer.headers["content-type"] == "application/json"
                assert "deadline" in answer.json()["error"]["message"]
                _assert_refused_after_the_deadline(answer.headers)
            assert failures("REJECTED") == rejected + 3
            assert failures("CANCELED") == cancelled
        # the same connection after the refusals: answered as usual
        served = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
        assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 2
    assert "Unexpected ASGI message" not in fleet.log()  # no second answer after the one written at the deadline


def _probe_counts(server) -> dict:
    try:
        return msgspec.json.decode(server.probe.read_bytes())
    except (OSError, msgspec.DecodeError):
        return {}


def test_deadline_counts_a_request_with_a_place_in_the_engine_as_started(fleet):
    """A request with a place in the engine at its deadline (fewer than ``max_num_seqs`` sequences ahead of it)
    has started: it runs on even when its first token has not come yet. Requests one at a time on an idle engine
    with deadlines of a few milliseconds: each is either refused while its prompt still renders (before the
    engine has it) or served whole; none is refused once the engine has it (the server's probe counts)."""
    ended = ("started", "placed", "expired")
    client = _client(fleet)
    for _ in range(2):  # the counts are written on the engine's steps, at most every 0.1 s: bring them up to date
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
        time.sleep(0.15)
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    before = _probe_counts(fleet)
    served = refused = 0
    for deadline_ms in (1, 2, 3, 5, 8, 12, 20, 30) * 2:
        try:
            completion = client.completions.create(model=MODEL, prompt="Tell me a story", max_tokens=8,
                                                   extra_body={"ignore_eos": True},
                                                   extra_headers={"x-request-timeout-ms": str(deadline_ms)})
            assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 8
            served += 1
        except openai.APIStatusError as exc:
            assert exc.status_code == 503 and "deadline" in exc.body["message"], exc.body
            refused += 1

    def settled():  # the counts are written on the engine's steps: a short request makes some
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
        counts = _probe_counts(fleet)
        done = sum(counts.get(key, 0) - before.get(key, 0) for key in ended)
        return counts if done >= served + refused else None

    counts = _wait_for(settled, timeout=30)
    assert counts, (_probe_counts(fleet), before, served, refused)
    delta = {key: value - before.get(key, 0) for key, value in counts.items()}
    assert delta["expired"] == delta["expired_rendering"] == refused, delta  # never once in the engine
    assert delta["started"] + delta["placed"] == served, delta


# -- 6. SIGTERM while streams run (ends the module's server) ------------------------------------------------
STREAM_TOKENS = 1000  # 8 streams, 2 at a time: several seconds of work left at SIGTERM


def test_sigterm_drains_running_streams_and_refuses_new_requests(fleet):
    streams = 8
    lock = threading.Lock()
    first_chunks = [0]
    results: list = [None] * streams

    def run(index: int) -> None:
        try:
            stream = _client(fleet, timeout=300).completions.create(
                model=MODEL, prompt=f"Story {index}", stream=True, max_tokens=STREAM_TOKENS,
                extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
            finish, counted, tokens = None, False, 0
            for chunk in stream:
                if not counted:
                    counted = True
                    with lock:
                        first_chunks[0] += 1
                if chunk.choices:
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            results[index] = (finish, tokens)
        except Exception as exc:  # noqa: BLE001 (reported below)
            results[index] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
    for thread in threads:
        thread.start()
    # the engine streams MAX_NUM_SEQS of them and holds the rest waiting: all are in flight
    in_flight = _wait_for(lambda: first_chunks[0] >= MAX_NUM_SEQS and _load(fleet)["server_load"] == streams, 120)
    assert in_flight, (first_chunks, _load(fleet))
    fleet.process.send_signal(signal.SIGTERM)

    def status(method: str, path: str, **kwargs) -> int | None:
        try:
            return httpx.request(method, f"{fleet.base_url}{path}", timeout=5, **kwargs).status_code
        except httpx.TransportError:
            return None

    # not ready at once: Triton's answer (400) on /v2/health/ready, 503 on /health/ready
    readiness = _wait_for(lambda: (code := status("GET", "/v2/health/ready")) != 200 and (code,), 10)
    assert readiness == (400,), f"readiness after SIGTERM: {readiness}; streams: {results}"
    assert status("GET", "/health/ready") == 503
    refused = status("POST", "/v1/completions", json={"model": MODEL, "prompt": "late", "max_tokens": 2})
    assert refused == 503, refused
    for thread in threads:
        thread.join(300)
    assert results == [("length", STREAM_TOKENS)] * streams, results
    assert fleet.process.wait(120) == 0
