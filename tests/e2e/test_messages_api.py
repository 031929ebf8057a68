"""``/v1/messages`` and ``/v1/messages/count_tokens`` (Anthropic's Messages API) driven by the ``anthropic`` client.

A real server over the toy models of ``tests/agent_fixtures.py`` (``agent``: hermes tool calls; ``thinker``:
deepseek_r1 reasoning too): text, thinking and tool_use blocks, streaming rebuilt to the same message, a
tool_use / tool_result round trip, token counts, errors in Anthropic's shape, ``x-api-key``.
"""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import pytest
from agent_fixtures import agent_repository
from support import start_server

WEATHER = {"city": "Paris", "days": [1, 2]}
CALL_TEXT = ('<think>Check the weather.</think>Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
             + json.dumps(WEATHER) + '}\n</tool_call>')
TOOLS = [{"name": "get_weather", "description": "The weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "array"}}}}]
KEY = "secret-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("messages")
    running = start_server([agent_repository(tmp)], "--response-store", ":memory:", "--api-key", KEY, tmp_dir=tmp)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    with anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


def test_text_message(client):
    message = client.messages.create(model="agent", max_tokens=64, system="Be brief.",
                                     messages=[{"role": "user", "content": "Hello there"}])
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [(b.type, b.text) for b in message.content] == [("text", "Hello there")]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.input_tokens == len(b"<system>Be brief.<user>Hello there|Hello there")
    assert message.usage.output_tokens == len(b"Hello there")


def test_thinking_and_tool_use(client):
    message = client.messages.create(model="thinker", max_tokens=256, tools=TOOLS,
                                     messages=[{"role": "user", "content": CALL_TEXT}])
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    thinking, text, call = message.content
    assert thinking.thinking == "Check the weather." and text.text == "Let me look.\n"
    assert (call.name, call.input) == ("get_weather", WEATHER) and call.id
    assert message.stop_reason == "tool_use"


@pytest.mark.parametrize("text", [CALL_TEXT, "<think>Hm.</think>Just words."])
def test_stream_rebuilds_the_message(client, text):
    whole = client.messages.create(model="thinker", max_tokens=256, tools=TOOLS,
                                   messages=[{"role": "user", "content": text}])
    with client.messages.stream(model="thinker", max_tokens=256, tools=TOOLS,
                                messages=[{"role": "user", "content": text}]) as stream:
        events = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "message_delta" in events and events.count("content_block_start") == len(whole.content)
    assert events.count("content_block_start") == events.count("content_block_stop")

    def blocks(message):
        return [{k: v for k, v in b.model_dump().items() if k not in ("id", "signature", "citations")}
                for b in message.content]

    assert blocks(streamed) == blocks(whole)
    assert streamed.stop_reason == whole.stop_reason and streamed.usage.output_tokens == whole.usage.output_tokens
    assert streamed.usage.input_tokens == whole.usage.input_tokens


def test_tool_use_round_trip(client):
    first = client.messages.create(model="agent", max_tokens=256, tools=TOOLS,
                                   messages=[{"role": "user", "content": CALL_TEXT}])
    call = next(b for b in first.content if b.type == "tool_use")
    second = client.messages.create(model="agent", max_tokens=256, tools=TOOLS, messages=[
        {"role": "user", "content": CALL_TEXT},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}]}])
    assert second.content[0].text == "Sunny, 21 C" and second.stop_reason == "end_turn"  # the result reached it
    shown = client.messages.create(model="agent", max_tokens=512, tools=TOOLS, tool_choice={"type": "none"},
                                   messages=[{"role": "user", "content": CALL_TEXT},
                                             {"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                                               for b in first.content]},
                                             {"role": "user", "content": [
                                                 {"type": "tool_result", "tool_use_id": call.id,
                                                  "content": [{"type": "text", "text": "Sunny"}]},
                                                 {"type": "text", "text": "LIST_TOOLS"}]}])
    prompt = shown.content[0].text
    assert f"<call {call.id} get_weather " in prompt and f"<tool>Sunny<for {call.id}>" in prompt
    assert prompt.endswith("<user>LIST_TOOLS[get_weather]")


def test_count_tokens(client):
    messages = [{"role": "user", "content": "Hello there"}]
    counted = client.messages.count_tokens(model="agent", system="Be brief.", messages=messages)
    created = client.messages.create(model="agent", max_tokens=16, system="Be brief.", messages=messages)
    assert counted.input_tokens == created.usage.input_tokens > 0


def test_errors_in_anthropic_shape(client, server):
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="nope", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="agent", max_tokens=0, messages=[{"role": "user", "content": "x"}])
    assert info.value.body["error"]["type"] == "invalid_request_error" and "max_tokens" in info.value.message
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="agent", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert "image" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):  # tool_choice any needs structured output (a vLLM model)
        client.messages.create(model="agent", max_tokens=8, tools=TOOLS, tool_choice={"type": "any"},
                               messages=[{"role": "user", "content": "x"}])
    url = f"{server.base_url}/v1/messages"
    body = {"model": "agent", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
    refused = httpx.post(url, json=body, timeout=30)
    assert refused.status_code == 401 and refused.json()["type"] == "error"
    assert refused.json()["error"]["type"] == "authentication_error"
    assert httpx.post(url, json=body, headers={"x-api-key": "wrong"}, timeout=30).status_code == 401
    assert httpx.post(url, json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=30).status_code == 200
    # x-api-key is Anthropic's header, not the OpenAI routes'
    assert httpx.post(f"{server.base_url}/v1/chat/completions", headers={"x-api-key": KEY}, timeout=30,
                      json={"model": "agent", "messages": [{"role": "user", "content": "x"}]}).status_code == 401
    answer = httpx.post(url, content=b"{", headers={"x-api-key": KEY, "content-type": "application/json"}, timeout=30)
    assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error"
    # the queue deadline header of /v1/chat/completions (its 503 needs an engine: tests/e2e/test_fleet_hooks.py)
    answer = httpx.post(url, json=body, headers={"x-api-key": KEY, "x-request-timeout-ms": "-5"}, timeout=30)
    assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error"
    assert "x-request-timeout-ms" in answer.json()["error"]["message"]
    answer = httpx.post(url, json=body, headers={"x-api-key": KEY, "x-request-timeout-ms": "60000"}, timeout=30)
    assert answer.status_code == 200 and answer.json()["content"][0]["text"] == "x"


def test_disconnect_cancels_and_requests_are_counted(client, server):
    def stats(model: str) -> dict:
        answer = httpx.get(f"{server.base_url}/v2/models/{model}/stats", timeout=30).json()
        return answer["model_stats"][0]["inference_stats"]

    def failures() -> int:
        return stats("slow")["fail"]["count"]

    success = stats("agent")["success"]["count"]
    client.messages.create(model="agent", max_tokens=8, messages=[{"role": "user", "content": "count me"}])
    with client.messages.stream(model="agent", max_tokens=8, messages=[{"role": "user", "content": "me too"}]) as s:
        assert s.get_final_text() == "me too"
    assert stats("agent")["success"]["count"] == success + 2  # in the model's statistics, as chat's
    before = failures()
    with httpx.stream("POST", f"{server.base_url}/v1/messages", headers={"x-api-key": KEY}, timeout=30,
                      json={"model": "slow", "max_tokens": 500, "stream": True,
                            "messages": [{"role": "user", "content": "x"}]}) as response:
        lines = response.iter_lines()
        while "text_delta" not in next(lines):
            pass
    deadline = time.monotonic() + 10
    while failures() == before:  # a cancelled request is counted failed, as chat's
        assert time.monotonic() < deadline, "the generation was not cancelled"
        time.sleep(0.05)
