"""One request's generation: engine deltas in, responses out, abort on cancellation, LLM metrics.

Runs as its own task on the server's loop, so requests never wait for one another: the engine
batches them continuously. Prompts are tokenized off the loop, those that arrive together in one hand-off
to the engine's tokenizer thread (:class:`_Tokenizing`). A streamed request (``stream`` true on a protocol that streams) gets one
response per engine step with only the new text, the last one FINAL; any other gets one response
with the whole text. A cancelled request is aborted in the engine within a step, which frees its
KV-cache blocks. A request's sampling dict becomes vLLM's ``SamplingParams`` here too (:func:`make_sampling_params`,
below: the generation is its one user).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any

import msgspec
import numpy as np
from vllm.exceptions import GracefulHTTPError, QueueOverflowError, VLLMClientError, VLLMValidationError
from vllm.renderers.inputs.preprocess import parse_model_prompt
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

from tideserve.llm_backends.metrics import GenerationTracker, LLMMetrics
from tideserve.backend_api import (
    Cancelled,
    DeadlinePassed,
    InferenceRequest,
    InternalError,
    InvalidArgument,
    QueueFull,
    ServerError,
    Unavailable,
)

from .engine import DeadlineProbe
from .inputs import RETURN_CACHED_TOKENS, parse_inputs
from .lora import LORA_NAME, Adapters
from .outputs import ResponseBuilder

log = logging.getLogger(__name__)


class _AbortBatch:
    """The engine aborts asked for in one loop turn, sent to the engine as one call (``AsyncLLM.abort`` takes a list
    of ids): under an admission flood the deadlines of a retry burst fire together, and one abort each was one
    task, one message to the engine core and one encoding apiece on the loop that also reads the next requests."""

    __slots__ = ("engine", "loop", "pending")

    def __init__(self, engine: AsyncLLM, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self.loop = loop
        self.pending: list[tuple[str, bool]] = []

    def add(self, request_id: str, quiet: bool) -> None:
        """Abort ``request_id`` with the others of this turn (on the loop's thread)."""
        if not self.pending:
            self.loop.call_soon(self._flush)
        self.pending.append((request_id, quiet))

    def _flush(self) -> None:
        batch, self.pending = self.pending, []
        if batch:
            self.loop.create_task(self._abort(batch))

    async def _abort(self, batch: list[tuple[str, bool]]) -> None:
        # the words Triton's vLLM backend logs (its request-cancellation test reads them); a deadline's refusal
        # (quiet) at debug level: no two lines per request in a flood
        for request_id, quiet in batch:
            log.log(logging.DEBUG if quiet else logging.INFO, "[vllm] Cancelling the request '%s'", request_id)
        await self.engine.abort([request_id for request_id, _ in batch])
        for request_id, quiet in batch:
            log.log(logging.DEBUG if quiet else logging.INFO, "[vllm] Successfully cancelled the request '%s'",
                    request_id)


class _Abort:
    """Aborts one engine request once, from a cancellation callback on any thread or from the loop (with the other
    aborts of the loop's turn: :class:`_AbortBatch`)."""

    __slots__ = ("batch", "done", "engine", "loop", "quiet", "request_id", "requested")

    def __init__(self, engine: AsyncLLM, request_id: str, loop: asyncio.AbstractEventLoop,
                 batch: _AbortBatch | None = None) -> None:
        self.engine = engine
        self.request_id = request_id
        self.loop = loop
        self.batch = batch if batch is not None else _AbortBatch(engine, loop)
        self.done = False
        self.requested = False  # the request was cancelled (read per step: a flag, no call)
        self.quiet = False  # a deadline's refusal: logged at debug level (no two lines per request in a flood)

    def on_cancel(self) -> None:
        self.requested = True
        try:
            self.loop.call_soon_threadsafe(self._start)
        except RuntimeError:  # the loop is closed: the engine is gone with it
            pass

    def on_loop(self, quiet: bool = False) -> None:
        """As :meth:`on_cancel`, from the loop's own thread (no wake-up of the loop, no turn of its own: the abort
        goes with the others of this turn)."""
        self.quiet = quiet
        self._start()

    def _start(self) -> None:
        if not self.done:
            self.done = True
            self.batch.add(self.request_id, self.quiet)


class _Tokenizing:
    """Tokenizes prompts on the engine renderer's thread, those that arrive together in one hand-off.

    vLLM's own ``render_cmpl_async`` hands each prompt to the renderer's thread and back: two wake-ups and a
    wait for the interpreter lock per prompt, taken in turn with the event loop. When many requests arrive at
    once (a burst of streams) those hand-offs queue one behind another while the loop also parses the requests,
    and the last prompt reaches the engine hundreds of milliseconds after the first (measured with
    ``bench/chat_ttft_probe.py``: 128 streams, 200-400 ms from the first prompt to the last on two cores). Here
    the prompts that came while the thread was busy go together in the next hand-off, each still rendered by the
    renderer's own synchronous ``render_cmpl`` (the same tokenization, the same engine input, one prompt's
    failure its own), on the renderer's thread where the engine tokenizes everything else (its tokenizer is not
    used by two threads at once)."""

    __slots__ = ("_executor", "_own", "_pending", "_running", "renderer")

    def __init__(self, renderer) -> None:
        self.renderer = renderer
        executor = getattr(renderer, "_executor", None)  # the renderer's tokenizer thread (vLLM's own pool)
        self._own = not isinstance(executor, Executor)
        self._executor: Executor = ThreadPoolExecutor(1, thread_name_prefix="vllm-tokenize") if self._own \
            else executor
        self._pending: list[tuple[Any, Any, asyncio.Future]] = []
        self._running = False

    async def render(self, parsed, tok_params):
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending.append((parsed, tok_params, future))
        if not self._running:
            self._running = True
            loop.create_task(self._drain())  # from the next turn: what arrives in this one goes along
        return await future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        batch: list = []
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                try:
                    results = await loop.run_in_executor(self._executor, self._render_all, batch)
                except Exception as exc:  # the thread is gone (shut down): each prompt fails with it
                    results = [(False, exc)] * len(batch)
                for (_, _, future), (ok, value) in zip(batch, results, strict=True):
                    if not future.done():
                        if ok:
                            future.set_result(value)
                        else:
                            future.set_exception(value)
                batch = []
        finally:
            self._running = False
            for _, _, future in batch + self._pending:  # left by a cancelled drain (the loop's end): fail, not hang
                if not future.done():
                    future.set_exception(Unavailable("the engine's tokenizer stopped"))
            self._pending = []

    def _render_all(self, batch: list) -> list[tuple[bool, Any]]:
        """On the tokenizer thread: each prompt's engine input, or its exception."""
        render = self.renderer.render_cmpl
        out = []
        for parsed, tok_params, _ in batch:
            try:
                out.append((True, render([parsed], tok_params)[0]))
            except Exception as exc:
                out.append((False, exc))
        return out

    def close(self) -> None:
        if self._own:
            self._executor.shutdown(wait=False)


class DeadlineExpired(DeadlinePassed):
    """A request that had not started generating by its deadline: refused (503 + Retry-After, gRPC UNAVAILABLE,
    counted as REJECTED) so that a router or client retries it elsewhere."""


class _CpuWaitProbe:
    """For measurements only (``TIDESERVE_DEADLINE_PROBE=1``): how long the loop's thread waited for a CPU between
    a deadline and its refusal. Every 2 ms (a timer on the loop) it notes the thread's run-queue wait so far as the
    kernel counts it (``/proc/self/task/<tid>/schedstat``); a refusal subtracts the last note taken before its
    deadline (so up to 2 ms before it). What is left of a late timer is the loop's own work."""

    EVERY_S = 0.002

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.fd = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
        self.notes: collections.deque[tuple[int, int]] = collections.deque(maxlen=4096)
        self._note()

    def wait_ns(self) -> int:
        return int(os.pread(self.fd, 96, 0).split()[1])

    def _note(self) -> None:
        self.notes.append((time.monotonic_ns(), self.wait_ns()))
        self.loop.call_later(self.EVERY_S, self._note)

    def waited_since(self, at_ns: int) -> int | None:
        """ns the thread waited for a CPU since ``at_ns`` (None: no note that old)."""
        for noted_at, waited in reversed(self.notes):
            if noted_at <= at_ns:
                return self.wait_ns() - waited
        return None


_PROBE = os.environ.get("TIDESERVE_DEADLINE_PROBE") == "1" and os.path.exists("/proc/self/task")
_probes: dict[asyncio.AbstractEventLoop, _CpuWaitProbe] = {}


def _probe(loop: asyncio.AbstractEventLoop) -> _CpuWaitProbe | None:
    if not _PROBE:
        return None
    probe = _probes.get(loop)
    if probe is None:
        probe = _probes[loop] = _CpuWaitProbe(loop)
    return probe


LOOP_SLICE_ENV = "TIDESERVE_LOOP_SLICE_US"
DEFAULT_LOOP_SLICE_US = 0  # off: on this project's loaded 2-core machine its effect was not shown either way
_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}  # the system call's number (Linux)
_SCHED_FLAG_RESET_ON_FORK = 0x01
_sliced: list[int] = []  # the threads that asked already


def ask_for_short_slice(slice_us: int | None = None) -> bool:
    """Ask the kernel to run the calling thread (the server's event loop) soon after it wakes: a time slice of
    ``slice_us`` (``TIDESERVE_LOOP_SLICE_US``, e.g. 100; default 0: leave it) instead of the default (0.7-3 ms).

    The engine's processes keep the host's cores busy, so the loop thread, woken by a request's bytes or a
    deadline's timer, used to wait for one of them to use up its slice: the way in and the refusal of a request
    under an admission flood came several milliseconds late (``bench/deadlines.py``). Linux's EEVDF scheduler
    (6.12 and later) lets a task with a shorter slice preempt on its wake-up; its share of the CPU is unchanged
    (its nice value is kept), and the threads and processes it starts get the default slice again
    (``SCHED_RESET_ON_FORK``). Elsewhere (another OS, an older kernel, another policy) nothing changes. True
    when the kernel took it."""
    if slice_us is None:
        try:
            slice_us = int(os.environ.get(LOOP_SLICE_ENV, DEFAULT_LOOP_SLICE_US))
        except ValueError:
            slice_us = DEFAULT_LOOP_SLICE_US
    number = _SCHED_SETATTR.get(os.uname().machine)
    tid = threading.get_native_id()
    if slice_us <= 0 or number is None or tid in _sliced:
        return False
    _sliced.append(tid)
    try:
        import ctypes
        import struct

        if os.sched_getscheduler(0) != os.SCHED_OTHER:
            return False
        # struct sched_attr (48 bytes): size, policy, flags, nice, priority, runtime (the slice, ns), deadline,
        # period
        attr = struct.pack("IIQiIQQQ", 48, os.SCHED_OTHER, _SCHED_FLAG_RESET_ON_FORK,
                           os.getpriority(os.PRIO_PROCESS, 0), 0, slice_us * 1000, 0, 0)
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(number, 0, ctypes.create_string_buffer(attr), 0) != 0:
            log.debug("sched_setattr: %s", os.strerror(ctypes.get_errno()))
            return False
    except (OSError, AttributeError, ValueError) as exc:  # no such call here
        log.debug("sched_setattr: %s", exc)
        return False
    log.debug("the event loop's thread %d runs with a %d us time slice", tid, slice_us)
    return True


KV_NEARLY_FULL = 0.9  # the engine's last reported KV-cache usage from which no request counts as placed


class EngineOrder:
    """The requests the server has added to one engine and that have not finished, in the order added: whether
    the engine has a place for a request, its queue deadline's notion of "started".

    A request with a queue deadline (``max_queue_delay_ms``, Triton's ``timeout``, ``x-request-timeout-ms``) that
    has not started by then is refused. Its first token is the plain sign that it started, but it comes one engine
    step (and the way back to the server) after the engine's scheduler took the request in: under an admission
    flood the engine schedules the oldest waiting requests, those closest to their deadlines, and a good share of
    them were refused in that step, their prefill run for nothing and their place in the batch lost for a step.

    With the engine's first-come-first-served policy the server can tell without asking the engine: the engine
    runs at most ``max_num_seqs`` sequences and takes waiting requests in the order they were added, so a request
    with fewer than ``max_num_seqs`` sequences still unfinished ahead of it (itself included) is running or taken
    in at the engine's next step. Such a request counts as started at its deadline and runs on, as a request
    Triton's scheduler has handed to a model instance does. The server's view lags the engine's (a request is
    finished for the server when its last output arrives, after the engine freed its place), so it errs towards a
    refusal. Not used when the engine schedules by priority (its order is not the arrival order) or when its
    KV cache is nearly full (it may hold requests back for want of blocks, not of places).
    """

    __slots__ = ("enabled", "entries", "kv_usage", "max_num_seqs")

    def __init__(self, max_num_seqs: int, enabled: bool = True,
                 kv_usage: Callable[[], float] | None = None) -> None:
        self.max_num_seqs = max_num_seqs
        self.enabled = enabled and max_num_seqs > 0
        self.kv_usage = kv_usage  # the engine's last reported KV-cache usage, 0 to 1 (None: not known)
        self.entries: dict[str, int] = {}  # request id -> its sequences (n), in the order added

    def add(self, request_id: str, sequences: int) -> None:
        self.entries[request_id] = max(1, sequences)

    def remove(self, request_id: str) -> None:
        self.entries.pop(request_id, None)

    def placed(self, request_id: str) -> bool:
        """Whether the engine runs ``request_id`` or takes it in at its next step (see the module docstring)."""
        if not self.enabled or request_id not in self.entries:
            return False
        if self.kv_usage is not None and self.kv_usage() >= KV_NEARLY_FULL:
            return False
        ahead = 0
        for other, sequences in self.entries.items():
            ahead += sequences
            if ahead > self.max_num_seqs:
                return False
            if other == request_id:
                return True
        return False


class _Deadline:
    """Refuses a request that has not started by its deadline: answers it at once and aborts it in the engine. A
    request has started when its first token came or when, at the deadline, the engine has a place for it
    (:class:`EngineOrder`); it is left to run on.

    One loop timer per request, due at the deadline itself. The loop's timers count whole milliseconds from a
    clock read at the start of its turn, so one can fire up to a millisecond early: then it is set again for the
    rest, and no request is refused before its deadline."""

    __slots__ = ("abort", "deadline_ns", "engine_id", "expired", "handle", "limit_ms", "loop", "model_name",
                 "order", "reaborted", "request", "sender", "started")

    def __init__(self, request, sender, deadline_ns: int, limit_ms: float, abort: _Abort, model_name: str) -> None:
        self.request = request
        self.sender = sender
        self.abort = abort
        self.deadline_ns = deadline_ns
        self.limit_ms = limit_ms
        self.model_name = model_name
        self.started = False
        self.expired = False
        self.reaborted = False
        self.order: EngineOrder | None = None  # once added to the engine: its order there, and its id
        self.engine_id = ""
        self.loop = asyncio.get_running_loop()
        self.handle = self.loop.call_later(max(0.0, (deadline_ns - time.monotonic_ns()) / 1e9), self._expire)
        _probe(self.loop)

    def _expire(self) -> None:
        if self.started or self.request.is_cancelled():
            return
        now = time.monotonic_ns()
        if now < self.deadline_ns:  # the timer came early: wait for the rest
            self.handle = self.loop.call_later((self.deadline_ns - now) / 1e9, self._expire)
            return
        if self.order is not None:
            if self.order.placed(self.engine_id):  # the engine runs it or takes it in at its next step: it started
                self.started = True
                DeadlineProbe.count("placed")
                return
            self.order.remove(self.engine_id)  # refused: no longer ahead of the requests after it
        self.expired = True
        DeadlineProbe.count("expired")
        error = deadline_error(self.model_name, self.limit_ms, self.deadline_ns, now)
        if (probe := _probe(self.loop)) is not None:
            error.cpu_wait_ns = probe.waited_since(self.deadline_ns)
        # the answer first (the handler's task is woken before the abort's starts), the engine's abort after it
        self.sender.send_error(error)
        self.abort.on_loop(quiet=True)  # (a no-op in the engine when the request is still rendering: it never gets
        # there)

    def cancel(self) -> None:
        self.handle.cancel()


def deadline_error(model_name: str, limit_ms: float, deadline_ns: int = 0, fired_ns: int = 0) -> DeadlineExpired:
    return DeadlineExpired(f"model '{model_name}': the request did not start generating within its deadline of "
                           f"{limit_ms:g} ms; retry later or on another replica", deadline_ns, fired_ns)


class _Steps:
    """What each engine output of one request does, in the order it comes: the token count for the LLM metrics,
    the deadline (a request refused at its deadline reads on until the engine's abort comes), a cancellation,
    then the output itself: a typed delta or a response to the sender when streamed, kept for the whole answer
    when not."""

    __slots__ = ("abort", "builder", "cached", "deadline", "last", "sender", "streaming", "tracker", "typed")

    def __init__(self, sender, builder: ResponseBuilder, tracker: GenerationTracker, abort: _Abort,
                 deadline: _Deadline | None, streaming: bool, cached: bool) -> None:
        self.sender = sender
        self.builder = builder
        self.typed = builder.typed  # its deltas go to the sender as they are (GenerationStream.send_delta)
        self.tracker = tracker
        self.abort = abort
        self.deadline = deadline
        self.streaming = streaming
        self.cached = cached
        self.last = None  # the latest output

    def take(self, output) -> None:
        self.last = output
        outs = output.outputs
        self.tracker.tokens(len(outs[0].token_ids) if len(outs) == 1 else sum(len(c.token_ids) for c in outs))
        deadline = self.deadline
        if deadline is not None and not deadline.started:
            if deadline.expired:  # answered already; abort again in case it came before the engine had it
                if not deadline.reaborted and any(c.token_ids for c in outs):
                    DeadlineProbe.count("expired_with_tokens")  # (its prefill had run)
                if not output.finished and not deadline.reaborted:
                    deadline.reaborted = True
                    self.abort.batch.add(self.abort.request_id, True)
                return
            deadline.started = True
            deadline.cancel()
            DeadlineProbe.count("started")
        abort = self.abort
        if abort.requested:
            if not output.finished:
                abort.on_loop(abort.quiet)  # (the engine answers with a final 'abort' output)
            return
        if not self.streaming:
            self.builder.add(output)
            return
        if output.finished:  # counted before the last piece goes out (as a whole answer is): a client that reads the
            # metrics once it has the answer finds it there, also when a frontend worker's client ran it
            Generator._finish(self.tracker, output, any(c.finish_reason == "abort" for c in outs))
        if self.typed:
            delta = self.builder.step(output)
            if self.cached and output.finished and output.num_cached_tokens is not None:
                delta.cached_tokens = int(output.num_cached_tokens)
            self.sender.send_delta(delta, output.finished)
        else:
            response = self.builder.delta(output)
            if self.cached and output.finished:
                _note_cached_tokens(response, output)
            self.sender.send(response, final=output.finished)


class _OutputSink:
    """Takes the place of vLLM's ``RequestOutputCollector`` of one request of one sequence: the engine's output
    handler hands each output straight to :meth:`put`, which does the request's step (:class:`_Steps`: the typed
    delta to the reader's stream) in the handler's own turn. The collector would wake the request's generation
    task once per engine step (an ``asyncio.Event``, the task's step, ``AsyncLLM.generate``'s async generator),
    for every request at every step: here the task wakes once, at the end (:attr:`done`). vLLM's own
    ``generate`` keeps its collector for the request's task because that task writes the HTTP chunk; here the
    reader (the HTTP handler's task) is a task of its own either way."""

    __slots__ = ("closed", "done", "steps")

    def __init__(self, steps: _Steps, done: asyncio.Future) -> None:
        self.steps = steps
        self.done = done  # the last output was taken (or the exception that ended the request)
        self.closed = False  # the generation ended otherwise (cancelled, failed): outputs still coming are dropped

    @classmethod
    def attach(cls, engine: AsyncLLM, collector, steps: _Steps) -> _OutputSink | None:
        """Put a sink where the engine's output processor keeps ``collector`` (None: not there, e.g. the request
        already finished: the collector has its outputs). An output that came already goes first."""
        state = engine.output_processor.request_states.get(collector.request_id)
        if state is None or state.queue is not collector:
            return None
        sink = cls(steps, asyncio.get_running_loop().create_future())
        state.queue = sink
        pending, collector.output = collector.output, None
        if pending is not None:
            sink.put(pending)
        if steps.streaming and steps.typed:
            _StepOutputs.install(state, sink)
        return sink

    def put(self, output) -> None:
        """One output of the request (or the exception that ends it), from the engine's output handler: nothing
        may raise into it (it serves every request)."""
        done = self.done
        if self.closed or done.done():
            return
        if isinstance(output, BaseException):
            done.set_exception(output)
            return
        try:
            self.steps.take(output)
        except Exception as exc:
            self.closed = True
            done.set_exception(exc)
            return
        if output.finished:
            self.closed = True
            done.set_result(None)


_MAKE_OUTPUT_PARAMS = ("new_token_ids", "pooling_output", "finish_reason", "stop_reason", "kv_transfer_params",
                       "ec_transfer_params", "error")


def _fits_make_output() -> bool:
    """Whether this vLLM's ``RequestState.make_request_output`` takes the arguments :class:`_StepOutputs` stands in
    for (another release: vLLM's own method serves every step)."""
    import inspect

    try:
        from vllm.v1.engine.output_processor import RequestState

        names = tuple(inspect.signature(RequestState.make_request_output).parameters)[1:]
    except (ImportError, AttributeError, TypeError, ValueError):
        return False
    return names == _MAKE_OUTPUT_PARAMS


_STEP_OUTPUTS = _fits_make_output()


class _StepCompletion:
    """The one completion of a :class:`_StepOutput`: the fields of vLLM's ``CompletionOutput`` a step is read for."""

    __slots__ = ("cumulative_logprob", "finish_reason", "index", "logprobs", "stop_reason", "text", "token_ids")

    def __init__(self) -> None:
        self.index = 0
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs = None
        self.cumulative_logprob = None
        self.finish_reason = None
        self.stop_reason = None


class _StepOutput:
    """A streamed request's unfinished step as :class:`_Steps` reads a ``RequestOutput`` (the same names), one object
    per request filled again at each step: it is read within the step (the typed delta copies what it needs)."""

    __slots__ = ("finished", "metrics", "num_cached_tokens", "outputs", "prompt", "prompt_logprobs",
                 "prompt_token_ids", "request_id")

    def __init__(self, state) -> None:
        self.request_id = state.external_req_id
        self.prompt = state.prompt
        self.prompt_token_ids = state.prompt_token_ids
        self.prompt_logprobs = None
        self.outputs = [_StepCompletion()]
        self.finished = False
        self.metrics = state.stats
        self.num_cached_tokens = state.num_cached_tokens


class _StepOutputs:
    """Stands in for vLLM's ``RequestState.make_request_output`` of one streamed typed request of one sequence (the
    engine's output processor calls it per request per engine step): a step that does not finish the request goes
    to the request's sink as a :class:`_StepOutput` filled in place, with no ``RequestOutput`` and
    ``CompletionOutput`` made per step only to be read back into the typed delta. What it reads is what vLLM's
    method reads for such a step (``RequestOutputKind.DELTA``, a stream interval of 1, no parent request): the
    detokenizer's new text, the new tokens' log probabilities, the cumulative log probability, the prompt's log
    probabilities popped once. The step that finishes the request (a stop, a length, a stop string, an abort), a
    step with transfer parameters, an error or a sampling mask, and anything else are vLLM's own method's: the
    request's last output is vLLM's ``RequestOutput``, as before."""

    __slots__ = ("make", "output", "sink", "state")

    def __init__(self, state, sink: _OutputSink) -> None:
        self.state = state
        self.sink = sink
        self.make = state.make_request_output  # vLLM's own (bound) method
        self.output = _StepOutput(state)

    @classmethod
    def install(cls, state, sink: _OutputSink) -> None:
        if (not _STEP_OUTPUTS or state.parent_req is not None or state.stream_interval != 1
                or state.output_kind != RequestOutputKind.DELTA or state.streaming_input
                or state.detokenizer is None or state.logprobs_processor is None or state.prompt_token_ids is None):
            return
        state.make_request_output = cls(state, sink).__call__

    def __call__(self, new_token_ids, pooling_output, finish_reason, stop_reason, kv_transfer_params=None,
                 ec_transfer_params=None, error=None):
        state = self.state
        if (finish_reason is not None or pooling_output is not None or kv_transfer_params is not None
                or ec_transfer_params is not None or error is not None or state.sampling_mask_chunks):
            if finish_reason is not None:  # the request's last output: vLLM's method again (and no cycle left)
                state.__dict__.pop("make_request_output", None)
            return self.make(new_token_ids, pooling_output, finish_reason, stop_reason, kv_transfer_params,
                             ec_transfer_params, error=error)
        processor = state.logprobs_processor
        output = self.output
        completion = output.outputs[0]
        completion.text = state.detokenizer.get_next_output_text(False, True)
        completion.token_ids = new_token_ids
        logprobs = processor.logprobs
        if logprobs:
            count = len(new_token_ids)
            logprobs = logprobs[-count:] if count else logprobs[:0]
        completion.logprobs = logprobs
        completion.cumulative_logprob = processor.cumulative_logprob
        output.prompt_logprobs = processor.pop_prompt_logprobs()
        processor.pop_prompt_token_id_logprobs()
        output.num_cached_tokens = state.num_cached_tokens
        self.sink.put(output)
        return None  # (taken: the output processor puts nothing in the request's queue)


class Generator:
    """Serves requests on one engine; :meth:`run` is one request, start to FINAL.

    ``max_queue_delay_ms``: the model's limit on a request's wait for its first token (0: none); a request's own
    ``timeout_us`` (Triton's ``timeout`` parameter, ``x-request-timeout-ms``) applies when it is sooner."""

    def __init__(self, engine: AsyncLLM, model_name: str, version: str, metrics: LLMMetrics,
                 output_dtypes: dict[str, np.dtype], adapters: Adapters | None = None,
                 max_queue_delay_ms: int = 0) -> None:
        self.max_queue_delay_ms = max_queue_delay_ms
        self.engine = engine
        self.adapters = adapters or Adapters(model_name, enabled=False)  # LoRA adapters a request may select
        self.model_name = model_name
        self.version = version
        self.metrics = metrics
        self.output_dtypes = output_dtypes
        # a request's priority reaches the engine only when it schedules by priority (model.json
        # "scheduling_policy": "priority"; lower values first, as vLLM orders them); otherwise it is ignored
        self.priority_scheduling = engine.vllm_config.scheduler_config.policy == "priority"
        self.tokenizing = _Tokenizing(engine.renderer)
        self.aborts: _AbortBatch | None = None  # the engine aborts of a loop turn, sent together (on the loop's)
        # the requests in the engine in the order added: at its deadline, one the engine has a place for started
        self.order = EngineOrder(engine.vllm_config.scheduler_config.max_num_seqs,
                                 enabled=not self.priority_scheduling)
        ask_for_short_slice()  # (the loop's thread, beside the engine's busy processes, when asked: see there)

    async def run(self, request) -> None:
        """One request, start to end: a typed generation, whose stream (the DataPlane's ``GenerationStream``, a
        frontend worker's) is the request and takes its deltas, or an InferenceRequest (Triton's tensors, or a
        typed generation a scheduler queued), answered through its ``response_sender``."""
        typed = not isinstance(request, InferenceRequest)  # a typed generation's stream
        sender = request if typed else request.response_sender
        generation = request.generation
        try:
            if generation is not None:  # a typed request, read as it is: its sampling fields become SamplingParams
                inputs = generation
                lora = self.adapters.select(generation.lora_name) if generation.lora_name is not None else None
                params = make_sampling_params(generation.sampling)
                want_prompt_logprobs = generation.prompt_logprobs
                cached = generation.cached_tokens
            else:  # Triton's tensor interface
                inputs = parse_inputs(request)
                lora_name = inputs.sampling.pop(LORA_NAME, None)
                lora = self.adapters.select(lora_name) if lora_name is not None else None
                params = make_sampling_params(inputs.sampling)
                want_prompt_logprobs = "prompt_logprobs" in inputs.outputs
                cached = inputs.cached_tokens
            fit_to_context(params, self.engine.model_config.max_model_len)  # (the OpenAI frontend refuses more)
            if want_prompt_logprobs and params.prompt_logprobs is None:
                params.prompt_logprobs = 0  # the prompt tokens' own log probabilities
            builder = ResponseBuilder(inputs, params.n, self.output_dtypes, self._decode_token)
        except ServerError as exc:
            sender.send_error(exc)
            return
        if request.is_cancelled():
            sender.send_error(Cancelled("the request was cancelled before generation started"))
            return
        deadline_ns, limit_ms = self._deadline(request)
        if deadline_ns and (now := time.monotonic_ns()) >= deadline_ns:
            DeadlineProbe.count("expired")
            DeadlineProbe.count("expired_rendering")  # (before the engine had it)
            sender.send_error(deadline_error(self.model_name, limit_ms, deadline_ns, now))
            return
        streaming = inputs.stream and (typed or request.streaming)
        request_id = f"{self.model_name}-{request.internal_id}"
        loop = asyncio.get_running_loop()
        if self.aborts is None or self.aborts.loop is not loop:
            self.aborts = _AbortBatch(self.engine, loop)
        abort = _Abort(self.engine, request_id, loop, self.aborts)
        # the deadline's timer runs from here: a prompt still rendering (tokenizing) at the deadline is refused then
        deadline = _Deadline(request, sender, deadline_ns, limit_ms, abort, self.model_name) if deadline_ns else None
        try:
            prompt = await self._render(inputs.prompt, inputs.add_special_tokens)
        except Exception as exc:  # the prompt does not fit the model (too long, bad token ids...)
            if deadline is not None:
                deadline.cancel()
            sender.send_error(exc if isinstance(exc, ServerError) else InvalidArgument(f"invalid prompt: {exc}"))
            return
        if deadline is not None and deadline.expired:  # refused while the prompt rendered: never sent to the engine
            DeadlineProbe.count("expired_rendering")
            return
        tracker = GenerationTracker(self.metrics, self.model_name, self.version, arrival=request.arrival_ns / 1e9)
        if typed:
            request.on_cancel(abort.on_cancel)
        else:
            request.cancellation.add_callback(abort.on_cancel)
            cached = cached or request.parameters.get(RETURN_CACHED_TOKENS) is True
        priority = request.priority if self.priority_scheduling else 0
        steps = _Steps(sender, builder, tracker, abort, deadline, streaming,
                       cached)  # what each engine output does
        self.order.add(request_id, params.n)
        if deadline is not None:
            deadline.order, deadline.engine_id = self.order, request_id
        try:
            await self._generate(prompt, params, request_id, lora, priority, steps)
        except asyncio.CancelledError:  # the model is unloading
            if deadline is not None:
                deadline.cancel()
            self._finish(tracker, steps.last, aborted=True)
            sender.send_error(Unavailable(f"model '{self.model_name}' was unloaded while the request ran"))
            raise
        except Exception as exc:
            if deadline is not None:
                deadline.cancel()
            if steps.last is not None:
                self._finish(tracker, steps.last, aborted=True)
            sender.send_error(engine_error(exc))
            return
        finally:
            self.order.remove(request_id)
        last = steps.last
        if deadline is not None:
            deadline.cancel()
            if deadline.expired:  # answered at the deadline (503); the engine has aborted it
                self._finish(tracker, last, aborted=True)
                return
        aborted = request.is_cancelled() or last is None or any(
            c.finish_reason == "abort" for c in last.outputs)
        self._finish(tracker, last, aborted)
        if aborted:
            sender.send_error(Cancelled("the request was cancelled"))
        elif not streaming:
            response = builder.whole()
            if cached:
                _note_cached_tokens(response, last)
            sender.send(response, final=True)

    async def _generate(self, prompt, params: SamplingParams, request_id: str, lora, priority: int,
                        steps: _Steps) -> None:
        """The request in the engine, each of its outputs to ``steps.take`` as it comes, until the last: what
        ``AsyncLLM.generate`` does (the same errors, the same abort when cancelled or failed), without a task
        switch per output for a request of one sequence (:class:`_OutputSink`)."""
        engine = self.engine
        collector = sink = None
        try:
            collector = await engine.add_request(request_id, prompt, params, lora_request=lora, priority=priority)
            if params.n == 1:
                sink = _OutputSink.attach(engine, collector, steps)
            if sink is not None:
                await sink.done
            else:  # several sequences share the collector (or it is not where this vLLM keeps it): read it
                finished = False
                while not finished:
                    output = collector.get_nowait() or await collector.get()
                    finished = output.finished
                    steps.take(output)
        except asyncio.CancelledError:
            if sink is not None:
                sink.closed = True
            if collector is not None:
                await engine.abort(collector.request_id, internal=True)
            raise
        except (EngineDeadError, VLLMClientError, GracefulHTTPError):
            raise
        except Exception as exc:  # as AsyncLLM.generate: aborted, the cause kept
            if sink is not None:
                sink.closed = True
            if collector is not None:
                await engine.abort(collector.request_id, internal=True)
            raise EngineGenerateError() from exc
        finally:
            if collector is not None:
                collector.close()

    def _deadline(self, request) -> tuple[int, float]:
        """When the request must have started generating (monotonic ns; 0: never) and the limit in ms."""
        limits = [ms for ms in (self.max_queue_delay_ms, request.timeout_us / 1000) if ms > 0]
        if not limits:
            return 0, 0.0
        limit_ms = min(limits)
        return request.arrival_ns + int(limit_ms * 1_000_000), limit_ms

    def _decode_token(self, token_id: int) -> str:
        return self.engine.renderer.get_tokenizer().decode([token_id])

    async def _render(self, prompt: str | list[int], add_special_tokens: bool = True):
        """Tokenize (off the loop, in the engine's renderer) and check the prompt against the model."""
        raw = prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}
        parsed = parse_model_prompt(self.engine.model_config, raw)
        renderer = self.engine.renderer
        tok_params = None
        if not add_special_tokens:
            tok_params = dataclasses.replace(renderer.default_cmpl_tok_params, add_special_tokens=False)
        return await self.tokenizing.render(parsed, tok_params)

    def close(self) -> None:
        self.tokenizing.close()

    @staticmethod
    def _finish(tracker: GenerationTracker, last: Any, aborted: bool) -> None:
        prompt_tokens = len(last.prompt_token_ids or ()) if last is not None else 0
        queue_time = None
        stats = getattr(last, "metrics", None)
        scheduled = getattr(stats, "scheduled_ts", 0.0)
        queued = getattr(stats, "queued_ts", 0.0)
        if scheduled and queued:
            queue_time = max(0.0, scheduled - queued)
        tracker.finish(prompt_tokens, queue_time, aborted=aborted)


def _note_cached_tokens(response, output: Any) -> None:
    """The prompt tokens the engine's prefix cache served, as the response parameter ``num_cached_tokens``."""
    if output is not None and output.num_cached_tokens is not None:
        if response.generation is not None:
            response.generation.cached_tokens = int(output.num_cached_tokens)
        else:
            response.parameters["num_cached_tokens"] = int(output.num_cached_tokens)


def engine_error(exc: BaseException) -> ServerError:
    """An engine exception as the ServerError a client sees."""
    if isinstance(exc, ServerError):
        return exc
    if isinstance(exc, VLLMClientError):
        return InvalidArgument(str(exc))
    if isinstance(exc, QueueOverflowError):  # the engine's own max_num_queued_reqs
        return QueueFull(f"the vLLM engine rejected the request: {exc}")
    if isinstance(exc, GracefulHTTPError):  # admission control: the engine's queue is full
        return Unavailable(f"the vLLM engine rejected the request: {exc}")
    if isinstance(exc, EngineDeadError):
        return Unavailable(f"the vLLM engine is dead: {exc}")
    cause = exc.__cause__
    if isinstance(exc, EngineGenerateError) and cause is not None:
        if isinstance(cause, VLLMClientError | ValueError | TypeError):
            return InvalidArgument(str(cause))
        return InternalError(f"{type(cause).__name__}: {cause}")
    log.debug("generation failed", exc_info=exc)
    return InternalError(f"{type(exc).__name__}: {exc}")


# -- sampling parameters --------------------------------------------------------------------------------------
#
# Sampling parameters from a request's JSON into vLLM's ``SamplingParams``, with errors that name the field.
#
# Keys are ``SamplingParams`` fields (as Triton's vLLM backend takes them). Values may be JSON-typed or
# strings that convert (``"0.7"``, ``"true"``: Triton's clients send strings). An unknown key, a value of
# the wrong type and any of vLLM's own range checks (``temperature`` < 0, ``max_tokens`` < 1...) raise
# :class:`~tideserve.errors.InvalidArgument`.

# Fields that are the engine's business, not the client's.
_INTERNAL = frozenset({"output_kind", "skip_clone", "output_text_buffer_length"})
ALLOWED = frozenset(f.name for f in msgspec.structs.fields(SamplingParams)
                    if not f.name.startswith("_") and f.name not in _INTERNAL)
_AT_FIELD = re.compile(r" - at `\$\.([A-Za-z0-9_]+)[^`]*`$")


def make_sampling_params(raw: dict[str, Any]) -> SamplingParams:
    """``SamplingParams`` streaming deltas (RequestOutputKind.DELTA) from a request's sampling dict."""
    for key in raw:
        if key not in ALLOWED:
            raise InvalidArgument(f"unknown sampling parameter '{key}'; the vllm backend takes the fields of "
                                  "vLLM's SamplingParams (e.g. max_tokens, temperature, top_p, top_k, stop, seed)")
    values = dict(raw)
    if isinstance(values.get("structured_outputs"), str):  # Triton's backend takes it as a JSON string
        try:
            values["structured_outputs"] = json.loads(values["structured_outputs"])
        except ValueError as exc:
            raise InvalidArgument(f"sampling parameter 'structured_outputs' is not valid JSON: {exc}") from None
    try:
        params = msgspec.convert(values, SamplingParams, strict=False)
    except msgspec.ValidationError as exc:
        message = str(exc)
        match = _AT_FIELD.search(message)
        if match:
            message = message[:match.start()]
            raise InvalidArgument(f"invalid sampling parameter '{match.group(1)}': {message}") from None
        raise InvalidArgument(f"invalid sampling parameters: {message}") from None
    except VLLMValidationError as exc:
        name = exc.parameter or _named_field(str(exc))
        where = f" '{name}'" if name else "s"
        raise InvalidArgument(f"invalid sampling parameter{where}: {exc}") from None
    except (TypeError, ValueError) as exc:
        name = _named_field(str(exc))
        where = f" '{name}'" if name else "s"
        raise InvalidArgument(f"invalid sampling parameter{where}: {exc}") from None
    params.output_kind = RequestOutputKind.DELTA
    return params


def fit_to_context(params: SamplingParams, max_model_len: int) -> None:
    """``max_tokens`` beyond the context window is no error on Triton's tensor interface (as Triton's vLLM
    backend, the engine stops at the context length): cut it to the window, so no value is too large to pass
    to the engine core."""
    if params.max_tokens is not None and params.max_tokens > max_model_len:
        params.max_tokens = max_model_len


def _named_field(message: str) -> str | None:
    """The sampling field a vLLM message starts with (``"min_p must be in [0, 1]..."``), if any."""
    first = message.split(" ", 1)[0].strip("`'\":")
    return first if first in ALLOWED else None
