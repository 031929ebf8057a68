"""``POST /v1/completions``: one DataPlane request per prompt, ``n`` choices each.

Choice ``index`` is ``prompt_index * n + i`` (as vLLM numbers them). ``echo`` puts the prompt before each
choice's text; with ``logprobs`` also the prompt's log probabilities before the choice's (the engine's
``prompt_logprobs``; the first token's is null), and ``max_tokens`` 0 answers with the prompt alone (as
vLLM: the engine makes one token, which is left out). Streaming sends one
``text_completion`` chunk per choice and model response that adds text (the last one carries
``finish_reason``), then a usage chunk when ``stream_options.include_usage``, then ``data: [DONE]``.
The prompts' requests are started a slice at a time, the event loop serving other work in between.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import orjson

from ...errors import ServerError
from ..errors import BadRequest, from_server_error
from ..generation import Choice, Chunks, Run, Usage, chunk_event, close_all, collect, merged, peek_all, text_writer
from ..http import DONE, EventStream, event, request_received_ns, request_timeout_us
from ..logprobs import CompletionLogprobs, prompt_logprobs
from ..protocol import parse
from .protocol import CompletionRequest

OBJECT = "text_completion"
SLICE = 16  # prompts started per turn of the event loop
FIELDS = {"structured_outputs": "response_format"}
DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default, also for an explicit null


async def create_completion(server, doc, scope) -> bytes | EventStream:
    request: CompletionRequest = parse(CompletionRequest, doc)
    catalog = server.catalog
    llm = catalog.get(request.model) if request.model else catalog.default()
    limits = server.limits
    request.check_completion(limits)
    prompts = request.prompts(limits)
    await limits.check_prompts_fit(llm, prompts, "prompt", server.run_blocking)
    if request.constraint() is not None and not llm.structured_outputs:
        raise BadRequest(f"model '{llm.name}' has no structured output (response_format needs a vLLM model)",
                         "response_format" if request.response_format is not None else "structured_outputs")
    max_tokens = request.max_tokens if request.max_tokens is not None else DEFAULT_MAX_TOKENS
    sampling = request.sampling(1 if request.echo_only else max_tokens, request.logprobs)
    prompt_count = request.prompt_logprobs_count
    if prompt_count is not None:
        if request.prompt_logprobs is not None and not llm.prompt_logprobs:
            raise BadRequest(f"model '{llm.name}' does not return the prompt's log probabilities (a vLLM model has "
                             "them)", "prompt_logprobs")
        sampling["prompt_logprobs"] = prompt_count
    stream = bool(request.stream)
    n = request.n
    request_id = f"cmpl-{uuid.uuid4().hex}"
    timeout_us = request_timeout_us(scope)
    received = request_received_ns(scope) if timeout_us else 0  # the kernel is asked only for a deadline
    echoes = [(p if isinstance(p, str) else llm.decode(p)) if request.echo else "" for p in prompts]
    runs: list[Run] = []
    try:
        for k, prompt in enumerate(prompts):
            if k and k % SLICE == 0:
                await asyncio.sleep(0)  # let the loop run the requests started so far, and other clients
            inference = llm.start(server.dataplane, prompt, sampling, stream=stream,
                                  logprobs=request.logprobs is not None, add_special_tokens=request.add_special_tokens,
                                  request_id=f"{request_id}-{k}", prompt_logprobs=prompt_count is not None,
                                  priority=request.priority, cached_tokens=server.limits.prompt_tokens_details,
                                  timeout_us=timeout_us, received_ns=received)
            runs.append(Run(llm, inference, n, index=k * n))
        if stream:
            await peek_all(runs)
        else:
            results = [await collect(runs[0], n)] if len(runs) == 1 else await _gather(runs, n)
    except ServerError as exc:
        await close_all(runs)
        raise from_server_error(exc, FIELDS) from None
    except BaseException:
        await close_all(runs)
        raise
    header = {"id": request_id, "object": OBJECT, "created": int(time.time()), "model": llm.name}
    if stream:
        reply = EventStream(None, lambda: close_all(runs))
        reply.events = _events(request, header, llm, runs, prompts, echoes, reply)
        return reply
    await close_all(runs)
    return _response(request, header, llm, runs, prompts, echoes, results)

create_completion.answers_refusals = True  # a deadline refusal is answered where it is made (asgi.RefusalNow)


async def _gather(runs: list[Run], n: int) -> list[list[Choice]]:
    return list(await asyncio.gather(*(collect(run, n) for run in runs)))


def _finish(reason: str | None) -> str:
    return reason if reason is not None else "stop"


def _response(request: CompletionRequest, header: dict, llm, runs, prompts, echoes, results) -> bytes:
    usage = Usage(llm)
    choices = []
    for k, (run, result) in enumerate(zip(runs, results)):
        usage.add_prompt(run, prompts[k])
        prompt = prompt_logprobs(run.prompt_logprobs) if request.prompt_logprobs is not None else None
        for i, choice in enumerate(result):
            usage.add_choice(choice)
            text, entries = (echoes[k], []) if request.echo_only else (echoes[k] + choice.text, choice.logprobs)
            logprobs = None
            if request.echo_logprobs:
                logprobs = CompletionLogprobs(request.logprobs).piece((run.prompt_logprobs or []) + entries)
            elif request.logprobs is not None:
                logprobs = CompletionLogprobs(request.logprobs, len(echoes[k])).piece(entries)
            choices.append({"index": run.index + i, "text": text, "logprobs": logprobs,
                            "finish_reason": _finish(choice.finish_reason), "stop_reason": None,
                            "prompt_logprobs": prompt})
    return orjson.dumps({**header, "choices": choices, "usage": usage.doc()})


async def _events(request: CompletionRequest, header: dict, llm, runs, prompts, echoes,
                  reply: EventStream | None = None):
    n = request.n
    options = request.stream_options
    include_usage = bool(options and options.include_usage)
    usage = Usage(llm)
    # usage in every chunk only when the final usage is asked for too (vLLM: include_usage and continuous_usage_stats)
    live_usage = usage if include_usage and options.continuous_usage_stats else None
    for k, run in enumerate(runs):
        usage.add_prompt(run, prompts[k])
    total = len(runs) * n
    finished = [False] * total
    echoed = [not request.echo] * total
    offset = (lambda j: 0) if request.echo_logprobs else (lambda j: len(echoes[j // n]))
    logprobs = ([CompletionLogprobs(request.logprobs, offset(j)) for j in range(total)]
                if request.logprobs is not None else None)
    echo_only = request.echo_only
    # one prompt, one choice, plain text (no echo, log probabilities or live usage): a text delta's chunk is written
    # where the delta comes while this waits for the next, as the chat stream does (DeltaStream.write_through)
    through = (len(runs) == 1 and n == 1 and not request.echo and logprobs is None and live_usage is None
               and reply is not None and reply.write is not None and hasattr(runs[0].stream, "write_through"))
    if through:
        head = Chunks(header)
        runs[0].stream.write_through(text_writer(reply.write, lambda text: head.choice(
            {"index": 0, "text": text, "logprobs": None, "finish_reason": None, "stop_reason": None}), usage, runs[0]))
    try:
        async for run, step in merged(runs):
            usage.add_step(step)
            for i in range(n):
                index = run.index + i
                if finished[index]:
                    continue
                text, reason = step.texts[i], step.finish[i]
                entries = step.logprobs[i] if step.logprobs is not None else None
                if echo_only:  # the one token the engine made is not part of the answer
                    text, entries = "", None
                if not echoed[index]:
                    text = echoes[index // n] + text
                    if request.echo_logprobs:
                        entries = (run.prompt_logprobs or []) + (entries or [])
                    echoed[index] = True
                if not text and reason is None and not entries:
                    continue
                choice = {"index": index, "text": text,
                          "logprobs": logprobs[index].piece(entries) if logprobs is not None else None,
                          "finish_reason": reason, "stop_reason": None}
                yield chunk_event(header, choice, live_usage)
                if reason is not None:
                    finished[index] = True
    except ServerError as exc:
        raise from_server_error(exc, FIELDS) from None
    finally:
        if through:
            runs[0].stream.write_through(None)
    for index in range(total):  # a model that reports no finish reason ends its choices here
        if not finished[index]:
            last = {"index": index, "text": "", "logprobs": None, "finish_reason": "stop", "stop_reason": None}
            yield chunk_event(header, last, live_usage)
    if include_usage:
        yield event({**header, "choices": [], "usage": usage.doc()})
    yield DONE
