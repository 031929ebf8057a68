"""Python models whose instances each run in a process of their own (the default), as Triton's stubs do.

The server keeps a :class:`ProcessModel` and one :class:`ProcessInstance` per instance slot; each
instance owns a :class:`ModelProcess`, the server's end of one model process (:mod:`.stub`), forked
by the zygote (:mod:`.zygote`). The process that runs ``auto_complete_config`` at load goes on to serve
the first instance.

- Requests: ``execute`` sends the batch (metadata on a socket, input tensors in the request arena, or
  inline when they are small) and returns once the process has run it; responses come back as they are
  sent (output tensors in the response arena, read in place, or inline) and go to each request's
  ResponseSender. Cancelling a request reaches the process's copy of it.
- BLS and model control from the process come in as calls, run through the DataPlane on the server's
  loop, their responses streamed back.
- Custom metrics: the process registers each series with a page of shared memory the server reads
  when /metrics is scraped. Log records arrive and are logged under their own logger names.
- A process that dies (a crash, a kill, ``sys.exit`` in execute) fails its in-flight requests with
  INTERNAL naming the model and why, and marks the model version UNAVAILABLE with that reason
  (``ModelContext.report_failure``); an explicit load starts new processes.

Everything here runs on the server's event loop: the socket is read with ``add_reader`` and written
without blocking (what the process has not read yet waits in a buffer), so a process that hangs
cannot stall the server.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from functools import partial

import msgspec
from tritonclient.grpc import model_config_pb2 as mc

from tideserve.backend_api import (
    InferenceRequest as CoreRequest,
    InferenceResponse as CoreResponse,
    InstanceContext,
    InternalError,
    InvalidArgument,
    Model,
    ModelContext,
    ModelInstance,
    ServerError,
    Unavailable,
    arena,
    wire,
)

from . import metrics, protocol
from .zygote import Zygote

log = logging.getLogger(__name__)

PROCESS_ISOLATION = "process_isolation"  # config parameter: "false" runs the model in the server's process
ARENA_BYTES = "shm_arena_bytes"  # config parameter: bytes of each of an instance's two arenas
DEFAULT_ARENA_BYTES = 64 * 1024 * 1024  # virtual: pages are backed as they are first written
FINALIZE_TIMEOUT_S = 30.0  # the model's finalize, before its process is killed
EXIT_STATUS_WAIT_S = 2.0  # after the socket closes, how long to wait for the exit status that names the cause
_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")
SUPPORTED = hasattr(os, "fork") and hasattr(socket, "send_fds")  # POSIX: a zygote to fork, SCM_RIGHTS


def process_isolation(ctx: ModelContext) -> bool:
    """Whether the model's instances run in processes of their own (``process_isolation``; by default
    wherever the platform allows)."""
    text = ctx.parameter(PROCESS_ISOLATION)
    if text is None:
        return SUPPORTED
    value = text.strip().lower()
    if value in _TRUE:
        if not SUPPORTED:
            raise InvalidArgument(f"model '{ctx.name}': '{PROCESS_ISOLATION}' needs fork() and descriptor passing, "
                                  f"which this platform lacks")
        return True
    if value in _FALSE:
        return False
    raise InvalidArgument(f"model '{ctx.name}': parameter '{PROCESS_ISOLATION}' must be \"true\" or \"false\", "
                          f"got '{value}'")


def arena_bytes(ctx: ModelContext) -> int:
    text = ctx.parameter(ARENA_BYTES)
    if not text:
        return DEFAULT_ARENA_BYTES
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 4096:
        raise InvalidArgument(f"model '{ctx.name}': parameter '{ARENA_BYTES}' must be a number of bytes >= 4096, "
                              f"got '{text}'")
    return value


def _log_level(model: str) -> int:
    """The least severe level the server logs for the model process (it sends nothing below)."""
    names = ("", "tideserve", f"tideserve.python_model.{model}")
    return min(logging.getLogger(name).getEffectiveLevel() for name in names)


def _how(returncode: int | None) -> str:
    if returncode is None:
        return "exited"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name} (signal {-returncode})"
    return f"exited with code {returncode}"


class ProcessModel(Model):
    """A Python model whose instances run in processes of their own."""

    def __init__(self, backend, ctx: ModelContext) -> None:
        super().__init__(backend, ctx)
        self.arena_bytes = arena_bytes(ctx)
        self._spare: ModelProcess | None = None  # started for auto-complete, kept for the first instance
        self.direct_processes: list[ModelProcess] = []  # --frontend-direct: those that take workers' requests

    def stats(self):
        """The model version's statistics (the core's, where direct requests' counters are added)."""
        metrics = self.ctx.metrics
        return metrics.model_stats(self.ctx.name, str(self.ctx.version)) if metrics is not None else None

    async def refresh_direct_statistics(self) -> None:
        """Fetch what each instance process counted for direct requests (before statistics are read)."""
        if self.direct_processes:
            await asyncio.gather(*(p.direct_counters() for p in list(self.direct_processes)),
                                 return_exceptions=True)

    def spec(self) -> protocol.ModelSpec:
        return protocol.ModelSpec(self.ctx.name, self.ctx.version, str(self.ctx.model_path),
                              self.config.SerializeToString())

    async def auto_complete_config(self) -> None:
        """Import ``model.py`` and run its ``auto_complete_config`` in the process of the first instance."""
        self._spare = await ModelProcess.start(self, f"{self.ctx.name}_{self.ctx.version}")
        self.config.CopyFrom(await self._spare.auto_complete())

    async def process_for(self, ctx: InstanceContext) -> ModelProcess:
        if self._spare is not None:
            process, self._spare = self._spare, None
            return process
        return await ModelProcess.start(self, ctx.name)

    def create_instance(self, ctx: InstanceContext) -> ProcessInstance:
        return ProcessInstance(self, ctx)

    async def finalize(self) -> None:
        if self._spare is not None:
            spare, self._spare = self._spare, None
            await spare.finalize()


class ProcessInstance(ModelInstance):
    """One instance slot: its model process does the work."""

    model: ProcessModel

    def __init__(self, model: ProcessModel, ctx: InstanceContext) -> None:
        super().__init__(model, ctx)
        self.process: ModelProcess | None = None

    async def initialize(self) -> None:
        process = await self.model.process_for(self.ctx)
        started = time.monotonic()
        try:
            await process.create_instance(self.ctx)
        except BaseException:
            await process.finalize()
            raise
        self.process = process
        process.instance = self
        log.debug("instance '%s' initialized in process %d (%.1f ms after it started, %.1f ms initialize)",
                  self.ctx.name, process.pid, (time.monotonic() - process.started_at) * 1e3,
                  (time.monotonic() - started) * 1e3)

    async def execute(self, requests: list[CoreRequest]) -> None:
        await self.process.submit(requests)

    def submit(self, requests: list[CoreRequest]) -> asyncio.Future:
        return self.process.submit(requests)

    async def finalize(self) -> None:
        if self.process is not None:
            await self.process.finalize()

    async def drain_direct(self, timeout: float | None) -> None:
        if self.process is not None:
            await self.process.drain_direct(FINALIZE_TIMEOUT_S if timeout is None else timeout)

    @property
    def pid(self) -> int:
        return self.process.pid if self.process is not None else 0

    async def open_direct(self, path: str) -> ModelProcess:
        """--frontend-direct: the process listens for frontend workers at ``path``."""
        await self.process.open_direct(path)
        return self.process

    @property
    def requests_in_flight(self) -> int:
        """Requests sent to the process whose final response has not come back."""
        return len(self.process.requests) if self.process is not None else 0


class ModelProcess:
    """The server's end of one model process."""

    def __init__(self, model: ProcessModel, label: str) -> None:
        self.model = model
        self.label = label  # the instance it serves; <model>_<version> until it serves one
        self.serves_instance = False
        self.loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self.pid = 0
        self.started_at = time.monotonic()
        self.failure: InternalError | None = None
        self.requests: dict[int, CoreRequest] = {}  # in the process, until their final response
        self._rescheduled: set[int] = set()  # requests the model rescheduled, until they run again (or are cancelled)
        self._batches: dict[int, asyncio.Future] = {}
        self._calls: dict[int, asyncio.Future] = {}  # AutoComplete, CreateInstance, Finalize
        self._served: dict[int, asyncio.Task] = {}  # the process's BLS calls and model control
        self._streams: dict[int, object] = {}  # the DataPlane streams of its decoupled BLS calls
        self._ids = itertools.count(1)
        self._pages: dict[int, object] = {}  # its custom metrics' pages
        self._returncode: asyncio.Future = self.loop.create_future()
        self._exit_reason = ""
        self._stopping = False
        self._closed = False
        self._gone_task: asyncio.Task | None = None
        self._pending_out: collections.deque[tuple[memoryview, int | None]] = collections.deque()
        self.direct_path: str | None = None  # --frontend-direct: where it listens for frontend workers
        self.instance: ProcessInstance | None = None  # the instance it serves, once created
        self._holds = 0  # BLS calls that batches from the frontend workers wait on (_hold)
        self._direct_drained = False  # it took no more direct requests and its drain's time ran out or ended
        self._releases: collections.deque[int] = collections.deque()
        self._release_scheduled = False
        size = model.arena_bytes
        self.sock, theirs = socket.socketpair()
        response_fd = -1
        try:
            self.outbox = arena.Outbox(arena.Arena(size, f"tideserve-{label}-requests"))
            response_fd = arena.create_file(size, f"tideserve-{label}-responses")
            self.inbox = arena.Inbox(response_fd, size, self._released)
            spec = protocol.ProcessSpec(label, size, size, _log_level(model.ctx.name))
            self._spawned = Zygote.get().spawn(spec, [theirs.fileno(), self.outbox.arena.fd, response_fd],
                                               self._exit_status)
        finally:
            theirs.close()
            if response_fd >= 0:
                os.close(response_fd)
            if hasattr(self, "outbox"):
                self.outbox.arena.close_fd()
        self.sock.setblocking(False)
        self.reader = wire.FrameReader(protocol.ToServer)
        self.loop.add_reader(self.sock.fileno(), self._on_readable)

    @classmethod
    async def start(cls, model: ProcessModel, label: str) -> ModelProcess:
        process = cls(model, label)
        try:
            process.pid = await asyncio.wrap_future(process._spawned)
        except RuntimeError as exc:  # the zygote could not fork, or is gone
            process._close()
            raise Unavailable(f"model '{model.ctx.name}': cannot start a model process: {exc}") from None
        return process

    # -- lifecycle ---------------------------------------------------------------------------------
    async def auto_complete(self) -> mc.ModelConfig:
        reply = await self._call(lambda call: protocol.AutoComplete(call, self.model.spec()))
        return mc.ModelConfig.FromString(reply.config)

    async def create_instance(self, ctx: InstanceContext) -> None:
        instance = protocol.InstanceSpec(ctx.name, ctx.kind, ctx.device_id, ctx.index, ctx.group_name)
        await self._call(lambda call: protocol.CreateInstance(call, self.model.spec(), instance))
        self.label = ctx.name
        self.serves_instance = True

    # -- --frontend-direct -------------------------------------------------------------------------
    async def open_direct(self, path: str) -> None:
        if self.direct_path is not None:
            raise InternalError(f"instance '{self.label}' already takes direct requests at {self.direct_path}")
        await self._call(lambda call: protocol.OpenDirect(call, path))
        self.direct_path = path
        self.model.direct_processes.append(self)

    async def direct_counters(self) -> None:
        """Fetch the process's counters of direct requests into the model version's statistics."""
        if self.direct_path is None or self.failure is not None or self._closed:
            return
        reply = await asyncio.wait_for(self._call(protocol.DirectStats), 5.0)
        self._store_counters(reply.config)

    def _store_counters(self, data: bytes) -> None:
        stats = self.model.stats()
        if stats is not None and data:
            stats.remote[self] = msgspec.msgpack.decode(data)

    def _retire_counters(self) -> None:
        if self.direct_path is None:
            return
        try:
            self.model.direct_processes.remove(self)
        except ValueError:
            pass
        stats = self.model.stats()
        if stats is not None:
            stats.retire(self)

    async def direct_failure(self, count: int) -> str:
        """A worker lost its link to this process with ``count`` requests in flight: they fail with the error
        requests in flight here get (once the process's end is known), and are counted as failed."""
        deadline = time.monotonic() + EXIT_STATUS_WAIT_S + 1.0
        while self.failure is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        stats = self.model.stats()
        if stats is not None:
            for _ in range(count):
                stats.record_failure(0, "BACKEND")
        if self.failure is not None:
            return self.failure.message
        return (f"Failed to process the request(s) for model '{self.model.ctx.name}', message: the process of "
                f"instance '{self.label}' (pid {self.pid}) closed its connection")

    async def drain_direct(self, timeout: float) -> None:
        """The process takes no more requests from frontend workers (they send them through the core) and waits up
        to ``timeout`` seconds for those in flight; its direct counters as of then are kept."""
        if self.direct_path is None or self._direct_drained or self._closed or self.failure is not None:
            return
        try:
            reply = await asyncio.wait_for(self._call(lambda call: protocol.DirectDrain(call, timeout)), timeout + 5)
            self._store_counters(reply.config)
        except (TimeoutError, ServerError) as exc:
            log.warning("instance '%s': direct requests did not drain: %s", self.label, exc)
        self._direct_drained = True

    async def finalize(self) -> None:
        """Run the model's finalize in the process and let it exit (killed if it does not)."""
        # the workers no longer see its address: wait for their requests in flight here, unless a drain (the
        # unload's or the exit's, with its own timeout) already did
        await self.drain_direct(FINALIZE_TIMEOUT_S)
        self._stopping = True
        if not self._closed and self.failure is None:
            try:
                await asyncio.wait_for(self._call(protocol.Finalize), FINALIZE_TIMEOUT_S)
            except TimeoutError:
                log.warning("instance '%s': finalize did not end within %.0fs; its process is killed", self.label,
                            FINALIZE_TIMEOUT_S)
            except ServerError as exc:
                log.warning("instance '%s': %s", self.label, exc.message)
        try:
            await asyncio.wait_for(asyncio.shield(self._returncode), EXIT_STATUS_WAIT_S)
        except TimeoutError:
            self.kill()
        self._close()
        self._fail(f"instance '{self.label}' was unloaded")
        self._drop_metrics()
        self._retire_counters()

    def kill(self) -> None:
        if self.pid and not self._returncode.done() and not self._closed:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    async def _call(self, make: Callable[[int], object]) -> protocol.Reply:
        if self.failure is not None:
            raise self.failure
        call = next(self._ids)
        future = self._calls[call] = self.loop.create_future()
        self._send(make(call))
        return await future

    # -- requests -----------------------------------------------------------------------------------
    async def execute(self, requests: list[CoreRequest]) -> None:
        """Run one batch in the process; the responses reach each request's sender as they come."""
        await self.submit(requests)

    def submit(self, requests: list[CoreRequest]) -> asyncio.Future:
        """Send one batch to the process; the future is done once it has run (the responses reach each request's
        sender as they come). The process runs the batches it is sent in order: one sent while another runs
        starts as that one ends, without waiting for the loop."""
        if self.failure is not None:
            raise self.failure
        batch = next(self._ids)
        done = self._batches[batch] = self.loop.create_future()
        tensors = [t for request in requests for t in request.inputs.values()]
        refs, payload, fd = self.outbox.put(tensors)
        metas, start = [], 0
        for request in requests:
            count = len(request.inputs)
            metas.append(wire.request_message(request.internal_id, request, refs[start:start + count]))
            start += count
        self._send(protocol.Execute(batch, metas, payload), fd)
        for request in requests:  # no response can arrive before this returns to the loop
            rid = request.internal_id
            self.requests[rid] = request
            if rid in self._rescheduled:  # runs again: its cancellation already reaches the process
                self._rescheduled.discard(rid)
            else:
                request.cancellation.add_callback(partial(self._cancel, rid))
        return done

    def _cancel(self, rid: int) -> None:
        if threading.get_ident() != self._loop_thread:
            self._soon(self._cancel, rid)
            return
        if rid in self._rescheduled:  # waiting to run again: the scheduler answers it now
            self._rescheduled.discard(rid)
            self.requests.pop(rid, None)
        if rid in self.requests and not self._closed:
            self._send(wire.Cancel(rid))

    def _deliver(self, rid: int, response: wire.Response, block) -> None:
        request = self.requests.get(rid)
        if request is None:
            return
        if response.final:
            del self.requests[rid]
        sender = request.response_sender
        try:
            if response.empty:
                sender.send(None, final=True)
            elif response.error is not None and response.final:
                sender.send_error(wire.server_error(response.error))
            else:
                sender.send(wire.core_response(response, block), final=response.final)
        except ServerError as exc:  # the request was already answered (e.g. the server gave up on it)
            log.debug("instance '%s': response to a finished request dropped: %s", self.label, exc)

    # -- the connection -----------------------------------------------------------------------------
    def _soon(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the server's loop is closed
            pass

    def _send(self, message, fd: int | None = None) -> None:
        """Write ``message`` (with ``fd``, closed once sent) without blocking; on the loop."""
        data = wire.frame(message)
        if self._releases:
            data = wire.frame(wire.Release(_drain(self._releases))) + data
        if self._closed:
            if fd is not None:
                os.close(fd)
            return
        if self._pending_out:
            self._pending_out.append((memoryview(data), fd))
            return
        sent = self._write(memoryview(data), fd)
        if sent < len(data):
            self._pending_out.append((memoryview(data)[sent:], fd if sent == 0 else None))
            self.loop.add_writer(self.sock.fileno(), self._flush)

    def _write(self, data: memoryview, fd: int | None) -> int:
        try:
            sent = wire.send_frames(self.sock, data, fd) if fd is not None else self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError:  # the process is gone; the reader hears of it
            sent = len(data)
        if fd is not None:
            os.close(fd)
        return sent

    def _flush(self) -> None:
        while self._pending_out and not self._closed:
            data, fd = self._pending_out[0]
            sent = self._write(data, fd)
            if sent < len(data):
                self._pending_out[0] = (data[sent:], fd if sent == 0 else None)
                return
            self._pending_out.popleft()
        if not self._closed:
            self.loop.remove_writer(self.sock.fileno())

    def _released(self, offset: int) -> None:
        """A block of the response arena is no longer read (called wherever its last array was dropped). The
        process hears of it with the next message, or a few milliseconds later when none goes out."""
        self._releases.append(offset)
        if not self._release_scheduled and not self._closed and not self.loop.is_closed():
            self._release_scheduled = True
            if threading.get_ident() == self._loop_thread:
                self.loop.call_later(arena.RELEASE_DELAY_S, self._send_releases)
            else:
                self._soon(self.loop.call_later, arena.RELEASE_DELAY_S, self._send_releases)

    def _send_releases(self) -> None:
        self._release_scheduled = False
        if self._releases and not self._closed:
            self._send(wire.Release(_drain(self._releases)))

    def _on_readable(self) -> bool:
        """Read and handle what has arrived; False once nothing more is there now."""
        try:
            messages = self.reader.receive(self.sock)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            messages = None
        if messages is None:
            self._lost()
            return False
        for message in messages:
            try:
                self._handle(message)
            except Exception:
                log.exception("instance '%s': cannot handle %s from its process", self.label, type(message).__name__)
        return True

    def _block(self, payload: wire.Payload | None):
        fd = self.reader.take_fd() if payload is not None and payload.offset == arena.OWN_FILE else None
        return self.inbox.block(payload, fd)

    def _handle(self, message) -> None:
        match message:
            case protocol.Respond(answers=answers, payload=payload):
                block = self._block(payload)
                for answer in answers:
                    self._deliver(answer.rid, answer.response, block)
            case protocol.Executed(batch=batch, rescheduled=rescheduled):
                for rid in rescheduled:  # back to the scheduler, which runs them again (or answers them)
                    request = self.requests.get(rid)
                    if request is not None:
                        request.reschedule = True
                        self._rescheduled.add(rid)
                future = self._batches.pop(batch, None)
                if future is not None and not future.done():
                    future.set_result(None)
            case protocol.Reply(call=call, error=error):
                future = self._calls.pop(call, None)
                if future is not None and not future.done():
                    if error is None:
                        future.set_result(message)
                    else:
                        future.set_exception(wire.server_error(error))
            case wire.Release(offsets=offsets):
                for offset in offsets:
                    self.outbox.arena.release(offset)
            case protocol.Call(call=call, request=request, payload=payload, unary=unary, holds=holds):
                core = wire.core_request(request, self._block(payload))
                self._serve(call, self._run_call(call, core, unary))
                if holds:
                    self._hold(self._served[call])
            case protocol.CancelCall(call=call, request_only=True):
                stream = self._streams.get(call)
                if stream is not None:
                    stream.request.cancellation.cancel()
            case protocol.CancelCall(call=call):
                stream = self._streams.pop(call, None)
                if stream is not None:
                    stream.cancel()
                task = self._served.get(call)
                if task is not None:
                    task.cancel()
            case protocol.LoadModel() | protocol.UnloadModel() | protocol.ModelReady():
                self._serve(message.call, self._run_control(message))
            case protocol.Log():
                self._log(message)
            case protocol.Series():
                self._series(message)
            case protocol.Exiting(reason=reason):
                self._exit_reason = reason

    # -- what the process asks of the server ----------------------------------------------------------
    def _hold(self, task: asyncio.Task) -> None:
        """The instance's thread waits on this BLS call in a batch that frontend workers sent straight to it:
        busy, though the core sent it nothing. Until the call ends the core sends the instance no batch
        (``ModelInstance.hold``): one it sent would wait behind that batch, and if it is the call's own request
        (a model calling itself through another instance), for ever."""
        instance = self.instance
        if instance is None:
            return
        self._holds += 1
        if instance.hold is None:
            instance.hold = asyncio.Event()
        task.add_done_callback(self._unhold)

    def _unhold(self, _task: asyncio.Task) -> None:
        self._holds -= 1
        instance = self.instance
        if self._holds == 0 and instance is not None and instance.hold is not None:
            hold, instance.hold = instance.hold, None
            hold.set()

    def _serve(self, call: int, coro) -> None:
        task = self.loop.create_task(coro)
        self._served[call] = task
        task.add_done_callback(lambda _: self._served.pop(call, None))

    async def _run_call(self, call: int, request: CoreRequest, unary: bool) -> None:
        infer = self.model.ctx.infer
        try:
            if infer is None:
                raise InternalError("this server has no data plane: models cannot call other models")
            if unary:
                self._answer_call(call, await infer.unary(request))
                return
            stream = self._streams[call] = infer(request)
            try:
                async for response in stream:
                    self._answer_call(call, response)
            finally:
                self._streams.pop(call, None)
        except ServerError as exc:
            self._answer_call(call, CoreResponse(error=exc, final=True))
        except asyncio.CancelledError:  # the model cancelled the call, or its process is gone
            pass

    def _answer_call(self, call: int, response: CoreResponse) -> None:
        if self._closed:
            return
        refs, payload, fd = self.outbox.put(response.outputs)
        self._send(protocol.CallResponse(call, wire.response_message(response, refs), payload), fd)

    async def _run_control(self, message) -> None:
        control = self.model.ctx.control
        result = protocol.ControlResult(message.call)
        try:
            if control is None:
                raise InternalError("this server has no data plane: models cannot control other models")
            match message:
                case protocol.LoadModel(name=name, config=config):
                    await control.load(name, config or None)
                case protocol.UnloadModel(name=name, unload_dependents=dependents):
                    await control.unload(name, unload_dependents=dependents)
                case protocol.ModelReady(name=name, version=version):
                    result.ready = control.ready(name, version)
        except ServerError as exc:
            result.error = wire.error_data(exc)
        if not self._closed:
            self._send(result)

    def _log(self, message: protocol.Log) -> None:
        logger = logging.getLogger(message.name)
        if not logger.isEnabledFor(message.level):
            return
        record = logger.makeRecord(message.name, message.level, message.pathname, message.lineno, message.message,
                                   None, None, func=message.func)
        record.created, record.msecs = message.created, (message.created % 1) * 1000
        record.threadName, record.process, record.processName = message.thread_name, self.pid, self.label
        record.exc_text = message.exc_text or None
        logger.handle(record)

    def _series(self, message: protocol.Series) -> None:
        if message.page not in self._pages:  # its first series brings the page
            fd = self.reader.take_fd()
            try:
                self._pages[message.page] = arena.map_file(fd, message.page_size)
            finally:
                os.close(fd)
        registry = getattr(self.model.ctx.metrics, "registry", None)
        if registry is None:
            return
        cells = memoryview(self._pages[message.page])[message.offset:message.offset + 8 * message.cells].cast("d")
        metrics.registry_collector(registry).add_remote(self, metrics.RemoteSeries(
            message.family, message.description, metrics.MetricKind(message.kind), dict(message.labels),
            message.buckets, cells))

    def _drop_metrics(self) -> None:
        registry = getattr(self.model.ctx.metrics, "registry", None)
        if registry is not None and self._pages:
            metrics.registry_collector(registry).drop_remote(self)

    # -- the end of the process -----------------------------------------------------------------------
    def _exit_status(self, returncode: int) -> None:
        """From the zygote's thread: the process exited."""
        self._soon(self._exited, returncode)

    def _exited(self, returncode: int) -> None:
        if not self._returncode.done():
            self._returncode.set_result(returncode)
        while not self._closed and self._on_readable():  # what it wrote before it exited
            pass
        self._lost()  # even if a program the model started still holds the socket open

    def _lost(self) -> None:
        """The socket closed: the process exited (or is about to)."""
        if self._closed:
            return
        self._close()
        self._gone_task = self.loop.create_task(self._gone())

    async def _gone(self) -> None:
        try:
            returncode = await asyncio.wait_for(asyncio.shield(self._returncode), EXIT_STATUS_WAIT_S)
        except TimeoutError:
            returncode = None
        served = (f"instance '{self.label}'" if self.serves_instance
                  else f"model '{self.model.ctx.name}' version {self.model.ctx.version}")
        how = f"the process of {served} (pid {self.pid}) {_how(returncode)}"
        self._fail(f"{self._exit_reason}; {how}" if self._exit_reason else how)

    def _fail(self, reason: str) -> None:
        """Answer everything still waiting on the process with an error; unless it was asked to stop, the
        model version turns UNAVAILABLE with ``reason``."""
        if self.failure is not None:
            return
        self.failure = InternalError(f"Failed to process the request(s) for model '{self.model.ctx.name}', "
                                     f"message: {reason}")
        if not self._stopping:
            log.error("model '%s' version %s: %s", self.model.ctx.name, self.model.ctx.version, reason)
            self.model.ctx.report_failure(reason)
        requests, self.requests = self.requests, {}
        for request in requests.values():
            request.response_sender.send_error(self.failure)
        for futures, error in ((self._batches, self.failure),
                               (self._calls, InternalError(f"model '{self.model.ctx.name}': {reason}"))):
            for future in futures.values():
                if not future.done():
                    future.set_exception(error)
            futures.clear()
        for stream in list(self._streams.values()):
            stream.cancel()
        for task in list(self._served.values()):
            task.cancel()
        if not self._stopping:
            self._retire_counters()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.sock.fileno() >= 0:
            self.loop.remove_reader(self.sock.fileno())
            if self._pending_out:
                self.loop.remove_writer(self.sock.fileno())
        for _data, fd in self._pending_out:
            if fd is not None:
                os.close(fd)
        self._pending_out.clear()
        self.sock.close()
        self.reader.close()


def _drain(queue: collections.deque[int]) -> list[int]:
    items = []
    while True:
        try:
            items.append(queue.popleft())
        except IndexError:
            return items
