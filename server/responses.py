"""Response delivery: a per-request stream the DataPlane reads and a sender the backend writes."""

from __future__ import annotations

import asyncio
import collections
import threading
from typing import Callable

from .errors import InternalError, ServerError
from .types import InferenceRequest, InferenceResponse


async def content_responses(stream) -> list[InferenceResponse]:
    """Every response of ``stream`` that carries content (a bare FINAL flag does not), the model's error raised;
    the stream is closed in any case. For the protocols that answer a request with its one response."""
    responses = []
    try:
        async for response in stream:
            if response.error is not None:
                raise response.error
            if not response.empty:
                responses.append(response)
    finally:
        await stream.aclose()
    return responses


class ResponseStream:
    """Async iterator of one request's responses; ``put`` may be called from any thread."""

    __slots__ = ("_loop", "_loop_thread", "_items", "_waiter", "_done", "on_error")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._items: collections.deque[InferenceResponse] = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._done = False
        # called once, on the loop, with the error of an error response as it is put (after the reader's wake-up):
        # a protocol handler that can answer a refusal at once, in the same loop turn as the backend refused it
        self.on_error: Callable[[BaseException], None] | None = None

    def put(self, response: InferenceResponse) -> None:
        if threading.get_ident() == self._loop_thread:
            self._put(response)
        else:
            self._loop.call_soon_threadsafe(self._put, response)

    def _put(self, response: InferenceResponse) -> None:
        items = self._items
        delta = response.generation
        if delta is not None and items and response.error is None and not response.parameters and not response.outputs:
            last = items[-1]  # not taken yet: a typed LLM delta joins it (one chunk for the reader, not two)
            if (last.generation is not None and not last.final and last.error is None and not last.parameters
                    and not last.outputs):
                last.generation.extend(delta)
                last.final = response.final
                return
        items.append(response)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)
        if response.error is not None and self.on_error is not None:
            hook, self.on_error = self.on_error, None
            hook(response.error)

    def wait(self) -> asyncio.Future:
        """A future done once a response is there to take (a reader awaits it directly: no coroutine of its
        own per response); cancelling it leaves the stream as it was."""
        waiter = self._waiter = self._loop.create_future()
        return waiter

    async def get(self) -> InferenceResponse:
        items = self._items
        while not items:
            await self.wait()
        return items.popleft()


class ResponseSender:
    """What a backend uses to answer one request: 0..N responses, the last one ``final``.

    Thread-safe. A classic (non-decoupled) model sends exactly one response with ``final``.
    """

    __slots__ = ("request", "_sink", "_lock", "_closed", "_sent")

    def __init__(self, request: InferenceRequest, sink: Callable[[InferenceResponse], None]) -> None:
        self.request = request
        self._sink = sink
        self._lock = threading.Lock()
        self._closed = False
        self._sent = 0

    @property
    def is_closed(self) -> bool:
        return self._closed

    @property
    def sent_count(self) -> int:
        return self._sent

    def send(self, response: InferenceResponse | None = None, final: bool = False) -> None:
        """Send ``response`` (or, with ``response=None, final=True``, just the FINAL flag)."""
        with self._lock:
            if self._closed:
                raise InternalError("response sender is closed: the final response was already sent")
            if final:
                self._closed = True
            self._sent += 1
        if response is None:
            if not final:
                raise InternalError("a response is required unless the FINAL flag is sent")
            response = InferenceResponse(final=True, empty=True)
        else:
            response.final = final
        self._fill(response)
        self._sink(response)
        if final:
            self.request = None  # request <-> sender: freed by reference counting, not left to the collector

    def send_delta(self, delta, final: bool = False) -> None:
        """Send a typed LLM delta (a GenerationDelta) as a response (what a GenerationStream takes as it is)."""
        self.send(InferenceResponse(generation=delta), final)

    def send_error(self, error: ServerError) -> None:
        """End the request with ``error`` (ignored if the request is already complete)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._sent += 1
        response = InferenceResponse(error=error, final=True)
        self._fill(response)
        self._sink(response)
        self.request = None

    def _fill(self, response: InferenceResponse) -> None:
        request = self.request
        if not response.model_name:
            response.model_name = request.model_name
        if not response.id:
            response.id = request.id
        requested = request.outputs
        if requested and response.outputs:
            if len(requested) == 1:
                name = requested[0].name
                response.outputs = [t for t in response.outputs if t.name == name]
                return
            wanted = {o.name for o in requested}
            for tensor in response.outputs:
                if tensor.name not in wanted:  # keep only those asked for (rare: most send just those)
                    response.outputs = [t for t in response.outputs if t.name in wanted]
                    return
