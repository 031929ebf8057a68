"""The ``python`` backend: runs Triton Python-backend models (``<model>/<version>/model.py``).

By default every instance runs in a process of its own (:mod:`.process`), as Triton's stub processes
do: a model that crashes, exits or holds the GIL fails or slows only itself. The parameter
``process_isolation: "false"`` runs a model in the server's process instead, with the classes below;
a model process hosts these same classes.

Each model version imports its ``model.py`` as its own module (:mod:`.loader`); each instance makes
its own ``TritonPythonModel()`` and runs every hook of it on one thread of its own. ``async def
execute`` runs on an event loop of the instance (decoupled models in the background, so the instance
takes the next batch at once), never on the server's loop: a model that blocks there, or calls the
blocking ``exec()``, cannot stall the server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import queue
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2 as mc

from tideserve.backend_api import (
    Backend,
    InferenceRequest as CoreRequest,
    InferenceResponse as CoreResponse,
    InstanceContext,
    InternalError,
    InvalidArgument,
    Model,
    ModelContext,
    ModelInstance,
    Unavailable,
    config_to_dict,
    config_to_json,
)

from .errors import TritonModelException
from .loader import ModelModule, import_model_file
from .messages import InferenceRequest, InferenceResponse
from .model_config import ModelConfig
from .process import ProcessModel, process_isolation
from .scope import ModelScope, ServerLink, remember_link, reset_scope, set_scope

log = logging.getLogger(__name__)

STUCK_WAIT_S = 5.0  # at unload, how long to wait for work that outlived the drain before abandoning it


class ModelExit(InternalError):
    """The model called ``sys.exit`` (raised SystemExit) in execute: its instance stops for good."""

    def __init__(self, message: str, reason: str, code: int) -> None:
        super().__init__(message)
        self.reason = reason
        self.code = code


class InstanceThread:
    """The one thread that runs a model instance's code; a daemon, so a model stuck in ``execute``
    cannot keep the server process from exiting (Triton would kill its stub process).

    Work comes through a queue, or, while the thread runs an event loop of its own (:meth:`serve`: a model
    process's direct links, ``direct.py``), through that loop: the loop's callbacks and the work posted to the
    thread then take turns on it. A model process can also give the thread something to do while its queue is
    empty (:attr:`idle`: read the process's socket and run the batches it brings inline, ``stub.py``)."""

    def __init__(self, name: str, scope: ModelScope) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # the switch to and from a loop against posts from other threads
        self._loop: asyncio.AbstractEventLoop | None = None
        self.busy = False
        # Run (on the thread) while the queue is empty, instead of waiting on it; returns True to be run again,
        # False to wait on the queue. While it waits itself it sets ``idling`` and watches for ``idle_wake``,
        # which a post then calls (after the work is queued: it returns, and the thread runs the work).
        self.idle: Callable[[], bool] | None = None
        self.idle_wake: Callable[[], None] | None = None
        self.idling = False
        self._thread = threading.Thread(target=self._run, args=(scope,), name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._put((future, fn, args))
        return future

    def post(self, fn, *args) -> None:
        """Run ``fn(*args)`` on the thread with no future to wait on (``fn`` answers for itself)."""
        self._put((None, fn, args))

    def _put(self, item) -> None:
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._call, item)
                return
            except RuntimeError:  # the loop closed in the meantime: the queue takes it
                pass
        with self._lock:
            loop = self._loop
            if loop is None:
                self._queue.put(item)
                if self.idling:
                    self.idle_wake()
                return
        loop.call_soon_threadsafe(self._call, item)

    def run(self, fn, *args) -> None:
        """Run ``fn(*args)`` now, on the thread (from :attr:`idle`), as posted work runs."""
        self._call((None, fn, args))

    def has_work(self) -> bool:
        """Whether work waits in the queue (for :attr:`idle`, after it set ``idling``)."""
        return not self._queue.empty()

    def _run(self, scope: ModelScope) -> None:
        set_scope(scope)
        while True:
            idle = self.idle
            # (called with work queued too: a thread that reads the process's socket hands the reading back before
            # it runs posted work, which may run long or never return, as the direct links' loop does)
            if idle is not None and idle():
                continue
            item = self._queue.get()
            if item is None:
                return
            self._call(item)
            del item

    def _call(self, item) -> None:
        future, fn, args = item
        if future is not None and not future.set_running_or_notify_cancel():
            return
        running = asyncio.events._get_running_loop()
        if running is not None:  # inside serve's loop: model code sees no running loop, as on the plain thread
            asyncio.events._set_running_loop(None)
        self.busy = True
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            if future is None:
                log.exception("instance thread: %s failed", getattr(fn, "__qualname__", fn))
            else:
                future.set_exception(exc)
        else:
            if future is not None:
                future.set_result(result)
        finally:
            self.busy = False
            if running is not None:
                asyncio.events._set_running_loop(running)

    def serve(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the thread: run ``loop`` until :meth:`stop`; what is posted to the thread meanwhile runs as its
        callbacks, in order."""
        with self._lock:
            self._loop = loop
            held = []
            while True:
                try:
                    held.append(self._queue.get_nowait())
                except queue.Empty:
                    break
        for item in held:
            if item is None:  # stopped before the loop ran
                self._queue.put(None)
                loop.call_soon(loop.stop)
                break
            loop.call_soon(self._call, item)
        busy, self.busy = self.busy, False
        try:
            loop.run_forever()
        finally:
            with self._lock:
                self._loop = None
            self.busy = busy

    def stop(self) -> None:
        with self._lock:
            loop = self._loop
            self._queue.put(None)
            if loop is None and self.idling:
                self.idle_wake()
        if loop is not None:
            try:
                loop.call_soon_threadsafe(loop.stop)
            except RuntimeError:
                pass


class PythonModel(Model):
    """One version of a Python model: its imported module and its configuration."""

    def __init__(self, backend: Backend, ctx: ModelContext, metrics_collector=None) -> None:
        """``metrics_collector``: in a model process, the collector that shares custom metrics with the server."""
        super().__init__(backend, ctx)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        self.link = (ServerLink(ctx.infer, ctx.control, loop, ctx.metrics, metrics_collector)
                     if loop is not None else None)
        if self.link is not None and ctx.infer is not None:
            remember_link(self.link)
        self.logger = logging.getLogger(f"tideserve.python_model.{ctx.name}")
        self.scope = ModelScope(self.link, ctx.name, ctx.version, ctx.version_path, self.logger)
        self.module: ModelModule | None = None
        self.model_class: type | None = None
        self._config_json: str | None = None

    @property
    def model_file(self) -> Path:
        return self.ctx.version_path / (self.config.default_model_filename or "model.py")

    @property
    def config_json(self) -> str:
        """The configuration as Triton hands it to ``initialize`` (final once the model loaded)."""
        if self._config_json is None:
            self._config_json = config_to_json(self.config)
        return self._config_json

    def _import(self) -> None:
        if self.module is not None:
            return
        path = self.model_file
        if not path.is_file():
            raise Unavailable(f"Python model file not found in '{path}'")
        self.module = import_model_file(self.ctx.name, self.ctx.version, path)
        model_class = getattr(self.module.module, "TritonPythonModel", None)
        if not isinstance(model_class, type):
            raise InvalidArgument(f"Python model '{path}' does not define a class 'TritonPythonModel'")
        self.model_class = model_class

    def auto_complete_config(self) -> None:
        """Import ``model.py`` and let ``TritonPythonModel.auto_complete_config`` fill in the config."""
        token = set_scope(self.scope)
        try:
            self._import()
            hook = getattr(self.model_class, "auto_complete_config", None)
            if hook is None:
                return
            result = hook(ModelConfig(config_to_dict(self.config)))
            if not isinstance(result, ModelConfig):
                raise InvalidArgument(f"auto_complete_config function in model '{self.ctx.name}' must return a "
                                      f"valid pb.ModelConfig object.")
            completed = mc.ModelConfig()
            json_format.ParseDict(result.as_dict(), completed)
            self.config.CopyFrom(completed)
            self._config_json = None
        except (ValueError, json_format.ParseError) as exc:  # ModelConfig's refusals, a bad result
            raise InvalidArgument(f"auto_complete_config of model '{self.ctx.name}': {exc}") from None
        finally:
            reset_scope(token)

    def initialize(self) -> None:
        self._import()

    def create_instance(self, ctx: InstanceContext) -> PythonInstance:
        return PythonInstance(self, ctx)

    def finalize(self) -> None:
        if self.module is not None:
            self.module.unload()
            self.module = None


class PythonInstance(ModelInstance):
    """One ``TritonPythonModel()`` with its own thread (and event loop for ``async def execute``)."""

    model: PythonModel

    def __init__(self, model: PythonModel, ctx: InstanceContext) -> None:
        super().__init__(model, ctx)
        self.decoupled = model.ctx.decoupled
        self.scope = model.scope
        self.thread = InstanceThread(ctx.name, model.scope)
        self.python_model = None
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._aloop_thread: threading.Thread | None = None
        self._background: set[concurrent.futures.Future] = set()  # async decoupled executions
        self._background_lock = threading.Lock()
        # what happens when the model calls sys.exit in execute: here the model turns UNAVAILABLE; a model
        # process ends itself instead (see .stub)
        self.on_exit: Callable[[ModelExit], None] = lambda exc: model.ctx.report_failure(exc.reason)

    # -- lifecycle (all model code runs on self.thread) -------------------------------------
    async def _on_thread(self, fn, *args):
        return await asyncio.wrap_future(self.thread.submit(fn, *args))

    async def initialize(self) -> None:
        try:
            await self._on_thread(self._initialize)
        except BaseException:
            self._stop_threads()
            raise

    def _initialize(self) -> None:
        self.python_model = self.model.model_class()
        hook = getattr(self.python_model, "initialize", None)
        if hook is not None:
            self._maybe_await(hook(self.args()))

    def args(self) -> dict[str, str]:
        """The ``args`` of ``initialize``: Triton's keys, every value a string."""
        ctx, model_ctx = self.ctx, self.model.ctx
        kind = ctx.kind.removeprefix("KIND_")
        return {
            "model_config": self.model.config_json,
            "model_instance_kind": kind,
            "model_instance_name": ctx.name,
            "model_instance_device_id": str(ctx.device_id),
            "model_repository": str(model_ctx.model_path),
            "model_version": str(model_ctx.version),
            "model_name": model_ctx.name,
        }

    async def finalize(self) -> None:
        try:
            deadline = time.monotonic() + STUCK_WAIT_S
            while self.thread.busy and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if self.thread.busy:
                log.warning("instance '%s' is still executing after the drain; it is abandoned without "
                            "finalize", self.ctx.name)
                return
            await self._on_thread(self._finalize)
        finally:
            self._stop_threads()

    def _finalize(self) -> None:
        with self._background_lock:
            background = list(self._background)
        if background:
            concurrent.futures.wait(background, timeout=STUCK_WAIT_S)
        hook = getattr(self.python_model, "finalize", None)
        if hook is not None:
            self._maybe_await(hook())

    def _stop_threads(self) -> None:
        """Let the instance's threads end (without waiting: they are daemons)."""
        if self._aloop is not None:
            self._aloop.call_soon_threadsafe(self._aloop.stop)
            self._aloop = self._aloop_thread = None
        self.thread.stop()

    # -- the instance's event loop -------------------------------------------------------------
    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._aloop is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=self._run_loop, args=(loop,), name=f"{self.ctx.name}-asyncio",
                                      daemon=True)
            thread.start()
            self._aloop, self._aloop_thread = loop, thread
        return self._aloop

    def _run_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        set_scope(self.scope)
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _scoped(self, coro):
        set_scope(self.scope)  # the task's own context
        try:
            return await coro
        except SystemExit as exc:  # asyncio would stop the instance's loop with it: carry it out as an error
            raise self._exit(exc) from None

    def _submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(self._scoped(coro), self._event_loop())

    def _maybe_await(self, result):
        return self._submit(result).result() if inspect.iscoroutine(result) else result

    # -- execute -----------------------------------------------------------------------------
    async def execute(self, requests: list[CoreRequest]) -> None:
        try:
            answers = await self._on_thread(self.run_execute, requests)
        except ModelExit as exc:
            self.on_exit(exc)
            raise
        self.answer(answers)

    @staticmethod
    def answer(answers: list[tuple[CoreRequest, CoreResponse]] | None) -> None:
        """Send the responses execute returned."""
        for request, response in answers or ():
            if response.error is not None:
                request.response_sender.send_error(response.error)
            else:
                request.response_sender.send(response, final=True)

    def run_execute(self, requests: list[CoreRequest]) -> list[tuple[CoreRequest, CoreResponse]] | None:
        """Run the model's execute, on the instance's thread; return the responses it returned, paired with
        their requests (None when it answers through the senders). Raises the batch's error, or ModelExit."""
        pb_requests = [InferenceRequest._wrap(r, self.decoupled) for r in requests]
        try:
            result = self.python_model.execute(pb_requests)
            if inspect.iscoroutine(result):
                if self.decoupled:  # answers through its senders; the instance moves on at once
                    future = self._submit(result)
                    with self._background_lock:
                        self._background.add(future)
                    future.add_done_callback(partial(self._background_done, pb_requests))
                    self._release(pb_requests)
                    return None
                result = self._submit(result).result()
            answers = self._returned(pb_requests, result)
            self._release(pb_requests)
            return answers
        except ModelExit:
            self._close_senders(pb_requests)
            raise
        except SystemExit as exc:  # sys.exit() in execute: never the server's exit
            self._close_senders(pb_requests)
            raise self._exit(exc) from None
        except Exception as exc:  # noqa: BLE001 - whatever the model raises fails its batch
            raise self._failure(pb_requests, exc) from None

    def _returned(self, pb_requests: list[InferenceRequest], result) -> list[tuple[CoreRequest, CoreResponse]] | None:
        """Triton's checks of what execute returned."""
        if result is None:  # the responses go (or went) through the response senders
            return None
        if self.decoupled:
            raise TritonModelException(f"Python model '{self.ctx.name}' is using the decoupled mode and the execute "
                                       f"function must return None.")
        if not isinstance(result, (list, tuple)):
            raise TritonModelException(f"Expected a list in the execute return, found type '{type(result)}'.")
        if len(result) != len(pb_requests):
            raise TritonModelException(
                f"Number of InferenceResponse objects do not match the number of InferenceRequest objects. "
                f"InferenceRequest(s) size is:{len(pb_requests)}, and InferenceResponse(s) size "
                f"is:{len(result)}\n")
        answers = []
        for request, response in zip(pb_requests, result):
            if response is None:  # sent (or to be sent) through the request's sender, or rescheduled
                continue
            if request._rescheduled:
                raise TritonModelException(f"Expected a None object in the execute function return list for "
                                           f"reschduled request, found type '{type(response)}'.")
            if not isinstance(response, InferenceResponse):
                raise TritonModelException(f"Expected an 'InferenceResponse' object in the execute function "
                                           f"return list, found type '{type(response)}'.")
            if request._sender is not None:
                with request._sender._lock:
                    request._sender._update_state(response, True)
            answers.append((request._core, response._core()))
        return answers

    def _release(self, pb_requests: list[InferenceRequest]) -> None:
        """After a successful execute: hand the requests the model released with
        TRITONSERVER_REQUEST_RELEASE_RESCHEDULE back to the scheduler (``reschedule``), which only an
        ``iterative_sequence`` model's sequence batcher takes; any other model's request is answered with
        Triton's error instead of being left without an answer."""
        for request in pb_requests:
            if not request._rescheduled:
                continue
            if self.model.config.sequence_batching.iterative_sequence:
                request._core.reschedule = True
                continue
            message = ("Request is released with TRITONSERVER_REQUEST_RELEASE_RESCHEDULE, while the model is not "
                       "configured to handle such a flag.")
            log.error("Failed to release request: %s", message)
            request._core.response_sender.send_error(InvalidArgument(message))

    @staticmethod
    def _close_senders(pb_requests: list[InferenceRequest]) -> None:
        for request in pb_requests:
            if request._sender is not None:
                request._sender._close()

    def _exit(self, exc: SystemExit) -> ModelExit:
        code = exc.code
        reason = (f"instance '{self.ctx.name}' of model '{self.model.ctx.name}' called sys.exit({code!r}) "
                  f"in execute")
        log.error("%s", reason)
        status = 0 if code is None else code if isinstance(code, int) else 1
        return ModelExit(f"Failed to process the request(s) for model '{self.ctx.name}', message: {reason}",
                         reason, status)

    def _failure(self, pb_requests: list[InferenceRequest], exc: BaseException) -> InternalError:
        """The error every request of a failed execute gets; closes their senders, as Triton does."""
        self._close_senders(pb_requests)
        message = (f"Failed to process the request(s) for model '{self.ctx.name}', message: "
                   f"{type(exc).__name__}: {exc}")
        log.error("%s", message)
        log.debug("model '%s' execute raised", self.model.ctx.name, exc_info=exc)
        return InternalError(message)

    def _background_done(self, pb_requests: list[InferenceRequest], future: concurrent.futures.Future) -> None:
        with self._background_lock:
            self._background.discard(future)
        if future.cancelled():
            error = InternalError(f"execution of model '{self.model.ctx.name}' was cancelled")
        else:
            exc = future.exception()
            if exc is None and future.result() is not None:
                exc = TritonModelException(f"Python model '{self.ctx.name}' is using the decoupled mode and the "
                                           f"execute function must return None.")
            if exc is None:
                return
            if isinstance(exc, ModelExit):
                self._close_senders(pb_requests)
                self.on_exit(exc)
                error = exc
            else:
                error = self._failure(pb_requests, exc)
        for request in pb_requests:
            request._core.response_sender.send_error(error)


class PythonBackend(Backend):
    """``backend: "python"``: Triton Python-backend models, unchanged; each instance in a process of its
    own unless the model's ``process_isolation`` parameter is "false"."""

    name = "python"
    model_class = PythonModel

    def create_model(self, ctx: ModelContext) -> Model:
        if process_isolation(ctx):
            return ProcessModel(self, ctx)
        return PythonModel(self, ctx)
