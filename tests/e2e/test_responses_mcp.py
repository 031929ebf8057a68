"""MCP tools run by the server on ``/v1/responses``, driven by the official ``openai`` client.

An MCP server made with the ``mcp`` SDK runs in this process (``MCPServer`` over streamable HTTP, and over SSE,
on 127.0.0.1): ``add`` adds two numbers, ``multiply`` is left out by ``allowed_tools``, ``fail`` raises. The
model is the scripted toy (``tests/openai_models/scripted.py``): it writes the last message of its prompt, so a
user message holding a hermes ``<tool_call>`` to ``add`` makes it call the tool; its chat template answers a
tool result with ``The sum is <result>.``, so the final text shows that the tool's answer reached the model's
context, and ``LIST_TOOLS`` shows the whole prompt. Covered: the ``mcp_list_tools`` and ``mcp_call`` items,
the streamed events rebuilding the whole response, a failing tool, the request's ``max_tool_calls``, a
conversation continued after MCP calls, the headers sent, SSE, approvals (``mcp_approval_request`` items, approved
and declined ``mcp_approval_response`` inputs, filters), and the refusals (a URL outside ``--mcp-allow``, bad tools
and approval responses, an unreachable server).
"""

from __future__ import annotations

import json
import shutil
import threading
import time

import httpx
import openai
import pytest
from agent_fixtures import TOY, _parameter, byte_tokenizer
from support import free_port, start_server

mcp_server = pytest.importorskip("mcp.server.mcpserver")
uvicorn = pytest.importorskip("uvicorn")

TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<call {{ c.function.name }} {{ c.function.arguments | tojson }}>{% endfor %}"
    "{% endfor %}{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}|"
    "{% if messages[-1].role == 'tool' %}The sum is {{ messages[-1].content }}.{% else %}{{ messages[-1].content }}"
    "{% endif %}")


def _call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


class _McpServer:
    """The MCP server of these tests, on its own thread; ``headers``: what each HTTP request carried."""

    def __init__(self) -> None:
        server = mcp_server.MCPServer("calc", log_level="WARNING")

        @server.tool()
        def add(a: int, b: int) -> int:
            """Add two numbers."""
            return a + b

        @server.tool()
        def multiply(a: int, b: int) -> int:
            """Multiply two numbers."""
            return a * b

        @server.tool()
        def fail(reason: str) -> str:
            """Always fails."""
            raise ValueError(reason)

        self.headers: list[dict[str, str]] = []
        self.port = free_port()
        self.sse_port = free_port()
        self._servers = [self._serve(server.streamable_http_app(), self.port),
                         self._serve(server.sse_app(), self.sse_port)]

    def _serve(self, app, port: int):
        async def recording(scope, receive, send):
            if scope["type"] == "http":
                self.headers.append({k.decode(): v.decode() for k, v in scope["headers"]})
            await app(scope, receive, send)

        server = uvicorn.Server(uvicorn.Config(recording, host="127.0.0.1", port=port, log_level="warning",
                                               lifespan="on"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the MCP server did not start"
            time.sleep(0.05)
        return server, thread

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    @property
    def sse_url(self) -> str:
        return f"http://127.0.0.1:{self.sse_port}/sse"

    def stop(self) -> None:
        for server, thread in self._servers:
            server.should_exit = True
            thread.join(10)


@pytest.fixture(scope="module")
def calc():
    running = _McpServer()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def dead_port():
    return free_port()  # allowed, but nothing listens there


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    root = tmp_path_factory.mktemp("mcp_repo") / "models"
    model = root / "agent"
    (model / "1").mkdir(parents=True)
    shutil.copy(TOY / "scripted.py", model / "1" / "model.py")
    byte_tokenizer(model / "tokenizer")
    config = "\n".join(line for line in (TOY / "scripted.pbtxt").read_text().splitlines() if "chat_template" not in line)
    (model / "config.pbtxt").write_text('name: "agent"\n' + config + "\n" + _parameter("chat_template", TEMPLATE)
                                        + _parameter("tool_call_parser", "hermes")
                                        + _parameter("tokenizer_dir", "tokenizer"))
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory, repository, calc, dead_port):
    tmp = tmp_path_factory.mktemp("mcp")
    running = start_server([repository], "--response-store", str(tmp / "responses.sqlite3"),
                           "--mcp-allow", f"http://127.0.0.1:{calc.port}/mcp", "--mcp-allow", calc.sse_url,
                           "--mcp-allow", f"http://127.0.0.1:{dead_port}/", tmp_dir=tmp)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _tool(url: str, **extra) -> dict:
    return {"type": "mcp", "server_label": "calc", "server_url": url, "allowed_tools": ["add", "fail"],
            "require_approval": "never", **extra}


def _without_ids(value):
    """``value`` with generated ids and times blanked; the client's own ``parsed`` (a streamed response's) left out."""
    if isinstance(value, dict):
        return {k: (None if k in ("id", "created_at", "item_id") else _without_ids(v)) for k, v in value.items()
                if k != "parsed"}
    if isinstance(value, list):
        return [_without_ids(v) for v in value]
    return value


# -- a round trip ----------------------------------------------------------------------------------------
def test_mcp_call_result_reaches_the_model(client, calc):
    calls_before = len(calc.headers)
    response = client.responses.create(model="agent", input=_call("add", a=2, b=3),
                                       tools=[_tool(calc.url, headers={"X-Calc-Key": "k1"})])
    assert response.status == "completed"
    assert [item.type for item in response.output] == ["mcp_list_tools", "mcp_call", "message"]
    listing, call, message = response.output
    assert listing.server_label == "calc" and listing.error is None
    assert [tool.name for tool in listing.tools] == ["add", "fail"]  # multiply: not in allowed_tools
    add = listing.tools[0]
    assert add.description == "Add two numbers." and add.input_schema["required"] == ["a", "b"]
    assert (call.name, call.server_label, call.status) == ("add", "calc", "completed")
    assert json.loads(call.arguments) == {"a": 2, "b": 3}
    assert call.output == "5" and call.error is None and call.id.startswith("mcp_")
    # the tool's answer was in the prompt of the second generation
    assert response.output_text == "The sum is 5."
    # usage: both generations (one token per byte)
    first = "<user>" + _call("add", a=2, b=3) + "[add][fail]|" + _call("add", a=2, b=3)
    second = ("<user>" + _call("add", a=2, b=3) + '<assistant><call add {"a": 2, "b": 3}><tool>5[add][fail]|'
              "The sum is 5.")
    assert response.usage.input_tokens == len(first.encode()) + len(second.encode())
    assert response.usage.output_tokens == len(_call("add", a=2, b=3).encode()) + len(b"The sum is 5.")
    # the tool's headers went to the MCP server, and are not echoed back
    assert any(h.get("x-calc-key") == "k1" for h in calc.headers[calls_before:])
    assert response.tools[0].headers is None


def test_streamed_events_rebuild_the_response(client, calc):
    kwargs = {"model": "agent", "input": _call("add", a=20, b=22), "tools": [_tool(calc.url)], "store": False}
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds[2:6] == ["response.output_item.added", "response.mcp_list_tools.in_progress",
                          "response.mcp_list_tools.completed", "response.output_item.done"]
    at = kinds.index("response.mcp_call.in_progress")
    assert kinds[at - 1] == "response.output_item.added" and events[at - 1].item.type == "mcp_call"
    call_events = [k for k in kinds[at:] if "mcp_call" in k]
    assert call_events[0] == "response.mcp_call.in_progress" and "response.mcp_call_arguments.delta" in call_events
    assert call_events[-2:] == ["response.mcp_call_arguments.done", "response.mcp_call.completed"]
    done = next(e for e in events if e.type == "response.mcp_call_arguments.done")
    deltas = "".join(e.delta for e in events if e.type == "response.mcp_call_arguments.delta")
    assert json.loads(done.arguments) == json.loads(deltas) == {"a": 20, "b": 22}
    items = [e.item for e in events if e.type == "response.output_item.done"]
    final = events[-1].response
    assert _without_ids([i.model_dump() for i in items]) == _without_ids([i.model_dump() for i in final.output])
    assert final.output[1].output == "42" and final.output_text == "The sum is 42."
    assert _without_ids(final.model_dump()) == _without_ids(whole.model_dump())


def test_failing_tool(client, calc):
    response = client.responses.create(model="agent", input=_call("fail", reason="nope"), tools=[_tool(calc.url)])
    _, call, message = response.output
    assert call.status == "failed" and call.output is None
    assert call.error.type == "mcp_tool_execution_error"
    assert response.output_text.startswith("The sum is Error: ")  # the model read the error


def test_max_tool_calls_leaves_calls_unrun(client, calc):
    response = client.responses.create(model="agent", input=_call("add", a=1, b=1) + _call("add", a=2, b=2),
                                       tools=[_tool(calc.url)], max_tool_calls=1)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_tool_calls"
    kinds = [(item.type, getattr(item, "status", None)) for item in response.output]
    assert kinds == [("mcp_list_tools", None), ("mcp_call", "completed"), ("mcp_call", "incomplete")]
    assert response.output[1].output == "2" and response.output[2].output is None


def test_conversation_continues_after_mcp_calls(client, calc):
    first = client.responses.create(model="agent", input=_call("add", a=4, b=5), tools=[_tool(calc.url)])
    assert first.output_text == "The sum is 9."
    second = client.responses.create(model="agent", previous_response_id=first.id, input="LIST_TOOLS")
    assert second.output_text == ("<user>" + _call("add", a=4, b=5) + '<assistant><call add {"a": 4, "b": 5}>'
                                  "<tool>9<assistant>The sum is 9.<user>LIST_TOOLS")


def test_sse_transport(client, calc):
    response = client.responses.create(model="agent", input=_call("add", a=7, b=8), tools=[_tool(calc.sse_url)])
    assert response.output[1].output == "15" and response.output_text == "The sum is 15."


# -- refusals --------------------------------------------------------------------------------------------
def test_url_outside_mcp_allow_is_refused(client, calc):
    for url in (f"http://127.0.0.1:{calc.port}/other", f"http://127.0.0.1:{calc.port}/mcp/../admin",
                "http://example.com/mcp"):
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model="agent", input="hi", tools=[_tool(url)])
        error = caught.value.body
        assert caught.value.status_code == 400 and url in error["message"] and "--mcp-allow" in error["message"]
        assert error["param"] == "tools[0].server_url" and error["type"] == "BadRequestError"


def test_refused_without_mcp_allow(tmp_path_factory, repository, calc):
    """A server without --mcp-allow refuses every MCP server."""
    tmp = tmp_path_factory.mktemp("mcp_closed")
    closed = start_server([repository], "--response-store", ":memory:", tmp_dir=tmp)
    try:
        answer = httpx.post(f"{closed.base_url}/v1/responses", timeout=30, json={
            "model": "agent", "input": "hi", "tools": [_tool(calc.url)]})
    finally:
        closed.stop()
    assert answer.status_code == 400 and calc.url in answer.json()["error"]["message"]


def test_bad_tools_are_refused(server, calc):
    for tool, param in ((_tool(calc.url, require_approval="sometimes"), "tools[0].require_approval"),
                        (_tool(calc.url, require_approval={"always": {"tool_names": "add"}}),
                         "tools[0].require_approval.always"),
                        ({"type": "mcp", "server_url": calc.url, "require_approval": "never"}, "tools[0].server_label"),
                        (_tool(calc.url, allowed_tools="add"), "tools[0].allowed_tools")):
        answer = httpx.post(f"{server.base_url}/v1/responses", timeout=30,
                            json={"model": "agent", "input": "hi", "tools": [tool]})
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == param


# -- approvals ---------------------------------------------------------------------------------------------------
def _approval(request_id: str, approve: bool, **extra) -> dict:
    return {"type": "mcp_approval_response", "approval_request_id": request_id, "approve": approve, **extra}


def test_approval_request_then_approved_call(client, calc):
    """require_approval left out (OpenAI's default: always): the call waits; approving it runs it."""
    tool = {**_tool(calc.url)}
    del tool["require_approval"]
    first = client.responses.create(model="agent", input=_call("add", a=2, b=3), tools=[tool])
    assert first.status == "completed"
    assert [item.type for item in first.output] == ["mcp_list_tools", "mcp_approval_request"]
    request = first.output[1]
    assert (request.name, request.server_label) == ("add", "calc") and request.id.startswith("mcpr_")
    assert json.loads(request.arguments) == {"a": 2, "b": 3}
    second = client.responses.create(model="agent", previous_response_id=first.id, tools=[tool],
                                     input=[_approval(request.id, True)])
    assert [item.type for item in second.output] == ["mcp_list_tools", "mcp_call", "message"]
    call = second.output[1]
    assert call.approval_request_id == request.id and call.output == "5" and call.status == "completed"
    assert second.output_text == "The sum is 5."  # the result reached the model
    # the conversation goes on with the call and its result (the request itself is not rendered)
    third = client.responses.create(model="agent", previous_response_id=second.id, input="LIST_TOOLS")
    assert third.output_text == ("<user>" + _call("add", a=2, b=3) + '<assistant><call add {"a": 2, "b": 3}>'
                                 "<tool>5<assistant>The sum is 5.<user>LIST_TOOLS")


def test_declined_call_and_approval_filters(client, calc):
    # a filter: add never waits, every other tool does (fail included)
    tool = _tool(calc.url, require_approval={"never": {"tool_names": ["add"]}})
    response = client.responses.create(model="agent", input=_call("add", a=1, b=2) + _call("fail", reason="x"),
                                       tools=[tool])
    assert [item.type for item in response.output] == ["mcp_list_tools", "mcp_call", "mcp_approval_request"]
    assert response.output[1].output == "3" and response.output[2].name == "fail"
    # declined, given back without previous_response_id: the model reads that it was not approved
    request = response.output[2].model_dump()
    declined = client.responses.create(model="agent", tools=[tool], input=[
        {"role": "user", "content": "go"}, request, _approval(request["id"], False, reason="not now")])
    assert [item.type for item in declined.output] == ["mcp_list_tools", "message"]
    assert declined.output_text == "The sum is Error: the user did not approve this call: not now."
    # streamed: the request item has only its added and done events
    with client.responses.stream(model="agent", input=_call("fail", reason="y"), tools=[tool], store=False) as stream:
        events = list(stream)
    added = [e for e in events if e.type == "response.output_item.added" and e.item.type == "mcp_approval_request"]
    [done] = [e for e in events if e.type == "response.output_item.done" and e.item.type == "mcp_approval_request"]
    assert len(added) == 1 and json.loads(done.item.arguments) == {"reason": "y"}
    kinds = [e.type for e in events]
    assert not any("mcp_call" in k for k in kinds) and kinds[-1] == "response.completed"
    assert [i.type for i in events[-1].response.output] == ["mcp_list_tools", "mcp_approval_request"]


def test_bad_approval_responses(server, calc):
    url = f"{server.base_url}/v1/responses"
    for item, tools, param in ((_approval("mcpr_unknown", True), [_tool(calc.url)], "input[0].approval_request_id"),
                               (_approval("mcpr_x", "yes"), [_tool(calc.url)], "input[0].approve"),
                               ({"type": "mcp_approval_response", "approve": True}, [_tool(calc.url)],
                                "input[0].approval_request_id")):
        answer = httpx.post(url, timeout=30, json={"model": "agent", "input": [item], "tools": tools})
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == param
    request = {"type": "mcp_approval_request", "id": "mcpr_1", "server_label": "calc", "name": "add",
               "arguments": "{}"}
    answer = httpx.post(url, timeout=30, json={"model": "agent", "input": [request, _approval("mcpr_1", True)]})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "tools"  # its server is not in tools


def test_unreachable_server(server, dead_port):
    url = f"http://127.0.0.1:{dead_port}/mcp"
    for stream in (False, True):
        answer = httpx.post(f"{server.base_url}/v1/responses", timeout=90,
                            json={"model": "agent", "input": "hi", "stream": stream, "tools": [_tool(url)]})
        assert answer.status_code == 424, answer.text
        error = answer.json()["error"]
        assert "Error retrieving tool list from MCP server: 'calc'" in error["message"] and error["param"] == "tools[0]"


def test_background(client, calc):
    queued = client.responses.create(model="agent", input=_call("add", a=1, b=2), tools=[_tool(calc.url)],
                                     background=True)
    assert queued.status == "queued"
    deadline = time.monotonic() + 60
    done = queued
    while done.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.1)
        done = client.responses.retrieve(queued.id)
    assert done.status == "completed" and done.output_text == "The sum is 3."
    assert [item.type for item in done.output] == ["mcp_list_tools", "mcp_call", "message"]
    assert done.output[1].output == "3"
