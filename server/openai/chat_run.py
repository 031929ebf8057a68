"""One chat generation for the APIs that speak in other shapes (``/v1/responses``, ``/v1/messages``).

Those endpoints translate their request into a :class:`ChatCompletionRequest` and run it here exactly as
``/v1/chat/completions`` runs one choice: the model's chat template (on a worker thread, within the
server's budget), the prompt-token limit, structured output for named / required tools and
``response_format``, one DataPlane request (:class:`~.generation.Run`), and the model's reasoning and
tool-call parsers on the output (:mod:`.chat_completion.output`). What comes back is the assistant message
as chat completions would answer it (whole, or as ``delta`` dicts while streaming); each API writes it in
its own shape. Closing a :class:`ChatRun` (or cancelling the task that awaits it: the client left) closes
the DataPlane stream, which aborts the engine request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from ..errors import ServerError
from ..tool_parsers import tool_parser
from .chat_completion import output
from .chat_completion.protocol import ChatCompletionRequest
from .chat_completion.serving import _render
from .errors import BadRequest, from_server_error
from .generation import Run, Usage, collect
from .llm import LLMModel


@dataclass(eq=False)
class ChatRun:
    """A started generation: the request, its model, the DataPlane run and the rendered prompt."""

    request: ChatCompletionRequest
    llm: LLMModel
    run: Run
    prompt: str
    fields: dict[str, str]  # engine sampling name -> the client's field, for error messages

    def usage(self) -> Usage:
        usage = Usage(self.llm)
        usage.add_prompt(self.run, self.prompt)
        return usage

    def choices(self) -> output.ChoiceStream:
        """The stream that reads the model's text as this request's answer (reasoning, tool calls)."""
        return output.ChoiceStream(self.request, self.llm)

    def error(self, exc: BaseException):
        """The OpenAI error of a model failure (fields named as the client sent them)."""
        return from_server_error(exc, self.fields, "messages")

    async def whole(self) -> tuple[dict, str, Usage]:
        """The whole answer: the chat message, its finish reason and the usage."""
        try:
            choice = (await collect(self.run, 1))[0]
        except ServerError as exc:
            raise self.error(exc) from None
        finally:
            await self.run.close()
        message, reason = output.message(self.request, self.llm, choice.text, choice.finish_reason)
        usage = self.usage()
        usage.add_choice(choice)
        return message, reason, usage

    async def deltas(self, usage: Usage) -> AsyncIterator[tuple[dict, str | None]]:
        """``(delta, finish reason)`` as the model writes (the reason only on the last); ``usage`` is
        counted along. A model error raises its OpenAIError."""
        stream = output.ChoiceStream(self.request, self.llm)
        finished = False
        try:
            while (step := await self.run.step()) is not None:
                usage.add_step(step)
                text, reason = step.texts[0], step.finish[0]
                delta = stream.feed(text) if text else {}
                if reason is not None:
                    last, reason = stream.finish(reason)
                    output.merge(delta, last)
                    finished = True
                if delta or reason is not None:
                    yield delta, reason
                if finished:
                    break
        except ServerError as exc:
            raise self.error(exc) from None
        if not finished:  # a model that reports no finish reason ends here
            delta, reason = stream.finish(None)
            yield delta, reason

    async def close(self) -> None:
        await self.run.close()


async def start(server, request: ChatCompletionRequest, llm: LLMModel, *, stream: bool, request_id: str,
                max_tokens_field: str = "max_tokens", timeout_us: int = 0, received_ns: int = 0,
                meanwhile: Callable[[], object] | None = None) -> ChatRun:
    """Check ``request`` (one choice), render its prompt and start its DataPlane request; with ``stream`` the
    first model response is awaited, so an error the model raises at once is still a plain HTTP error.
    ``timeout_us``: the request's queue deadline (``x-request-timeout-ms``, :func:`.http.request_timeout_us`),
    counted from ``received_ns`` (when the server began to read the request) where given. ``meanwhile``: work
    the answer needs but the engine does not (a stream's opening events), handed to the event loop once the
    request is submitted (``call_soon``), so it is done while the engine works toward the first token rather
    than between that token and the client."""
    limits = server.limits
    request.check_chat(limits, auto_tools=llm.tool_call_parser is not None)
    mode = request.tool_mode
    constrained_by = "tool_choice" if mode in ("named", "required") else "response_format"
    if request.constraint() is not None and not llm.structured_outputs:
        raise BadRequest(f"model '{llm.name}' has no structured output, which {constrained_by} needs (a vLLM "
                         "model has it)", constrained_by)
    prompt = await server.run_blocking(_render, request, llm, limits)
    await limits.check_prompts_fit(llm, [prompt], "messages", server.run_blocking)
    max_tokens, _ = request.max_output
    sampling = request.sampling(max_tokens, None)
    if mode == "auto" and llm.sampling_json and tool_parser(llm.tool_call_parser).keeps_special_tokens:
        sampling["skip_special_tokens"] = False  # the parser's markers are special tokens of such models
    fields = {"max_tokens": max_tokens_field, "structured_outputs": constrained_by}
    run = None
    try:
        inference = llm.start(server.dataplane, prompt, sampling, stream=stream, logprobs=False,
                              add_special_tokens=False, request_id=request_id, priority=request.priority,
                              cached_tokens=limits.prompt_tokens_details, timeout_us=timeout_us,
                              received_ns=received_ns)
        run = Run(llm, inference, 1)
        if meanwhile is not None:
            asyncio.get_running_loop().call_soon(meanwhile)
        if stream:
            await run.peek()
    except BaseException as exc:
        if run is not None:
            await run.close()
        if isinstance(exc, ServerError):
            raise from_server_error(exc, fields, "messages") from None
        raise
    return ChatRun(request, llm, run, prompt, fields)


async def render(server, request: ChatCompletionRequest, llm: LLMModel) -> str:
    """The prompt ``request`` renders to with ``llm``'s chat template (for token counts)."""
    return await server.run_blocking(_render, request, llm, server.limits)
