"""``/v1/responses``: create (whole, streamed or in the background), retrieve, delete, cancel, input items.

A create request becomes one chat generation (:mod:`..chat_run`) on the conversation it continues:
``instructions`` as the system message, then, with ``previous_response_id``, the stored conversation of
that response and its output, then this request's input items. The answer is a ``response`` object
(:mod:`.output`); streaming sends OpenAI's event sequence (``response.created``, ``response.in_progress``,
the output items' events, ``response.completed`` or ``response.failed``), each ``event: <type>`` with a
``sequence_number``. With ``store`` (the default) the response, its input items and its conversation
are written to the response store (:mod:`.store`, SQLite), so ``previous_response_id`` works after a
restart. ``background`` answers at once (``queued``) and generates in a task of this process; ``cancel``
marks the stored response ``cancelled``, and the task (in whichever frontend process runs it) stops
within :data:`CANCEL_POLL_S`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import urllib.parse
from dataclasses import dataclass, field

import orjson

from ...errors import ServerError
from ..chat_completion.output import ChoiceStream, merge
from ..chat_run import ChatRun, start
from ..errors import BadRequest, OpenAIError
from ..http import EventStream, request_received_ns, request_timeout_us
from ..protocol import parse
from . import mcp, output
from .protocol import ResponsesRequest, chat_request, input_items, new_id, renamed, to_messages
from .store import ResponseStore, Stored

log = logging.getLogger(__name__)

CANCEL_POLL_S = 0.25  # how often a background response looks for a cancel made by another process
_RUNNING = ("queued", "in_progress")


@dataclass(eq=False)
class Responses:
    """What the ``/v1/responses`` routes share: the store and this process's background tasks."""

    store: ResponseStore
    tasks: dict[str, asyncio.Task] = field(default_factory=dict)
    mcp: mcp.McpSettings = field(default_factory=mcp.McpSettings)  # the MCP servers responses may use


def _responses(server) -> Responses:
    found = getattr(server, "responses", None)
    if found is None:
        found = server.responses = Responses(ResponseStore())
    return found


# -- create -------------------------------------------------------------------------------------------
async def create_response(server, body: bytes, scope) -> bytes | EventStream:
    timeout_us = request_timeout_us(scope)  # x-request-timeout-ms: refused (503) if not generating by then
    request: ResponsesRequest = parse(ResponsesRequest, body, server.body)
    request.check()
    state = _responses(server)
    catalog = server.catalog
    llm = catalog.get(request.model) if request.model else catalog.default()
    request.model = llm.name
    items = input_items(request)
    history: list[dict] = []
    earlier: list[dict] = []  # the previous response's output items
    if request.previous_response_id is not None:
        previous = await _stored(server, state, request.previous_response_id, "previous_response_id")
        earlier = previous.response.get("output") or []
        history = previous.conversation + to_messages(earlier)
    approvals = {item["id"]: item for item in earlier + items if item["type"] == "mcp_approval_request"}
    conversation = history + to_messages(items, approvals)
    # the MCP tools' settings are read from the body's JSON (only a request that has such tools parses it)
    doc = _json(server, body) if any(tool.type == "mcp" for tool in request.tools) else {}
    servers = mcp.servers_of(doc.get("tools"), state.mcp)
    approved = mcp.approved_calls(items, approvals, servers)
    messages = ([{"role": "system", "content": request.instructions}] if request.instructions else []) + conversation
    if not messages:
        raise BadRequest("the request has no input", "input")
    response_id = new_id("resp")
    created = int(time.time())
    job = _Job(server, state, request, llm.name, response_id, created, items, conversation)
    if servers:
        return await _with_mcp(job, mcp.ToolRounds(server, request, llm, messages, servers, state.mcp,
                                                   response_id, timeout_us, approved))
    chat = chat_request(request, messages, request.stream)
    if request.background:
        async def launch():
            run = await start(server, chat, llm, stream=True, request_id=response_id,
                              max_tokens_field="max_output_tokens", timeout_us=timeout_us)
            return job.collect(run), run.close

        return await job.in_background(launch)
    try:
        run = await start(server, chat, llm, stream=request.stream, request_id=response_id,
                          max_tokens_field="max_output_tokens", timeout_us=timeout_us,
                          received_ns=request_received_ns(scope) if timeout_us else 0,
                          meanwhile=(lambda: job.prepare(chat, llm)) if request.stream else None)
    except OpenAIError as exc:
        raise renamed(exc) from None
    if request.stream:
        return EventStream(job.events(run), run.close)
    message, reason, usage = await _whole(run)
    answer = job.answer(output.items_of(message, reason), reason, output.usage_doc(run, usage, message.get("reasoning")))
    await job.save(answer)
    return orjson.dumps(answer)


create_response.takes_bytes = True  # the body's bytes go straight into the request model (validated once)


def _json(server, body: bytes | dict) -> dict:
    """The body as its JSON object (already read as valid JSON into the request model)."""
    return body if isinstance(body, dict) else server.body.parse_json(body, "request body")


async def _with_mcp(job: _Job, rounds: mcp.ToolRounds) -> bytes | EventStream:
    """A response whose model may call MCP tools (:mod:`.mcp`): tool lists, generations and calls."""
    if job.request.background:
        async def launch():
            await rounds.begin()
            return job.collect_rounds(rounds), rounds.close

        return await job.in_background(launch)
    await rounds.begin()
    if job.request.stream:
        return EventStream(job.round_events(rounds), rounds.close)
    try:
        answer = await job.collect_rounds(rounds)
    except OpenAIError as exc:
        raise renamed(exc) from None
    finally:
        await rounds.close()
    await job.save(answer)
    return orjson.dumps(answer)


async def _whole(run: ChatRun):
    try:
        return await run.whole()
    except OpenAIError as exc:
        raise renamed(exc) from None


@dataclass(eq=False)
class _Job:
    """One create request: the response object it writes and where it stores it."""

    server: object
    state: Responses
    request: ResponsesRequest
    model: str
    id: str
    created: int
    items: list[dict]
    conversation: list[dict]
    _echo: dict | None = field(default=None, init=False, repr=False)  # the request's settings, made once
    _ahead: _Ahead | None = field(default=None, init=False, repr=False)  # a stream's opening, made early

    def response(self, status: str, output_items: list[dict], usage: dict | None = None, error: dict | None = None,
                 incomplete: dict | None = None) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": error,
                "incomplete_details": incomplete, "output": output_items, "usage": usage,
                **(self._echo or self._echoed()), "model": self.model}

    def _echoed(self) -> dict:
        self._echo = self.request.echo()
        return self._echo

    def started(self) -> bytes:
        """The JSON of :meth:`response` ``in_progress`` with no output (``response.created`` and
        ``response.in_progress`` carry it): its fixed head written around the JSON of the request's settings
        (:meth:`ResponsesRequest.echo_json`), the bytes ``orjson.dumps(self.response("in_progress", []))`` gives,
        without the merged dict."""
        if self.request.model != self.model:  # (the model is set on the request before its settings are echoed)
            return orjson.dumps(self.response("in_progress", []))
        return _STARTED % (orjson.dumps(self.id), self.created, self.request.echo_json()[1:])

    def answer(self, items: list[dict], reason: str, usage: dict) -> dict:
        if reason == "length":
            return self.response("incomplete", items, usage, incomplete={"reason": "max_output_tokens"})
        if reason == "max_tool_calls":  # MCP calls left unrun (mcp.ToolRounds)
            return self.response("incomplete", items, usage, incomplete={"reason": "max_tool_calls"})
        return self.response("completed", items, usage)

    async def save(self, response: dict, background: bool = False) -> None:
        if self.request.store:
            await self.server.run_blocking(self.state.store.put, response, self.items, self.conversation, background,
                                           os.getpid() if background else None)

    # -- streaming ------------------------------------------------------------------------------------
    def prepare(self, chat, llm) -> None:
        """Make the stream's opening (:class:`_Ahead`) while the engine computes the first token
        (:func:`..chat_run.start`'s ``meanwhile``)."""
        if self._ahead is None:
            self._ahead = _Ahead(self, ChoiceStream(chat, llm))

    async def events(self, run: ChatRun):
        """The events of one generation, written as bytes, those of one model step in one chunk (one write):
        ``response.created`` and ``response.in_progress`` go with the first step's events, made before it
        (:meth:`prepare`), and so are a plain answer's message item announcements. The steps are read here (as
        :meth:`ChatRun.deltas` reads them, without its generator): text that continues the open item is written
        from its template, with no delta dict for a plain answer (no reasoning parser, no tools)."""
        ahead = self._ahead or _Ahead(self, run.choices())
        self._ahead = None
        writer = output.EventWriter(2)  # 0 and 1: the opening's
        chunk = ahead.opening
        stream = output.OutputStream()
        more_text = stream.more_text
        choices = ahead.choices
        plain = choices.plain
        first = ahead.item  # a plain answer's message item, announced ahead
        current = None  # a plain answer's message item once its text is written: every later text continues it
        usage = run.usage()
        reasoning: list[str] = []
        reason = None
        step_of = run.run.step
        delta_of = writer.delta
        try:
            while (step := await step_of()) is not None:
                usage.add_step(step)
                text, reason = step.texts[0], step.finish[0]
                if reason is None:
                    if not text:
                        continue
                    if current is not None:  # nearly every token of a plain answer: its bytes and nothing else
                        current.parts.append(text)
                        yield delta_of(current, text)
                        continue
                    if plain:
                        item = more_text("message", text)
                        if item is None and first is not None:  # its first text: the item announced ahead
                            item, first = (stream.adopt(first, text) if writer.sequence == 2 else None), None
                            if item is not None:
                                chunk += ahead.announced  # sequence 2 and 3
                                writer.sequence = 4
                        if item is not None:
                            yield chunk + delta_of(item, text)
                            chunk = b""
                            current = item  # (a plain answer opens no other item until it finishes)
                            continue
                        delta = {"content": text}
                    else:
                        delta = choices.feed(text)
                        kind = _only_text(delta)
                        if kind is not None and (item := more_text(kind, delta[_TEXT_KEYS[kind]])) is not None:
                            if kind == "reasoning":
                                reasoning.append(delta["reasoning"])
                            yield chunk + writer.delta(item, delta[_TEXT_KEYS[kind]])
                            chunk = b""
                            continue
                else:
                    delta = choices.feed(text) if text else {}
                    last, reason = choices.finish(reason)
                    merge(delta, last)
                if delta.get("reasoning"):
                    reasoning.append(delta["reasoning"])
                chunk += writer.events(stream.feed(delta))
                if reason is not None:
                    break
                if chunk:
                    yield chunk
                    chunk = b""
            else:  # a model that reports no finish reason ends here
                delta, reason = choices.finish(None)
                if delta.get("reasoning"):
                    reasoning.append(delta["reasoning"])
                chunk += writer.events(stream.feed(delta))
        except ServerError as exc:
            error = run.error(exc)
            chunk += writer.events(stream.finish("error"))
            failed = self.response("failed", stream.items, error={"code": "server_error" if error.status >= 500
                                                                  else "invalid_request", "message": error.message})
            if chunk:
                yield chunk
            await self.save(failed)
            yield writer.wrapped("response.failed", orjson.dumps(failed))
            return
        chunk += writer.events(stream.finish(reason))
        final = self.answer(stream.items, reason or "stop", output.usage_doc(run, usage, "".join(reasoning)))
        if self.request.store:  # the last text goes out while the store writes
            yield chunk
            chunk = b""
            await self.save(final)
        yield chunk + writer.wrapped("response.completed" if final["status"] == "completed" else "response.incomplete",
                                     orjson.dumps(final))

    async def round_events(self, rounds: mcp.ToolRounds):
        """The events of a response with MCP tools (:class:`.mcp.ToolRounds`)."""
        writer = output.EventWriter()
        started = self.started()
        yield writer.wrapped("response.created", started) + writer.wrapped("response.in_progress", started)
        try:
            async for event in rounds.events():
                yield writer.event(event)
        except OpenAIError as exc:
            exc = renamed(exc)
            failed = self.response("failed", rounds.items, error={"code": "server_error" if exc.status >= 500
                                                                  else "invalid_request", "message": exc.message})
            await self.save(failed)
            yield writer.wrapped("response.failed", orjson.dumps(failed))
            return
        final = self.answer(rounds.items, rounds.reason, rounds.usage)
        await self.save(final)
        yield writer.wrapped("response.completed" if final["status"] == "completed" else "response.incomplete",
                             orjson.dumps(final))

    # -- background -----------------------------------------------------------------------------------
    async def in_background(self, launch) -> bytes:
        """Answer ``queued`` and generate in a task: ``await launch()`` starts the generation and gives the
        coroutine that collects the final response and what closes the generation."""
        queued = self.response("queued", [])
        await self.save(queued, background=True)
        task = asyncio.ensure_future(self._background(launch))
        self.state.tasks[self.id] = task
        task.add_done_callback(lambda _: self.state.tasks.pop(self.id, None))
        return orjson.dumps(queued)

    async def _background(self, launch) -> None:
        store = self.state.store
        blocking = self.server.run_blocking
        try:
            if not await blocking(store.update, self.response("in_progress", []), _RUNNING):
                return  # cancelled (or deleted) before it started
            collect, close = await launch()
            work = asyncio.ensure_future(collect)
            try:
                while not work.done():
                    await asyncio.wait([work], timeout=CANCEL_POLL_S)
                    if not work.done() and await blocking(store.status, self.id) != "in_progress":
                        work.cancel()  # cancelled or deleted through another process
                        await asyncio.gather(work, return_exceptions=True)
                        return
            finally:
                if not work.done():
                    work.cancel()
                await close()
            final = work.result()
        except asyncio.CancelledError:
            return  # cancel already wrote the stored status
        except OpenAIError as exc:
            exc = renamed(exc)
            final = self.response("failed", [], error={"code": "server_error" if exc.status >= 500
                                                       else "invalid_request", "message": exc.message})
        except Exception as exc:  # a bug: the response fails and says so
            log.exception("background response %s failed", self.id)
            final = self.response("failed", [], error={"code": "server_error",
                                                       "message": f"internal error: {type(exc).__name__}: {exc}"})
        await blocking(store.update, final, _RUNNING)

    async def collect_rounds(self, rounds: mcp.ToolRounds) -> dict:
        """The response of a run with MCP tools, its events dropped."""
        async for _ in rounds.events():
            pass
        return self.answer(rounds.items, rounds.reason, rounds.usage)

    async def collect(self, run: ChatRun) -> dict:
        """The response of a run streamed from the model (so a cancel stops it between two pieces)."""
        stream = output.OutputStream()
        usage = run.usage()
        reasoning: list[str] = []
        reason = None
        async for delta, reason in run.deltas(usage):
            if delta.get("reasoning"):
                reasoning.append(delta["reasoning"])
            stream.feed(delta)
        stream.finish(reason)
        return self.answer(stream.items, reason or "stop", output.usage_doc(run, usage, "".join(reasoning)))


class _Ahead:
    """What a streamed response writes before the model's first text, made while the engine computes that text
    (:meth:`_Job.prepare`): ``response.created`` and ``response.in_progress`` (sequence 0 and 1), the reader of
    the model's text, and for a plain answer (its text is the message item's from the first token on) that item,
    index 0, with its delta head and the bytes of its ``response.output_item.added`` and
    ``response.content_part.added`` (2 and 3), written with its first text; unused if the model writes none."""

    __slots__ = ("announced", "choices", "item", "opening")

    def __init__(self, job: _Job, choices: ChoiceStream) -> None:
        started = job.started()
        writer = output.EventWriter()
        self.opening = writer.wrapped("response.created", started) + writer.wrapped("response.in_progress", started)
        self.choices = choices
        self.item = None
        self.announced = b""
        if choices.plain:
            self.item, self.announced = output.OutputStream().announce_message(writer)
            writer.head(self.item)


_TEXT_KEYS = {"message": "content", "reasoning": "reasoning"}
# _Job.response("in_progress", []) up to the request's settings: id (JSON), created_at, then the settings' JSON
# without its opening brace
_STARTED = (b'{"id":%s,"object":"response","created_at":%d,"status":"in_progress","error":null,'
            b'"incomplete_details":null,"output":[],"usage":null,%s')


def _only_text(delta: dict) -> str | None:
    """``message`` or ``reasoning`` when ``delta`` holds only text of that kind (a reasoning delta also carries it
    as ``reasoning_content``), else None."""
    if "tool_calls" in delta:
        return None
    if delta.get("content"):
        return "message" if len(delta) == 1 else None
    return "reasoning" if delta.get("reasoning") and "content" not in delta else None


# -- the stored responses ---------------------------------------------------------------------------------
def _check_id(response_id: str) -> None:
    if not response_id.startswith("resp"):
        raise BadRequest(f"Invalid 'response_id': '{response_id}'. Expected an ID that begins with 'resp'.",
                         "response_id")


def not_found(response_id: str, param: str = "response_id") -> OpenAIError:
    return OpenAIError(f"Response with id '{response_id}' not found.", 404, param)


async def _stored(server, state: Responses, response_id: str, param: str = "response_id") -> Stored:
    if param == "response_id":
        _check_id(response_id)
    stored = await server.run_blocking(state.store.get, response_id)
    if stored is None:
        raise not_found(response_id, param)
    if stored.status in _RUNNING and stored.owner not in (None, os.getpid()) and not _alive(stored.owner):
        stored.response.update(status="failed", error={"code": "server_error", "message": "the server process "
                                                       "that ran this background response stopped"})
        await server.run_blocking(state.store.update, stored.response, _RUNNING)
        stored.status = "failed"
    return stored


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _response_id(scope) -> str:
    return scope["path_params"]["response_id"]


async def retrieve_response(server, _doc, scope) -> bytes:
    query = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1"))
    if query.get("stream", ["false"])[-1].lower() == "true":
        raise BadRequest("streaming a stored response again is not supported here: retrieve it without 'stream'",
                         "stream")
    stored = await _stored(server, _responses(server), _response_id(scope))
    return orjson.dumps(stored.response)


async def delete_response(server, _doc, scope) -> bytes:
    state = _responses(server)
    response_id = _response_id(scope)
    _check_id(response_id)
    if not await server.run_blocking(state.store.delete, response_id):
        raise not_found(response_id)
    task = state.tasks.get(response_id)
    if task is not None:
        task.cancel()
    return orjson.dumps({"id": response_id, "object": "response", "deleted": True})


async def cancel_response(server, _doc, scope) -> bytes:
    state = _responses(server)
    stored = await _stored(server, state, _response_id(scope))
    if not stored.background:
        raise BadRequest("Cannot cancel a synchronous response.", "response_id")
    response = stored.response
    if stored.status in _RUNNING:
        response["status"] = "cancelled"
        if await server.run_blocking(state.store.update, response, _RUNNING):
            task = state.tasks.get(stored.id)
            if task is not None:
                task.cancel()
        else:  # it finished meanwhile: answer what it became
            response = (await _stored(server, state, stored.id)).response
    return orjson.dumps(response)


async def list_input_items(server, _doc, scope) -> bytes:
    query = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1"))

    def one(name: str) -> str | None:
        values = query.get(name)
        return values[-1] if values else None

    try:
        limit = int(one("limit") or 20)
    except ValueError:
        raise BadRequest(f"Invalid 'limit': {one('limit')!r} is not an integer", "limit") from None
    if not 1 <= limit <= 100:
        raise BadRequest(f"Invalid 'limit': must be between 1 and 100, got {limit}", "limit")
    order = one("order") or "desc"
    if order not in ("asc", "desc"):
        raise BadRequest(f"Invalid 'order': must be 'asc' or 'desc', got {order!r}", "order")
    stored = await _stored(server, _responses(server), _response_id(scope))
    items = list(stored.input_items) if order == "asc" else list(reversed(stored.input_items))
    for name, keep_after in (("after", True), ("before", False)):
        marker = one(name)
        if marker is not None:
            at = next((i for i, item in enumerate(items) if item.get("id") == marker), None)
            if at is None:
                raise BadRequest(f"Invalid '{name}': no input item '{marker}' in response '{stored.id}'", name)
            items = items[at + 1:] if keep_after else items[:at]
    page = items[:limit]
    return orjson.dumps({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})
