"""``--frontend-direct on``: the model process's side of the frontend workers' direct links.

When the core asks (``OpenDirect``), the instance process listens on a Unix socket (in a directory only the
server's user can enter) for links from the frontend workers (``tideserve.workers.direct``). Requests that come
that way meet a scheduler here, the one the core would use for the model (the dynamic batcher with the model's
``dynamic_batching`` settings, else one request per execute), whose batches run on the instance's thread between
the batches the core sends (BLS calls, ensembles, requests that are not eligible). Its queue is this instance's
own, where Triton keeps one per model.

All of it lives on the instance's thread: that thread runs an event loop of its own (``InstanceThread.serve``)
with the links, the scheduler and its timers, and runs each batch inline, so a batch costs no hand-over between
threads (no wake-up of the instance's thread and none back, no contention for the GIL); the work the core posts to
the thread runs between the loop's callbacks. A decoupled model's links stay on the process's main loop, which
hands each batch to the instance's thread: what such a model sends while it executes, or from threads of its own,
leaves at once instead of after the batch.

What this process runs for direct requests it counts in a ``ModelStats`` of its own, as the core would count
them (success, failure and its reason, queue, compute, batches, executions, latency histograms); the core asks
for those counters (``DirectStats``) before it answers statistics or ``/metrics``, and adds them. An unload
first drains (``DirectDrain``): new requests are handed back to the worker (``retry``: it sends them through
the core) while those in flight finish. A worker whose link closes has its requests cancelled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import logging
import mmap
import os
import threading
import time

from tideserve.backend_api import (
    DIRECT_EXECUTING,
    DIRECT_QUEUE_SUFFIX,
    DIRECT_QUEUE_WORD,
    DIRECT_RUN_SHIFT,
    DIRECT_SHORT_RUN_US,
    DIRECT_SHORT_RUNS,
    BodyDecoder,
    DirectAnswer,
    DirectAnswers,
    DirectJson,
    DirectScheduler,
    DirectSubmit,
    DirectToProcess,
    DynamicBatcher,
    InstanceSlot,
    ModelRuntime,
    ModelStats,
    ResponseSender,
    ServerError,
    Status,
    direct_run_stamp,
    wire,
)

from .backend import ModelExit, PythonInstance
from .scope import set_direct_batch

log = logging.getLogger(__name__)

_FAILURE_REASON = {Status.CANCELLED: "CANCELED", Status.UNAVAILABLE: "REJECTED"}


class _Runtime:
    """What the schedulers and ``ModelRuntime.execute`` read of a model version: here, this one instance."""

    execute = ModelRuntime.execute
    _started, _ended, _batcher_hook = ModelRuntime._started, ModelRuntime._ended, ModelRuntime._batcher_hook
    _send_returned = ModelRuntime._send_returned
    rate_limiter = None

    def __init__(self, name: str, config, instance, stats: ModelStats, server: DirectServer) -> None:
        self.name = name
        self.config = config
        self.stats = stats
        self.decoupled = config.model_transaction_policy.decoupled
        loop = asyncio.get_running_loop()
        self.slots = [InstanceSlot(_HandOff(instance, loop) if self.decoupled else _Inline(instance, server))]


class _Inline:
    """The instance as the direct scheduler runs it on the instance's own thread (the loop's): a batch runs inline,
    the loop waiting for it as the instance's thread would. What arrived meanwhile is read before the next batch
    forms (as a queue would have held it), and counts as queued from no later than the batch's start."""

    __slots__ = ("instance", "ctx", "server")
    hold = None  # the schedulers here run what the core never sees (ModelInstance.hold)

    def __init__(self, instance: PythonInstance, server: DirectServer) -> None:
        self.instance = instance
        self.ctx = instance.ctx
        self.server = server

    async def execute(self, requests) -> None:
        instance, server = self.instance, self.server
        thread = instance.thread
        server.held_from = time.monotonic_ns()
        loop = server.loop  # the loop this runs on (asking asyncio costs a getpid system call on 3.11)
        asyncio.events._set_running_loop(None)  # model code sees no running loop, as on the plain thread
        thread.busy = True
        set_direct_batch(True)
        try:
            answers = instance.run_execute(requests)
        except ModelExit as exc:
            instance.on_exit(exc)  # in a model process: it ends here
            raise
        finally:
            set_direct_batch(False)
            thread.busy = False
            asyncio.events._set_running_loop(loop)
            server.held_until = time.monotonic_ns()
        PythonInstance.answer(answers)
        # a turn of the loop, whose poll reads what the links delivered during the batch, before the batcher looks
        # at its queue again; after a long batch a few (a link that connected meanwhile is accepted in one turn,
        # made in the next, read in the third)
        await asyncio.sleep(0)
        if server.held_until - server.held_from > LONG_BATCH_NS:
            await asyncio.sleep(0)
            await asyncio.sleep(0)


class _HandOff:
    """A decoupled model's instance, whose loop runs on the process's main thread: each batch is handed to the
    instance's thread, which wakes the loop with one callback when it is done. (A decoupled model sends its
    responses while it executes, and from threads of its own: the loop writes them at once, never held behind the
    batch that runs.)"""

    __slots__ = ("instance", "ctx", "loop")
    hold = None

    def __init__(self, instance: PythonInstance, loop: asyncio.AbstractEventLoop) -> None:
        self.instance = instance
        self.ctx = instance.ctx
        self.loop = loop

    async def execute(self, requests) -> None:
        done = self.loop.create_future()
        self.instance.thread.post(self._run, requests, done)
        answers = await done
        PythonInstance.answer(answers)

    def _run(self, requests, done: asyncio.Future) -> None:
        """On the instance's thread."""
        set_direct_batch(True)
        try:
            answers, error = self.instance.run_execute(requests), None
        except ModelExit as exc:
            self.instance.on_exit(exc)  # in a model process: it ends here
            answers, error = None, exc
        except BaseException as exc:  # noqa: BLE001 - the batch's error, raised where execute is awaited
            answers, error = None, exc
        finally:
            set_direct_batch(False)
        try:
            self.loop.call_soon_threadsafe(_settle, done, answers, error)
        except RuntimeError:  # the loop is closed: the process is exiting
            pass


def _settle(done: asyncio.Future, answers, error: BaseException | None) -> None:
    if done.done():
        return
    if error is None:
        done.set_result(answers)
    else:
        done.set_exception(error)


LONG_BATCH_NS = 1_000_000  # an inline batch this long is followed by a few loop turns (see _Inline), not one

# The event loop's timers run no finer than this: uvloop rounds a shorter delay to "at once" (asyncio's own loop
# up to a millisecond), so a batcher that waits out a 100 us max_queue_delay with them spins through loop turns
# for the whole delay.
LOOP_TIMER_RESOLUTION_S = 0.001
# A lone request (nothing else queued: low load, where its latency is the request's whole cost) waits out a delay up
# to this long through loop turns instead of the timerfd, whose wake-up from the poll comes tens of microseconds
# late (Triton's add_sub waits 100 us); more requests queued wait on the timerfd, and the CPU stays free for the
# other processes. TIDESERVE_DIRECT_SPIN_US overrides it (0: never spin).
SPIN_MAX_S = float(os.environ.get("TIDESERVE_DIRECT_SPIN_US", "100")) / 1e6


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop where it is installed (its timers fire on the loop's next turn for delays under a
    millisecond), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class _FineTimer:
    """A sub-millisecond timer for the loop: a Linux ``timerfd`` the loop watches, so the loop sleeps in its
    poll until the deadline or I/O, whichever comes first (arming and disarming are one system call each; no
    thread, no spinning)."""

    _CLOCK_MONOTONIC = 1
    _TFD_FLAGS = os.O_NONBLOCK | os.O_CLOEXEC  # TFD_NONBLOCK | TFD_CLOEXEC

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        libc = ctypes.PyDLL(None, use_errno=True)  # holds the GIL: the calls never block, and a release would
        # hand the GIL to the instance's thread in the middle of the loop's turn
        self._settime = libc.timerfd_settime
        self._settime.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec), ctypes.c_void_p)
        fd = libc.timerfd_create(self._CLOCK_MONOTONIC, self._TFD_FLAGS)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create")
        self.fd = fd
        self._spec = _Itimerspec()
        self._off = _Itimerspec()
        self._armed = False
        self._waiter: asyncio.Future | None = None
        loop.add_reader(fd, self._expired)

    @classmethod
    def create(cls, loop: asyncio.AbstractEventLoop) -> _FineTimer | None:
        """A fine timer, or None where the system has no timerfd (the loop's own timers are used then)."""
        try:
            return cls(loop)
        except (OSError, AttributeError, NotImplementedError):
            return None

    def arm(self, timeout: float, waiter: asyncio.Future) -> None:
        value = self._spec.it_value
        value.tv_sec = 0
        value.tv_nsec = max(int(timeout * 1e9), 1)
        self._settime(self.fd, 0, self._spec, None)
        self._armed = True
        self._waiter = waiter

    def disarm(self, waiter: asyncio.Future) -> None:
        if self._waiter is waiter:
            self._waiter = None
            if self._armed:  # the wait ended early (a request came): the timer must not wake the loop for nothing
                self._armed = False
                self._settime(self.fd, 0, self._off, None)

    def _expired(self) -> None:
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            return
        self._armed = False
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def close(self) -> None:
        try:
            self.loop.remove_reader(self.fd)
        finally:
            os.close(self.fd)


# An instance whose batches run shorter than this on average (TIDESERVE_DIRECT_SHORT_RUN_US) collects the workers'
# next requests behind the batch it runs, until a full batch waits, rather than have them wake another instance
SHORT_RUN_NS = DIRECT_SHORT_RUN_US * 1000


class _QueueWord:
    """The requests this instance's batcher holds (queued, not yet in a batch), plus ``DIRECT_EXECUTING`` while it
    runs a batch (and when it started) and ``DIRECT_SHORT_RUNS`` while its batches run short, in a shared word the
    frontend workers read when they pick an instance (``tideserve.workers.direct``): a file beside the instance's socket
    (``<socket>.queue``, in the same private directory), one native 8-byte integer written by this process only."""

    def __init__(self, path: str) -> None:
        self.path = path + DIRECT_QUEUE_SUFFIX
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, DIRECT_QUEUE_WORD.size)
            self.map = mmap.mmap(fd, DIRECT_QUEUE_WORD.size)
        finally:
            os.close(fd)
        self.value = 0
        self.queued = 0
        self.running = 0  # DIRECT_EXECUTING while the instance runs a batch
        self.short = 0  # DIRECT_SHORT_RUNS while its batches run short
        self.mean_run_ns = -1.0  # the running mean of its batches' time (-1: none ran yet)

    def set(self, queued: int) -> None:
        self.queued = queued
        self._write()

    def executing(self, running: bool, started_ns: int = 0) -> None:
        self.running = DIRECT_EXECUTING + (direct_run_stamp(started_ns) << DIRECT_RUN_SHIFT) if running else 0
        self._write()

    def ran(self, elapsed_ns: int) -> None:
        """A batch ran for ``elapsed_ns``: its running mean (the last 8 or so batches) says whether they run short."""
        mean = self.mean_run_ns
        mean = self.mean_run_ns = elapsed_ns if mean < 0 else mean + (elapsed_ns - mean) / 8
        self.short = DIRECT_SHORT_RUNS if mean < SHORT_RUN_NS else 0

    def _write(self) -> None:
        value = self.queued + self.running + self.short
        if value != self.value:
            self.value = value
            DIRECT_QUEUE_WORD.pack_into(self.map, 0, value)

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except OSError:
            pass


class _DirectBatcher(DynamicBatcher):
    """The model's dynamic batcher, whose waits shorter than the loop's timers can time go to a fine timer."""

    take_ready = None  # run() marks each batch in the queue word: every batch goes through it, none taken on a thread

    def __init__(self, runtime, queue: _QueueWord | None = None) -> None:
        super().__init__(runtime)
        self._fine = _FineTimer.create(asyncio.get_running_loop())
        self.queue_word = queue

    async def next_batch(self):
        batch = await super().next_batch()
        if self.queue_word is not None:
            self.queue_word.set(self.pending())
        return batch

    async def run(self, slot, batch) -> None:
        word = self.queue_word
        if word is None:
            await super().run(slot, batch)
            return
        started = time.monotonic_ns()
        word.executing(True, started)  # the workers send the next requests to an instance that is free, as one queue
        # would (or, where its batches run short, behind this one, for as long as it runs short)
        try:
            await super().run(slot, batch)
        finally:
            word.ran(time.monotonic_ns() - started)
            word.executing(False)

    async def _sleep(self, timeout: float | None) -> None:
        if timeout is None or self._fine is None or not 0 < timeout < LOOP_TIMER_RESOLUTION_S:
            await super()._sleep(timeout)
            return
        if timeout <= SPIN_MAX_S and self.pending() <= 1:
            await asyncio.sleep(0)  # one loop turn (its poll takes what arrived), then the batcher looks again
            return
        waiter = self._waiter = self._fine.loop.create_future()
        self._fine.arm(timeout, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            self._fine.disarm(waiter)


class _Entry:
    """A direct request in flight, as its responses and a cancellation need it. It holds the request's arrival and
    cancellation token, not the request: the request holds its response sender, whose sink holds this entry, and a
    reference back would make every request a cycle that only the garbage collector frees (17 objects a request)."""

    __slots__ = ("arrival_ns", "cancellation", "counted", "encoding", "first")

    def __init__(self, request, encoding=None) -> None:
        self.arrival_ns = request.arrival_ns
        self.cancellation = request.cancellation
        self.first = True
        self.counted = False  # its success or failure is recorded (a cancellation records it at once)
        self.encoding = encoding  # an HTTP body's: how its answer is written (a DecodedRequest without the request)


class _Connection(asyncio.Protocol):
    """One frontend worker's link."""

    def __init__(self, server: DirectServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.reader = wire.FrameReader(DirectToProcess)
        self.requests: dict[int, _Entry] = {}
        self._out: list[DirectAnswer] = []
        self._flush_scheduled = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server.connections.add(self)
        log.debug("instance '%s': a frontend worker linked directly", self.server.stub.spec.label)

    def connection_lost(self, exc) -> None:
        self.transport = None
        self.server.connections.discard(self)
        for rid in list(self.requests):  # the worker is gone: nobody reads the answers
            self.server.cancel(self, rid)

    def data_received(self, data: bytes) -> None:
        server = self.server
        for message in self.reader.feed(data):
            if type(message) is DirectSubmit:
                for request in message.requests:
                    server.submit(self, request)
                for body in message.bodies:
                    server.submit_body(self, body)
            else:
                server.cancel(self, message.rid)

    def send(self, message: DirectAnswer) -> None:
        """Queue ``message`` (on the loop): what one turn of the loop sends leaves in one message."""
        if self.transport is None:
            return
        self._out.append(message)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.server.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        out, transport = self._out, self.transport
        if out and transport is not None and not transport.is_closing():
            try:
                transport.write(wire.frame(out[0] if len(out) == 1 else DirectAnswers(out)))
            except Exception:  # an output the link cannot carry: each answer alone, that one as an error
                for message in out:
                    transport.write(self._framed(message))
        self._out = []

    def _framed(self, message: DirectAnswer) -> bytes:
        try:
            return wire.frame(message)
        except Exception as exc:  # noqa: BLE001 - as in DirectServer._respond: the final one answers the error
            log.exception("model '%s': a response cannot be sent to the frontend", self.server.runtime.name)
            if not message.response.final:
                return b""
            return wire.frame(DirectAnswer(message.rid, wire.Response(error=wire.error_data(exc))))


class DirectServer:
    """The instance's listening socket, its scheduler and its counters."""

    def __init__(self, stub, path: str) -> None:
        self.stub = stub
        self.path = path
        self.loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        model = stub.model
        config = model.config
        self.stats = ModelStats(model.ctx.name, str(model.ctx.version), metrics=True)  # with its histograms
        self.version = str(model.ctx.version)
        self._bodies: BodyDecoder | None = None  # made at the first HTTP body
        self.runtime = _Runtime(model.ctx.name, config, stub.instance, self.stats, self)
        self.queue_word: _QueueWord | None = None
        if config.HasField("dynamic_batching"):
            try:
                self.queue_word = _QueueWord(path)
            except OSError as exc:  # the workers pick without it
                log.debug("instance '%s': no queue word: %s", stub.spec.label, exc)
            self.scheduler = _DirectBatcher(self.runtime, self.queue_word)
        else:
            self.scheduler = DirectScheduler(self.runtime)
        self.max_batch_size = config.max_batch_size
        self.connections: set[_Connection] = set()
        self.inflight = 0
        self.draining = False
        self.held_from = self.held_until = 0  # the last batch that ran inline, which held the links unread
        self._idle = asyncio.Event()
        self._idle.set()
        self._server: asyncio.AbstractServer | None = None

    @classmethod
    async def open(cls, stub, path: str) -> DirectServer:
        """(On the process's main loop.) A server listening at ``path``, run by an event loop on the instance's
        thread, which serves that loop from now on (until the thread stops); a decoupled model's on this loop."""
        if stub.model.config.model_transaction_policy.decoupled:  # its loop stays on the main thread (_HandOff)
            return await cls._start(stub, path)
        opened: concurrent.futures.Future = concurrent.futures.Future()
        stub.instance.thread.post(cls._serve, stub, path, opened)
        return await asyncio.wrap_future(opened)

    @classmethod
    def _serve(cls, stub, path: str, opened: concurrent.futures.Future) -> None:
        """On the instance's thread: make the server, then run its loop (and the thread's other work) on it."""
        loop = new_event_loop()
        try:
            server = loop.run_until_complete(cls._start(stub, path))
        except BaseException as exc:  # noqa: BLE001 - OpenDirect's failure
            loop.close()
            opened.set_exception(exc)
            return
        opened.set_result(server)
        try:
            stub.instance.thread.serve(loop)
        finally:
            server._close_loop()

    @classmethod
    async def _start(cls, stub, path: str) -> DirectServer:
        server = cls(stub, path)
        await server.scheduler.start()
        server._server = await server.loop.create_unix_server(lambda: _Connection(server), path)
        return server

    def _close_loop(self) -> None:
        """The thread stopped serving the loop (the instance is finalized): end what runs on it."""
        loop = self.loop
        try:
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            if tasks:
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            if self._server is not None:
                self._server.close()
            for connection in list(self.connections):
                if connection.transport is not None:
                    connection.transport.abort()
        except Exception:  # noqa: BLE001 - the process is ending
            log.debug("instance '%s': closing the direct links' loop", self.stub.spec.label, exc_info=True)
        finally:
            loop.close()
            if self.queue_word is not None:
                self.queue_word.close()

    def counters(self) -> dict:
        """(From any thread: the process's main loop asks while the instance's runs its batches.)"""
        for _ in range(9):
            try:
                return self._counters()
            except RuntimeError:  # a counter's dictionary grew while it was read: read again
                continue
        return self._counters()

    def _counters(self) -> dict:
        counters = self.stats.export()
        counters["pending"] = self.scheduler.pending()  # nv_inference_pending_request_count, as of now
        counters["inflight"] = self.inflight  # GET /load's server_load, as of now
        return counters

    async def drain(self, timeout: float) -> dict:
        """(On the process's main loop.) Take no new request (the workers send them through the core), wait for
        those in flight."""
        self.draining = True  # read where a request arrives: no hop needed to refuse the next ones
        if self.loop is asyncio.get_running_loop():
            return await self._drain(timeout)
        waited = asyncio.run_coroutine_threadsafe(self._drain(timeout), self.loop)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(waited), timeout + 1.0)
        except TimeoutError:  # a batch holds the instance's thread past the drain's time
            log.warning("instance '%s': direct requests still running after %.0fs", self.stub.spec.label, timeout)
            return self.counters()

    async def _drain(self, timeout: float) -> dict:
        if self._server is not None:
            self._server.close()
        if self.queue_word is not None:  # the workers that mapped it keep reading their map
            self.queue_word.close()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            log.warning("instance '%s': %d direct request(s) still in flight after %.0fs", self.stub.spec.label,
                        self.inflight, timeout)
        return self.counters()

    # -- requests ------------------------------------------------------------------------------------------
    def submit(self, connection: _Connection, meta: wire.Request) -> None:
        rid = meta.rid
        if self.draining:
            connection.send(DirectAnswer(rid, wire.Response(), retry=True))
            return
        request = wire.core_request(meta)
        if self.max_batch_size > 0:
            for tensor in request.inputs.values():  # validated by the worker: every input has the batch
                if tensor.shape:
                    request.batch_size = tensor.shape[0]
                break
        self._schedule(connection, rid, request, _Entry(request))

    def submit_body(self, connection: _Connection, message: DirectJson) -> None:
        """An HTTP infer body: decoded and validated here as the worker's frontend would, then scheduled as
        :meth:`submit` schedules a request, its answer written as the HTTP body. One this does not take whole (an
        error the frontend words and the core counts, a parameter the direct path leaves to the core,
        classification) goes back to the worker (``retry``), which decodes it and goes its usual way."""
        rid = message.rid
        bodies = self._bodies
        if bodies is None:
            bodies = self._bodies = BodyDecoder(self.runtime.config)
            log.debug("instance '%s': HTTP infer bodies are decoded here", self.stub.spec.label)
        taken = None if self.draining else bodies.request(message)
        if taken is None:
            connection.send(DirectAnswer(rid, wire.Response(), retry=True))
            return
        request, encoding = taken
        self._schedule(connection, rid, request, _Entry(request, encoding))

    def _schedule(self, connection: _Connection, rid: int, request, entry: _Entry) -> None:
        request.response_sender = ResponseSender(request, lambda response: self._respond(connection, rid, entry,
                                                                                          response))
        # queued since the worker took it (its arrival_ns: CLOCK_MONOTONIC, the same in every process), as the core's
        # one queue counts from the request's arrival, the link's transit included; one sent while a batch held the
        # links unread no earlier than that batch's start
        request.queue_start_ns = max(request.arrival_ns, self.held_from)
        try:
            self.scheduler.enqueue(request)
        except ServerError as exc:
            self.stats.record_failure(time.monotonic_ns() - request.arrival_ns,
                                      _FAILURE_REASON.get(exc.status, "OTHER"))
            connection.send(DirectAnswer(rid, wire.Response(error=wire.error_data(exc)), rejected=True))
            return
        connection.requests[rid] = entry
        if self.queue_word is not None:
            self.queue_word.set(self.scheduler.pending())
        self.inflight += 1
        self._idle.clear()

    def cancel(self, connection: _Connection, rid: int) -> None:
        entry = connection.requests.get(rid)
        if entry is None or entry.counted:
            return
        entry.counted = True
        entry.cancellation.cancel()
        self.stats.record_failure(time.monotonic_ns() - entry.arrival_ns, "CANCELED")
        self._finished()  # as in the core: a drain does not wait for a cancelled request

    def _finished(self) -> None:
        self.inflight -= 1
        if not self.inflight:
            self._idle.set()

    def _respond(self, connection: _Connection, rid: int, entry: _Entry, response) -> None:
        """The response sender's sink, from whichever thread the model answers on."""
        if threading.get_ident() != self._loop_thread:
            try:
                self.loop.call_soon_threadsafe(self._respond, connection, rid, entry, response)
            except RuntimeError:  # the loop is closed: the process is exiting
                pass
            return
        stats = self.stats
        elapsed = time.monotonic_ns() - entry.arrival_ns
        if entry.first:
            entry.first = False
            stats.record_first_response(elapsed)
        final = response.final
        if final:
            connection.requests.pop(rid, None)
            if not entry.counted:
                entry.counted = True
                self._finished()
                if response.error is None:
                    stats.record_success(elapsed)
                else:
                    stats.record_failure(elapsed, _FAILURE_REASON.get(response.error.status, "BACKEND"))
        encoding = entry.encoding
        if encoding is not None and final:  # an HTTP body's: its answer as the frontend writes it
            response.model_version = self.version
            connection.send(BodyDecoder.answer(rid, response, encoding, self.runtime.name))
            return
        try:
            message = DirectAnswer(rid, wire.response_message(response))
        except Exception as exc:  # an output the link cannot carry
            log.exception("model '%s': a response cannot be sent to the frontend", self.runtime.name)
            if not final:
                return
            message = DirectAnswer(rid, wire.Response(error=wire.error_data(exc)))
        connection.send(message)
