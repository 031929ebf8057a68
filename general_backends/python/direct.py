"""``--frontend-direct on``: the model process's side of the frontend workers' direct links.

When the core asks (``OpenDirect``), the instance process listens on a Unix socket (in a directory only the
server's user can enter) for links from the frontend workers (``tideserve.workers.direct``). Requests that come
that way meet a scheduler here, the one the core would use for the model (the dynamic batcher with the model's
``dynamic_batching`` settings, else one request per execute), whose batches run on the instance's thread between
the batches the core sends (BLS calls, ensembles, requests that are not eligible). Its queue is this instance's
own, where Triton keeps one per model.

What this process runs for direct requests it counts in a ``ModelStats`` of its own, as the core would count
them (success, failure and its reason, queue, compute, batches, executions, latency histograms); the core asks
for those counters (``DirectStats``) before it answers statistics or ``/metrics``, and adds them. An unload
first drains (``DirectDrain``): new requests are handed back to the worker (``retry``: it sends them through
the core) while those in flight finish. A worker whose link closes has its requests cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from tideserve.backend_api import (
    DirectAnswer,
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
    wire,
)

from .backend import ModelExit, PythonInstance

log = logging.getLogger(__name__)

_FAILURE_REASON = {Status.CANCELLED: "CANCELED", Status.UNAVAILABLE: "REJECTED"}


class _Runtime:
    """What the schedulers and ``ModelRuntime.execute`` read of a model version: here, this one instance."""

    execute = ModelRuntime.execute
    _send_returned = ModelRuntime._send_returned
    rate_limiter = None

    def __init__(self, name: str, config, instance, stats: ModelStats) -> None:
        self.name = name
        self.config = config
        self.stats = stats
        self.decoupled = config.model_transaction_policy.decoupled
        self.slots = [InstanceSlot(_Instance(instance, asyncio.get_running_loop()))]


class _Instance:
    """The instance as the direct scheduler runs it: ``execute`` hands the batch to the instance's thread and
    is woken by one callback when it is done (no executor future chained to a loop future per batch)."""

    __slots__ = ("instance", "ctx", "loop")

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
        try:
            answers, error = self.instance.run_execute(requests), None
        except ModelExit as exc:
            self.instance.on_exit(exc)  # in a model process: it ends here
            answers, error = None, exc
        except BaseException as exc:  # noqa: BLE001 - the batch's error, raised where execute is awaited
            answers, error = None, exc
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


# The event loop's timers run no finer than this: uvloop rounds a shorter delay to "at once", so a batcher that
# waits out a 100 us max_queue_delay with them spins through loop turns for the whole delay.
LOOP_TIMER_RESOLUTION_S = 0.001


class _FineTimer:
    """Wakes the loop at sub-millisecond deadlines, from a thread of its own that sleeps until the deadline (a
    thread's timed wait is as fine as the kernel's), while the loop sleeps until then or until I/O wakes it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._cond = threading.Condition(threading.Lock())
        self._due: tuple[float, asyncio.Future] | None = None
        self._thread: threading.Thread | None = None

    def arm(self, timeout: float, waiter: asyncio.Future) -> None:
        with self._cond:
            self._due = (time.monotonic() + timeout, waiter)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="direct-batcher-timer", daemon=True)
                self._thread.start()
            else:
                self._cond.notify()

    def disarm(self, waiter: asyncio.Future) -> None:
        """The wait ended: nothing to wake (the thread finds nothing due when it wakes; no notify, no syscall)."""
        due = self._due
        if due is not None and due[1] is waiter:
            self._due = None

    def _run(self) -> None:
        cond = self._cond
        with cond:
            while True:
                due = self._due
                if due is None:
                    cond.wait()
                    continue
                remaining = due[0] - time.monotonic()
                if remaining > 0:
                    cond.wait(remaining)
                    continue
                self._due = None
                try:
                    self.loop.call_soon_threadsafe(_wake_waiter, due[1])
                except RuntimeError:  # the loop is closed: the process is exiting
                    return


def _wake_waiter(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class _DirectBatcher(DynamicBatcher):
    """The model's dynamic batcher, whose waits shorter than the loop's timers can time go to a fine timer."""

    def __init__(self, runtime) -> None:
        super().__init__(runtime)
        self._fine = _FineTimer(asyncio.get_running_loop())

    async def _sleep(self, timeout: float | None) -> None:
        if timeout is None or not 0 < timeout < LOOP_TIMER_RESOLUTION_S:
            await super()._sleep(timeout)
            return
        waiter = self._waiter = self._fine.loop.create_future()
        self._fine.arm(timeout, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            self._fine.disarm(waiter)


class _Entry:
    __slots__ = ("counted", "first", "request")

    def __init__(self, request) -> None:
        self.request = request
        self.first = True
        self.counted = False  # its success or failure is recorded (a cancellation records it at once)


class _Connection(asyncio.Protocol):
    """One frontend worker's link."""

    def __init__(self, server: DirectServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.reader = wire.FrameReader(DirectToProcess)
        self.requests: dict[int, _Entry] = {}
        self._out: list[bytes] = []
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
                server.submit(self, message.request)
            else:
                server.cancel(self, message.rid)

    def send(self, message) -> None:
        """Queue ``message`` (on the loop): what one turn of the loop sends leaves in one write."""
        if self.transport is None:
            return
        self._out.append(wire.frame(message))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.server.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        out, transport = self._out, self.transport
        if out and transport is not None and not transport.is_closing():
            transport.write(out[0] if len(out) == 1 else b"".join(out))
        out.clear()


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
        self.runtime = _Runtime(model.ctx.name, config, stub.instance, self.stats)
        self.scheduler = (_DirectBatcher(self.runtime) if config.HasField("dynamic_batching")
                          else DirectScheduler(self.runtime))
        self.max_batch_size = config.max_batch_size
        self.connections: set[_Connection] = set()
        self.inflight = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        await self.scheduler.start()
        self._server = await self.loop.create_unix_server(lambda: _Connection(self), self.path)

    def counters(self) -> dict:
        counters = self.stats.export()
        counters["pending"] = self.scheduler.pending()  # nv_inference_pending_request_count, as of now
        return counters

    async def drain(self, timeout: float) -> dict:
        """Take no new request (the workers send them through the core), wait for those in flight."""
        self.draining = True
        if self._server is not None:
            self._server.close()
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
        entry = _Entry(request)
        request.response_sender = ResponseSender(request, lambda response: self._respond(connection, rid, entry,
                                                                                          response))
        request.queue_start_ns = time.monotonic_ns()
        try:
            self.scheduler.enqueue(request)
        except ServerError as exc:
            self.stats.record_failure(time.monotonic_ns() - request.arrival_ns,
                                      _FAILURE_REASON.get(exc.status, "OTHER"))
            connection.send(DirectAnswer(rid, wire.Response(error=wire.error_data(exc)), rejected=True))
            return
        connection.requests[rid] = entry
        self.inflight += 1
        self._idle.clear()

    def cancel(self, connection: _Connection, rid: int) -> None:
        entry = connection.requests.get(rid)
        if entry is None or entry.counted:
            return
        entry.counted = True
        entry.request.cancellation.cancel()
        self.stats.record_failure(time.monotonic_ns() - entry.request.arrival_ns, "CANCELED")
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
        elapsed = time.monotonic_ns() - entry.request.arrival_ns
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
        try:
            message = DirectAnswer(rid, wire.response_message(response))
        except Exception as exc:  # an output the link cannot carry
            log.exception("model '%s': a response cannot be sent to the frontend", self.runtime.name)
            if not final:
                return
            message = DirectAnswer(rid, wire.Response(error=wire.error_data(exc)))
        connection.send(message)
