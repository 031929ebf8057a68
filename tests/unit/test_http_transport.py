"""The HTTP port's transport (server/http/limits.py): what uvicorn writes in one event-loop turn leaves as one
write (a response's head and body: one system call), and nothing written is lost on close."""

from __future__ import annotations

import asyncio

from tideserve.http.limits import CoalescingTransport


class _Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        assert not self.closed
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


async def test_the_writes_of_one_turn_leave_as_one():
    inner = _Transport()
    transport = CoalescingTransport(inner, asyncio.get_running_loop())
    transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
    transport.write(memoryview(b"{}"))
    assert inner.writes == []
    await asyncio.sleep(0)
    assert inner.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"]
    transport.write(b"data: 1\n\n")  # a later event of a stream: its own write, the next turn
    await asyncio.sleep(0)
    assert inner.writes[1:] == [b"data: 1\n\n"]


async def test_close_sends_what_is_pending_first():
    inner = _Transport()
    transport = CoalescingTransport(inner, asyncio.get_running_loop())
    transport.write(b"last words")
    transport.close()
    assert inner.writes == [b"last words"] and inner.closed and transport.is_closing()
    await asyncio.sleep(0)  # the scheduled flush finds nothing left
    assert inner.writes == [b"last words"]


async def test_a_streamed_event_is_written_at_once_after_what_is_held():
    inner = _Transport()
    transport = CoalescingTransport(inner, asyncio.get_running_loop())
    transport.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
    transport.write_event(b"data: 1\n\n")  # the stream's first event joins the head held in this turn
    assert inner.writes == []
    await asyncio.sleep(0)
    assert inner.writes == [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\ndata: 1\n\n"]
    transport.write_event(b"data: 2\n\n")  # nothing held: written now, no callback for the turn's end
    assert inner.writes[1:] == [b"data: 2\n\n"]
    inner.closed = True
    transport.write_event(b"data: 3\n\n")  # a closing connection takes nothing more
    assert inner.writes[1:] == [b"data: 2\n\n"]
