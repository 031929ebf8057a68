"""A model process: one instance of a Python model, hosted with the in-process classes.

Forked from the zygote (:mod:`.zygote`), the process serves the server over one socket. It builds the
same :class:`~.backend.PythonModel` and :class:`~.backend.PythonInstance` the server would build in
process, and feeds them real core requests rebuilt from the server's messages, whose response senders
write the responses back (tensors through the response arena). Everything a model reaches through
``pb_utils`` goes to the server:

- BLS and model control: the model's context (and so its :class:`~.scope.ServerLink`) holds a
  :class:`RemoteInfer` and a :class:`RemoteControl`, the process's side of the server's ``infer`` and
  ``control`` handles: they send the request to the server, which runs it through its DataPlane and
  streams the responses back;
- custom metrics: :class:`ProcessMetrics` keeps each series in a shared page the server reads;
- logging: every record goes to the server's log (:class:`LogForwarder`).

The server's messages are read by one thread at a time. Once a model that is not decoupled has its instance,
that is the instance's thread (where model code runs, as in the server) while it has nothing else to do: it
reads the socket and runs each batch it reads inline, so a batch costs no hand-over between threads (no
wake-up of a second thread, no passing of the GIL). While it runs a batch nobody reads, unless something needs
reading: a reply the process awaits (a BLS call, a model control: the reader thread takes over when one is sent
or in flight) or a cancellation of a batch that runs long (the reader thread looks every few milliseconds while a
batch runs, and takes over after ``LONG_BATCH_S``). The reader thread reads otherwise (before the instance
exists, for decoupled models, with direct links, while the instance's thread runs other work) and hands a batch
to the instance's thread, which goes on reading after it. BLS responses and the model's lifecycle go to an
event loop on the main thread, which runs BLS calls and ``auto_complete_config`` / ``initialize`` /
``finalize``. ``TIDESERVE_PROCESS_READER=thread`` keeps the reader thread reading always. Writes
are blocking, under a lock, from whichever thread answers; what a batch returns goes out in one write. The process exits when
the server asks (after ``finalize``), when its socket closes (the server is gone), or when the model
calls ``sys.exit`` in execute.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import itertools
import logging
import os
import select
import socket
import sys
import threading
import time
from functools import partial
from pathlib import Path

import msgspec
from tritonclient.grpc import model_config_pb2 as mc

from tideserve.backend_api import (
    InferenceRequest as CoreRequest,
    InferenceResponse as CoreResponse,
    InstanceContext,
    ModelContext,
    ResponseSender,
    arena,
    as_server_error,
    wire,
)

from . import metrics, protocol
from .backend import ModelExit, PythonBackend, PythonInstance, PythonModel

log = logging.getLogger(__name__)

METRICS_PAGE = 64 * 1024  # bytes of shared memory per page of custom metric values
# The instance's thread reads the socket between its batches (see the module's doc); "thread": never.
INSTANCE_READS = os.environ.get("TIDESERVE_PROCESS_READER", "instance") != "thread"
LONG_BATCH_S = 0.01  # a batch that runs this long while nobody reads: the reader thread takes over reading
STANDBY_CHECK_S = 0.01  # how often the reader thread looks, while the instance's thread may run such a batch
STANDBY_IDLE_S = 1.0  # no batch for this long: the reader thread stops looking until the next batch starts

# Who reads the socket (Stub._holder): the reader thread, the instance's thread, or nobody (None: the
# instance's thread runs a batch it read, or one the reader thread handed it, and reads again after it).
THREAD, INSTANCE = "thread", "instance"


def run(spec: protocol.ProcessSpec, sock_fd: int, request_fd: int, response_fd: int) -> int:
    """The life of a model process (in the child the zygote forked); its exit code."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)  # a model's prints reach the log in order
        except AttributeError:
            pass
    if "numpy.random" in sys.modules:  # forked children would otherwise share the zygote's random state
        sys.modules["numpy.random"].seed()
    os.set_inheritable(sock_fd, False)  # a program the model starts must not keep the connection open
    stub = Stub(spec, socket.socket(fileno=sock_fd), request_fd, response_fd)
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(LogForwarder(stub))
    root.setLevel(spec.log_level)
    _name_process(spec.label)
    loop = _new_event_loop()
    asyncio.set_event_loop(loop)
    loop.run_until_complete(stub.serve())
    _flush_output()
    return 0


def _new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop where it is installed, as the server's own processes run: its timers fire on the loop's next
    turn for delays under a millisecond (a dynamic batcher's ``max_queue_delay_microseconds: 100``), where
    asyncio's own loop sleeps in ``epoll`` for at least a whole millisecond."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _name_process(label: str) -> None:
    """Name the process after what it serves, for ps and top (Linux keeps 15 characters)."""
    threading.current_thread().name = label
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(15, label.encode()[:15], 0, 0, 0)  # PR_SET_NAME
        except (OSError, AttributeError):
            pass


def _flush_output() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


class Stub:
    """The model process's end of the connection, and the model and instance it hosts."""

    def __init__(self, spec: protocol.ProcessSpec, sock: socket.socket, request_fd: int, response_fd: int) -> None:
        self.spec = spec
        self.sock = sock
        self.sock.setblocking(True)
        self.reader = wire.FrameReader(protocol.ToProcess)
        self.requests_in = arena.Inbox(request_fd, spec.request_arena, self._released)
        os.close(request_fd)
        self.responses_out = arena.Outbox(arena.Arena(spec.response_arena, "", fd=response_fd))
        self.responses_out.arena.close_fd()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._write_lock = threading.Lock()
        self._local = threading.local()
        self._releases: collections.deque[int] = collections.deque()  # blocks of the request arena read
        self._release_scheduled = False
        self._done: asyncio.Future | None = None
        self._tasks: set[asyncio.Task] = set()
        self.model: PythonModel | None = None
        self.instance: PythonInstance | None = None
        self.direct = None  # a DirectServer (direct.py) once the server opens frontend workers' direct links
        self.requests: dict[int, CoreRequest] = {}  # by the server's id, until their final response
        self.calls: dict[int, RemoteCall] = {}  # BLS calls in flight
        self.controls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        # who reads the socket (THREAD, INSTANCE or None) and whether the instance's thread may (see the module's
        # doc); only the holder changes it, but for None -> THREAD (the reader thread takes over)
        self._role = threading.Lock()
        self._holder: str | None = THREAD
        self._inline = False
        self._standby = threading.Event()  # wakes the reader thread while it does not read
        self._standby_deep = False  # it waits for no timeout (no batch for STANDBY_IDLE_S)
        self._batch_since = 0.0  # when the batch the instance's thread runs while nobody reads started (0: none)
        self._last_batch = 0.0
        self._wake_fd: int | None = None  # an eventfd that ends the instance's thread's poll (work posted to it)
        self._poll: select.poll | None = None
        # the model's handles to the server, and its custom metrics
        self.remote_infer = RemoteInfer(self)
        self.remote_control = RemoteControl(self)
        self.process_metrics = ProcessMetrics(self)

    # -- the connection ------------------------------------------------------------------------------
    async def serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._done = self.loop.create_future()
        threading.Thread(target=self._read, name=f"{self.spec.label}-reader", daemon=True).start()
        await self._done

    def send(self, *messages, fd: int | None = None) -> None:
        """Write ``messages`` at once (with ``fd``, which is then closed); from any thread, blocking."""
        data = b"".join(map(wire.frame, messages))
        with self._write_lock:
            if self._releases:
                data = wire.frame(wire.Release(_drain(self._releases))) + data
            if fd is None:
                self.sock.sendall(data)
            else:
                sent = wire.send_frames(self.sock, data, fd)
                if sent < len(data):
                    self.sock.sendall(data[sent:])
        if fd is not None:
            os.close(fd)

    def _read(self) -> None:
        """The reader thread: while it reads, hands each message to whoever handles it (the instance's thread
        for a batch, the event loop for BLS responses and the model's lifecycle); else waits to take over."""
        while True:
            if self._holder != THREAD:
                self._park()
                continue
            for message in self._receive():
                try:
                    if type(message) is protocol.Execute:
                        self._hand_over(message)
                    else:
                        self._handle(message)
                except Exception:
                    log.exception("model process '%s': cannot handle %s", self.spec.label, type(message).__name__)

    def _receive(self) -> list:
        try:
            messages = self.reader.receive(self.sock)
        except OSError:
            messages = None
        if messages is None:  # the server is gone: nobody is left to answer
            _flush_output()
            os._exit(0)
        return messages

    def _park(self) -> None:
        """The reader thread while it does not read: it looks every STANDBY_CHECK_S whether the batch the
        instance's thread runs while nobody reads has run LONG_BATCH_S (then it reads: a cancellation reaches the
        batch), or at once when woken (a reply is awaited)."""
        self._standby_deep = True  # before reading _batch_since: a batch that starts now wakes it (_run_inline)
        deep = not self._batch_since and time.monotonic() - self._last_batch > STANDBY_IDLE_S
        if not deep:
            self._standby_deep = False
        self._standby.wait(None if deep else STANDBY_CHECK_S)
        self._standby.clear()
        self._standby_deep = False
        since = self._batch_since
        if since and time.monotonic() - since >= LONG_BATCH_S:
            self._take_over()

    def _take_over(self) -> None:
        """The reader thread reads while the instance's thread runs its batch (from any thread)."""
        with self._role:
            if self._holder is None:
                self._holder = THREAD
                self._standby.set()

    def _batch(self, message: protocol.Execute) -> tuple:
        block = self.requests_in.block(message.payload, self._fd_of(message.payload))
        requests = message.requests
        cores = [self._request(meta, block) for meta in requests]
        return message.batch, cores, [meta.rid for meta in requests]

    def _hand_over(self, message: protocol.Execute) -> None:
        """(The reader thread.) The batch goes to the instance's thread; where that thread may read, it reads
        after the batch, and this thread stops reading (it finishes the messages it read)."""
        args = self._batch(message)
        if self._inline:
            with self._role:
                if self._holder == THREAD:
                    self._holder = None
            self.instance.thread.post(self._run_inline, *args)
        else:
            self.instance.thread.post(self._run_batch, *args)

    def _enable_instance_reads(self, instance: PythonInstance) -> None:
        """The instance's thread reads the socket while its queue is empty (a model that is not decoupled)."""
        if not INSTANCE_READS or instance.decoupled or not hasattr(os, "eventfd"):
            return
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        poll = select.poll()
        poll.register(self.sock.fileno(), select.POLLIN)
        poll.register(self._wake_fd, select.POLLIN)
        self._poll = poll
        thread = instance.thread
        thread.idle_wake = self._wake
        thread.idle = self._read_on_instance
        self._inline = True

    def _disable_instance_reads(self) -> None:
        """From now on the reader thread reads (the instance's thread runs the direct links' loop)."""
        if self._inline:
            self._inline = False
            self._wake()

    def _wake(self) -> None:
        try:
            os.eventfd_write(self._wake_fd, 1)
        except OSError:
            pass

    def _read_on_instance(self) -> bool:
        """(The instance's thread, while its queue is empty.) Read the socket and run the batches it brings; False
        when this thread does not read (it waits on its queue), True to be called again."""
        thread = self.instance.thread
        if self._holder != INSTANCE:  # (None: the reader thread is handing this thread a batch)
            return False
        if not self._inline:
            self._give_up()
            thread.idle = None
            return False
        thread.idling = True
        if thread.has_work():
            thread.idling = False
            self._give_up()  # posted work (finalize, the direct links' loop) may await replies meanwhile
            return True
        try:
            ready = self._poll.poll()
        finally:
            thread.idling = False
        readable = False
        for fd, _events in ready:
            if fd == self._wake_fd:
                try:
                    os.eventfd_read(self._wake_fd)
                except OSError:
                    pass
            else:
                readable = True
        if readable:
            batches = []  # run after the other messages read with them (a cancellation of theirs among them)
            for message in self._receive():
                try:
                    if type(message) is protocol.Execute:
                        batches.append(self._batch(message))
                    else:
                        self._handle(message)
                except Exception:
                    log.exception("model process '%s': cannot handle %s", self.spec.label, type(message).__name__)
            for args in batches:
                thread.run(self._run_inline, *args)
        return True

    def _give_up(self) -> None:
        """(The instance's thread, holding the role.) The reader thread reads from now on."""
        with self._role:
            if self._holder == INSTANCE:
                self._holder = THREAD
                self._standby.set()

    def _run_inline(self, batch: int, requests: list[CoreRequest], rids: list[int]) -> None:
        """(The instance's thread.) Run a batch with nobody reading the socket (unless a reply is awaited: the
        reader thread reads then); read again after it."""
        with self._role:
            if self._holder == INSTANCE:
                self._holder = None
            if self._holder is None and (self.calls or self.controls):
                self._holder = THREAD
                self._standby.set()
            unread = self._holder is None
        if unread:
            self._batch_since = time.monotonic()
            if self._standby_deep:
                self._standby.set()
        try:
            self._run_batch(batch, requests, rids)
        finally:
            self._batch_since = 0.0
            self._last_batch = time.monotonic()
            with self._role:
                if self._holder is None:
                    if self._inline:
                        self._holder = INSTANCE
                    else:
                        self._holder = THREAD
                        self._standby.set()

    def _handle(self, message) -> None:
        loop = self.loop
        match message:
            case protocol.Execute():
                self.instance.thread.post(self._run_batch, *self._batch(message))
            case wire.Cancel(rid=rid):
                request = self.requests.get(rid)
                if request is not None:
                    request.cancellation.cancel()
            case protocol.CallResponse(call=call, response=response, payload=payload):
                block = self.requests_in.block(payload, self._fd_of(payload))
                remote = self.calls.get(call)
                if remote is not None:
                    loop.call_soon_threadsafe(remote.deliver, wire.core_response(response, block))
            case protocol.ControlResult():
                loop.call_soon_threadsafe(self._control_result, message)
            case wire.Release(offsets=offsets):
                for offset in offsets:
                    self.responses_out.arena.release(offset)
            case protocol.AutoComplete(call=call, model=model):
                loop.call_soon_threadsafe(self._spawn, self._reply(call, self._auto_complete(model)))
            case protocol.CreateInstance(call=call, model=model, instance=instance):
                loop.call_soon_threadsafe(self._spawn, self._reply(call, self._create_instance(model, instance)))
            case protocol.Finalize(call=call):
                loop.call_soon_threadsafe(self._spawn, self._finalize(call))
            case protocol.OpenDirect(call=call, path=path):
                loop.call_soon_threadsafe(self._spawn, self._reply(call, self._open_direct(path)))
            case protocol.DirectStats(call=call):
                loop.call_soon_threadsafe(self._direct_counters, call)
            case protocol.DirectDrain(call=call, timeout_s=timeout_s):
                loop.call_soon_threadsafe(self._spawn, self._reply(call, self._direct_drain(timeout_s)))

    def _fd_of(self, payload: wire.Payload | None) -> int | None:
        return self.reader.take_fd() if payload is not None and payload.offset == arena.OWN_FILE else None

    def _spawn(self, coro) -> None:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _released(self, offset: int) -> None:
        """A block of the request arena is no longer read (called where its last array was dropped). The
        server hears of it with the next message, or a few milliseconds later when none goes out."""
        self._releases.append(offset)
        if not self._release_scheduled:
            self._release_scheduled = True
            try:
                self.loop.call_soon_threadsafe(self.loop.call_later, arena.RELEASE_DELAY_S, self._send_releases)
            except RuntimeError:  # the loop is closed: the process is exiting
                pass

    def _send_releases(self) -> None:
        self._release_scheduled = False
        if self._releases:
            self.send(wire.Release(_drain(self._releases)))

    # -- requests and responses ---------------------------------------------------------------------------
    def _request(self, meta: wire.Request, block) -> CoreRequest:
        request = wire.core_request(meta, block)
        request.response_sender = ResponseSender(request, partial(self._respond, meta.rid))
        self.requests[meta.rid] = request
        return request

    def _respond(self, rid: int, response: CoreResponse) -> None:
        """The response sender's sink: from whichever thread the model answers on."""
        if response.final:
            self.requests.pop(rid, None)
        held = getattr(self._local, "answers", None)
        if held is not None:  # a batch's returned responses: sent together when the batch ends
            held.append((rid, response))
        else:
            message, fd = self._answers([(rid, response)])
            self.send(message, fd=fd)

    def _answers(self, items: list[tuple[int, CoreResponse]]) -> tuple[protocol.Respond, int | None]:
        """The Respond message for ``items`` (their tensors in one block) and the descriptor to send with it."""
        refs, payload, fd = self.responses_out.put([t for _, response in items for t in response.outputs])
        answers, start = [], 0
        for rid, response in items:
            end = start + len(response.outputs)
            answers.append(protocol.Answer(rid, wire.response_message(response, refs[start:end])))
            start = end
        return protocol.Respond(answers, payload), fd

    def _run_batch(self, batch: int, requests: list[CoreRequest], rids: list[int]) -> None:
        """On the instance's thread: run execute, then send its responses and the end of the batch at once
        (with the requests the model rescheduled)."""
        try:
            answers = self.instance.run_execute(requests)
        except ModelExit as exc:
            self.exit_process(exc)
        except Exception as exc:  # noqa: BLE001 - as the server's runtime does: the batch fails, the model serves on
            error = as_server_error(exc)
            answers = [(request, CoreResponse(error=error)) for request in requests]
        self._local.answers = held = []
        try:
            PythonInstance.answer(answers)
        finally:
            self._local.answers = None
        rescheduled = [rid for rid, request in zip(rids, requests) if request.reschedule]
        for rid in rescheduled:  # it comes back as a new request when it runs again
            self.requests.pop(rid, None)
        executed = protocol.Executed(batch, rescheduled)
        if held:
            message, fd = self._answers(held)
            self.send(message, executed, fd=fd)
        else:
            self.send(executed)

    def exit_process(self, exc: ModelExit) -> None:
        """The model called sys.exit in execute: tell the server why, then exit with its code."""
        try:
            self.send(protocol.Exiting(exc.reason))
        finally:
            _flush_output()
            os._exit(exc.code)

    # -- the model's lifecycle ----------------------------------------------------------------------------
    async def _reply(self, call: int, coro) -> None:
        try:
            config = await coro
        except Exception as exc:  # noqa: BLE001 - the server reports it as the load's failure
            error = as_server_error(exc)
            self.send(protocol.Reply(call, error=wire.error_data(error)))
        else:
            self.send(protocol.Reply(call, config=config or b""))

    def _model(self, spec: protocol.ModelSpec) -> PythonModel:
        config = mc.ModelConfig.FromString(spec.config)
        if self.model is None:
            ctx = ModelContext(spec.name, spec.version, config, Path(spec.model_path), infer=self.remote_infer,
                               control=self.remote_control)
            self.model = PythonModel(PythonBackend(), ctx, metrics_collector=self.process_metrics)
        else:
            self.model.ctx.config.CopyFrom(config)
        return self.model

    async def _auto_complete(self, spec: protocol.ModelSpec) -> bytes:
        model = self._model(spec)
        await asyncio.to_thread(model.auto_complete_config)
        return model.config.SerializeToString()

    async def _create_instance(self, spec: protocol.ModelSpec, instance: protocol.InstanceSpec) -> None:
        model = self._model(spec)
        await asyncio.to_thread(model.initialize)
        ctx = InstanceContext(instance.name, instance.kind, instance.device_id, instance.index, instance.group_name)
        created = model.create_instance(ctx)
        created.on_exit = self.exit_process
        await created.initialize()
        self.instance = created
        self._enable_instance_reads(created)
        self.spec.label = instance.name
        _name_process(instance.name)

    # -- --frontend-direct ---------------------------------------------------------------------------------
    async def _open_direct(self, path: str) -> None:
        if self.direct is None:
            from .direct import DirectServer

            self._disable_instance_reads()  # its thread runs the links' loop
            self.direct = await DirectServer.open(self, path)

    def _direct_counters(self, call: int) -> None:
        counters = self.direct.counters() if self.direct is not None else {}
        self.send(protocol.Reply(call, config=msgspec.msgpack.encode(counters)))

    async def _direct_drain(self, timeout_s: float) -> bytes:
        counters = await self.direct.drain(timeout_s) if self.direct is not None else {}
        return msgspec.msgpack.encode(counters)

    async def _finalize(self, call: int) -> None:
        try:
            if self.instance is not None:
                await self.instance.finalize()
        except Exception:
            log.exception("instance '%s' failed to finalize", self.spec.label)
        if self.model is not None:
            self.model.finalize()
        self.send(protocol.Reply(call))
        self._done.set_result(None)

    # -- calls to the server ----------------------------------------------------------------------------
    def call(self, request: CoreRequest, unary: bool, holds: bool = False) -> RemoteCall:
        """Send a BLS request to the server (on the loop); its responses come to the returned call. ``holds``: the
        instance's thread waits on it in a batch from the frontend workers (``protocol.Call``)."""
        call = next(self._ids)
        remote = self.calls[call] = RemoteCall(self, call)
        self._take_over()  # its responses are read while a batch runs
        refs, payload, fd = self.responses_out.put(list(request.inputs.values()))
        meta = wire.request_message(call, request, refs)
        self.send(protocol.Call(call, meta, payload, unary, holds), fd=fd)
        return remote

    def _control_result(self, result: protocol.ControlResult) -> None:
        future = self.controls.pop(result.call, None)
        if future is not None and not future.done():
            future.set_result(result)

    async def control(self, make) -> protocol.ControlResult:
        call = next(self._ids)
        future = self.controls[call] = self.loop.create_future()
        self._take_over()  # its result is read while a batch runs
        self.send(make(call))
        result = await future
        if result.error is not None:
            raise wire.server_error(result.error)
        return result


def _drain(queue: collections.deque[int]) -> list[int]:
    items = []
    while True:
        try:
            items.append(queue.popleft())
        except IndexError:
            return items


class RemoteCall:
    """A BLS call in flight: its responses as they arrive, an async iterator like the DataPlane's streams."""

    def __init__(self, stub: Stub, call: int) -> None:
        self._stub = stub
        self._call = call
        self._items: collections.deque[CoreResponse] = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._done = False

    def deliver(self, response: CoreResponse) -> None:
        if response.final:
            self._stub.calls.pop(self._call, None)
        self._items.append(response)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def __aiter__(self) -> RemoteCall:
        return self

    async def __anext__(self) -> CoreResponse:
        if self._done:
            raise StopAsyncIteration
        while not self._items:
            self._waiter = self._stub.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
            if self._done and not self._items:
                raise StopAsyncIteration
        response = self._items.popleft()
        if response.final:
            self._done = True
        return response

    def cancel(self) -> None:
        """Stop the call (the server cancels its request); iteration ends."""
        if self._done:
            return
        self._done = True
        if self._stub.calls.pop(self._call, None) is not None:
            self._stub.send(protocol.CancelCall(self._call))
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def aclose(self) -> None:
        self.cancel()

    def cancel_request(self) -> None:
        """Flag the called model's request as cancelled; its responses keep coming until its final one."""
        if not self._done and self._call in self._stub.calls:
            self._stub.send(protocol.CancelCall(self._call, True))


class RemoteInfer:
    """The server's ``infer`` handle as the model process sees it (what BLS uses)."""

    def __init__(self, stub: Stub) -> None:
        self._stub = stub

    def __call__(self, request: CoreRequest, holds: bool = False) -> RemoteCall:
        return self._stub.call(request, unary=False, holds=holds)

    async def unary(self, request: CoreRequest, holds: bool = False) -> CoreResponse:
        request.streaming = False
        remote = self._stub.call(request, unary=True, holds=holds)
        try:
            response = await remote.__anext__()
        except asyncio.CancelledError:  # a timeout: the server's request is cancelled too
            remote.cancel()
            raise
        if response.error is not None:
            raise response.error
        return response


class RemoteControl:
    """The server's model-control handle as the model process sees it (``pb_utils.load_model`` ...)."""

    def __init__(self, stub: Stub) -> None:
        self._stub = stub

    async def load(self, name: str, config_json: str | None = None) -> None:
        await self._stub.control(lambda call: protocol.LoadModel(call, name, config_json or ""))

    async def unload(self, name: str, unload_dependents: bool = False) -> None:
        await self._stub.control(lambda call: protocol.UnloadModel(call, name, unload_dependents))

    async def ready(self, name: str, version: str = "") -> bool:
        return (await self._stub.control(lambda call: protocol.ModelReady(call, name, version))).ready


class ProcessMetrics(metrics.Collector):
    """Custom metrics of the model process: each series in a page of shared memory the server maps (the
    page's file goes with the first series in it), so updating a metric sends nothing."""

    def __init__(self, stub: Stub) -> None:
        super().__init__()
        self._stub = stub
        self._pages_lock = threading.Lock()
        self._pages: list = []
        self._page_size = 0
        self._used = 0

    def new_cells(self, family: metrics.MetricFamily, labels: dict[str, str],
                  buckets: list[float] | None) -> memoryview:
        count = metrics.cell_count(family._kind, buckets)
        size = 8 * count
        fd = None
        with self._pages_lock:
            if not self._pages or self._used + size > self._page_size:
                self._page_size = max(METRICS_PAGE, size)
                fd = arena.create_file(self._page_size, "tideserve-metrics")
                self._pages.append(arena.map_file(fd, self._page_size))
                self._used = 0
            page, offset = len(self._pages) - 1, self._used
            self._used += size
            cells = memoryview(self._pages[page])[offset:offset + size].cast("d")
        self._stub.send(protocol.Series(family._name, family._description, int(family._kind), labels, buckets, page,
                                    self._page_size, offset, count), fd=fd)
        return cells


class LogForwarder(logging.Handler):
    """Sends every log record of the process to the server, which logs it under the same logger name."""

    def __init__(self, stub: Stub) -> None:
        super().__init__()
        self._stub = stub
        self._formatter = logging.Formatter()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = ""
            if record.exc_info:
                text = self._formatter.formatException(record.exc_info)
            elif record.exc_text:
                text = record.exc_text
            if record.stack_info:
                text = (text + "\n" if text else "") + record.stack_info
            self._stub.send(protocol.Log(record.name, record.levelno, record.getMessage(), record.pathname,
                                     record.lineno, record.funcName or "", record.created, record.threadName or "",
                                     text))
        except Exception:  # noqa: BLE001 - logging's own way: report on stderr, never raise
            self.handleError(record)

