"""``/v1/responses`` (OpenAI's Responses API) driven by the official ``openai`` client and the OpenAI Agents SDK.

A real server over toy Python models (``tests/agent_fixtures.py``): ``agent`` writes what its prompt scripts
(hermes tool calls, deepseek_r1 reasoning) and can show the prompt it was given; ``slow`` writes words
slowly (background responses and cancel). Covered: text, reasoning and function-call items, the streamed
event sequence rebuilding the non-streamed response, store / retrieve / delete / input items,
``previous_response_id`` (also after a server restart over the same SQLite store), background and cancel,
structured output refused on a model without it, errors in OpenAI's shape, the API key and restricted
API groups.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from agent_fixtures import agent_repository
from support import start_server

WEATHER = {"city": "Paris", "days": [1, 2]}
CALL_TEXT = ('<think>Check the weather.</think>Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
             + json.dumps(WEATHER) + '}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "array"}}}},
         {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}]


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    return agent_repository(tmp_path_factory.mktemp("responses_repo"))


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    return tmp_path_factory.mktemp("responses_store") / "responses.sqlite3"


def _start(repository, store_path, tmp, *extra):
    return start_server([repository], "--response-store", str(store_path), *extra, tmp_dir=tmp)


@pytest.fixture(scope="module")
def server(repository, store_path, tmp_path_factory):
    running = _start(repository, store_path, tmp_path_factory.mktemp("responses"))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _without_ids(value):
    """``value`` with generated ids and times blanked (two runs of one request differ only there); the client's
    own ``parsed`` and ``parsed_arguments`` (a streamed response's) left out."""
    if isinstance(value, dict):
        return {k: (None if k in ("id", "call_id", "created_at", "item_id") else _without_ids(v))
                for k, v in value.items() if k not in ("parsed", "parsed_arguments")}
    if isinstance(value, list):
        return [_without_ids(v) for v in value]
    return value


# -- create ------------------------------------------------------------------------------------------------
def test_text_answer(client):
    response = client.responses.create(model="agent", input="Hello there", instructions="Be brief.")
    assert response.object == "response" and response.status == "completed" and response.id.startswith("resp_")
    assert response.output_text == "Hello there"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.content[0].type == "output_text"
    prompt = "<system>Be brief.<user>Hello there|Hello there"
    assert response.usage.input_tokens == len(prompt.encode())  # one token per byte
    assert response.usage.output_tokens == len(b"Hello there")
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.usage.input_tokens_details.cached_tokens == 0
    assert response.instructions == "Be brief." and response.model == "agent" and response.store is True


def test_reasoning_and_function_calls(client):
    response = client.responses.create(model="thinker", input=CALL_TEXT, tools=TOOLS)
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message", "function_call", "function_call"]
    reasoning, message, weather, clock = response.output
    assert reasoning.content[0].text == "Check the weather." and reasoning.content[0].type == "reasoning_text"
    assert message.content[0].text == "Let me look.\n"
    assert (weather.name, json.loads(weather.arguments)) == ("get_weather", WEATHER)
    assert (clock.name, json.loads(clock.arguments)) == ("get_time", {})
    assert weather.call_id != clock.call_id and weather.status == "completed"
    assert response.usage.output_tokens_details.reasoning_tokens == len(b"Check the weather.")


def _events(client, **kwargs) -> list:
    with client.responses.stream(**kwargs) as stream:
        return list(stream)


@pytest.mark.parametrize("text", [CALL_TEXT, "Just reasoning, no answer.", "<think>Hm.</think>Words, no calls."])
def test_streamed_events_rebuild_the_response(client, text):
    whole = client.responses.create(model="thinker", input=text, tools=TOOLS, store=False)
    events = _events(client, model="thinker", input=text, tools=TOOLS, store=False)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    # the items, rebuilt from the events alone
    items: dict[int, dict] = {}
    for event in events:
        if event.type == "response.output_item.added":
            items[event.output_index] = {"type": event.item.type, "text": "", "arguments": "",
                                         "name": getattr(event.item, "name", None)}
        elif event.type in ("response.output_text.delta", "response.reasoning_text.delta"):
            items[event.output_index]["text"] += event.delta
        elif event.type == "response.function_call_arguments.delta":
            items[event.output_index]["arguments"] += event.delta
        elif event.type == "response.output_item.done":
            done = event.item.model_dump()
            rebuilt = items[event.output_index]
            if rebuilt["type"] == "function_call":
                assert (done["name"], done["arguments"]) == (rebuilt["name"], rebuilt["arguments"])
            else:
                assert done["content"][0]["text"] == rebuilt["text"]
    final = events[-1].response
    assert len(items) == len(final.output)
    assert _without_ids(final.model_dump()["output"]) == _without_ids(whole.model_dump()["output"])
    assert final.usage == whole.usage
    if text == CALL_TEXT:  # the arguments came in pieces, as the model wrote them
        assert kinds.count("response.function_call_arguments.delta") > 4
        assert "response.reasoning_text.delta" in kinds and "response.output_text.done" in kinds


@pytest.mark.parametrize("text", ["Hello there, a plain answer", ""])
def test_plain_stream_events_in_order(client, text):
    """A plain answer (no tools, no reasoning parser), whose opening events are made while the model computes its
    first token: the exact event sequence, numbered from 0, the message item announced with the first text (not
    at all when the model writes none) and rebuilding the non-streamed response."""
    whole = client.responses.create(model="agent", input=text, store=False)
    events = _events(client, model="agent", input=text, store=False)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    if text:
        assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                         "response.output_text.done", "response.content_part.done", "response.output_item.done",
                         "response.completed"]
        assert "".join(deltas) == text and len(deltas) > 1
        added, done = events[2].item, events[-2].item
        assert added.id == done.id == events[3].item_id == events[4].item_id and added.status == "in_progress"
        assert events[-1].response.output[0].id == added.id
    else:
        assert kinds == ["response.created", "response.in_progress", "response.completed"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert events[0].response.id == events[1].response.id == events[-1].response.id
    final = events[-1].response
    assert _without_ids(final.model_dump()["output"]) == _without_ids(whole.model_dump()["output"])
    assert final.usage == whole.usage


def test_model_error_mid_stream_fails_the_response(client):
    """The model fails after two words (``slow``'s ``FAIL``): the open item is closed and the stream ends with
    ``response.failed`` carrying what was written and the error."""
    events = _events(client, model="slow", input="FAIL", max_output_tokens=6, store=False)
    kinds = [e.type for e in events]
    assert kinds[-1] == "response.failed" and "response.completed" not in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    failed = events[-1].response
    assert failed.status == "failed" and "the words ran out" in failed.error.message
    assert failed.output[0].content[0].text == "w0 w1 "
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "w0 w1 "


def test_named_and_none_tool_choice(client):
    none = client.responses.create(model="agent", input="LIST_TOOLS", tools=TOOLS, tool_choice="none")
    assert none.output_text.endswith("[get_weather][get_time]")  # the tools reached the template
    with pytest.raises(openai.BadRequestError) as info:  # a named function needs structured output (vLLM)
        client.responses.create(model="agent", input="x", tools=TOOLS,
                                tool_choice={"type": "function", "name": "get_time"})
    assert "structured output" in info.value.body["message"] and info.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="agent", input="x", text={"format": {"type": "json_object"}})
    assert info.value.body["param"] == "text.format"


# -- stored responses -----------------------------------------------------------------------------------------
def test_retrieve_input_items_delete(client):
    created = client.responses.create(model="agent", input=[
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "input_text", "text": "What is up?"}]}])
    got = client.responses.retrieve(created.id)
    assert got.model_dump() == created.model_dump()
    items = client.responses.input_items.list(created.id)
    assert [i.role for i in items.data] == ["user", "developer"]  # newest first by default
    assert [i.role for i in client.responses.input_items.list(created.id, order="asc").data] == ["developer", "user"]
    page = client.responses.input_items.list(created.id, order="asc", limit=1)
    assert len(page.data) == 1 and page.has_more and page.first_id == page.last_id
    rest = client.responses.input_items.list(created.id, order="asc", after=page.last_id)
    assert [i.role for i in rest.data] == ["user"] and not rest.has_more
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(created.id)
    assert info.value.body["message"] == f"Response with id '{created.id}' not found."
    unstored = client.responses.create(model="agent", input="x", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.retrieve("nope")
    assert "Expected an ID that begins with 'resp'" in info.value.body["message"]


def test_function_call_round_trip_with_previous_response(client):
    first = client.responses.create(model="agent", input=CALL_TEXT, tools=TOOLS)
    calls = [item for item in first.output if item.type == "function_call"]
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": f"result of {c.name}"} for c in calls]
    second = client.responses.create(model="agent", previous_response_id=first.id, tools=TOOLS, tool_choice="none",
                                     input=outputs + [{"role": "user", "content": "LIST_TOOLS"}])
    shown = second.output_text
    # the whole conversation reached the template: the first input, the calls, their results
    assert shown.startswith("<user><think>Check the weather.</think>Let me look.")
    for call in calls:
        assert f"<call {call.call_id} {call.name} " in shown and f"result of {call.name}<for {call.call_id}>" in shown
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="agent", input="x", previous_response_id="resp_missing")
    assert info.value.body["param"] == "previous_response_id"


def test_extensions_and_tool_outputs_validated_once(client):
    """vLLM's extensions (sent through the client's ``extra_body``) are validated with the Responses request: a bad
    one is a 400 naming it; a good one reaches the generation; a function call's output given as text parts is joined
    (the chat request is built from the validated request, not validated again)."""
    for field, value in (("top_k", -5), ("stop", 3), ("seed", "x"), ("chat_template_kwargs", [1])):
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model="agent", input="x", extra_body={field: value})
        assert info.value.body["param"] == field, (field, info.value.body)
    with pytest.raises(openai.BadRequestError) as info:  # a good one reaches the model (this one takes no seed)
        client.responses.create(model="agent", input="x", store=False, extra_body={"seed": 3})
    assert "'seed'" in info.value.body["message"]
    items = [{"type": "function_call", "call_id": "call_9", "name": "get_time", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "call_9",
              "output": [{"type": "input_text", "text": "no"}, {"type": "input_text", "text": "on"}]},
             {"role": "user", "content": "LIST_TOOLS"}]
    shown = client.responses.create(model="agent", input=items, tools=TOOLS, store=False).output_text
    assert shown == "<assistant><call call_9 get_time {}><tool>noon<for call_9><user>LIST_TOOLS[get_weather][get_time]"


def test_previous_response_after_a_restart(repository, store_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("restart")
    running = _start(repository, store_path, tmp)
    try:
        with openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0) as c:
            first = c.responses.create(model="agent", input="Remember the number 7.", instructions="Be kind.")
            before = c.responses.create(model="agent", input="LIST_TOOLS", previous_response_id=first.id)
    finally:
        running.stop()
    running = _start(repository, store_path, tmp)
    try:
        with openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0) as c:
            assert c.responses.retrieve(first.id).model_dump() == first.model_dump()
            after = c.responses.create(model="agent", input="LIST_TOOLS", previous_response_id=first.id)
    finally:
        running.stop()
    # the same prompt, token for token (instructions do not carry over, as OpenAI's API has it)
    assert after.output_text == before.output_text == "<user>Remember the number 7.<assistant>Remember the number 7." \
                                                       "<user>LIST_TOOLS"
    assert after.usage.input_tokens == before.usage.input_tokens > 0


# -- background ---------------------------------------------------------------------------------------------
def _poll(client, response_id: str, until: tuple[str, ...], timeout: float = 30):
    deadline = time.monotonic() + timeout
    while True:
        response = client.responses.retrieve(response_id)
        if response.status in until or time.monotonic() > deadline:
            return response
        time.sleep(0.1)


def test_background_completes_and_cancels(client):
    done = client.responses.create(model="slow", input="go", background=True, max_output_tokens=3)
    assert done.status == "queued" and done.background is True
    finished = _poll(client, done.id, ("completed", "failed", "incomplete"))
    assert finished.status == "completed" and finished.output_text == "w0 w1 w2"
    with pytest.raises(openai.BadRequestError):  # not a background response
        client.responses.cancel(client.responses.create(model="agent", input="x").id)

    running = client.responses.create(model="slow", input="go", background=True, max_output_tokens=200)
    assert _poll(client, running.id, ("in_progress",)).status == "in_progress"
    cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled"
    time.sleep(0.6)  # the generation stopped: the stored response stays cancelled
    assert client.responses.retrieve(running.id).status == "cancelled"
    assert client.responses.cancel(running.id).status == "cancelled"  # again: the same answer
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="slow", input="go", background=True, store=False)
    assert info.value.body["param"] == "background"


# -- errors and access ---------------------------------------------------------------------------------------
def test_errors_in_openai_shape(server):
    url = f"{server.base_url}/v1/responses"
    for body, param in (({"model": "agent", "input": [{"type": "image", "url": "x"}]}, "input[0].type"),
                        ({"model": "agent", "input": [{"role": "user", "content": [{"type": "input_image"}]}]},
                         "input[0].content"),
                        ({"model": "agent", "input": "x", "temperature": 5}, "temperature"),
                        ({"model": "agent", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
                        ({"model": "agent", "input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
                        ({"model": "agent", "input": 3}, "input")):
        answer = httpx.post(url, json=body, timeout=30)
        assert answer.status_code == 400, (body, answer.text)
        assert answer.json()["error"]["param"] == param and answer.json()["error"]["type"] == "BadRequestError"
    answer = httpx.post(url, json={"model": "nope", "input": "x"}, timeout=30)
    assert answer.status_code == 404 and answer.json()["error"]["param"] == "model"
    answer = httpx.post(url, content=b"{", headers={"content-type": "application/json"}, timeout=30)
    assert answer.status_code == 400
    # the queue deadline header of /v1/chat/completions (its 503 needs an engine: tests/e2e/test_fleet_hooks.py)
    answer = httpx.post(url, json={"model": "agent", "input": "x"}, headers={"x-request-timeout-ms": "soon"},
                        timeout=30)
    assert answer.status_code == 400 and "x-request-timeout-ms" in answer.json()["error"]["message"]
    answer = httpx.post(url, json={"model": "agent", "input": "x"}, headers={"x-request-timeout-ms": "60000"},
                        timeout=30)
    assert answer.status_code == 200 and answer.json()["output"][0]["content"][0]["text"] == "x"


def _model_stats(server, model: str) -> dict:
    stats = httpx.get(f"{server.base_url}/v2/models/{model}/stats", timeout=30).json()
    return stats["model_stats"][0]["inference_stats"]


def test_disconnect_cancels_and_metrics_count(client, server):
    """A client that leaves a stream cancels its generation (counted failed, as chat's); requests are counted in
    the model's statistics and metrics as chat completions are."""
    before = _model_stats(server, "slow")["fail"]["count"]
    with httpx.stream("POST", f"{server.base_url}/v1/responses", timeout=30,
                      json={"model": "slow", "input": "x", "max_output_tokens": 500, "stream": True}) as response:
        lines = response.iter_lines()
        while "response.output_text.delta" not in next(lines):
            pass
    deadline = time.monotonic() + 10
    while _model_stats(server, "slow")["fail"]["count"] == before:
        assert time.monotonic() < deadline, "the generation was not cancelled"
        time.sleep(0.05)
    success = _model_stats(server, "agent")["success"]["count"]
    metric = _success_metric(server, "agent")
    client.responses.create(model="agent", input="count me", store=False)
    _events(client, model="agent", input="count me too", store=False)
    assert _model_stats(server, "agent")["success"]["count"] == success + 2
    assert _success_metric(server, "agent") == metric + 2


def _success_metric(server, model: str) -> float:
    for line in server.metrics().splitlines():
        if line.startswith("nv_inference_request_success{") and f'model="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_api_key_and_restricted_api(repository, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("responses_access")
    running = start_server([repository], "--response-store", ":memory:", "--api-key", "secret",
                           "--http-restricted-api", "inference:team=agents", tmp_dir=tmp)
    try:
        url = f"{running.base_url}/v1/responses"
        body = {"model": "agent", "input": "hi"}
        assert httpx.post(url, json=body, timeout=30).status_code == 401
        answer = httpx.post(url, json=body, headers={"authorization": "Bearer secret"}, timeout=30)
        assert answer.status_code == 403 and answer.json()["error"]["type"] == "PermissionDeniedError"
        answer = httpx.post(url, json=body, headers={"authorization": "Bearer secret", "team": "agents"}, timeout=30)
        assert answer.status_code == 200 and answer.json()["output"][0]["content"][0]["text"] == "hi"
        response_id = answer.json()["id"]
        assert httpx.get(f"{url}/{response_id}", timeout=30).status_code == 401
        assert httpx.get(f"{url}/{response_id}", headers={"authorization": "Bearer secret", "team": "agents"},
                         timeout=30).status_code == 200
        # /v1/messages is in the same API group, refused in Anthropic's shape
        messages = f"{running.base_url}/v1/messages"
        body = {"model": "agent", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
        answer = httpx.post(messages, json=body, headers={"x-api-key": "secret"}, timeout=30)
        assert answer.status_code == 403 and answer.json()["type"] == "error"
        assert answer.json()["error"]["type"] == "permission_error"
        answer = httpx.post(messages, json=body, headers={"x-api-key": "secret", "team": "agents"}, timeout=30)
        assert answer.status_code == 200 and answer.json()["content"][0]["text"] == "hi"
    finally:
        running.stop()


# -- the OpenAI Agents SDK --------------------------------------------------------------------------------------
def test_agents_sdk_runs_a_function_tool(server):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny in {city}"

    client = AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    model = agents.OpenAIResponsesModel(model="agent", openai_client=client)
    agent = agents.Agent(name="weather", instructions="Use the tools.", tools=[get_weather], model=model)
    script = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    result = agents.Runner.run_sync(agent, script, run_config=agents.RunConfig(tracing_disabled=True))
    assert calls == ["Paris"]
    assert result.final_output == "Sunny in Paris"  # the tool's answer reached the model's context


def test_memory_store_is_shared_by_frontend_workers(repository, tmp_path_factory):
    """``--response-store :memory:`` with frontend workers: a stored response is found by whichever worker a GET
    reaches (a temporary file the workers share), and the file is gone once the server stops."""
    tmp = tmp_path_factory.mktemp("responses_memory_workers")
    store_tmp = tmp / "tmp"
    store_tmp.mkdir()
    running = start_server([repository], "--response-store", ":memory:", "--frontend-workers", "2",
                           tmp_dir=tmp, env={"TMPDIR": str(store_tmp), "TIDESERVE_HTTP_FILL_CONNECTIONS": "0"})
    try:
        url = f"{running.base_url}/v1/responses"
        answer = httpx.post(url, json={"model": "agent", "input": "remember me"}, timeout=30)
        assert answer.status_code == 200, answer.text
        response_id = answer.json()["id"]
        assert [p.name for p in store_tmp.iterdir() if p.name.startswith("tideserve-responses-")]
        for _ in range(12):  # a new connection each: either worker may take it (both take HTTP connections)
            got = httpx.get(f"{url}/{response_id}", timeout=30)
            assert got.status_code == 200, got.text
            assert got.json()["output"][0]["content"][0]["text"] == "remember me"
    finally:
        running.stop()
    assert not [p.name for p in store_tmp.iterdir() if p.name.startswith("tideserve-responses-")]
