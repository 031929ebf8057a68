"""One prompt's generation through the DataPlane (a :class:`Run`), several runs merged, totals per choice.

A run of a typed request (a model whose engine takes them) is started with :meth:`DataPlane.generate` and its
deltas are its :class:`~.llm.Step` s as they come; any other with :meth:`DataPlane.infer`, its responses read
into Steps. Closing a run (or cancelling the task awaiting it: the client went away) closes its stream, which
cancels the request: an LLM backend aborts the engine request and frees its KV cache.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import orjson

from ..errors import ServerError, as_server_error
from .http import REFUSAL, event
from .llm import LLMModel, Step, StepReader


class Run:
    """The responses of one prompt, as Steps; ``index`` places its choices among the request's."""

    __slots__ = ("_done", "_pending", "cached_tokens", "index", "prompt_logprobs", "prompt_tokens", "reader",
                 "stream", "typed")

    def __init__(self, llm: LLMModel, stream, n: int, index: int = 0) -> None:
        # ``stream``: the request's (LLMModel.start); a typed request's deltas come as they are
        self.typed = llm.typed
        self.stream = stream
        if (refusal := REFUSAL.get()) is not None:  # a deadline refusal is answered where it is made
            refusal.watch(self.stream)
        self.reader = None if self.typed else StepReader(llm, n)  # (a typed request's deltas are its Steps)
        self.index = index
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None  # prompt tokens the prefix cache served (when asked for)
        self.prompt_logprobs: list[dict] | None = None
        self._pending: Step | None = None
        self._done = False

    async def step(self) -> Step | None:
        """The next Step (None after the last); a model error raises it as a ServerError."""
        if self._pending is not None:
            step, self._pending = self._pending, None
            return step
        if self.typed:
            if self._done:
                return None
            try:
                step = await self.stream.__anext__()
            except StopAsyncIteration:
                self._done = True
                return None
            except ServerError:
                self._done = True
                raise
            self._keep(step)
            return step
        while not self._done:
            try:
                response = await self.stream.__anext__()
            except StopAsyncIteration:
                self._done = True
                break
            if response.final:
                self._done = True
            if response.error is not None:
                self._done = True
                raise as_server_error(response.error)
            if response.empty:
                continue
            step = self.reader.read(response)
            self._keep(step)
            return step
        return None

    def _keep(self, step) -> None:
        """What a step tells of the whole request (cached and prompt tokens, prompt logprobs), kept as it comes."""
        if step.cached_tokens is not None:
            self.cached_tokens = step.cached_tokens
        if step.prompt_tokens is not None:
            self.prompt_tokens = step.prompt_tokens
        if step.prompt_logprobs is not None:
            self.prompt_logprobs = step.prompt_logprobs

    async def peek(self) -> None:
        """Wait for the first Step (keeping it for :meth:`step`): an error the model raises at once
        (a prompt too long, a bad sampling value) then fails the request before any byte is sent."""
        self._pending = await self.step()

    async def close(self) -> None:
        await self.stream.aclose()


async def peek_all(runs: list[Run]) -> None:
    if len(runs) == 1:
        await runs[0].peek()
    else:
        await asyncio.gather(*(run.peek() for run in runs))


async def close_all(runs: list[Run]) -> None:
    for run in runs:
        await run.close()


async def merged(runs: list[Run]) -> AsyncIterator[tuple[Run, Step]]:
    """Steps of all runs as they come (one run: directly; several: through a queue)."""
    if len(runs) == 1:
        run = runs[0]
        while (step := await run.step()) is not None:
            yield run, step
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(run: Run) -> None:
        try:
            while (step := await run.step()) is not None:
                queue.put_nowait((run, step, None))
        except Exception as exc:  # a model error (ServerError) or a bug: the merged stream ends with it
            queue.put_nowait((run, None, as_server_error(exc)))
            return
        queue.put_nowait((run, None, None))

    tasks = [asyncio.ensure_future(pump(run)) for run in runs]
    try:
        remaining = len(runs)
        while remaining:
            run, step, error = await queue.get()
            if error is not None:
                raise error
            if step is None:
                remaining -= 1
                continue
            yield run, step
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass(slots=True)
class Choice:
    """One choice's totals over its steps."""

    text: str = ""
    finish_reason: str | None = None
    tokens: int = 0
    logprobs: list = field(default_factory=list)
    counted: bool = False  # the model reported token counts

    def add(self, step: Step, i: int) -> None:
        self.text += step.texts[i]
        if step.finish[i] is not None:
            self.finish_reason = step.finish[i]
        if step.tokens is not None:
            self.tokens += step.tokens[i]
            self.counted = True
        if step.logprobs is not None and step.logprobs[i]:
            self.logprobs.extend(step.logprobs[i])


async def collect(run: Run, n: int) -> list[Choice]:
    """Every step of a run, added up per choice."""
    choices = [Choice() for _ in range(n)]
    while (step := await run.step()) is not None:
        for i, choice in enumerate(choices):
            choice.add(step, i)
    return choices


class Usage:
    """A request's token counts: the model's own when it reports them, else its tokenizer's count."""

    __slots__ = ("_runs", "_uncounted", "completion_tokens", "llm", "prompt_tokens")

    def __init__(self, llm: LLMModel) -> None:
        self.llm = llm
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self._uncounted: list[str] = []
        self._runs: list[Run] = []  # their cached prompt tokens are read when the usage is written

    def add_prompt(self, run: Run, prompt: str | list[int]) -> None:
        self._runs.append(run)
        if run.prompt_tokens is not None:
            self.prompt_tokens += run.prompt_tokens
        elif isinstance(prompt, list):
            self.prompt_tokens += len(prompt)
        else:
            self.prompt_tokens += self.llm.count_tokens(prompt)

    def add_step(self, step: Step) -> None:
        if step.tokens is not None:
            self.completion_tokens += sum(step.tokens)
        else:
            self._uncounted.extend(t for t in step.texts if t)

    def add_choice(self, choice: Choice) -> None:
        self.completion_tokens += choice.tokens if choice.counted else self.llm.count_tokens(choice.text)

    def doc(self) -> dict:
        if self._uncounted:
            self.completion_tokens += self.llm.count_tokens("".join(self._uncounted))
            self._uncounted = []
        doc = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
               "total_tokens": self.prompt_tokens + self.completion_tokens}
        cached = [run.cached_tokens for run in self._runs if run.cached_tokens is not None]
        if cached:  # asked for (--enable-prompt-tokens-details) and reported by the engine
            doc["prompt_tokens_details"] = {"cached_tokens": sum(cached)}
        return doc


class Chunks:
    """The SSE events of one streamed request's chunks, ``{**header, "choices": [choice]}`` (and ``usage`` with
    continuous usage stats): the header's JSON is written once per request, so a chunk costs its choice's JSON,
    and a chunk of plain content (:meth:`text`) only its text's. The bytes are those of :func:`chunk_event`."""

    __slots__ = ("_head",)

    def __init__(self, header: dict) -> None:
        whole = orjson.dumps({**header, "choices": []})
        self._head = b"data: " + whole[:-2]  # ... "choices":[

    def choice(self, choice: dict, usage: Usage | None = None) -> bytes:
        tail = b"]}\n\n" if usage is None else b'],"usage":' + orjson.dumps(usage.doc()) + b"}\n\n"
        return self._head + orjson.dumps(choice) + tail

    def text(self, index: int, text: str) -> bytes:
        """The chunk of ``{"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}``."""
        return b'%s{"index":%d,"delta":{"content":%s},"logprobs":null,"finish_reason":null}]}\n\n' % (
            self._head, index, orjson.dumps(text))


def text_writer(write, render, usage: Usage, run: Run):
    """A stream's taker of a delta of plain text of its one choice (``DeltaStream.write_through``): the chunk
    ``render(text)`` written to the connection at once (the bytes the stream's events would yield for it), its tokens
    counted, its prompt tokens kept on the run, as the events and :meth:`Run.step` read them; False for the last
    delta, one with the prompt's log probabilities or cached tokens, and where the connection cannot take it now.
    It runs in the engine's output handler: it must not raise."""

    def take(delta) -> bool:
        if delta.finish[0] is not None or delta.cached_tokens is not None or delta.prompt_logprobs is not None:
            return False
        text = delta.texts[0]
        try:
            if text and not write(render(text)):
                return False
        except Exception:  # noqa: BLE001 - the reader meets it again
            return False
        usage.add_step(delta)
        if delta.prompt_tokens is not None:  # (what Run._keep reads of such a delta)
            run.prompt_tokens = delta.prompt_tokens
        return True

    return take


def chunk_event(header: dict, choice: dict, usage: Usage | None = None) -> bytes:
    """The SSE event of one streamed chunk holding ``choice``; ``usage`` (continuous usage stats) adds the
    counts so far."""
    chunk = {**header, "choices": [choice]}
    if usage is not None:
        chunk["usage"] = usage.doc()
    return event(chunk)
