"""``POST /v1/chat/completions``: messages rendered with the model's chat template, one DataPlane request.

Streaming sends, per choice, a first chunk with the role, then (with vLLM's ``echo``, when the final message
is the assistant's) one with that message's text, then one ``chat.completion.chunk`` per model
response that adds something (the last carries ``finish_reason``), then a usage chunk when
``stream_options.include_usage``, then ``data: [DONE]``. A named tool streams its arguments as
``tool_calls`` deltas; ``required`` tool calls come whole in the finishing chunk (they are parsed from
the complete JSON array); ``auto`` calls stream as the model's tool-call parser reads them, reasoning as
``reasoning`` deltas (:mod:`.output`). The template renders on a worker thread within the server's time
and size limits.
"""

from __future__ import annotations

import functools
import time
import uuid

import orjson

from ...errors import ServerError
from ...tool_parsers import tool_parser
from ..chat_template import ChatTemplate, RenderBudget, TemplateError, special_tokens
from ..errors import BadRequest, from_server_error
from ..generation import Chunks, Run, Usage, close_all, collect, text_writer
from ..http import DONE, EventStream, event, request_received_ns, request_timeout_us
from ..limits import OpenAILimits
from ..llm import LLMModel
from ..logprobs import chat_content, prompt_logprobs
from ..protocol import parse
from . import output
from .output import ROLE
from .protocol import ChatCompletionRequest

OBJECT, CHUNK = "chat.completion", "chat.completion.chunk"


async def create_chat_completion(server, body: bytes, scope) -> bytes | EventStream:
    request: ChatCompletionRequest = parse(ChatCompletionRequest, body, server.body)
    catalog = server.catalog
    llm = catalog.get(request.model) if request.model else catalog.default()
    limits = server.limits
    request.check_chat(limits, auto_tools=llm.tool_call_parser is not None)
    mode = request.tool_mode
    constrained_by = "tool_choice" if mode in ("named", "required") else "response_format"
    constraint = request.constraint()
    if constraint is not None and not llm.structured_outputs:
        raise BadRequest(f"model '{llm.name}' has no structured output, which "
                         f"{constrained_by} needs (a vLLM model has it)", constrained_by)
    prompt = await server.run_blocking(_render, request, llm, limits)
    if len(prompt) > limits.uncounted_chars:  # (a shorter prompt cannot hold more tokens than the limit)
        await limits.check_prompts_fit(llm, [prompt], "messages", server.run_blocking)
    max_tokens, max_field = request.max_output
    sampling = request.sampling(max_tokens, (request.top_logprobs or 0) if request.logprobs else None)
    if mode == "auto" and llm.sampling_json and tool_parser(llm.tool_call_parser).keeps_special_tokens:
        sampling["skip_special_tokens"] = False  # the parser's markers are special tokens of such models
    if request.prompt_logprobs is not None:
        if not llm.prompt_logprobs:
            raise BadRequest(f"model '{llm.name}' does not return the prompt's log probabilities (a vLLM model has "
                             "them)", "prompt_logprobs")
        sampling["prompt_logprobs"] = request.prompt_logprobs
    fields = {"max_tokens": max_field, "logprobs": "top_logprobs",
              "structured_outputs": constrained_by}
    stream = bool(request.stream)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    run = None
    try:
        timeout_us = request_timeout_us(scope)
        received = request_received_ns(scope) if timeout_us else 0  # the kernel is asked only for a deadline
        run = Run(llm, llm.start(server.dataplane, prompt, sampling, stream=stream, logprobs=bool(request.logprobs),
                                 add_special_tokens=False, request_id=request_id, priority=request.priority,
                                 prompt_logprobs=request.prompt_logprobs is not None,
                                 cached_tokens=server.limits.prompt_tokens_details, timeout_us=timeout_us,
                                 received_ns=received), request.n)
        if stream:
            await run.peek()
        else:
            choices = await collect(run, request.n)
    except BaseException as exc:
        if run is not None:
            await run.close()
        if isinstance(exc, ServerError):
            raise from_server_error(exc, fields, "messages") from None
        raise
    if not stream:
        await run.close()
    header = {"id": request_id, "object": CHUNK if stream else OBJECT, "created": int(time.time()),
              "model": llm.name}
    if stream:
        reply = EventStream(None, lambda: close_all([run]))
        reply.events = _events(request, header, llm, run, prompt, fields, reply)
        return reply
    usage = Usage(llm)
    usage.add_prompt(run, prompt)
    echoed = request.echo_prefix(ROLE)
    out = []
    for i, choice in enumerate(choices):
        usage.add_choice(choice)
        message, reason = output.message(request, llm, choice.text, choice.finish_reason)
        if echoed:
            message["content"] = echoed + (message["content"] or "")
        out.append({"index": i, "message": message,
                    "logprobs": {"content": chat_content(choice.logprobs, request.top_logprobs or 0)}
                    if request.logprobs else None,
                    "finish_reason": reason, "stop_reason": None})
    prompt_entries = prompt_logprobs(run.prompt_logprobs) if request.prompt_logprobs is not None else None
    return orjson.dumps({**header, "choices": out, "usage": usage.doc(), "prompt_logprobs": prompt_entries})


create_chat_completion.takes_bytes = True  # the body's bytes go straight into the request model
create_chat_completion.answers_refusals = True  # a deadline refusal is answered where it is made (asgi.RefusalNow)


def _render(request: ChatCompletionRequest, llm: LLMModel, limits: OpenAILimits) -> str:
    """The prompt (blocking: on a worker thread). A failure of the request's own template names
    ``chat_template``, one of the model's names ``messages``."""
    template = llm.template
    if request.chat_template is not None:
        special = template.special_tokens if template is not None else (
            special_tokens(llm.tokenizer_dir) if llm.tokenizer_dir is not None else {})
        try:
            template = ChatTemplate(request.chat_template, special, "request")
        except TemplateError as exc:
            raise BadRequest(str(exc), "chat_template") from None
    if template is None:
        raise BadRequest(f"model '{llm.name}' has no chat template: its tokenizer files define none and its config "
                         "sets no 'chat_template' parameter; send 'chat_template' with the request or use "
                         "/v1/completions")
    budget = RenderBudget(limits.chat_template_timeout_s, limits.max_rendered_chars)
    try:
        return template.render(request.template_messages(), tools=request.template_tools(),
                               add_generation_prompt=request.add_generation_prompt,
                               continue_final_message=request.continue_final_message,
                               extra=request.chat_template_kwargs, budget=budget)
    except TemplateError as exc:
        raise BadRequest(str(exc), "chat_template" if request.chat_template is not None else "messages") from None


async def _events(request: ChatCompletionRequest, header: dict, llm: LLMModel, run: Run, prompt: str,
                  fields: dict, reply: EventStream | None = None):
    n = request.n
    options = request.stream_options
    include_usage = bool(options and options.include_usage)
    top = request.top_logprobs or 0
    usage = Usage(llm)
    # usage in every chunk only when the final usage is asked for too (vLLM: include_usage and continuous_usage_stats)
    live_usage = usage if include_usage and options.continuous_usage_stats else None
    usage.add_prompt(run, prompt)
    finished = [False] * n
    chunks = Chunks(header)
    # the common case: no tool mode and no reasoning parser, so the text goes out as it comes: a text delta is one
    # chunk of plain content, its bytes written around the text, and the finishing chunk is built here (no
    # ChoiceStream, which reads the answer's reasoning and tool calls)
    plain = request.tool_mode == "none" and not llm.reasoning_parser
    outputs = None if plain else [output.ChoiceStream(request, llm) for _ in range(n)]
    plain_text = plain and not request.logprobs and live_usage is None
    for i in range(n):
        first = {"index": i, "delta": {"role": ROLE, "content": ""}, "logprobs": None, "finish_reason": None}
        yield chunks.choice(first, live_usage)
    echoed = request.echo_prefix(ROLE)
    for i in range(n if echoed else 0):  # echo: the final message the answer continues, before the answer
        yield chunks.choice({"index": i, "delta": {"content": echoed}, "logprobs": None, "finish_reason": None},
                            live_usage)
    through = (plain_text and n == 1 and reply is not None and reply.write is not None
               and hasattr(run.stream, "write_through"))
    if through:  # a text delta's chunk written where the delta comes while this waits for the next
        run.stream.write_through(text_writer(reply.write, functools.partial(chunks.text, 0), usage, run))
    try:
        while (step := await run.step()) is not None:
            usage.add_step(step)
            for i in range(n):
                if finished[i]:
                    continue
                text, reason = step.texts[i], step.finish[i]
                if plain_text and reason is None:
                    if text:
                        yield chunks.text(i, text)
                    continue
                entries = step.logprobs[i] if step.logprobs is not None else None
                if not text and reason is None and not entries:
                    continue
                if plain:
                    delta = {"content": text} if text else {}
                    if reason is not None:
                        reason = reason or "stop"
                else:
                    delta = outputs[i].feed(text) if text else {}
                    if reason is not None:
                        last, reason = outputs[i].finish(reason)
                        output.merge(delta, last)
                if reason is None and not delta and not entries:
                    continue  # text held back (it may start a marker)
                choice = {"index": i, "delta": delta,
                          "logprobs": {"content": chat_content(entries, top)} if request.logprobs else None,
                          "finish_reason": reason}
                yield chunks.choice(choice, live_usage)
                if reason is not None:
                    finished[i] = True
    except ServerError as exc:
        raise from_server_error(exc, fields, "messages") from None
    finally:
        if through:
            run.stream.write_through(None)
    for i in range(n):  # a model that reports no finish reason ends its choices here
        if not finished[i]:
            delta, reason = ({}, "stop") if plain else outputs[i].finish(None)
            last = {"index": i, "delta": delta, "logprobs": None, "finish_reason": reason}
            yield chunks.choice(last, live_usage)
    if include_usage:
        yield event({**header, "choices": [], "usage": usage.doc()})
    yield DONE
