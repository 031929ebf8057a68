"""The frontend workers' HTTP connections spread evenly (server/workers/balance.py), without a server: acceptors of
one listening socket sharing a table of open connections, in one loop."""

from __future__ import annotations

import asyncio
import os
import socket

from tideserve.workers import balance


class _Protocol(asyncio.Protocol):
    def connection_lost(self, exc) -> None:
        pass


def _listening() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


async def _settle(acceptors, total: int) -> None:
    for _ in range(400):
        if sum(a.open for a in acceptors) >= total and not any(a.tasks for a in acceptors):
            return
        await asyncio.sleep(0.005)
    raise AssertionError([a.open for a in acceptors])


def test_connections_that_arrive_together_spread_evenly_and_closing_counts():
    async def main():
        listener = _listening()
        fd = balance.create_table(2)
        tables = [balance.ConnectionTable(fd, i, 2) for i in range(2)]
        acceptors = [balance.BalancedAcceptor(socket.socket(fileno=os.dup(listener.fileno())), table, _Protocol)
                     for table in tables]
        clients = [socket.create_connection(listener.getsockname()) for _ in range(8)]
        for acceptor in acceptors:
            acceptor.start()
        await _settle(acceptors, 8)
        assert [a.open for a in acceptors] == [4, 4]
        assert tables[0].others_fewest() == 4
        for client in clients[:3]:
            client.close()
        for _ in range(200):
            if sum(a.open for a in acceptors) == 5:
                break
            await asyncio.sleep(0.005)
        assert sum(a.open for a in acceptors) == 5
        for acceptor in acceptors:
            acceptor.close()
            acceptor.sock.close()
        for client in clients[3:]:
            client.close()
        listener.close()
        os.close(fd)

    asyncio.run(main())


def test_a_worker_alone_accepts_after_stepping_aside_at_most_max_defer():
    async def main():
        listener = _listening()
        fd = balance.create_table(2)  # the other worker's slot says 0: it holds fewer, but never accepts
        acceptor = balance.BalancedAcceptor(socket.socket(fileno=os.dup(listener.fileno())),
                                            balance.ConnectionTable(fd, 0, 2), _Protocol)
        acceptor.start()
        clients = [socket.create_connection(listener.getsockname()) for _ in range(3)]
        await _settle([acceptor], 3)
        assert acceptor.open == 3
        acceptor.close()
        acceptor.sock.close()
        for client in clients:
            client.close()
        listener.close()
        os.close(fd)

    asyncio.run(main())
