"""Business Logic Scripting: a model calling other models through the server's DataPlane.

The DataPlane lives on the server's event loop. A blocking ``exec()`` (from ``execute`` on an
instance thread) hops onto that loop with ``run_coroutine_threadsafe`` and waits; ``async_exec()``
awaits the same coroutine, directly when already on the server loop, otherwise through a future.
Errors come back as responses carrying a TritonError, as in Triton.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import TYPE_CHECKING

from tideserve.backend_api import ServerError

from .errors import ErrorCode, TritonError, TritonModelException, from_server_error
from .response import InferenceResponse
from .scope import ServerLink, current_link, in_direct_batch

if TYPE_CHECKING:
    from tideserve.backend_api import InferStream

    from .messages import InferenceRequest


def _timeout_error() -> TritonError:
    return TritonError("Request timeout expired", ErrorCode.UNAVAILABLE)


def _check_request(request: InferenceRequest) -> None:
    if request._core is not None:
        raise TritonModelException("a request given to execute cannot be executed again; build a new "
                                   "pb_utils.InferenceRequest for the model to call")


def _holding(holds: bool) -> dict:
    """The call's ``holds`` (a model process's BLS call that a batch from the frontend workers waits on), only where
    it is set: a server's own DataPlane takes no such argument, and runs no such batch."""
    return {"holds": True} if holds else {}


async def _run_unary(link: ServerLink, request: InferenceRequest, holds: bool = False) -> InferenceResponse:
    """On the server loop: run ``request`` and return its one response (errors as responses)."""
    try:
        core = request._to_core()
        call = link.require_infer().unary(core, **_holding(holds))
        if request._timeout > 0:
            response = await asyncio.wait_for(call, request._timeout / 1e6)
        else:
            response = await call
    except asyncio.TimeoutError:
        return InferenceResponse._from_error(_timeout_error())
    except ServerError as exc:
        return InferenceResponse._from_error(from_server_error(exc))
    except TritonModelException as exc:
        return InferenceResponse._from_error(TritonError(str(exc)))
    return InferenceResponse._from_core(response)


async def _open_stream(link: ServerLink, request: InferenceRequest, holds: bool = False) -> ResponseIterator:
    """On the server loop: start ``request`` and return the iterator over its responses once the first one
    is there (as Triton's ``exec`` / ``async_exec`` do), so that iterating what has arrived never waits."""
    deadline = time.monotonic() + request._timeout / 1e6 if request._timeout > 0 else None
    try:
        stream = link.require_infer()(request._to_core(), **_holding(holds))
    except ServerError as exc:
        return ResponseIterator(link, None, deadline, InferenceResponse._from_error(from_server_error(exc)))
    except TritonModelException as exc:
        return ResponseIterator(link, None, deadline, InferenceResponse._from_error(TritonError(str(exc))))
    iterator = ResponseIterator(link, stream, deadline)
    iterator._prefetch(await iterator._fetch())
    return iterator


def execute_blocking(request: InferenceRequest, decoupled: bool):
    _check_request(request)
    link = current_link()
    if link.on_loop():
        raise TritonModelException("InferenceRequest.exec() cannot block the server's event loop; "
                                   "use 'await request.async_exec()' in an async execute")
    holds = in_direct_batch()  # the instance waits here, busy, while the core may take it for idle
    coro = _open_stream(link, request, holds) if decoupled else _run_unary(link, request, holds)
    return asyncio.run_coroutine_threadsafe(coro, link.loop).result()


def execute_async(request: InferenceRequest, decoupled: bool) -> asyncio.Future:
    _check_request(request)
    link = current_link()
    coro = _open_stream(link, request) if decoupled else _run_unary(link, request)
    if link.on_loop():
        return asyncio.ensure_future(coro)
    return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, link.loop))


class ResponseIterator:
    """The responses of a BLS request to a decoupled model, iterated with ``for`` or ``async for``.

    ``exec(decoupled=True)`` / ``async_exec(decoupled=True)`` hand it over once the first response has
    arrived, as Triton does: an ``async def execute`` may then iterate a one-response stream with a plain
    ``for`` without blocking its event loop (and the other requests it runs).

    Every response is yielded, the last one included (it may carry no outputs: only the end of
    the stream). ``cancel()`` cancels the called model's request, as Triton does: iteration goes on
    until the model's final response (a model that honours it answers with a CANCELLED error; one that
    ignores it keeps streaming). Iterating again after the end replays the responses, as Triton does.
    """

    def __init__(self, link: ServerLink, stream: InferStream | None, deadline: float | None,
                 only: InferenceResponse | None = None) -> None:
        self._link = link
        self._stream = stream
        self._deadline = deadline
        self._responses: list[InferenceResponse] = [only] if only is not None else []
        self._finished = stream is None
        self._index = 0
        self._next: tuple[InferenceResponse | None, bool] | None = None  # fetched, not yet handed out
        self._stream_ended = stream is None  # the last response has been fetched

    # -- on the server loop ------------------------------------------------------------------
    async def _fetch(self) -> tuple[InferenceResponse | None, bool]:
        """The next response and whether it is the last one."""
        stream = self._stream
        try:
            if self._deadline is None:
                core = await stream.__anext__()
            else:
                core = await asyncio.wait_for(stream.__anext__(), max(0.0, self._deadline - time.monotonic()))
        except StopAsyncIteration:
            return None, True
        except asyncio.TimeoutError:
            stream.cancel()
            return InferenceResponse._from_error(_timeout_error()), True
        return InferenceResponse._from_core(core), core.final or core.error is not None

    def _cancel_on_loop(self) -> None:
        stream = self._stream
        if stream is None:
            return
        cancel_request = getattr(stream, "cancel_request", None)  # a call from a model process
        if cancel_request is not None:
            cancel_request()
        else:  # a DataPlane stream: flag its request, keep its responses coming
            stream.request.cancellation.cancel()

    def _prefetch(self, fetched: tuple[InferenceResponse | None, bool]) -> None:
        self._next = fetched
        if fetched[1]:
            self._stream_ended = True

    # -- the model's side ----------------------------------------------------------------------
    def _prefetched(self) -> tuple[InferenceResponse | None, bool] | None:
        fetched, self._next = self._next, None
        return fetched

    def _take(self, fetched: tuple[InferenceResponse | None, bool]) -> InferenceResponse:
        response, last = fetched
        if last:
            self._finished = self._stream_ended = True
        if response is None:
            self._index = len(self._responses)
            raise StopIteration
        self._responses.append(response)
        self._index = len(self._responses)
        return response

    def _replay(self) -> InferenceResponse:
        if self._index < len(self._responses):
            self._index += 1
            return self._responses[self._index - 1]
        raise StopIteration

    def __iter__(self) -> ResponseIterator:
        if self._finished and self._index >= len(self._responses):
            self._index = 0
        return self

    def __next__(self) -> InferenceResponse:
        if self._finished:
            return self._replay()
        fetched = self._prefetched()
        if fetched is not None:
            return self._take(fetched)
        if self._link.on_loop():
            raise TritonModelException("iterating a BLS response stream with 'for' would block the server's "
                                       "event loop; use 'async for'")
        future = asyncio.run_coroutine_threadsafe(self._fetch(), self._link.loop)
        return self._take(future.result())

    def __aiter__(self) -> ResponseIterator:
        return self.__iter__()

    async def __anext__(self) -> InferenceResponse:
        if self._finished:
            try:
                return self._replay()
            except StopIteration:
                raise StopAsyncIteration from None
        response = self._prefetched()
        if response is None and self._link.on_loop():
            response = await self._fetch()
        elif response is None:
            response = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._fetch(), self._link.loop))
        try:
            return self._take(response)
        except StopIteration:
            raise StopAsyncIteration from None

    def cancel(self) -> None:
        """Cancel the request if it is still running."""
        if self._finished or self._stream_ended:
            return
        if self._link.on_loop():
            self._cancel_on_loop()
        else:
            self._link.loop.call_soon_threadsafe(self._cancel_on_loop)

    def __del__(self) -> None:
        # Like Triton, let an abandoned stream run to its end (its responses are dropped).
        stream = self._stream
        if stream is None or self._stream_ended:
            return
        try:
            self._link.loop.call_soon_threadsafe(_drain_soon, stream)
        except RuntimeError:  # the loop is closed
            pass


_draining: set[asyncio.Task] = set()


async def _drain(stream: InferStream) -> None:
    async for _ in stream:
        pass


def _drain_soon(stream: InferStream) -> None:
    task = asyncio.ensure_future(_drain(stream))
    _draining.add(task)
    task.add_done_callback(_draining.discard)


# -- model control from inside a model --------------------------------------------------------
def _call_on_loop(link: ServerLink, coro):
    if link.on_loop():
        coro.close()
        raise TritonModelException("this call would block the server's event loop")
    return asyncio.run_coroutine_threadsafe(coro, link.loop).result()


def _raise_as_model_exception(call):
    async def run():
        try:
            return await call()
        except ServerError as exc:
            raise TritonModelException(exc.message) from None
    return run()


def load_model(model_name: str, config: str = "", files: dict | None = None) -> None:
    """Load (or reload) a model; the server must run in explicit model control mode."""
    if files:
        raise TritonModelException("load_model: override files are not supported")
    link = current_link()
    control = link.require_control()
    _call_on_loop(link, _raise_as_model_exception(lambda: control.load(model_name, config or None)))


def unload_model(model_name: str, unload_dependents: bool = False) -> None:
    link = current_link()
    control = link.require_control()
    _call_on_loop(link, _raise_as_model_exception(lambda: control.unload(model_name, unload_dependents)))


def is_model_ready(model_name: str, model_version: str = "") -> bool:
    link = current_link()
    control = link.require_control()

    async def ready() -> bool:
        answer = control.ready(model_name, str(model_version or ""))
        # in a model process the server answers over the connection: the answer is awaited
        return await answer if inspect.isawaitable(answer) else answer

    if link.on_loop():
        return control.ready(model_name, str(model_version or ""))
    return _call_on_loop(link, ready())
