"""The frontend workers' HTTP connections spread evenly (server/workers/balance.py), without a server: acceptors of
one listening socket sharing a table of open connections, in one loop."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest
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


def _acceptors(listener: socket.socket, fd: int, count: int, takers: int, fill: int):
    tables = [balance.ConnectionTable(fd, i, count) for i in range(count)]
    return [balance.BalancedAcceptor(socket.socket(fileno=os.dup(listener.fileno())), table, _Protocol, takers, fill)
            for table in tables]


def _close(listener, fd, acceptors, clients) -> None:
    for acceptor in acceptors:
        acceptor.close()
        acceptor.sock.close()
    for client in clients:
        client.close()
    listener.close()
    os.close(fd)


async def _connect(listener, acceptors, clients, count: int) -> None:
    clients += [socket.create_connection(listener.getsockname()) for _ in range(count)]
    await _settle(acceptors, len(clients))


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
        _close(listener, fd, acceptors, clients[3:])

    asyncio.run(main())


def test_a_worker_alone_accepts_after_stepping_aside_at_most_max_defer():
    async def main():
        listener = _listening()
        fd = balance.create_table(2)
        balance.ConnectionTable(fd, 1, 2).set(0)  # the other worker's slot says 0: it holds fewer, but never accepts
        acceptor = balance.BalancedAcceptor(socket.socket(fileno=os.dup(listener.fileno())),
                                            balance.ConnectionTable(fd, 0, 2), _Protocol)
        acceptor.start()
        clients = [socket.create_connection(listener.getsockname()) for _ in range(3)]
        await _settle([acceptor], 3)
        assert acceptor.open == 3
        _close(listener, fd, [acceptor], clients)

    asyncio.run(main())


def test_the_workers_that_take_first_depend_on_the_workers_against_the_cores():
    assert balance.takers(2, 2) == 1  # as many workers as cores: they cannot all run beside their model processes
    assert balance.takers(3, 2) == 1
    assert balance.takers(4, 4) == 2  # one per two cores, as --frontend-workers auto counts them
    assert balance.takers(8, 16) == 8  # cores to spare: every worker from the first connection, as before
    assert balance.takers(3, 4) == 3
    assert balance.takers(2, 1) == 1
    assert balance.fill_limit() == balance.fill_limit("") == balance.FILL_CONNECTIONS
    assert balance.fill_limit("6") == 6  # TIDESERVE_HTTP_FILL_CONNECTIONS decides where given
    assert balance.fill_limit("0") == 0
    assert balance.fill_limit("many") == balance.FILL_CONNECTIONS  # not an integer: ignored (logged)


def test_the_first_workers_take_connections_evenly_until_full_then_every_worker_does():
    async def main():
        listener = _listening()
        fd = balance.create_table(3)
        acceptors = _acceptors(listener, fd, 3, takers=2, fill=4)
        for acceptor in acceptors:
            acceptor.start()
        clients: list[socket.socket] = []
        await _connect(listener, acceptors, clients, 6)
        assert [a.open for a in acceptors] == [3, 3, 0]  # the first two, evenly
        await _connect(listener, acceptors, clients, 4)
        assert [a.open for a in acceptors] == [4, 4, 2]  # both full: the third takes its share
        await _connect(listener, acceptors, clients, 5)
        assert [a.open for a in acceptors] == [5, 5, 5]  # beyond, even over all
        _close(listener, fd, acceptors, clients)

    asyncio.run(main())


def test_one_taker_keeps_every_connection_that_arrives_later_too():
    # The second worker steps aside for each; a later connection is not taken from the first because the second
    # once stepped aside longer ago than MAX_DEFER_S.
    async def main():
        listener = _listening()
        fd = balance.create_table(2)
        acceptors = _acceptors(listener, fd, 2, takers=1, fill=balance.FILL_CONNECTIONS)
        for acceptor in acceptors:
            acceptor.start()
        clients: list[socket.socket] = []
        await _connect(listener, acceptors, clients, 8)
        for _ in range(4):
            await asyncio.sleep(balance.MAX_DEFER_S * 1.5)
            await _connect(listener, acceptors, clients, 1)
        assert [a.open for a in acceptors] == [12, 0]
        _close(listener, fd, acceptors, clients)

    asyncio.run(main())


def test_a_worker_that_is_not_a_taker_accepts_when_the_taker_never_comes():
    async def main():
        listener = _listening()
        fd = balance.create_table(2)
        balance.ConnectionTable(fd, 0, 2).set(0)  # worker 0's slot says 0: its turn, but it never accepts
        acceptor = balance.BalancedAcceptor(socket.socket(fileno=os.dup(listener.fileno())),
                                            balance.ConnectionTable(fd, 1, 2), _Protocol, 1)
        acceptor.start()
        clients = [socket.create_connection(listener.getsockname()) for _ in range(3)]
        await _settle([acceptor], 3)
        assert acceptor.open == 3
        _close(listener, fd, [acceptor], clients)

    asyncio.run(main())


def test_nobody_steps_aside_for_a_worker_not_started_stopped_or_dead(monkeypatch):
    monkeypatch.setattr(balance, "MAX_TAKER_WAIT_S", 60.0)  # stepping aside for a gone taker would outlast _settle
    monkeypatch.setattr(balance, "MAX_DEFER_S", 60.0)

    async def main():
        listener = _listening()
        fd = balance.create_table(2)
        first, second = _acceptors(listener, fd, 2, takers=1, fill=balance.FILL_CONNECTIONS)
        second.start()  # the taker has not started: the other takes the connections
        clients: list[socket.socket] = []
        await _connect(listener, [first, second], clients, 3)
        assert [first.open, second.open] == [0, 3]
        first.start()  # the taker starts: it takes the next ones
        await _connect(listener, [first, second], clients, 2)
        assert [first.open, second.open] == [2, 3]
        first.close()  # stopping: the other takes them again
        await _connect(listener, [first, second], clients, 2)
        assert [first.open, second.open] == [2, 5]
        first.table.set(0)  # as a dead worker's last count says; the core marks it gone when it exits
        balance.mark_gone(fd, 0, 2)
        await _connect(listener, [first, second], clients, 1)
        assert [first.open, second.open] == [2, 6]
        _close(listener, fd, [first, second], clients)

    asyncio.run(main())


# -- the gRPC port: a program on the SO_REUSEPORT group of its listeners ----------------------------------------------
def _reuseport_listeners(count: int, host: str = "::ffff:127.0.0.1", port: int = 0) -> list[socket.socket]:
    """Listeners as gRPC makes them for 127.0.0.1 (the default: a dual-stack IPv6 socket on the IPv4-mapped
    address) or for 0.0.0.0 (``::``)."""
    listeners = []
    for _ in range(count):
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
        port = sock.getsockname()[1]
        sock.listen(64)
        sock.setblocking(False)
        listeners.append(sock)
    return listeners


def _accepted(listeners: list[socket.socket], port: int, connections: int) -> list[int]:
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(connections)]
    counts = []
    for listener in listeners:
        count = 0
        while True:
            try:
                accepted, _ = listener.accept()
            except BlockingIOError:
                break
            accepted.close()
            count += 1
        counts.append(count)
    for client in clients:
        client.close()
    return counts


def test_one_taker_gets_every_grpc_connection_and_keeps_them_when_a_listener_joins_or_leaves():
    listeners = _reuseport_listeners(2)
    port = listeners[0].getsockname()[1]
    try:
        assert balance.steer_reuseport("127.0.0.1", port, 1)
        assert _accepted(listeners, port, 32) == [32, 0]  # the first listener: the kernel's hash spreads them
        # a listener that joins later (a restarted worker) is numbered last: still none for it
        listeners += _reuseport_listeners(1, port=port)
        assert _accepted(listeners, port, 16) == [16, 0, 0]
        listeners.pop(0).close()  # the taker's worker died: the last listener takes its number, and the connections
        assert _accepted(listeners, port, 8) == [0, 8]
    finally:
        for listener in listeners:
            listener.close()


def test_several_takers_share_the_grpc_connections_and_the_others_get_none():
    listeners = _reuseport_listeners(4)
    port = listeners[0].getsockname()[1]
    try:
        assert balance.steer_reuseport("127.0.0.1", port, 2)
        counts = _accepted(listeners, port, 64)
        assert counts[2:] == [0, 0] and sum(counts) == 64 and min(counts[:2]) > 0, counts
    finally:
        for listener in listeners:
            listener.close()


def test_a_wildcard_grpc_port_is_steered_through_its_dual_stack_listener():
    try:
        listeners = _reuseport_listeners(2, "::")  # what gRPC makes of 0.0.0.0 where the machine has IPv6
    except OSError as exc:  # no IPv6 here: gRPC would listen on IPv4's wildcard (the tests above)
        pytest.skip(f"no IPv6 on this machine: {exc}")
    port = listeners[0].getsockname()[1]
    try:
        assert balance.steer_reuseport("0.0.0.0", port, 1)
        assert _accepted(listeners, port, 16) == [16, 0]
    finally:
        for listener in listeners:
            listener.close()


def _dealing_or_skip() -> None:
    fd = balance.deal_program(2)
    if fd is None:  # the machine's policy, not the server's: where bpf(2) is refused the classic program picks
        pytest.skip("this kernel loads no eBPF program for this user (kernel.unprivileged_bpf_disabled)")
    os.close(fd)


@pytest.mark.parametrize(("count", "connections"), [(2, 2), (2, 7), (4, 64)])
def test_the_grpc_connections_are_dealt_to_the_takers_in_turn(count, connections):
    """A client's two connections reach two workers (the kernel's hash puts both on one worker one time in two)."""
    _dealing_or_skip()
    listeners = _reuseport_listeners(count)
    port = listeners[0].getsockname()[1]
    try:
        assert balance.steer_reuseport("127.0.0.1", port, count) == "in turn"
        counts = _accepted(listeners, port, connections)
        assert max(counts) - min(counts) <= 1 and sum(counts) == connections, counts
    finally:
        for listener in listeners:
            listener.close()


def test_only_the_first_takers_are_dealt_connections():
    _dealing_or_skip()
    listeners = _reuseport_listeners(4)
    port = listeners[0].getsockname()[1]
    try:
        assert balance.steer_reuseport("127.0.0.1", port, 2) == "in turn"
        assert _accepted(listeners, port, 10) == [5, 5, 0, 0]
    finally:
        for listener in listeners:
            listener.close()


def test_a_kernel_without_an_atomic_fetch_gets_the_add_then_read_program(monkeypatch):
    """Before Linux 5.12 an atomic add returns nothing: the program adds, then reads the counter."""
    _dealing_or_skip()
    made = balance._deal_instructions
    fetches = []

    def instructions(map_fd, first, fetch):
        fetches.append(fetch)
        return made(map_fd, first, fetch) if not fetch else b"\xff" * 8  # a program the kernel refuses

    monkeypatch.setattr(balance, "_deal_instructions", instructions)
    listeners = _reuseport_listeners(2)
    port = listeners[0].getsockname()[1]
    try:
        assert balance.steer_reuseport("127.0.0.1", port, 2) == "in turn"
        assert _accepted(listeners, port, 8) == [4, 4]
        assert fetches == [True, False]
    finally:
        for listener in listeners:
            listener.close()


def test_where_bpf_is_refused_the_takers_are_picked_at_random(monkeypatch):
    def refused(command, attr):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(balance, "_bpf", refused)
    assert balance.deal_program(2) is None
    listeners = _reuseport_listeners(3)
    port = listeners[0].getsockname()[1]
    try:
        assert balance.steer_reuseport("127.0.0.1", port, 2) == "at random"
        counts = _accepted(listeners, port, 64)
        assert counts[2] == 0 and min(counts[:2]) > 0 and sum(counts) == 64, counts
    finally:
        for listener in listeners:
            listener.close()


def test_the_grpc_port_is_steered_to_the_http_takers_or_to_every_worker(monkeypatch):
    monkeypatch.delenv("TIDESERVE_HTTP_FILL_CONNECTIONS", raising=False)
    monkeypatch.setattr(balance, "cores", lambda: 2)
    assert balance.grpc_takers(1) == 0  # nothing to steer
    assert balance.grpc_takers(2) == 1  # the HTTP port's one taker
    monkeypatch.setattr(balance, "cores", lambda: 16)
    assert balance.grpc_takers(8) == 8  # every worker takes: dealt over all of them
    monkeypatch.setattr(balance, "cores", lambda: 2)
    monkeypatch.setenv("TIDESERVE_HTTP_FILL_CONNECTIONS", "0")  # every worker takes its share from the first
    assert balance.grpc_takers(2) == 2


def test_the_program_picks_among_the_first_takers():
    assert balance.reuseport_program(1) == [(0x06, 0, 0, 0)]  # return 0
    load, mod, ret = balance.reuseport_program(3)
    assert mod == (0x94, 0, 0, 3) and ret == (0x16, 0, 0, 0) and load[0] == 0x20
