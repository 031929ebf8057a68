"""The HTTP port's connections spread over the frontend workers: evenly, or first over a few where cores are few.

Every worker serves the one listening socket the core made. Left to the event loop, a worker that wakes first
accepts every connection waiting (libuv accepts until the backlog is empty), so the few long-lived connections of a
load generator or a proxy land mostly on one worker: 8 connections opened together went 8 / 0 or 6 / 2 over two
workers, which then run at the speed of one. Here each worker accepts the connections itself, one per wake-up, and
only while it holds no more open connections than the worker holding the fewest; the counts are a small table of
shared memory the core makes (one slot per worker, written by its owner only). A worker that holds more steps aside
for ``DEFER_S`` and looks again; after ``MAX_DEFER_S`` of stepping aside for the same backlog (the others busy or
gone) it accepts anyway, so a connection never waits on a worker that does not come. A worker not started yet,
stopping, or dead (the core marks one that exits) counts as holding :data:`GONE`: no other steps aside for it.

Where the workers cannot all run at once beside their model processes (as many workers as cores, or more: two
workers on 2 cores), spreading costs more than it gives: each worker's loop turn serves fewer requests, so every
turn's poll, link write and read, and every batch's wake-up are paid for fewer requests, and the workers compete for
the cores with the instance processes and the client. There only the first :func:`takers` workers (one per two
cores, as ``--frontend-workers auto`` counts them; one on 2 cores) take connections, evenly among them, until each
holds ``fill`` (:func:`fill_limit`: unbounded unless ``TIDESERVE_HTTP_FILL_CONNECTIONS`` says; 0 spreads over every
worker from the first connection); beyond, every worker takes them evenly. The others step aside for a taker up to
``MAX_TAKER_WAIT_S`` (a taker whose loop does not come). With fewer workers than cores every worker takes its share from the
first connection, as before.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import select
import socket
import struct
import time

log = logging.getLogger(__name__)

DEFER_S = 0.0005
MAX_DEFER_S = 0.02
MAX_TAKER_WAIT_S = 0.1  # a worker that is not a taker steps aside this long for a taker (a loaded machine's taker
# can take longer than MAX_DEFER_S to come, and one connection on another worker costs every request of it more)
ACCEPTS_PER_WAKE = 16  # where some workers take before others: the most connections one wake-up accepts
FILL_CONNECTIONS = 1 << 20  # what each of those takes before the others take any (all, in effect)
GONE = 1 << 62  # the count of a worker that accepts none: never the fewest, never a taker with room
_SLOT = struct.Struct("q")


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def takers(workers: int, cores: int) -> int:
    """How many of ``workers`` take the HTTP connections first: all of them where there are fewer workers than
    cores; else the workers the cores can run beside their model processes, one per two cores (at least one)."""
    return workers if workers < cores else max(1, min(workers, cores // 2))


def fill_limit(override: str | None = None) -> int:
    """How many connections each of the first :func:`takers` workers takes before the others take any:
    :data:`FILL_CONNECTIONS`, or ``override`` (``TIDESERVE_HTTP_FILL_CONNECTIONS``) where given (0: none, every
    worker takes its share from the first connection)."""
    if override in (None, ""):
        return FILL_CONNECTIONS
    try:
        return max(0, int(override))
    except ValueError:  # a worker that cannot start over a setting's typo would take the server's start with it
        log.warning("TIDESERVE_HTTP_FILL_CONNECTIONS=%r is not an integer: ignored", override)
        return FILL_CONNECTIONS


# -- the gRPC port ---------------------------------------------------------------------------------------------
# Each worker's gRPC server (grpcio) listens on the port itself, with SO_REUSEPORT: the kernel picks the listener of
# each new connection, by a hash of the connection's addresses unless the port's group of listeners carries a
# program. grpcio accepts its own connections, so the rule above cannot be applied at accept; the core gives the group
# a program that picks among its first ``takers`` listeners (the HTTP port's takers where its first-takers rule applies:
# fewer takers than workers, unbounded fill; else every worker): ``return 0`` for one taker (2 workers on 2 cores);
# for more, each new connection to the next of them in turn, an eBPF program with a counter in a one-entry map
# (:func:`deal_program`), so that a client's two connections reach two workers, where the hash puts both on one
# worker one time in two; where the kernel refuses to load it (unprivileged), a classic BPF program that picks one of
# them at random. The listeners are numbered in the order they started to listen (a listener that closes gives its
# number to the last one), so the takers are the first workers whose gRPC servers started, whichever they are.
SO_ATTACH_REUSEPORT_CBPF = getattr(socket, "SO_ATTACH_REUSEPORT_CBPF", 51)
SO_ATTACH_REUSEPORT_EBPF = getattr(socket, "SO_ATTACH_REUSEPORT_EBPF", 52)
_BPF_INSN = struct.Struct("HBBI")  # struct sock_filter: code, jt, jf, k
_BPF_RET_K, _BPF_RET_A, _BPF_LD_W_ABS, _BPF_ALU_MOD_K = 0x06, 0x16, 0x20, 0x94
_SKF_AD_RANDOM = 0xFFFFF000 + 56  # SKF_AD_OFF + SKF_AD_RANDOM: a random 32-bit number
_WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def reuseport_program(first: int) -> list[tuple[int, int, int, int]]:
    """A classic BPF program for a SO_REUSEPORT group: the number of the listener that takes a new connection, one
    of the first ``first`` (a number beyond the group's listeners: the kernel's hash picks, as without a program)."""
    if first <= 1:
        return [(_BPF_RET_K, 0, 0, 0)]
    return [(_BPF_LD_W_ABS, 0, 0, _SKF_AD_RANDOM), (_BPF_ALU_MOD_K, 0, 0, first), (_BPF_RET_A, 0, 0, 0)]


# -- an eBPF program that deals the connections in turn (bpf(2) through ctypes: no library needed) --------------------
_SYS_BPF = {"x86_64": 321, "aarch64": 280, "ppc64le": 361, "s390x": 351}
_BPF_MAP_CREATE, _BPF_PROG_LOAD = 0, 5
_BPF_MAP_TYPE_ARRAY, _BPF_PROG_TYPE_SOCKET_FILTER = 2, 1
_BPF_ATTR_SIZE = 128  # the kernel reads the fields it knows and checks that the rest of what it is given is zero
_EBPF_INSN = struct.Struct("<BBhi")  # struct bpf_insn: code, dst_reg | src_reg << 4, off, imm
_BPF_PSEUDO_MAP_FD = 1
_BPF_FUNC_MAP_LOOKUP_ELEM = 1
_BPF_ADD, _BPF_FETCH = 0x00, 0x01


def _ebpf(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return _EBPF_INSN.pack(code, dst | src << 4, off, imm)


def _deal_instructions(map_fd: int, first: int, fetch: bool) -> bytes:
    """``index = counter++ % first`` over the map's one 8-byte counter (an atomic fetch-and-add; without ``fetch``,
    for kernels before 5.12, an atomic add then a read: two connections that arrive at once may then go to one
    listener); 0 if the map cannot be read."""
    lookup = [
        _ebpf(0x18, dst=1, src=_BPF_PSEUDO_MAP_FD, imm=map_fd), _ebpf(0),  # r1 = the map (a 16-byte load)
        _ebpf(0x62, dst=10, off=-4, imm=0),                                 # *(u32 *)(r10 - 4) = 0: the key
        _ebpf(0xBF, dst=2, src=10), _ebpf(0x07, dst=2, imm=-4),            # r2 = &key
        _ebpf(0x85, imm=_BPF_FUNC_MAP_LOOKUP_ELEM),                         # r0 = &counter or NULL
    ]
    if fetch:
        count = [_ebpf(0xB7, dst=1, imm=1),                                  # r1 = 1
                 _ebpf(0xDB, dst=0, src=1, imm=_BPF_ADD | _BPF_FETCH)]       # r1 = atomic fetch_add(*r0, r1)
    else:
        count = [_ebpf(0xB7, dst=1, imm=1), _ebpf(0xDB, dst=0, src=1, imm=_BPF_ADD),  # atomic *r0 += 1
                 _ebpf(0x79, dst=1, src=0)]                                  # r1 = *r0
    pick = [_ebpf(0xBF, dst=0, src=1), _ebpf(0x97, dst=0, imm=first), _ebpf(0x95)]  # return r1 % first
    found = [_ebpf(0x15, dst=0, off=len(count) + len(pick), imm=0)]          # r0 == NULL: to the end below
    return b"".join(lookup + found + count + pick + [_ebpf(0xB7, dst=0, imm=0), _ebpf(0x95)])  # return 0


def _bpf(command: int, attr: bytes) -> int:
    import ctypes
    import platform

    number = _SYS_BPF.get(platform.machine())
    if number is None:
        raise OSError(f"no bpf system call known on {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    buffer = ctypes.create_string_buffer(attr.ljust(_BPF_ATTR_SIZE, b"\0"), _BPF_ATTR_SIZE)
    fd = libc.syscall(ctypes.c_long(number), ctypes.c_int(command), buffer, ctypes.c_uint(_BPF_ATTR_SIZE))
    if fd < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    return fd


def deal_program(first: int) -> int | None:
    """The file descriptor of an eBPF program for a SO_REUSEPORT group that sends each new connection to the next of
    its first ``first`` listeners, in turn; None where the kernel does not load it (bpf(2) needs privileges where
    ``kernel.unprivileged_bpf_disabled`` is set, as most distributions set it; another platform)."""
    import ctypes

    try:
        map_fd = _bpf(_BPF_MAP_CREATE, struct.pack("IIIII", _BPF_MAP_TYPE_ARRAY, 4, 8, 1, 0))
    except OSError as exc:
        log.debug("no eBPF map for the gRPC port's program: %s", exc)
        return None
    try:
        gpl = ctypes.create_string_buffer(b"GPL")  # (the program's license, as the kernel asks every program's)
        for fetch in (True, False):
            code = ctypes.create_string_buffer(_deal_instructions(map_fd, first, fetch))
            attr = struct.pack("IIQQIIQ", _BPF_PROG_TYPE_SOCKET_FILTER, (len(code) - 1) // _EBPF_INSN.size,
                               ctypes.addressof(code), ctypes.addressof(gpl), 0, 0, 0)
            try:
                return _bpf(_BPF_PROG_LOAD, attr)  # (the program holds the map)
            except OSError as exc:
                log.debug("the gRPC port's eBPF program (fetch %s) not loaded: %s", fetch, exc)
        return None
    finally:
        os.close(map_fd)


def _attach(sock: socket.socket, program: list[tuple[int, int, int, int]]) -> None:
    import ctypes

    filters = ctypes.create_string_buffer(b"".join(_BPF_INSN.pack(*insn) for insn in program))
    fprog = struct.pack("HxxxxxxP", len(program), ctypes.addressof(filters))  # struct sock_fprog
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF, fprog)


def _ipv6_loopback() -> bool:
    """Whether an IPv6 socket can bind ``[::1]``: gRPC's test before it makes a dual-stack listener."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


def _listener_choices(host: str, port: int) -> list[list[tuple[int, tuple]]]:
    """Where gRPC listens for ``host:port``: per address, the ways it may have bound it, in the order it tries them
    (where the machine has IPv6's loopback it listens on a dual-stack IPv6 socket: the wildcard as ``::``, an IPv4
    address as its IPv4-mapped form, e.g. ``[::ffff:127.0.0.1]``; else on IPv4's)."""
    v6 = _ipv6_loopback()
    if host in _WILDCARDS:
        return [[(socket.AF_INET6, ("::", port))] * v6 + [(socket.AF_INET, ("0.0.0.0", port))]]
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    choices = []
    for family, _, _, _, address in infos:
        if family == socket.AF_INET:
            choice = [(socket.AF_INET6, (f"::ffff:{address[0]}", port))] * v6 + [(socket.AF_INET, (address[0], port))]
        else:
            choice = [(family, address[:2])]
        if choice not in choices:
            choices.append(choice)
    return choices


def grpc_takers(workers: int) -> int:
    """How many of ``workers`` the gRPC port's new connections go to (:func:`steer_reuseport`): the HTTP port's first
    takers where its first-takers rule applies (fewer :func:`takers` than workers, no fill limit set), else every
    worker; 0 for one worker (nothing to steer)."""
    if workers <= 1:
        return 0
    first = takers(workers, cores())
    if first >= workers or fill_limit(os.environ.get("TIDESERVE_HTTP_FILL_CONNECTIONS")) != FILL_CONNECTIONS:
        return workers
    return first


def steer_reuseport(host: str, port: int, first: int) -> str:
    """Give the SO_REUSEPORT group of the listeners on ``host:port`` a program that sends every new connection to
    one of its first ``first`` listeners: in turn where the kernel loads :func:`deal_program`, else at random (one
    listener: always it). The program is set through a listener of the group: one made here, bound as gRPC binds
    (:func:`_listener_choices`), which joins the group, sets it, and closes (the group keeps it while any listener
    stays). How it picks ("to the first", "in turn", "at random"), or "" where none could be set (the kernel's hash
    picks, as before)."""
    try:
        choices = _listener_choices(host, port)
    except OSError as exc:
        log.warning("gRPC port %s:%d: its connections are spread by the kernel's hash (%s)", host, port, exc)
        return ""
    program = reuseport_program(first)
    deal = deal_program(first) if first > 1 else None
    how = ""
    try:
        for choice in choices:
            for family, address in choice:
                try:
                    with socket.socket(family, socket.SOCK_STREAM) as sock:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                        if family == socket.AF_INET6:
                            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                        sock.bind(address)
                        sock.listen(1)  # (it joins the group, numbered last: the program never picks it)
                        how = _attach_deal(sock, deal)
                        if not how:
                            _attach(sock, program)
                            how = "to the first" if first <= 1 else "at random"
                except OSError as exc:
                    log.debug("gRPC port: no program set through %s: %s", address, exc)
                    continue
                break  # (gRPC's first way that works is the one it listens on)
    finally:
        if deal is not None:
            os.close(deal)  # (the group holds the program it was given)
    return how


def _attach_deal(sock: socket.socket, deal: int | None) -> str:
    """"in turn" once ``deal`` is the group's program; "" where there is none or the kernel refuses it."""
    if deal is None:
        return ""
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_EBPF, deal)
    except OSError as exc:
        log.debug("gRPC port: the eBPF program not attached: %s", exc)
        return ""
    return "in turn"


def create_table(count: int) -> int:
    """A file descriptor (inheritable) of a table of ``count`` connection counts, every worker :data:`GONE` until
    its acceptor starts."""
    fd = os.memfd_create("tideserve-http-connections", 0) if hasattr(os, "memfd_create") else _temp_fd()
    os.ftruncate(fd, _SLOT.size * count)
    os.set_inheritable(fd, True)
    for index in range(count):
        mark_gone(fd, index, count)
    return fd


def mark_gone(fd: int, index: int, count: int) -> None:
    """Worker ``index`` accepts no connections (not started, stopping, or dead: the core marks a worker that
    exits), so that no other worker steps aside for it."""
    with mmap.mmap(fd, _SLOT.size * count) as table:
        _SLOT.pack_into(table, index * _SLOT.size, GONE)


def _temp_fd() -> int:  # pragma: no cover - systems without memfd_create
    import tempfile
    fd, path = tempfile.mkstemp(prefix="tideserve-connections-")
    os.unlink(path)
    return fd


class ConnectionTable:
    """The open HTTP connections of each worker, in shared memory."""

    def __init__(self, fd: int, index: int, count: int) -> None:
        self.map = mmap.mmap(fd, _SLOT.size * count)
        self.index = index
        self.count = count
        self.offset = index * _SLOT.size

    def set(self, value: int) -> None:
        _SLOT.pack_into(self.map, self.offset, value)

    def held(self, index: int) -> int:
        return _SLOT.unpack_from(self.map, index * _SLOT.size)[0]

    def others_fewest(self, among: int | None = None) -> int:
        """The fewest connections any other worker holds, of the first ``among`` workers (all where None; a large
        number when there is no other)."""
        fewest = 1 << 62
        for index in range(self.count if among is None else among):
            if index != self.index:
                fewest = min(fewest, self.held(index))
        return fewest

    def fewest(self, among: int, own: int) -> int:
        """The fewest connections any of the first ``among`` workers holds, this one counted as ``own``."""
        return min(own if index == self.index else self.held(index) for index in range(among))


class BalancedAcceptor:
    """Accepts ``sock``'s connections for ``factory``'s protocols (uvicorn's) in this worker, one per wake-up,
    while this worker holds no more connections than the fewest of the others; with ``takers`` fewer than the
    workers, only the first ``takers`` workers (evenly among them) while one of them holds fewer than ``fill``."""

    def __init__(self, sock: socket.socket, table: ConnectionTable, factory, takers: int | None = None,
                 fill: int = FILL_CONNECTIONS) -> None:
        self.sock = sock
        self.table = table
        self.factory = factory
        self.takers = table.count if takers is None or not fill else min(takers, table.count)
        self.fill = fill
        self.loop = asyncio.get_running_loop()
        self.open = 0
        self.deferring_since = 0.0
        self.reading = False
        self.closed = False
        self.resume_handle = None
        self.tasks: set[asyncio.Task] = set()
        self.pending = select.poll()  # whether a connection waits, while stepping aside
        self.pending.register(sock.fileno(), select.POLLIN)

    def start(self) -> None:
        self.sock.setblocking(False)
        self._publish()  # from here on this worker takes connections (a restarted one begins with none)
        self._read()

    def _read(self) -> None:
        self.resume_handle = None
        if not self.closed and not self.reading:
            self.loop.add_reader(self.sock.fileno(), self._ready)
            self.reading = True

    def _pause(self, delay: float, then=None) -> None:
        if self.reading:
            self.loop.remove_reader(self.sock.fileno())
            self.reading = False
        if self.resume_handle is None:
            self.resume_handle = self.loop.call_later(delay, then or self._read)

    def _look_again(self) -> None:
        """After stepping aside: where the backlog it stepped aside for is gone (another worker took it), the next
        connection's wait counts from its own arrival, not from this one's."""
        if self.deferring_since and not self.pending.poll(0):
            self.deferring_since = 0.0
        self._read()

    def _others_turn(self) -> float:
        """How long this worker steps aside for the others at most (0: it takes the connection now)."""
        if self.takers < self.table.count and self.table.fewest(self.takers, self.open) < self.fill:
            if self.table.index >= self.takers:
                return MAX_TAKER_WAIT_S
            return MAX_DEFER_S if self.open > self.table.others_fewest(self.takers) else 0.0
        return MAX_DEFER_S if self.open > self.table.others_fewest() else 0.0

    def _ready(self) -> None:
        # Every worker taking, one connection per wake-up (the others look too); the first few taking, a taker
        # accepts what waits, so that a client's connections opened together reach it before another gives up
        # waiting for it (MAX_TAKER_WAIT_S).
        for _ in range(ACCEPTS_PER_WAKE if self.takers < self.table.count else 1):
            wait = self._others_turn()
            if wait:
                now = time.monotonic()
                if not self.deferring_since:
                    self.deferring_since = now
                if now - self.deferring_since < wait:
                    self._pause(DEFER_S, self._look_again)  # another worker takes it (or this one, looking again)
                    return
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):  # another worker took it, or none waits
                self.deferring_since = 0.0
                return
            except OSError as exc:  # out of descriptors, or the like: look again a little later
                log.warning("HTTP accept failed: %s", exc)
                self._pause(0.1)
                return
            self.deferring_since = 0.0
            self._opened()
            conn.setblocking(False)
            task = self.loop.create_task(self.loop.connect_accepted_socket(self._protocol, conn))
            self.tasks.add(task)
            task.add_done_callback(self._connected)

    def _connected(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:  # the connection never began
            log.debug("HTTP connection setup failed", exc_info=task.exception())
            self._closed()

    def _protocol(self):
        protocol = self.factory()
        lost = protocol.connection_lost

        def connection_lost(exc) -> None:
            self._closed()
            lost(exc)

        protocol.connection_lost = connection_lost
        return protocol

    def _opened(self) -> None:
        self.open += 1
        self._publish()

    def _closed(self) -> None:
        self.open -= 1
        self._publish()

    def _publish(self) -> None:
        self.table.set(GONE if self.closed else self.open)

    def close(self) -> None:
        """Accept no more (the open connections are uvicorn's to close)."""
        self.closed = True
        self._publish()
        if self.reading:
            self.loop.remove_reader(self.sock.fileno())
            self.reading = False
        if self.resume_handle is not None:
            self.resume_handle.cancel()
            self.resume_handle = None


def acceptor_for(table: ConnectionTable):
    """``Frontends.http_acceptor`` for a worker: a :class:`BalancedAcceptor` of the shared socket for a started
    uvicorn server, making uvicorn's protocols as its own listening server would (the first :func:`takers`
    workers for this machine's cores taking the connections first)."""
    first = takers(table.count, cores())
    fill = fill_limit(os.environ.get("TIDESERVE_HTTP_FILL_CONNECTIONS"))

    def attach(sock: socket.socket, server) -> BalancedAcceptor:
        config = server.config

        def factory():
            return config.http_protocol_class(config=config, server_state=server.server_state,
                                              app_state=server.lifespan.state)

        acceptor = BalancedAcceptor(sock, table, factory, first, fill)
        acceptor.start()
        return acceptor

    return attach
