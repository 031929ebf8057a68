"""The OpenAI frontend without an engine: a real server over a toy text model
(``tests/openai_models/words.py``) driven by the official ``openai`` client.

Request validation, chat templates and what the frontend reads of a model, without a server, are in
``tests/unit`` (``test_openai_protocol.py``, ``test_openai_chat_template.py``, ``test_openai_models.py``).

The engine tests (the tiny vLLM model: outputs, usage, logprobs, structured output, tools, aborts)
are in ``test_openai.py``.
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.request
from pathlib import Path

import httpx
import openai
import pytest
from support import TEST_MODELS, start_server
from health_probe import HealthProbe
from openai_fixtures import TEMPLATE

TOY = Path(__file__).resolve().parents[1] / "openai_models"
API_KEY = "sk-tideserve-test"


# -- a real server over the toy model -----------------------------------------------------------
def _repository(root: Path) -> Path:
    repository = root / "models"
    chat = f'parameters {{ key: "chat_template" value {{ string_value: {json.dumps(TEMPLATE)} }} }}\n'
    for name, extra in (("words", ""), ("words_chat", chat), ("words_2d", chat)):
        (repository / name / "1").mkdir(parents=True)
        shutil.copy(TOY / "words.py", repository / name / "1" / "model.py")
        config = (TOY / "words.pbtxt").read_text()
        if name == "words_2d":  # max_batch_size 0 with [1, 1] inputs, as Triton's mock_llm and tool_stream_py
            config = config.replace("dims: [ 1 ]", "dims: [ 1, 1 ]").replace("dims: [ -1 ]", "dims: [ 1, -1 ]")
        (repository / name / "config.pbtxt").write_text(f'name: "{name}"\n' + config + extra)
    shutil.copytree(TEST_MODELS / "add_sub", repository / "add_sub")
    shutil.copytree(TEST_MODELS / "mock_llm", repository / "mock_llm")
    (repository / "mock_llm" / "config.pbtxt").write_text((TEST_MODELS / "mock_llm" / "config.pbtxt").read_text() + chat)
    return repository


@pytest.fixture(scope="module")
def toy_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openai_toy")
    server = start_server([_repository(tmp)], tmp_dir=tmp)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def key_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openai_key")
    server = start_server([_repository(tmp)], tmp_dir=tmp, env={"TIDESERVE_API_KEY": API_KEY})
    yield server
    server.stop()


@pytest.fixture()
def client(toy_server):
    with openai.OpenAI(base_url=f"{toy_server.base_url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def _sse(server, path: str, body: dict) -> list[str]:
    """The raw ``data:`` lines of a streamed answer."""
    with httpx.stream("POST", f"{server.base_url}{path}", json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def test_models_lists_only_text_models(client):
    assert sorted(m.id for m in client.models.list().data) == ["mock_llm", "words", "words_2d", "words_chat"]
    model = client.models.retrieve("words")
    assert (model.id, model.object, model.owned_by) == ("words", "model", "tideserve")
    for name in ("nope", "add_sub"):
        with pytest.raises(openai.NotFoundError) as info:
            client.models.retrieve(name)
        assert info.value.body["type"] == "NotFoundError" and info.value.body["param"] == "model"


def test_health(toy_server):
    assert httpx.get(f"{toy_server.base_url}/health").status_code == 200
    ready = httpx.get(f"{toy_server.base_url}/health/ready")  # Triton's OpenAI frontend's readiness probe
    assert ready.status_code == 200 and ready.content == b""


def test_completion_through_a_generic_text_model(client):
    result = client.completions.create(model="words", prompt="hi", max_tokens=4)
    assert result.object == "text_completion" and result.id.startswith("cmpl-") and result.model == "words"
    assert [(c.index, c.text, c.finish_reason) for c in result.choices] == [(0, "w0 w1 w2 w3", "stop")]
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens


def test_inputs_take_the_shape_the_model_declares(client):
    """A model that does not batch and declares [1, 1] inputs (Triton's mock_llm) gets [1, 1] tensors; one that
    declares [1] gets [1] (the same rule as between an ensemble's steps)."""
    for model in ("words_2d", "words_chat"):
        result = client.completions.create(model=model, prompt="hi", max_tokens=3)
        assert result.choices[0].text == "w0 w1 w2", model
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2)
        assert chat.choices[0].message.content == "w0 w1", model
        chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=3, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "w0 w1 w2", model


def test_triton_mock_llm_is_served(client):
    """Triton's mock_llm interface: [1, 1] inputs and no length input (max_tokens, always set, is not sent)."""
    assert client.completions.create(model="mock_llm", prompt="hello there").choices[0].text == "hello there"
    assert client.completions.create(model="mock_llm", prompt="abc", max_tokens=5).choices[0].text == "abc"
    chunks = list(client.completions.create(model="mock_llm", prompt="hello there", stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "hello there"
    chat = client.chat.completions.create(model="mock_llm", messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content == "user: hi\nassistant:"
    with pytest.raises(openai.BadRequestError, match="temperature"):  # other fields still need an input
        client.completions.create(model="mock_llm", prompt="x", temperature=0.5)


def test_completion_stream_and_usage_chunk(client, toy_server):
    chunks = list(client.completions.create(model="words", prompt="hi", max_tokens=5, stream=True,
                                            stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == "w0 w1 w2 w3 w4" and len(texts) >= 5
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    lines = _sse(toy_server, "/v1/completions", {"model": "words", "prompt": "x", "max_tokens": 2, "stream": True})
    assert lines[-1] == "[DONE]" and all(json.loads(x)["object"] == "text_completion" for x in lines[:-1])


def test_continuous_usage_stats(toy_server):
    lines = _sse(toy_server, "/v1/chat/completions", {
        "model": "words_chat", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    chunks = [json.loads(x) for x in lines[:-1]]
    assert all("usage" in c for c in chunks) and chunks[-1]["choices"] == []


@pytest.mark.parametrize("route, body", [
    ("/v1/chat/completions", {"model": "words_chat", "messages": [{"role": "user", "content": "x"}]}),
    ("/v1/completions", {"model": "words", "prompt": "x"})])
def test_continuous_usage_stats_needs_include_usage(toy_server, route, body):
    """As vLLM: ``continuous_usage_stats`` without ``include_usage`` puts usage in no chunk (vLLM's
    tests/entrypoints/openai completion test_completion_stream_options)."""
    lines = _sse(toy_server, route, {**body, "max_tokens": 3, "stream": True,
                                     "stream_options": {"include_usage": False, "continuous_usage_stats": True}})
    chunks = [json.loads(x) for x in lines[:-1]]
    assert chunks and all(c.get("usage") is None and c["choices"] for c in chunks)


def test_completion_several_prompts(client):
    result = client.completions.create(model="words", prompt=["a", "b", "c"], max_tokens=2)
    assert [(c.index, c.text) for c in result.choices] == [(0, "w0 w1"), (1, "w0 w1"), (2, "w0 w1")]
    chunks = list(client.completions.create(model="words", prompt=["a", "b"], max_tokens=3, stream=True))
    by_index = {}
    for chunk in chunks:
        for choice in chunk.choices:
            by_index[choice.index] = by_index.get(choice.index, "") + choice.text
    assert by_index == {0: "w0 w1 w2", 1: "w0 w1 w2"}


def test_completion_echo(client):
    assert client.completions.create(model="words", prompt="say: ", max_tokens=2, echo=True).choices[0].text == \
        "say: w0 w1"
    chunks = list(client.completions.create(model="words", prompt="say: ", max_tokens=2, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "say: w0 w1"


def test_chat_needs_a_chat_template(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="words", messages=[{"role": "user", "content": "hi"}])
    assert "no chat template" in info.value.body["message"]
    assert info.value.body["code"] == 400 and info.value.body["type"] == "BadRequestError"


def test_chat_template_sent_with_the_request(client):
    result = client.chat.completions.create(model="words", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                            extra_body={"chat_template": TEMPLATE})
    assert result.choices[0].message.content == "w0 w1"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="words", messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"chat_template": "{% for %}"})
    assert info.value.body["param"] == "chat_template" and "does not compile" in info.value.body["message"]


def test_chat_with_a_configured_template(client, toy_server):
    result = client.chat.completions.create(model="words_chat", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=3)
    assert result.object == "chat.completion" and result.id.startswith("chatcmpl-")
    choice = result.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", "w0 w1 w2", "stop")
    chunks = list(client.chat.completions.create(model="words_chat", messages=[{"role": "user", "content": "hi"}],
                                                 max_completion_tokens=3, stream=True))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "w0 w1 w2"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    lines = _sse(toy_server, "/v1/chat/completions", {"model": "words_chat", "stream": True, "max_tokens": 2,
                                                      "messages": [{"role": "user", "content": "x"}]})
    assert lines[-1] == "[DONE]"


async def test_async_client_streams(toy_server):
    async with openai.AsyncOpenAI(base_url=f"{toy_server.base_url}/v1", api_key="x", max_retries=0) as client:
        stream = await client.chat.completions.create(model="words_chat", messages=[{"role": "user", "content": "a"}],
                                                      max_tokens=4, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert text == "w0 w1 w2 w3"


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": 3.0}, "temperature"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"n": 2}, "n"),  # no sampling_parameters input: the toy model makes one choice
    ({"logprobs": 2}, "logprobs"),
    ({"extra_body": {"top_k": 3}}, "top_k"),
    ({"extra_body": {"response_format": {"type": "json_object"}}}, "response_format"),
    ({"echo": True, "logprobs": 1}, "echo"),  # no prompt log probabilities from this model
    ({"suffix": "!"}, "suffix"),
    ({"max_tokens": 0}, "max_tokens"),  # 0 only with echo
])
def test_completion_errors_are_400_with_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="words", prompt="hi", **kwargs)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param and info.value.body["type"] == "BadRequestError"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no_such_model", prompt="hi")
    assert info.value.body == {"message": "The model `no_such_model` does not exist.", "type": "NotFoundError",
                               "param": "model", "code": 404}
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="add_sub", messages=[{"role": "user", "content": "x"}])


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"model": "words", "prompt": "hi"}, 400, "model"),  # no tokenizer files
    ("/detokenize", {"model": "words", "tokens": [1]}, 400, "model"),
    ("/tokenize", {"model": "add_sub", "prompt": "hi"}, 404, "model"),
    ("/tokenize", {"prompt": "hi"}, 400, "model"),  # two text models: the request must name one
    ("/v1/embeddings", {"input": "hi"}, 400, "model"),  # no embedding model served
    ("/v1/embeddings", {"model": "words", "input": "hi"}, 404, "model"),
])
def test_tokenize_and_embeddings_errors_without_such_models(toy_server, path, body, status, param):
    response = httpx.post(f"{toy_server.base_url}{path}", json=body, timeout=30)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param and response.json()["error"]["code"] == status


def test_malformed_bodies_are_400(toy_server):
    url = f"{toy_server.base_url}/v1/chat/completions"
    response = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["type"] == "BadRequestError"
    response = httpx.post(url, json={"model": "words_chat", "messages": [{"role": "wizard", "content": "x"}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages[0].role"
    response = httpx.post(url, json=[1, 2])
    assert response.status_code == 400


def test_error_after_the_stream_started_is_an_error_chunk(client, toy_server):
    lines = _sse(toy_server, "/v1/completions", {"model": "words", "prompt": "FAIL", "max_tokens": 6, "stream": True})
    assert [json.loads(x)["choices"][0]["text"] for x in lines[:2]] == ["w0 ", "w1 "]
    error = json.loads(lines[2])["error"]
    assert "the words ran out" in error["message"] and error["code"] == 500
    assert lines[3:] == ["[DONE]"]
    with pytest.raises(openai.APIError, match="the words ran out"):
        for _ in client.completions.create(model="words", prompt="FAIL", max_tokens=6, stream=True):
            pass


def _failures(server, model: str) -> int:
    with urllib.request.urlopen(f"{server.base_url}/v2/models/{model}/stats") as r:
        stats = json.loads(r.read())["model_stats"][0]["inference_stats"]
    return stats["fail"]["count"]


def test_client_disconnect_cancels_the_request(toy_server):
    before = _failures(toy_server, "words")
    with httpx.stream("POST", f"{toy_server.base_url}/v1/completions", timeout=30,
                      json={"model": "words", "prompt": "long", "max_tokens": 500, "stream": True}) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
    deadline = time.monotonic() + 5
    while _failures(toy_server, "words") == before:  # the DataPlane counts a cancelled request as failed
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_api_key_guards_only_the_v1_routes(key_server):
    base = key_server.base_url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.get(f"{base}/v1/models", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "AuthenticationError"
        assert response.json()["error"]["code"] == 401
    response = httpx.post(f"{base}/v1/completions", json={"model": "words", "prompt": "x"})
    assert response.status_code == 401
    with openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0) as client, \
            pytest.raises(openai.AuthenticationError):
        client.models.list()
    with openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0) as client:
        assert client.completions.create(model="words", prompt="x", max_tokens=1).choices[0].text == "w0"
    assert httpx.get(f"{base}/v2/health/ready").status_code == 200
    assert httpx.get(f"{base}/v2/models/words").status_code == 200
    assert httpx.get(f"{base}/health").status_code == 200
    assert "nv_inference_request_success" in key_server.metrics()


# -- limits and hostile input -------------------------------------------------------------------
@pytest.mark.parametrize("content_type", [b"text/plain", b"application/x-www-form-urlencoded", None])
def test_non_json_bodies_are_refused(toy_server, content_type):
    body = json.dumps({"model": "words", "prompt": "x", "max_tokens": 1}).encode()
    headers = {"content-type": content_type.decode()} if content_type else {}
    response = httpx.post(f"{toy_server.base_url}/v1/completions", content=body, headers=headers)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and "Unsupported Media Type" in error["message"]
    ok = httpx.post(f"{toy_server.base_url}/v1/completions", content=body,
                    headers={"content-type": "Application/JSON; charset=utf-8"})
    assert ok.status_code == 200


def test_a_request_template_that_overflows_is_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="words", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                       extra_body={"chat_template": "{% for i in range(10**9) %}x{% endfor %}"})
    assert info.value.body["param"] == "chat_template" and info.value.body["code"] == 400


def test_5000_prompts_are_refused_without_delaying_health(toy_server):
    with HealthProbe(toy_server.http_port) as probe:
        start = time.monotonic()
        response = httpx.post(f"{toy_server.base_url}/v1/completions", timeout=60,
                              json={"model": "words", "prompt": ["hi"] * 5000, "max_tokens": 1})
        took = time.monotonic() - start
        time.sleep(0.1)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert "at most 256" in response.json()["error"]["message"]
    assert took < 5 and probe.worst < 1.0, (took, probe.worst)  # generous bounds: ~10 ms each measured


@pytest.mark.parametrize("kwargs, param, says", [
    ({"n": 129}, "n", "at most 128"),
    ({"logprobs": 21}, "logprobs", "greater than max allowed: 20"),
    ({"prompt": "é" * 140_000}, "prompt", "at most 262144 prompt tokens"),  # no tokenizer: UTF-8 bytes
])
def test_completion_limits_are_400_naming_the_field(client, kwargs, param, says):
    request = {"model": "words", "prompt": "hi", "max_tokens": 1, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**request)
    assert info.value.body["param"] == param and says in info.value.body["message"]


# -- a server with other limits -------------------------------------------------------------------
@pytest.fixture(scope="module")
def limits_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openai_limits")
    server = start_server([_repository(tmp)], "--openai-max-prompts", "5000", "--openai-max-prompt-tokens", "20000",
                          "--openai-max-n", "1", "--openai-max-logprobs", "0",
                          "--openai-chat-template-timeout-secs", "0.5", tmp_dir=tmp)
    yield server
    server.stop()


def test_5000_prompts_allowed_are_answered_without_delaying_health(limits_server):
    with HealthProbe(limits_server.http_port) as probe:
        response = httpx.post(f"{limits_server.base_url}/v1/completions", timeout=120,
                              json={"model": "words", "prompt": ["hi"] * 5000, "max_tokens": 1})
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == 5000 and {c["text"] for c in choices} == {"w0"}
    assert probe.worst < 1.0, probe.worst  # generous: the prompts are started 16 per turn of the event loop


def test_a_slow_chat_template_is_refused_without_stalling_the_server(limits_server):
    nested = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with HealthProbe(limits_server.http_port) as probe:
        response = httpx.post(f"{limits_server.base_url}/v1/chat/completions", timeout=60, json={
            "model": "words", "messages": [{"role": "user", "content": "hi"}], "chat_template": nested})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "chat_template" and "ran for more than 0.5 s" in error["message"]
    assert probe.worst < 1.0, probe.worst  # the render runs on a worker thread


def test_configured_limits_name_the_field(limits_server):
    url = f"{limits_server.base_url}/v1"
    chat = {"model": "words_chat", "messages": [{"role": "user", "content": "x" * 30_000}], "max_tokens": 1}
    for path, body, param in [
        ("/completions", {"model": "words", "prompt": "hi", "n": 2}, "n"),
        ("/completions", {"model": "words", "prompt": "hi", "logprobs": 1}, "logprobs"),
        ("/completions", {"model": "words", "prompt": ["x" * 10_000, "y" * 10_001]}, "prompt"),
        ("/chat/completions", chat, "messages"),  # the rendered prompt
        ("/chat/completions", {**chat, "messages": [{"role": "user", "content": "x"}], "logprobs": True,
                               "top_logprobs": 1}, "top_logprobs"),
    ]:
        response = httpx.post(url + path, json=body, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


# -- model management: POST /v1/models/{model}/load and /unload (Triton's python/openai test_model_management) ---
ADMIN = {"admin-key": "admin-secret"}


@pytest.fixture(scope="module")
def explicit_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openai_explicit")
    server = start_server([_repository(tmp)], "--model-control-mode", "explicit",
                          "--http-restricted-api", "model-repository:admin-key=admin-secret", tmp_dir=tmp)
    yield server
    server.stop()


def _manage(server, name: str, action: str, headers=ADMIN) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/models/{name}/{action}", headers=headers, timeout=60)


def _listed(server) -> list[str]:
    return sorted(m["id"] for m in httpx.get(f"{server.base_url}/v1/models", headers=ADMIN).json()["data"])


def test_load_and_unload_a_model(explicit_server):
    server = explicit_server
    assert _listed(server) == []
    answer = _manage(server, "words", "load")
    assert answer.status_code == 200
    card = answer.json()
    assert (card["id"], card["object"], card["owned_by"]) == ("words", "model", "tideserve") and card["created"] > 0
    assert _listed(server) == ["words"]
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0) as client:
        assert client.completions.create(model="words", prompt="hi", max_tokens=2).choices[0].text
    again = _manage(server, "words", "load")
    assert again.status_code == 400 and again.json()["error"]["message"] == "Model 'words' is already loaded"
    answer = _manage(server, "words", "unload")
    assert answer.status_code == 200 and answer.json() == {"status": "success", "model": "words"}
    assert _listed(server) == []
    assert httpx.get(f"{server.base_url}/v1/models/words", headers=ADMIN).status_code == 404
    again = _manage(server, "words", "unload")
    assert again.status_code == 400 and again.json()["error"]["message"] == "Unknown model: words"


def test_model_management_is_in_the_model_repository_group(explicit_server):
    for action in ("load", "unload"):
        answer = _manage(explicit_server, "words", action, headers={})
        assert answer.status_code == 403 and "model-repository" in answer.json()["error"]["message"]


@pytest.mark.parametrize("path, status, says", [
    ("nope/load", 404, "Failed to load model 'nope': failed to load 'nope', failed to poll from model repository"),
    ("nope/unload", 400, "Unknown model: nope"),
    ("../load", 400, "Failed to load model '..': invalid model name"),
    ("%20%20/load", 400, "Invalid model name"),
    ("%09/unload", 400, "Invalid model name"),  # a line break the router itself refuses (404)
    ("words/subdir/load", 404, "does not exist"),
    ("/etc/passwd/unload", 404, "does not exist"),
    ("/load", 404, "does not exist"),
])
def test_model_management_refuses_bad_names(explicit_server, path, status, says):
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", explicit_server.http_port, timeout=30)
    try:  # http.client sends the path as it is ('..' and all), as Triton's test does
        connection.request("POST", f"/v1/models/{path}", headers=ADMIN)
        answer = connection.getresponse()
        assert answer.status == status
        assert says in json.loads(answer.read())["error"]["message"]
    finally:
        connection.close()


def test_concurrent_loads_load_once(explicit_server):
    import concurrent.futures
    import os

    # one load or unload at a time per frontend process: across worker processes each may pass the check
    one_process = (os.environ.get("TIDESERVE_TEST_FRONTEND_WORKERS") or "1") == "1"
    for action in ("load", "unload"):
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            codes = sorted(pool.map(lambda _: _manage(explicit_server, "words_chat", action).status_code, range(5)))
        if one_process:
            assert codes == [200, 400, 400, 400, 400]
        else:
            assert codes[0] == 200 and set(codes) <= {200, 400}
        assert ("words_chat" in _listed(explicit_server)) == (action == "load")


def test_model_management_needs_explicit_mode(toy_server):
    for action in ("load", "unload"):
        answer = httpx.post(f"{toy_server.base_url}/v1/models/words/{action}", timeout=30)
        assert answer.status_code == 400
        assert answer.json()["error"]["message"] == "Model load/unload requires --model-control-mode=explicit"


# -- vLLM's chat echo and request checks (vLLM test_chat_echo, test_chat_logit_bias_validation; OpenAI's rules) ---
SAYING = "Here is a common saying about apple. An apple a day, keeps"


@pytest.mark.parametrize("echo", [True, False])
def test_chat_echo_with_continue_final_message(client, echo):
    completion = client.chat.completions.create(
        model="words_chat", messages=[{"role": "user", "content": "tell me a common saying"},
                                      {"role": "assistant", "content": SAYING}],
        extra_body={"echo": echo, "continue_final_message": True, "add_generation_prompt": False})
    message = completion.choices[0].message
    assert message.role == "assistant" and completion.choices[0].finish_reason == "stop"
    assert message.content.startswith(SAYING + "w0 w1") if echo else SAYING not in message.content


def test_chat_echo_streams_the_final_message_first(client):
    stream = client.chat.completions.create(
        model="words_chat", messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": SAYING}],
        stream=True, max_tokens=2,
        extra_body={"echo": True, "continue_final_message": True, "add_generation_prompt": False})
    parts = [chunk.choices[0].delta.content or "" for chunk in stream]
    assert parts[0] == "" and parts[1] == SAYING and "".join(parts) == SAYING + "w0 w1"
    # echo when the final message is not the assistant's: nothing is echoed (the answer does not continue it)
    completion = client.chat.completions.create(model="words_chat", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=2, extra_body={"echo": True})
    assert completion.choices[0].message.content == "w0 w1"


@pytest.mark.parametrize("top_logprobs", [0, 5])
def test_top_logprobs_needs_logprobs(client, top_logprobs):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="words_chat", messages=[{"role": "user", "content": "hi"}],
                                       top_logprobs=top_logprobs)
    assert info.value.body["param"] == "top_logprobs"
    assert "when using `top_logprobs`, `logprobs` must be set to true" in info.value.body["message"]


def test_stream_options_without_stream(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="words", prompt="hi", stream_options={"include_usage": None})
    assert info.value.body["message"] == "Stream options can only be defined when `stream=True`."
    # an empty object asks for nothing, as vLLM reads it
    assert client.completions.create(model="words", prompt="hi", max_tokens=1, stream_options={}).choices[0].text


def test_logit_bias_names_every_bad_key(client):
    for create, kwargs in ((client.chat.completions.create, {"messages": [{"role": "user", "content": "hi"}]}),
                           (client.completions.create, {"prompt": "hi"})):
        with pytest.raises(openai.BadRequestError) as info:
            create(model="words_chat", max_tokens=2, logit_bias={"bad1": 50.0, "7": 20.0, "bad2": 20.0}, **kwargs)
        message = info.value.body["message"]
        assert "logit_bias" in message and "'bad1'" in message and "'bad2'" in message and "'7'" not in message
        assert info.value.body["param"] == "logit_bias"
