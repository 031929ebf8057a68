"""MCP tools run by the server for ``/v1/responses`` (OpenAI's remote MCP tool).

A request may name MCP servers among its ``tools``: ``{"type": "mcp", "server_label", "server_url",
"allowed_tools", "headers", "require_approval"}``. The server reaches only the URLs that
``--mcp-allow`` prefixes allow (:class:`McpSettings`; none by default: any MCP tool is then a 400 naming
its URL). For such a response :class:`ToolRounds` lists each server's tools (an ``mcp_list_tools`` output
item), offers them to the model as function tools beside the request's own, and generates; a call the
model's tool-call parser reads for an MCP tool becomes an ``mcp_call`` item, is run against its server
with the ``mcp`` SDK (streamable HTTP; SSE for a URL whose path ends in ``/sse``) and its result, as a
tool message, goes back to the model, which generates again, until it answers without MCP calls, calls
one of the client's function tools, or a limit ends the response (``max_tool_rounds``, the request's
``max_tool_calls``, ``max_output_tokens``). Every generation is streamed from the model, so a streamed
response and a whole one are built by the same code; the events are OpenAI's
(``response.mcp_list_tools.*``, ``response.mcp_call.*``, ``response.mcp_call_arguments.*``).

Approvals, as OpenAI's: a call of a tool that ``require_approval`` covers (``always``, the default, or a
``{"always": {...}, "never": {...}}`` filter of tool names and ``read_only``) is not run: it becomes an
``mcp_approval_request`` item and the response ends there. A later request answers it with an
``mcp_approval_response`` input item (``previous_response_id``, or the request item given back as input):
an approved call is run before the next generation (an ``mcp_call`` item with its ``approval_request_id``),
a declined one goes to the model as a call whose result says it was not approved (:func:`approved_calls`,
:func:`.protocol.to_messages`).

Each list or call opens its own MCP session (one HTTP exchange or a few), within :attr:`McpSettings.timeout_s`,
on the task that runs the response, so a client that leaves cancels it like the generation.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from ..chat_run import ChatRun, start
from ..errors import BadRequest, OpenAIError
from . import output
from .protocol import FunctionTool, ResponsesRequest, chat_request, new_id, renamed, to_messages

DEFAULT_MAX_TOOL_ROUNDS = 8
DEFAULT_TIMEOUT_S = 60.0
_BOUNDARY = "/?#"  # what may follow an allowed prefix that does not end in '/'
_DOT_SEGMENT = re.compile(r"/(\.|%2e){1,2}(/|\?|#|$)", re.IGNORECASE)
_UNSAFE = re.compile(r"[\\\s\x00-\x1f\x7f]")


@dataclass(frozen=True)
class McpSettings:
    """Which MCP servers ``/v1/responses`` may reach, and how far one response may go with them."""

    allow: tuple[str, ...] = ()
    """URL prefixes (``--mcp-allow``); a server URL must start with one, at a boundary of it. None: no MCP."""
    max_tool_rounds: int = DEFAULT_MAX_TOOL_ROUNDS
    """Most generations of one response whose MCP calls the server runs (``--mcp-max-tool-rounds``)."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Longest one list or call may take, connecting included."""

    def allows(self, url: str) -> bool:
        if not url.startswith(("http://", "https://")) or _DOT_SEGMENT.search(url) or _UNSAFE.search(url):
            return False  # a dot segment, backslash, space or control character could step out of the prefix
        for prefix in self.allow:
            if url.startswith(prefix) and (prefix.endswith("/") or len(url) == len(prefix)
                                           or url[len(prefix)] in _BOUNDARY):
                return True
        return False


@dataclass(frozen=True)
class ToolFilter:
    """Which tools a ``require_approval`` filter covers: ``tool_names`` (None: any name) and ``read_only`` (the
    tool's ``readOnlyHint`` annotation; None: either)."""

    names: frozenset[str] | None = None
    read_only: bool | None = None

    def covers(self, tool: dict) -> bool:
        if self.names is not None and tool["name"] not in self.names:
            return False
        return self.read_only is None or bool((tool.get("annotations") or {}).get("readOnlyHint")) == self.read_only


_EVERY_TOOL = ToolFilter()


@dataclass(eq=False)
class McpServer:
    """One ``{"type": "mcp"}`` entry of a request, and the tools listed from it."""

    index: int  # in the request's tools
    label: str
    url: str
    headers: dict[str, str]
    allowed: frozenset[str] | None  # tool names; None: all
    read_only: bool  # only tools annotated read-only
    always: ToolFilter | None = _EVERY_TOOL  # require_approval: the tools whose calls wait for an approval
    never: ToolFilter | None = None  # ... and those that never do (OpenAI's default: every call waits)
    tools: list[dict] = field(default_factory=list)  # name, description, input_schema, annotations
    list_id: str = field(default_factory=lambda: new_id("mcpl"))

    def list_item(self) -> dict:
        return {"id": self.list_id, "type": "mcp_list_tools", "server_label": self.label, "tools": self.tools,
                "error": None}

    def needs_approval(self, name: str) -> bool:
        tool = next((t for t in self.tools if t["name"] == name), {"name": name})
        if self.always is not None and self.always.covers(tool):
            return True
        return not (self.never is not None and self.never.covers(tool))


# -- the request's MCP tools --------------------------------------------------------------------------
def servers_of(tools: Any, settings: McpSettings) -> list[McpServer]:
    """The MCP servers a request's ``tools`` name (each checked; a 400 naming the field at fault)."""
    servers: list[McpServer] = []
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        if not isinstance(tool, dict) or tool.get("type") != "mcp":
            continue
        where = f"tools[{i}]"
        label, url = tool.get("server_label"), tool.get("server_url")
        if not isinstance(label, str) or not label:
            raise BadRequest(f"{where}: an MCP tool needs a 'server_label'", f"{where}.server_label")
        if tool.get("connector_id") is not None:
            raise BadRequest(f"{where}: connectors are not supported here; give the MCP server's 'server_url'",
                             f"{where}.connector_id")
        if not isinstance(url, str) or not url:
            raise BadRequest(f"{where}: an MCP tool needs a 'server_url'", f"{where}.server_url")
        if not settings.allows(url):
            raise BadRequest(f"{where}: the MCP server URL '{url}' is not allowed by this server (it reaches only "
                             "the URLs its --mcp-allow prefixes allow)", f"{where}.server_url")
        if any(s.label == label for s in servers):
            raise BadRequest(f"{where}: two MCP tools are labelled '{label}'", f"{where}.server_label")
        always, never = _approval(tool.get("require_approval"), where)
        allowed, read_only = _allowed(tool.get("allowed_tools"), where)
        servers.append(McpServer(i, label, url, _headers(tool, where), allowed, read_only, always, never))
    return servers


def _approval(value: Any, where: str) -> tuple[ToolFilter | None, ToolFilter | None]:
    """``require_approval`` as (the tools that always wait for an approval, those that never do): ``always``
    (also when left out, OpenAI's default), ``never``, or ``{"always": filter, "never": filter}``, each filter
    ``{"tool_names": [...], "read_only": bool}``; a tool neither covers waits."""
    if value is None or value == "always":
        return _EVERY_TOOL, None
    if value == "never":
        return None, _EVERY_TOOL
    if isinstance(value, dict) and set(value) <= {"always", "never"}:
        return (_tool_filter(value.get("always"), f"{where}.require_approval.always"),
                _tool_filter(value.get("never"), f"{where}.require_approval.never"))
    raise BadRequest(f"{where}: require_approval must be 'always', 'never' or {{'always': {{...}}, 'never': {{...}}}}",
                     f"{where}.require_approval")


def _tool_filter(value: Any, where: str) -> ToolFilter | None:
    if value is None:
        return None
    names = value.get("tool_names") if isinstance(value, dict) else None
    read_only = value.get("read_only") if isinstance(value, dict) else None
    if not isinstance(value, dict) or set(value) - {"tool_names", "read_only"} or not (
            names is None or (isinstance(names, list) and all(isinstance(n, str) for n in names))) \
            or not (read_only is None or isinstance(read_only, bool)):
        raise BadRequest(f"{where} must be {{'tool_names': [names], 'read_only': true|false}}", where)
    return ToolFilter(frozenset(names) if names is not None else None, read_only)


def approved_calls(items: list[dict], requests: dict[str, dict], servers: list[McpServer]) -> list[dict]:
    """The approval requests that this request's ``mcp_approval_response`` items approve (``requests``: the
    approval requests of the conversation by id); an answer to an unknown request, or to a server that is not
    among the request's tools, is a 400."""
    approved = []
    for i, item in enumerate(items):
        if item["type"] != "mcp_approval_response":
            continue
        request = requests.get(item["approval_request_id"])
        if request is None:
            raise BadRequest(f"input[{i}]: no MCP approval request '{item['approval_request_id']}' in this "
                             "conversation", f"input[{i}].approval_request_id")
        if not any(s.label == request["server_label"] for s in servers):
            raise BadRequest(f"input[{i}]: the call to approve is one of MCP server '{request['server_label']}', "
                             "which is not among the request's tools", "tools")
        if item["approve"]:
            approved.append(request)
    return approved


def _allowed(value: Any, where: str) -> tuple[frozenset[str] | None, bool]:
    if value is None:
        return None, False
    if isinstance(value, list) and all(isinstance(name, str) for name in value):
        return (None if "*" in value else frozenset(value)), False
    if isinstance(value, dict):
        names = value.get("tool_names")
        if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise BadRequest(f"{where}: allowed_tools.tool_names must be a list of names",
                             f"{where}.allowed_tools.tool_names")
        return (frozenset(names) if names is not None and "*" not in names else None), bool(value.get("read_only"))
    raise BadRequest(f"{where}: allowed_tools must be a list of tool names or {{'tool_names': [...]}}",
                     f"{where}.allowed_tools")


def _headers(tool: dict, where: str) -> dict[str, str]:
    headers = tool.get("headers") or {}
    if not isinstance(headers, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
        raise BadRequest(f"{where}: headers must be an object of strings", f"{where}.headers")
    headers = dict(headers)
    token = tool.get("authorization")
    if isinstance(token, str) and token:
        headers["Authorization"] = f"Bearer {token}"
    return headers


# -- talking to an MCP server ---------------------------------------------------------------------------
@asynccontextmanager
async def _session(server: McpServer, timeout_s: float):
    import httpx2
    from mcp import Client
    from mcp.client.sse import sse_client
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    if server.url.split("?", 1)[0].rstrip("/").endswith("/sse"):
        async with Client(sse_client(server.url, headers=server.headers, timeout=timeout_s,
                                     sse_read_timeout=timeout_s), cache=None,
                          read_timeout_seconds=timeout_s) as client:
            yield client
        return
    async with create_mcp_http_client(headers=server.headers, timeout=httpx2.Timeout(timeout_s)) as http, \
            Client(streamable_http_client(server.url, http_client=http), cache=None,
                   read_timeout_seconds=timeout_s) as client:
        yield client


def _first_error(exc: BaseException) -> BaseException:
    """The error inside the SDK's task-group exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _describe(exc: BaseException) -> str:
    exc = _first_error(exc)
    if isinstance(exc, TimeoutError):
        return "no answer in time"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def list_tools(server: McpServer, settings: McpSettings) -> None:
    """Fill ``server.tools`` (the allowed ones); a server that cannot list them fails the request (424, as
    OpenAI answers it)."""
    try:
        async with asyncio.timeout(settings.timeout_s), _session(server, settings.timeout_s) as client:
            listed, cursor = [], None
            for _ in range(100):  # pages
                page = await client.list_tools(cursor=cursor)
                listed.extend(page.tools)
                cursor = page.next_cursor
                if cursor is None:
                    break
    except Exception as exc:  # the SDK raises what its transport raised, often in an exception group
        raise OpenAIError(f"Error retrieving tool list from MCP server: '{server.label}' ({_describe(exc)})", 424,
                          f"tools[{server.index}]") from None
    for tool in listed:
        annotations = tool.annotations.model_dump(by_alias=True, exclude_none=True) if tool.annotations else None
        if server.allowed is not None and tool.name not in server.allowed:
            continue
        if server.read_only and not (annotations or {}).get("readOnlyHint"):
            continue
        server.tools.append({"name": tool.name, "description": tool.description, "input_schema": tool.input_schema,
                             "annotations": annotations})


async def call_tool(server: McpServer, name: str, arguments: str, settings: McpSettings) -> tuple[str | None, dict | None]:
    """Run one call: ``(output, None)`` or ``(None, error)`` with ``error`` in OpenAI's shape (a protocol error,
    the tool's own error, or an HTTP error: ``code`` the status, 502 when the server gave none)."""
    from mcp import MCPError

    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except ValueError as exc:
        parsed, message = None, f"the arguments are not JSON: {exc}"
    else:
        message = "the arguments must be a JSON object"
    if not isinstance(parsed, dict):
        return None, {"type": "mcp_protocol_error", "code": -32602, "message": message}
    try:
        async with asyncio.timeout(settings.timeout_s), _session(server, settings.timeout_s) as client:
            result = await client.call_tool(name, parsed)
    except Exception as exc:
        found = _first_error(exc)
        if isinstance(found, MCPError):
            return None, {"type": "mcp_protocol_error", "code": found.code, "message": found.message}
        status = getattr(getattr(found, "response", None), "status_code", None)
        return None, {"type": "http_error", "code": status if isinstance(status, int) else 502,
                      "message": _describe(found)}
    blocks = [block.model_dump(by_alias=True, exclude_none=True) for block in result.content]
    if result.is_error:
        return None, {"type": "mcp_tool_execution_error", "content": blocks}
    texts = [b["text"] if b.get("type") == "text" else json.dumps(b) for b in blocks]
    if not texts and result.structured_content is not None:
        texts = [json.dumps(result.structured_content)]
    return "\n".join(texts), None


# -- the generations of one response --------------------------------------------------------------------------
def call_item(item_id: str, server_label: str, name: str, arguments: str, status: str, output_text: str | None = None,
              error: dict | None = None) -> dict:
    return {"id": item_id, "type": "mcp_call", "server_label": server_label, "name": name, "arguments": arguments,
            "output": output_text, "error": error, "status": status, "approval_request_id": None}


def approval_item(item_id: str, server_label: str, name: str, arguments: str) -> dict:
    return {"id": item_id, "type": "mcp_approval_request", "server_label": server_label, "name": name,
            "arguments": arguments}


class ToolRounds:
    """One response with MCP tools: the tool lists, then generations and the MCP calls between them.

    :meth:`begin` lists the tools and starts the first generation (so those errors are plain HTTP errors);
    :meth:`events` yields every event after ``response.in_progress`` (without ``sequence_number``) and leaves
    the output in :attr:`items`, the summed token counts in :attr:`usage` and the finish in :attr:`reason`
    (``stop``, ``length``, or ``max_tool_calls`` when a limit left calls unrun)."""

    def __init__(self, server, request: ResponsesRequest, llm, messages: list[dict],
                 servers: list[McpServer], settings: McpSettings, response_id: str, timeout_us: int = 0,
                 approved: list[dict] | None = None) -> None:
        self.server = server
        self.request = request
        self.llm = llm
        self.messages = list(messages)
        self.servers = servers
        self.settings = settings
        self.response_id = response_id
        self.timeout_us = timeout_us  # the queue deadline (x-request-timeout-ms) of the first generation
        self.items: list[dict] = []
        self.usage: dict | None = None
        self.reason = "stop"
        self._by_tool: dict[str, McpServer] = {}
        self._run: ChatRun | None = None
        self._round = 0
        self._round_items: list[dict] = []  # the last generation's items
        self._calls_run = 0
        self._approved = approved or []  # approval requests approved by this request: run before generating
        self._approved_calls: list[dict] = []  # ... their mcp_call items

    async def begin(self) -> None:
        await asyncio.gather(*(list_tools(s, self.settings) for s in self.servers))
        own = {t.name for t in self.request.tools if t.type == "function"}
        for server in self.servers:
            for tool in server.tools:
                other = self._by_tool.get(tool["name"])
                if other is not None or tool["name"] in own:
                    by = f"MCP server '{other.label}'" if other is not None else "a function tool of the request"
                    raise BadRequest(f"tool '{tool['name']}' of MCP server '{server.label}' has the name of a tool of "
                                     f"{by}; narrow allowed_tools", f"tools[{server.index}].allowed_tools")
                self._by_tool[tool["name"]] = server
        for request in self._approved:
            server = self._by_tool.get(request["name"])
            if server is None or server.label != request["server_label"]:
                raise BadRequest(f"the approved call of '{request['name']}' is not one of the tools MCP server "
                                 f"'{request['server_label']}' lists now (allowed_tools)", "tools")
            self._calls_run += 1
            result, error = await call_tool(server, request["name"], request["arguments"], self.settings)
            call = call_item(new_id("mcp"), server.label, request["name"], request["arguments"],
                             "failed" if error else "completed", result, error)
            call["approval_request_id"] = request["id"]
            self._approved_calls.append(call)
        self.messages += to_messages(self._approved_calls)
        self._run = await self._start()

    async def close(self) -> None:
        if self._run is not None:
            await self._run.close()

    def _chat(self):
        """The chat request of the next generation: the request's function tools and the listed MCP tools; the
        request's ``tool_choice`` on the first generation only, ``auto`` after; what is left of
        ``max_output_tokens``."""
        request = self.request
        tools = [t for t in request.tools if t.type == "function"]
        tools += [FunctionTool(type="function", name=t["name"], description=t["description"],
                               parameters=t["input_schema"]) for s in self.servers for t in s.tools]
        choice: Any = request.tool_choice if self._round == 0 else "auto"
        if isinstance(choice, dict) and choice.get("type") == "mcp":
            if not isinstance(choice.get("name"), str):
                raise BadRequest("tool_choice of type 'mcp' needs the tool's 'name' here", "tool_choice")
            choice = {"type": "function", "name": choice["name"]}
        remaining = request.max_output_tokens
        if remaining is not None and self.usage is not None:
            remaining -= self.usage["output_tokens"]
        copy = request.model_copy(update={"tools": tools, "tool_choice": choice, "max_output_tokens": remaining})
        return chat_request(copy, self.messages, True)

    async def _start(self) -> ChatRun:
        request_id = self.response_id if self._round == 0 else f"{self.response_id}-{self._round}"
        try:
            return await start(self.server, self._chat(), self.llm, stream=True, request_id=request_id,
                               max_tokens_field="max_output_tokens",
                               timeout_us=self.timeout_us if self._round == 0 else 0)
        except OpenAIError as exc:
            raise renamed(exc) from None

    async def events(self) -> AsyncIterator[dict]:
        for server in self.servers:
            index, item = len(self.items), server.list_item()
            yield {"type": "response.output_item.added", "output_index": index, "item": {**item, "tools": []}}
            yield {"type": "response.mcp_list_tools.in_progress", "item_id": server.list_id, "output_index": index}
            yield {"type": "response.mcp_list_tools.completed", "item_id": server.list_id, "output_index": index}
            yield {"type": "response.output_item.done", "output_index": index, "item": item}
            self.items.append(item)
        for call in self._approved_calls:  # run in begin(), before the first generation
            index = len(self.items)
            yield {"type": "response.output_item.added", "output_index": index,
                   "item": {**call, "output": None, "error": None, "status": "in_progress"}}
            yield {"type": "response.mcp_call.in_progress", "item_id": call["id"], "output_index": index}
            yield {"type": "response.mcp_call.failed" if call["error"] else "response.mcp_call.completed",
                   "item_id": call["id"], "output_index": index}
            yield {"type": "response.output_item.done", "output_index": index, "item": call}
            self.items.append(call)
        while True:
            pending: list[dict] = []
            async for event in self._generate(pending):
                yield event
            if not pending:
                return
            limited = self._round >= self.settings.max_tool_rounds
            for item in pending:
                index = self.items.index(item)
                limit = self.request.max_tool_calls
                if limited or (limit is not None and self._calls_run >= limit):
                    item["status"] = "incomplete"
                    self.reason = "max_tool_calls"
                else:
                    self._calls_run += 1
                    server = self._by_tool[item["name"]]
                    result, error = await call_tool(server, item["name"], item["arguments"], self.settings)
                    item.update(output=result, error=error, status="failed" if error else "completed")
                    yield {"type": "response.mcp_call.failed" if error else "response.mcp_call.completed",
                           "item_id": item["id"], "output_index": index}
                yield {"type": "response.output_item.done", "output_index": index, "item": item}
            if self.reason != "stop" or any(i["type"] in ("function_call", "mcp_approval_request")
                                            for i in self._round_items):
                return  # a limit, a call of the client's own tools or one to approve: the client answers it
            self.messages += to_messages(self._round_items)
            self._round += 1
            self._run = await self._start()

    async def _generate(self, pending: list[dict]) -> AsyncIterator[dict]:
        """One generation's events; its MCP calls (not run yet) go to ``pending``, its items to :attr:`items`."""
        run = self._run
        assert run is not None
        stream, translate = output.OutputStream(), _Translate(len(self.items), self._by_tool)
        usage = run.usage()
        reasoning: list[str] = []
        reason = None
        try:
            async for delta, reason in run.deltas(usage):
                if delta.get("reasoning"):
                    reasoning.append(delta["reasoning"])
                for event in stream.feed(delta):
                    for out in translate.events(event):
                        yield out
        except OpenAIError:
            for event in stream.finish("error"):
                for out in translate.events(event):
                    yield out
            self.items += translate.items(stream.items)
            raise
        finally:
            await run.close()
            self._run = None
        for event in stream.finish(reason):
            for out in translate.events(event):
                yield out
        self._round_items = translate.items(stream.items)
        self.items += self._round_items
        self.usage = _add(self.usage, output.usage_doc(run, usage, "".join(reasoning)))
        if reason == "length":
            self.reason = "length"
        pending += [item for item in self._round_items if item["type"] == "mcp_call"]
        if reason == "length":
            for item in pending:
                item["status"] = "incomplete"
            pending.clear()


def _add(total: dict | None, usage: dict) -> dict:
    """Token counts of two generations, summed."""
    if total is None:
        return usage
    return {"input_tokens": total["input_tokens"] + usage["input_tokens"],
            "input_tokens_details": {"cached_tokens": total["input_tokens_details"]["cached_tokens"]
                                     + usage["input_tokens_details"]["cached_tokens"]},
            "output_tokens": total["output_tokens"] + usage["output_tokens"],
            "output_tokens_details": {"reasoning_tokens": total["output_tokens_details"]["reasoning_tokens"]
                                      + usage["output_tokens_details"]["reasoning_tokens"]},
            "total_tokens": total["total_tokens"] + usage["total_tokens"]}


class _Translate:
    """One generation's events as the response numbers them (its items after ``offset`` earlier ones), with
    the function calls of MCP tools turned into ``mcp_call`` items: ``response.mcp_call.in_progress`` after
    the item is added, ``response.mcp_call_arguments.delta`` / ``.done``; the item's ``output_item.done``
    waits until the call has run. A call that waits for an approval becomes an ``mcp_approval_request`` item,
    with no events between its ``output_item.added`` and ``.done``."""

    def __init__(self, offset: int, by_tool: dict[str, McpServer]) -> None:
        self.offset = offset
        self.by_tool = by_tool
        self.calls: dict[str, dict] = {}  # function-call item id -> its mcp_call item
        self.approvals: dict[str, dict] = {}  # function-call item id -> its mcp_approval_request item

    def _item(self, item: dict) -> dict:
        """The mcp_call or mcp_approval_request item of a function call of an MCP tool (made once)."""
        made = self.calls.get(item["id"]) or self.approvals.get(item["id"])
        if made is None:
            server = self.by_tool[item["name"]]
            if server.needs_approval(item["name"]):
                made = self.approvals[item["id"]] = approval_item(new_id("mcpr"), server.label, item["name"], "")
            else:
                made = self.calls[item["id"]] = call_item(new_id("mcp"), server.label, item["name"], "",
                                                          "in_progress")
        return made

    def events(self, event: dict) -> list[dict]:
        if "output_index" in event:
            event["output_index"] += self.offset
        kind = event["type"]
        item = event.get("item")
        if kind == "response.output_item.added" and item["type"] == "function_call" and item["name"] in self.by_tool:
            made = self._item(item)
            if made["type"] == "mcp_approval_request":
                return [{**event, "item": dict(made)}]
            return [{**event, "item": dict(made)},
                    {"type": "response.mcp_call.in_progress", "item_id": made["id"], "output_index": event["output_index"]}]
        item_id = item["id"] if item is not None else event.get("item_id")
        approval = self.approvals.get(item_id)
        if approval is not None:
            if kind != "response.output_item.done":
                return []
            approval["arguments"] = item["arguments"]
            return [{**event, "item": approval}]
        call = self.calls.get(item_id)
        if call is None:
            return [event]
        if kind == "response.function_call_arguments.delta":
            return [{"type": "response.mcp_call_arguments.delta", "item_id": call["id"],
                     "output_index": event["output_index"], "delta": event["delta"]}]
        if kind == "response.function_call_arguments.done":
            call["arguments"] = event["arguments"]
            return [{"type": "response.mcp_call_arguments.done", "item_id": call["id"],
                     "output_index": event["output_index"], "arguments": event["arguments"]}]
        return []  # the call's output_item.done: sent once it has run

    def items(self, items: list[dict]) -> list[dict]:
        """The generation's finished items: MCP calls as their ``mcp_call`` items (status ``calling``) or
        ``mcp_approval_request`` items."""
        found = []
        for item in items:
            if item["type"] == "function_call" and item["name"] in self.by_tool:
                made = self._item(item)
                made["arguments"] = item["arguments"]
                if made["type"] == "mcp_call":
                    made["status"] = "calling"
                item = made
            found.append(item)
        return found
