"""A frontend worker process: the HTTP and gRPC frontends over a RemoteDataPlane.

Started by the core (server/workers/pool.py) with its end of a socketpair and the shared HTTP listening
socket. It serves until the core says Stop, and exits at once if the core goes away. Started with the server
(``--engine-clients-first``), it builds its engine clients (workers/engines.py) for the models loaded at start before
it serves the ports and says Ready: the server is ready once every worker's generations run on its own client, not
relayed through the core while a client is being built (importing vLLM: 10-20 s on 2 cores). A worker started again
after one died serves at once and builds in the background.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys

from .remote import CoreLink, open_frontend

log = logging.getLogger("tideserve.workers")

# at the server's start, a worker serves once its engine clients are built or after this long (relaying meanwhile)
ENGINE_CLIENTS_START_S = 300.0


async def serve(link_fd: int, http_fd: int | None, arena: tuple[int, int, int] | None = None,
                balance: tuple[int, int] | None = None, engine_clients_first: bool = False) -> int:
    from ..app import Frontends

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # stopping is the core's decision (it drains first)
        loop.add_signal_handler(sig, lambda: None)
    sock = socket.socket(fileno=link_fd)
    _, link = await loop.connect_accepted_socket(CoreLink, sock)
    if arena is not None:  # (this side's arena, the core's, their size)
        send_fd, receive_fd, size = arena
        link.attach(send_fd, receive_fd, size)
        os.close(send_fd)
        os.close(receive_fd)
    start, options, dataplane, access = await open_frontend(link)
    if dataplane.engines is not None:
        dataplane.engines.start_building()
        if engine_clients_first:
            await dataplane.engines.built(ENGINE_CLIENTS_START_S)
    frontends = Frontends(dataplane, options, access)
    if balance is not None and http_fd is not None:  # (the table's fd, the number of workers)
        from .balance import ConnectionTable, acceptor_for
        frontends.http_acceptor = acceptor_for(ConnectionTable(balance[0], start.index, balance[1]))
    http = socket.socket(fileno=http_fd) if http_fd is not None else None
    await frontends.start(http_socket=http, grpc_shared=True)
    if options.freeze_heap:
        from .. import heap
        heap.freeze()
    link.send(_ready())
    why = await link.stopped
    if why == "lost":  # the core died: nobody to answer requests; leave now
        log.error("frontend worker %d: the core process is gone; exiting", start.index)
        return 1
    if link.stop_message:  # the exit timeout ran out: answer what runs here without the core now
        dataplane._abort_own(link.stop_message)
    await frontends.stop()
    return 0


def _ready():
    from .protocol import Ready
    return Ready(os.getpid())


def main(argv: list[str] | None = None) -> int:
    # Ctrl-C reaches the whole process group: the workers leave stopping to the core
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parser = argparse.ArgumentParser(prog="tideserve-frontend-worker")
    parser.add_argument("--link-fd", type=int, required=True)
    parser.add_argument("--http-fd", type=int, default=None)
    parser.add_argument("--arena", default=None, help="SEND_FD,RECEIVE_FD,BYTES: the link's shared-memory arenas")
    parser.add_argument("--balance", default=None,
                        help="FD,WORKERS: the table of each worker's open HTTP connections (workers/balance.py)")
    parser.add_argument("--engine-clients-first", action="store_true",
                        help="build the engine clients of the models loaded now before serving (the server's start)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s %(name)s[worker {os.getpid()}]: %(message)s")
    try:
        import uvloop
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    arena = tuple(int(x) for x in args.arena.split(",")) if args.arena else None
    balance = tuple(int(x) for x in args.balance.split(",")) if args.balance else None
    return run(serve(args.link_fd, args.http_fd, arena, balance, args.engine_clients_first))


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
