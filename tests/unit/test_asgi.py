"""The ASGI plumbing the HTTP frontends share (tideserve.asgi): cancel_on_disconnect and the answers it sends.

The frontends' own disconnect tests (test_http, test_generate, test_openai_frontend) drive it through real
servers; these pin its bookkeeping down without one.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest

from tideserve import asgi
from tideserve.asgi import ClientGone, cancel_on_disconnect, error_body, send_error


class Connection:
    """An ASGI ``receive`` whose client disconnects when told to (the body was already read)."""

    def __init__(self) -> None:
        self.left = asyncio.Event()
        self.reads = 0

    async def receive(self) -> dict:
        self.reads += 1
        await self.left.wait()
        return {"type": "http.disconnect"}


async def test_a_disconnect_cancels_the_block_and_ends_it_with_client_gone():
    connection = Connection()
    cleaned = []

    async def handler():
        with cancel_on_disconnect(connection.receive):
            try:
                connection.left.set()
                await asyncio.sleep(10)
            finally:
                cleaned.append(True)  # e.g. closing the InferenceStream, which cancels the request

    task = asyncio.ensure_future(handler())
    with pytest.raises(ClientGone):
        await task
    assert cleaned == [True]
    assert task.cancelling() == 0  # the watch took its cancellation back


async def test_a_cancellation_from_elsewhere_stays_a_cancellation():
    connection = Connection()
    entered = asyncio.Event()

    async def handler():
        with cancel_on_disconnect(connection.receive):
            entered.set()
            await asyncio.sleep(10)

    task = asyncio.ensure_future(handler())
    await entered.wait()
    task.cancel()  # server shutdown, not the client
    with pytest.raises(asyncio.CancelledError):
        await task

    task = asyncio.ensure_future(handler())  # both at once: the outside cancellation wins
    entered.clear()
    await entered.wait()
    task.cancel()
    connection.left.set()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_block_done_before_the_delay_never_watches():
    connection = Connection()
    with cancel_on_disconnect(connection.receive, delay=0.5):
        await asyncio.sleep(0)
    await asyncio.sleep(0.01)
    assert connection.reads == 0

    with cancel_on_disconnect(connection.receive, delay=0.01) as watch:  # it watches from the first tick after 10 ms
        await asyncio.sleep(0.01 + 3 * asgi._WATCH_TICK_S)
    assert connection.reads == 1 and not watch.gone


async def test_send_error_is_kserve_shaped():
    sent = []

    async def send(message):
        sent.append(message)

    await send_error(send, 404, "model 'x' is not found")
    body = error_body("model 'x' is not found")
    assert orjson.loads(body) == {"error": "model 'x' is not found"}
    assert sent == [{"type": "http.response.start", "status": 404, "headers": [
                        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]},
                    {"type": "http.response.body", "body": body}]


def _uvicorn_cycle(body: bytes, more_body: bool):
    """uvicorn's own request cycle, as its httptools protocol leaves it once ``body`` has arrived."""
    from unittest import mock

    from uvicorn.protocols.http.flow_control import FlowControl
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

    transport = mock.Mock()
    transport.is_closing.return_value = False
    cycle = RequestResponseCycle(scope={"type": "http", "method": "POST"}, transport=transport,
                                 flow=FlowControl(transport), logger=mock.Mock(), access_logger=mock.Mock(),
                                 access_log=False, default_headers=[], message_event=asyncio.Event(),
                                 expect_100_continue=False, keep_alive=True, on_response=lambda: None)
    cycle.body += body
    cycle.more_body = more_body
    cycle.message_event.set()
    return cycle


async def test_whole_body_takes_an_arrived_body_and_the_disconnect_watch_still_waits():
    cycle = _uvicorn_cycle(b'{"inputs": []}', more_body=False)
    assert asgi.whole_body(cycle.receive) == b'{"inputs": []}'
    watch = asyncio.ensure_future(cycle.receive())  # what cancel_on_disconnect's watcher does later
    await asyncio.sleep(0.01)
    assert not watch.done()  # waits for the client, as after uvicorn's own receive of the body
    cycle.disconnected = True
    cycle.message_event.set()
    assert await watch == {"type": "http.disconnect"}


async def test_whole_body_leaves_a_body_still_arriving_to_receive():
    cycle = _uvicorn_cycle(b'{"in', more_body=True)
    assert asgi.whole_body(cycle.receive) is None
    assert await cycle.receive() == {"type": "http.request", "body": b'{"in', "more_body": True}
    assert asgi.whole_body(Connection().receive) is None  # not uvicorn's: the ASGI receive


async def test_a_whole_answer_is_one_write_with_its_length_and_headers_checked_as_uvicorn_checks_them():
    written = []
    for _ in range(2):  # the second time the header pairs come from the checked ones
        cycle = _uvicorn_cycle(b"", more_body=False)
        cycle.transport.write = cycle.transport.write_now = written.append
        cycle.default_headers = [(b"date", b"Thu, 26 Nov 2026 01:02:03 GMT")]
        await asgi.send_response(cycle.send, 200, b'{"ok":true}', [(b"Content-Type", b"application/json")])
        assert cycle.response_complete
    assert written[0] == written[1] == (b"HTTP/1.1 200 OK\r\ndate: Thu, 26 Nov 2026 01:02:03 GMT\r\n"
                                        b"content-type: application/json\r\ncontent-length: 11\r\n\r\n"
                                        b'{"ok":true}')
    cycle = _uvicorn_cycle(b"", more_body=False)
    with pytest.raises(RuntimeError, match="Invalid HTTP header value"):  # uvicorn's own refusal, as before
        await asgi.send_response(cycle.send, 200, b"{}", [(b"content-type", b"application/json\r\nx: y")])


async def test_blocks_past_their_delay_watch_and_those_ended_sooner_never_do():
    async def hold(connection: Connection, seconds: float) -> None:
        with cancel_on_disconnect(connection.receive, delay=0.02):
            await asyncio.sleep(seconds)

    quick, slow = [Connection() for _ in range(3)], [Connection() for _ in range(3)]
    await asyncio.gather(*(hold(c, 0) for c in quick), *(hold(c, 0.03 + 3 * asgi._WATCH_TICK_S) for c in slow))
    assert [c.reads for c in quick] == [0, 0, 0] and [c.reads for c in slow] == [1, 1, 1]

    leaving = Connection()
    task = asyncio.ensure_future(hold(leaving, 10))
    while not leaving.reads:  # watching once its delay is over
        await asyncio.sleep(0.01)
    leaving.left.set()
    with pytest.raises(ClientGone):
        await task


@pytest.mark.skipif(not asgi.KERNEL_ARRIVAL, reason="the kernel's TCP_INFO and tick (Linux)")
def test_a_deadline_counts_from_when_the_kernel_had_the_bytes_never_before_they_came():
    """Bytes that waited in the socket (a busy loop) count from their arrival as the kernel tells it, in whole
    ticks rounded toward the read: never before the client sent them; the kernel is asked once per request."""
    import socket
    import time

    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
        with client, server:
            sent = time.monotonic_ns()
            client.sendall(b"POST / HTTP/1.1\r\n")
            time.sleep(0.05)  # the loop busy elsewhere: the bytes wait
            server.recv(100)
            read = time.monotonic_ns()
            scope = {asgi.RECEIVED_NS: read, asgi.CONNECTION_SOCKET: server}
            arrived = asgi.received_ns(scope)
            assert sent <= arrived < read - 20_000_000  # 50 ms waited: at most two ticks (10 ms each at HZ 100) lost
            assert asgi.CONNECTION_SOCKET not in scope and scope[asgi.RECEIVED_NS] == arrived
            assert asgi.received_ns(scope) == arrived  # asked once: the scope keeps the answer
    assert asgi.received_ns({asgi.RECEIVED_NS: 5}) == 5 and asgi.received_ns({}) == 0
    # a socket the kernel cannot say it for (closed): the parser's time
    assert asgi.kernel_arrival_ns(server, 7) == 7


@pytest.mark.skipif(not asgi.KERNEL_ARRIVAL, reason="the kernel's TCP_INFO and tick (Linux)")
def test_the_time_since_the_current_tick_counts_from_the_least_lag_of_the_coarse_clock(monkeypatch):
    """The time since the kernel's current tick is what the coarse clock lies behind now, less the least that it lay
    behind (its own lag behind its tick), grown by the most that lag can drift since, and a margin; 0 at the first
    reading, at most a tick."""
    tick, margin, drift = asgi._TICK_NS, asgi._PHASE_MARGIN_NS, asgi._PHASE_DRIFT
    monkeypatch.setattr(asgi, "_phase_floor", [tick, 0])
    now = 10**12
    assert asgi._tick_phase_ns(now, now - 300_000) == 0  # the first reading: the clock's own lag, as far as known
    assert asgi._tick_phase_ns(now, now - 2_300_000) == 2_000_000 - margin
    assert asgi._tick_phase_ns(now, now - 300_000 - 10 * tick) == tick  # at most a tick
    assert asgi._tick_phase_ns(now, now - 200_000) == 0  # a lesser lag: the least from here on
    assert asgi._tick_phase_ns(now, now - 1_200_000) == 1_000_000 - margin
    # a second later the lag may have grown by as much as the kernel can move its clock's frequency
    later = now + 1_000_000_000
    assert asgi._tick_phase_ns(later, later - 1_200_000) == 1_000_000 - 1_000_000_000 // drift - margin
    assert asgi._tick_phase_ns(later, later - 100_000) == 0  # a lesser one: the least again, read now
    assert asgi._tick_phase_ns(later, later - 1_100_000) == 1_000_000 - margin
