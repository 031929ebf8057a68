"""End to end over the example deployment (``model_repository/``, prepared as ``make serve`` prepares it),
with real clients: ``tritonclient`` (HTTP and gRPC streams), the generate endpoints, ONNX Runtime and
XGBoost for the answers made by hand.

One server for the session, shared with the README's tests (``example_server`` in tests/conftest.py: the vLLM
engine takes 40 s or more to start on a CPU). It also serves a second, temporary repository with ensembles over
the example models that fail: at load (validation) or at run time (a failing step).
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time

import numpy as np
import pytest
from example_fixtures import (
    BROKEN,
    EXAMPLE_MODELS,
    REPOSITORY,
    ROOT,
    post_json,
    repository_index,
    sse_events,
)
from llm_fixtures import GrpcStream, llm_inputs, metric_value

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
]

PROMPTS = ["Once upon a time", "The quick brown fox", "Hello world, this is"]
GREEDY = {"temperature": 0, "max_tokens": 32}
SENTENCES = ["Where is my parcel? It should have arrived on Monday.", "I was charged twice this month.",
             "The app crashes when I press the export button.", "Refund please",
             "Can you deliver to my office instead?"]

@pytest.fixture(scope="module")
def server(example_server):
    """The session's example server (tests/conftest.py), which also serves the broken ensembles."""
    return example_server


@pytest.fixture()
def grpc_client(server):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    yield client
    client.close()


@pytest.fixture()
def http_client(server):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.http_url, network_timeout=120)
    yield client
    client.close()


# -- preparation ---------------------------------------------------------------------------------
def test_preparation_is_idempotent(server):
    """After the server fixture prepared the repository, a second run finds nothing to make."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "tideserve.bench.examples.prepare", str(REPOSITORY), "--check"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert time.monotonic() - started < 30  # a check of stamps, no training or export
    for path in ("llm/1/tiny_llama/model.safetensors", "text_encoder/1/model.onnx", "text_tokenizer/1/tokenizer.json",
                 "text_classifier_head/1/model.onnx", "tabular/1/xgboost.json"):
        assert (REPOSITORY / path).is_file(), path
    ignored = subprocess.run(["git", "check-ignore", "-q", str(REPOSITORY / "text_encoder/1/model.onnx")],
                             cwd=ROOT, check=False)
    assert ignored.returncode in (0, 128)  # 128: not a git checkout


def test_every_example_model_is_ready(server):
    index = repository_index(server)
    assert {name: index[name]["state"] for name in EXAMPLE_MODELS} == dict.fromkeys(EXAMPLE_MODELS, "READY")


# -- the LLM ensemble against the direct model ----------------------------------------------------
@pytest.mark.parametrize("prompt", PROMPTS)
def test_ensemble_generate_stream_equals_the_direct_model(server, prompt):
    body = {"text_input": prompt, "stream": True,
            "parameters": {**GREEDY, "return_num_output_tokens": True, "return_finish_reason": True}}
    direct = sse_events(server, "llm", body)
    piped = sse_events(server, "llm_ensemble", body)
    direct_text = "".join(event["text_output"] for event in direct)
    piped_text = "".join(event["text_output"] for event in piped)
    assert piped_text == direct_text
    assert len(piped) > 1  # streamed, not one answer
    # the whole (non-streamed) answer of the direct model, without the prompt, is the same text
    status, whole = post_json(server, "/v2/models/llm/generate",
                              {"text_input": prompt, "exclude_input_in_output": True, "parameters": GREEDY})
    assert status == 200 and whole["text_output"] == direct_text
    status, whole = post_json(server, "/v2/models/llm_ensemble/generate", {"text_input": prompt, "parameters": GREEDY})
    assert status == 200 and whole["text_output"] == direct_text
    assert sum(event["num_output_tokens"] for event in piped) == GREEDY["max_tokens"]
    assert piped[-1]["finish_reason"] == "length"
    # exclude_input_in_output false (Triton's vLLM interface; genai-perf sends the flag): the prompt, then the text
    for model in ("llm", "llm_ensemble"):
        status, whole = post_json(server, f"/v2/models/{model}/generate",
                                  {"text_input": prompt, "exclude_input_in_output": False, "parameters": GREEDY})
        assert status == 200 and whole["text_output"] == prompt + direct_text, model


def test_ensemble_grpc_stream_equals_the_direct_model(server):
    import tritonclient.grpc as grpcclient

    stream = GrpcStream(server.grpc_url)
    try:
        for i, prompt in enumerate(PROMPTS):
            sampling = {**GREEDY, "max_tokens": 48, "ignore_eos": True}
            stream.send("llm", f"direct-{i}", llm_inputs(grpcclient, prompt, stream=True, sampling=sampling))
            stream.send("llm_ensemble", f"piped-{i}", llm_inputs(grpcclient, prompt, stream=True, sampling=sampling,
                                                                  return_num_output_tokens=True))
        results = stream.wait_all()
    finally:
        stream.close()
    for i in range(len(PROMPTS)):
        direct, piped = results[f"direct-{i}"], results[f"piped-{i}"]
        assert direct.error is None and piped.error is None, (direct.error, piped.error)
        assert piped.text == direct.text
        assert sum(int(r.as_numpy("num_output_tokens").sum()) for r in piped.results) == 48
        assert piped.finals[-1] and not any(piped.finals[:-1])


def test_ensemble_serves_the_openai_chat_endpoint(server):
    """The ensemble has the text interface, so the OpenAI frontend serves it like the vLLM model."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    messages = [{"role": "user", "content": "Tell me a story."}]
    answers = {model: client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
               for model in ("llm", "llm_ensemble")}
    assert answers["llm_ensemble"].choices[0].message.content == answers["llm"].choices[0].message.content
    assert answers["llm_ensemble"].usage.completion_tokens == 16
    chunks = client.chat.completions.create(model="llm_ensemble", messages=messages, max_tokens=16, temperature=0,
                                            stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == answers["llm"].choices[0].message.content


# -- the text classifier against its steps run by hand --------------------------------------------
def classify_by_hand(texts: list[str]) -> np.ndarray:
    """tokenize (MiniLM's tokenizer.json) -> ONNX Runtime on the encoder file -> the head's formula."""
    import onnxruntime

    from tideserve.bench.examples.minilm import minilm_inputs, minilm_tokenizer
    from tideserve.bench.examples.text_classifier import head_parameters, softmax_head

    feeds = minilm_inputs(texts, minilm_tokenizer(256, REPOSITORY / "text_tokenizer" / "1" / "tokenizer.json"))
    encoder = onnxruntime.InferenceSession(str(REPOSITORY / "text_encoder" / "1" / "model.onnx"),
                                           providers=["CPUExecutionProvider"])
    embeddings = encoder.run(["sentence_embedding"], feeds)[0]
    head = REPOSITORY / "text_classifier_head" / "1" / "model.onnx"
    by_formula = softmax_head(embeddings, *head_parameters(head))
    by_graph = onnxruntime.InferenceSession(str(head), providers=["CPUExecutionProvider"]).run(
        ["scores"], {"embedding": embeddings})[0]
    np.testing.assert_allclose(by_graph, by_formula, rtol=1e-5, atol=1e-6)
    return by_graph


def classifier_inputs(module, texts: list[str]):
    data = np.array([[t.encode()] for t in texts], dtype=np.object_)
    tensor = module.InferInput("text", list(data.shape), "BYTES")
    tensor.set_data_from_numpy(data)
    return [tensor]


def test_classifier_scores_equal_its_steps_run_by_hand(grpc_client, http_client):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    expected = classify_by_hand(SENTENCES)
    served = http_client.infer("text_classifier", classifier_inputs(httpclient, SENTENCES)).as_numpy("scores")
    assert served.shape == (len(SENTENCES), 3) and served.dtype == np.float32
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(served.sum(axis=1), 1.0, rtol=1e-5)
    served = grpc_client.infer("text_classifier", classifier_inputs(grpcclient, SENTENCES)).as_numpy("scores")
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-6)

    # the classification extension names the labels of labels.txt
    labels = (REPOSITORY / "text_classifier" / "labels.txt").read_text().split()
    top = grpc_client.infer("text_classifier", classifier_inputs(grpcclient, SENTENCES),
                            outputs=[grpcclient.InferRequestedOutput("scores", class_count=1)]).as_numpy("scores")
    assert [row[0].decode().split(":")[2] for row in top] == [labels[i] for i in expected.argmax(axis=1)]
    assert [row[0].decode().split(":")[2] for row in top] == ["shipping", "billing", "technical", "billing",
                                                              "shipping"]


def test_classifier_learnt_its_training_sentences(http_client):
    import tritonclient.http as httpclient

    from tideserve.bench.examples.text_classifier import read_data

    texts, gold = read_data(REPOSITORY / "text_classifier_data.jsonl")
    labels = (REPOSITORY / "text_classifier" / "labels.txt").read_text().split()
    predicted = []
    for start in range(0, len(texts), 16):  # max_batch_size 16
        scores = http_client.infer("text_classifier", classifier_inputs(httpclient, texts[start:start + 16]))
        predicted += [labels[i] for i in scores.as_numpy("scores").argmax(axis=1)]
    assert np.mean([p == g for p, g in zip(predicted, gold)]) >= 0.95


# -- the tabular model against XGBoost ------------------------------------------------------------
def test_tabular_equals_xgboost_predict_proba(http_client):
    import tritonclient.http as httpclient
    import xgboost
    from sklearn.datasets import load_breast_cancer

    rows = load_breast_cancer().data.astype(np.float32)
    model = xgboost.XGBClassifier()
    model.load_model(str(REPOSITORY / "tabular" / "1" / "xgboost.json"))
    tensor = httpclient.InferInput("input__0", list(rows.shape), "FP32")
    tensor.set_data_from_numpy(rows)
    served = http_client.infer("tabular", [tensor]).as_numpy("output__0")
    np.testing.assert_array_equal(served, model.predict_proba(rows).astype(np.float32))
    assert (served.argmax(axis=1) == load_breast_cancer().target).mean() > 0.95  # its training data


# -- what goes wrong ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_broken_ensemble_is_unavailable_with_the_reason(server, http_client, name):
    row = repository_index(server)[name]
    assert row["state"] == "UNAVAILABLE"
    assert BROKEN[name][1] in row["reason"], row["reason"]
    assert not http_client.is_model_ready(name)
    assert http_client.is_model_ready("text_classifier")  # the models it uses still serve


def test_a_failing_step_fails_the_request_and_names_the_step(http_client):
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as caught:
        http_client.infer("failing_classifier", classifier_inputs(httpclient, SENTENCES[:2]))
    message = str(caught.value)
    assert "in ensemble 'failing_classifier', " in message
    assert "the head is broken" in message
    # the steps before it and the server are fine
    scores = http_client.infer("text_classifier", classifier_inputs(httpclient, SENTENCES[:2])).as_numpy("scores")
    np.testing.assert_allclose(scores, classify_by_hand(SENTENCES[:2]), rtol=1e-5, atol=1e-6)


def test_an_engine_error_in_the_llm_step_reaches_the_client(server):
    status, answer = post_json(server, "/v2/models/llm_ensemble/generate",
                               {"text_input": "Hi", "parameters": {"temperature": -1, "max_tokens": 4}})
    assert status == 400
    assert answer["error"].startswith("in ensemble 'llm_ensemble', ") and "temperature" in answer["error"]
    events = sse_events(server, "llm_ensemble", {"text_input": "Hi", "stream": True,
                                                 "parameters": {"max_tokens": 4, "temperature": 0}})
    assert "".join(e["text_output"] for e in events)  # the next request is fine


@pytest.mark.parametrize("how", ["grpc", "sse"])
def test_a_cancelled_ensemble_stream_aborts_the_engine_request(server, how):
    import tritonclient.grpc as grpcclient

    labels = {"model_name": "llm", "version": "1"}
    before = metric_value(server.metrics(), "tideserve:request_aborted_total", **labels) or 0.0
    sampling = {"temperature": 0, "ignore_eos": True, "max_tokens": 900}
    if how == "grpc":
        stream = GrpcStream(server.grpc_url)
        stream.send("llm_ensemble", "long", llm_inputs(grpcclient, PROMPTS[0], stream=True, sampling=sampling))
        while len(stream.results["long"].texts) < 3:
            stream.poll(60)
        assert not stream.results["long"].done
    else:
        connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
        connection.request("POST", "/v2/models/llm_ensemble/generate_stream",
                           json.dumps({"text_input": PROMPTS[0], "stream": True, "parameters": sampling}),
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200
        events = 0
        while events < 3:
            events += response.readline().startswith(b"data:")
    running = metric_value(server.metrics(), "tideserve:num_requests_running", **labels)
    assert running == 1
    cancelled_at = time.monotonic()
    if how == "grpc":
        stream.close(cancel=True)
    else:
        connection.sock.shutdown(2)
        connection.close()

    while True:
        text = server.metrics()
        aborted = metric_value(text, "tideserve:request_aborted_total", **labels) or 0.0
        running = metric_value(text, "tideserve:num_requests_running", **labels)
        kv_usage = metric_value(text, "tideserve:kv_cache_usage_perc", **labels)
        if aborted == before + 1 and running == 0 and kv_usage == 0:
            break
        assert time.monotonic() - cancelled_at < 20, (aborted, running, kv_usage)
        time.sleep(0.1)
    # the ensemble counted a failed (cancelled) request, and serves the next one
    events = sse_events(server, "llm_ensemble", {"text_input": "Hi", "stream": True,
                                                 "parameters": {"max_tokens": 4, "temperature": 0,
                                                                "return_num_output_tokens": True}})
    assert sum(e["num_output_tokens"] for e in events) == 4


# -- hostile input: refused with a 4xx that names what is wrong -------------------------------------
CONTEXT = 1024  # llm's max_model_len (model_repository/llm/1/model.json)


@pytest.mark.parametrize("model", ["llm", "llm_ensemble"])
def test_max_tokens_beyond_the_context_stops_at_the_context(server, grpc_client, model):
    """Triton's tensor interface takes max_tokens beyond the context as Triton's vLLM backend does: the engine
    stops at the context length (the OpenAI frontend refuses it as vLLM's server does: the next test)."""
    import tritonclient.grpc as grpcclient

    sampling = {"max_tokens": CONTEXT + 1, "temperature": 0, "ignore_eos": True}
    status, answer = post_json(server, f"/v2/models/{model}/generate",
                               {"text_input": "Hi", "parameters": {**sampling, "return_num_output_tokens": True}})
    assert status == 200, answer
    assert CONTEXT - 8 <= answer["num_output_tokens"] < CONTEXT  # the prompt's tokens and the output fill it
    if model == "llm":
        result = grpc_client.infer(model, llm_inputs(grpcclient, "Hi", sampling={**sampling, "max_tokens": 2**62},
                                                     exclude_input=True, return_num_input_tokens=True,
                                                     return_num_output_tokens=True))
        assert (int(result.as_numpy("num_input_tokens")[0]) + int(result.as_numpy("num_output_tokens")[0])
                == CONTEXT)
    else:  # the tokenizer step refuses what its INT32 output cannot hold
        status, answer = post_json(server, f"/v2/models/{model}/generate",
                                   {"text_input": "Hi", "parameters": {"max_tokens": 2**63}})
        assert status == 400 and "'max_tokens' must be between 1 and 2147483647" in answer["error"], answer


@pytest.mark.parametrize("model", ["llm", "llm_ensemble"])
def test_openai_max_tokens_beyond_the_context_is_400_naming_it(server, model):
    import openai

    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=model, prompt="Hi", max_tokens=5000)
        assert info.value.body["param"] == "max_tokens"
        assert f"maximum context length is {CONTEXT} tokens" in info.value.body["message"]
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                           max_completion_tokens=2**40, stream=True)
        assert info.value.body["param"] == "max_completion_tokens"
        assert "'max_completion_tokens'" in info.value.body["message"]


def test_invalid_utf8_text_is_400_naming_the_input(http_client, grpc_client):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    for module, client, status in ((httpclient, http_client, "400"),
                                   (grpcclient, grpc_client, "StatusCode.INVALID_ARGUMENT")):
        data = np.array([[b"fine"], [b"\xff\xfe not UTF-8"]], dtype=np.object_)
        tensor = module.InferInput("text", list(data.shape), "BYTES")
        tensor.set_data_from_numpy(data)
        for model in ("text_tokenizer", "text_classifier"):
            with pytest.raises(InferenceServerException) as caught:
                client.infer(model, [tensor])
            assert caught.value.status() == status, (model, caught.value)
            assert "input 'text' element 1 is not valid UTF-8" in str(caught.value)
    assert http_client.infer("text_classifier", classifier_inputs(httpclient, SENTENCES[:1])).as_numpy("scores") \
        is not None


def test_many_prompts_do_not_delay_health(server):
    """5,000 prompts are refused at once; the most one request may hold (256) are answered while health checks
    stay quick (the bound is generous: ~10-70 ms measured, 9.9 s before the prompts were limited)."""
    import httpx
    from health_probe import HealthProbe

    url = f"{server.base_url}/v1/completions"
    with HealthProbe(server.http_port) as probe:
        refused = httpx.post(url, json={"model": "llm", "prompt": ["hi"] * 5000, "max_tokens": 1}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt"
    assert probe.worst < 1.0, probe.worst
    with HealthProbe(server.http_port) as probe:
        answered = httpx.post(url, json={"model": "llm", "prompt": ["hi"] * 256, "max_tokens": 2}, timeout=300)
    assert answered.status_code == 200 and len(answered.json()["choices"]) == 256
    assert probe.worst < 1.0, (probe.worst, sorted(probe.latencies)[-5:])
