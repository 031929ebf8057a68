"""The core's side of the frontend workers: it starts them, answers their requests through the DataPlane,
keeps their view of the repository current, restarts one that dies and stops them all on shutdown.

Each worker has one Unix stream socket to the core (a socketpair made before it starts). The HTTP
listening socket is made here and inherited by every worker (the kernel hands each new connection to
one of them); the gRPC port is bound by each worker with SO_REUSEPORT, behind a socket the core holds
on it so that a port another program uses is still a start-up error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any

from .. import arena, wire
from ..errors import InternalError, ServerError
from . import protocol as p

if TYPE_CHECKING:
    from ..app import ServerOptions
    from ..dataplane import DataPlane, InferenceStream

log = logging.getLogger(__name__)

SNAPSHOT_INTERVAL_S = 1.0  # also push the repository's state this often (new model directories, ensembles)
RESTART_DELAY_S = 0.5


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening, inheritable by the workers."""
    family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(4096)
        sock.set_inheritable(True)
    except BaseException:
        sock.close()
        raise
    return sock


def reserved_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` with SO_REUSEPORT, not listening: the workers' gRPC servers (also
    SO_REUSEPORT, same user) can bind beside it; anything else cannot, and a port in use fails here."""
    family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


class _Link(p.FramedLink):
    """One worker's connection: its requests in flight, its calls, the runtimes it knows."""

    def __init__(self, pool: "FrontendWorkers", index: int) -> None:
        self.pool = pool
        self.index = index
        super().__init__(p.ToCore)
        self.tasks: dict[int, tuple[asyncio.Task, InferenceStream]] = {}
        self.known: set[int] = set()  # runtime uids this worker has been described
        self.ready = asyncio.get_running_loop().create_future()
        self.closed = asyncio.get_running_loop().create_future()
        self.process: subprocess.Popen | None = None
        self.served = False  # it said Ready once

    def connection_lost(self, exc) -> None:
        for task, stream in list(self.tasks.values()):
            task.cancel()
            stream.cancel()
        self.tasks.clear()
        if not self.closed.done():
            self.closed.set_result(None)
        self.pool.engine_counts.lost(self.index)
        if not self.ready.done():
            self.ready.set_exception(RuntimeError(f"frontend worker {self.index} exited during start-up"))
            self.ready.exception()  # retrieved here: the pool reports it
        self.pool.lost(self)

    def data_received(self, data: bytes) -> None:
        for message in self.splitter.feed(data):
            kind = type(message)
            if kind is p.Infer:
                self._infer(message)
            elif kind is wire.Release:
                self.release(message)
            elif kind is wire.Cancel:
                entry = self.tasks.pop(message.rid, None)
                if entry is not None:  # the stream too: a task cancelled before it ran never reaches its finally
                    entry[0].cancel()
                    entry[1].cancel()
            elif kind is p.WorkerGenerations:  # generations the worker ran on its own engine client
                self.pool.engine_counts.received(self.index, message)
            elif kind is p.Ready:
                self.served = True
                if not self.ready.done():
                    self.ready.set_result(message.pid)
            else:  # one of the interface's calls (p.Call)
                asyncio.get_running_loop().create_task(self._run_call(message))

    # -- inference ---------------------------------------------------------------------------------------
    def _infer(self, message: p.Infer) -> None:
        rid = message.request.rid
        try:
            m = message.request
            typed = m.generation is not None and not message.unary  # a worker's RemoteDataPlane.generate
            if typed:
                stream = self.pool.dataplane.generate(m.model_name, m.generation, model_version=m.model_version,
                                                      id=m.id, priority=m.priority, timeout_us=m.timeout_us,
                                                      arrival_ns=m.arrival_ns, trace_context=m.trace_context or None)
            else:
                request = p.request_of(message, self.inbox)
                if message.unary:
                    request.streaming = False
                stream = self.pool.dataplane.infer(request)
        except Exception as exc:
            self.send(p.error_respond(rid, exc, rejected=True))
            return
        relay = self._relay_generation(rid, stream) if typed else self._relay(rid, stream, message.unary)
        task = asyncio.get_running_loop().create_task(relay)
        self.tasks[rid] = (task, stream)

    async def _relay_generation(self, rid: int, stream) -> None:
        """A typed generation's deltas, one message each as the stream hands them out (deltas not sent yet join
        there), then a bare FINAL flag; a model's error as the final answer."""
        send = self.send
        uid = self.pool.describe(self, stream.runtime)
        try:
            async for delta in stream:
                send(p.Respond(rid, wire.Response(final=False, generation=delta), uid))
            send(p.Respond(rid, wire.Response(final=True, empty=True), uid))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            send(p.error_respond(rid, exc, uid))
        finally:
            self.tasks.pop(rid, None)
            await stream.aclose()

    async def _relay(self, rid: int, stream: "InferenceStream", unary: bool) -> None:
        send, outbox = self.send, self.outbox
        uid = self.pool.describe(self, stream.runtime)
        try:
            if unary:
                response = await self.pool.dataplane.collect_unary(stream)
                send(p.respond_message(rid, response, uid, outbox))
                return
            async for response in stream:
                try:
                    message = p.respond_message(rid, response, uid, outbox)
                except Exception as exc:  # an output the link cannot carry
                    log.exception("model '%s': a response cannot be sent to the frontend", stream.request.model_name)
                    send(p.error_respond(rid, exc, uid))
                    return
                send(message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            send(p.error_respond(rid, exc, uid))
        finally:
            self.tasks.pop(rid, None)
            await stream.aclose()

    # -- the interface's other methods -------------------------------------------------------------
    async def _run_call(self, message: "p.Call") -> None:
        try:
            result = p.Result(message.cid, await message.run(self.pool.dataplane))
        except Exception as exc:
            if not isinstance(exc, ServerError):
                log.exception("frontend call %s failed", type(message).__name__)
            result = p.Result(message.cid, error=wire.error_data(exc))
        if message.changes_repository:
            self.pool.push_all()  # every worker sees the change before the answer
        try:
            self.send(result)
        except Exception as exc:  # a value msgpack cannot carry
            log.exception("frontend call %s: the result cannot be sent", type(message).__name__)
            self.send(p.Result(message.cid, error=wire.error_data(exc)))


class FrontendWorkers:
    """``count`` frontend worker processes serving the HTTP and gRPC ports over ``dataplane``."""

    def __init__(self, dataplane: "DataPlane", options: "ServerOptions", count: int,
                 grpc_process: bool = False) -> None:
        self.dataplane = dataplane
        self.options = options
        self.count = count
        # --grpc-frontend pyvoy: one more worker, last, that serves the gRPC port (an Envoy process running
        # server/grpc/asgi_transport.py); the ``count`` others then serve HTTP only (and there may be none)
        self.grpc_index = count if grpc_process else None
        self.links: list[_Link | None] = [None] * (count + grpc_process)
        self._http: socket.socket | None = None
        self._balance: int | None = None  # the workers' table of open HTTP connections (workers/balance.py)
        self._grpc: socket.socket | None = None
        self._stopping = False
        self._started = False  # every worker said Ready once (the snapshots say ready from then on)
        self._push_scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ticker: asyncio.Task | None = None
        self._restarts: set[asyncio.Task] = set()
        # --frontend-direct: the instance processes' addresses by runtime uid (dataplane.direct_endpoints: the process
        # at each address, for DirectFailure)
        self.direct: dict[int, list[str]] = {}
        from .engines import CoreCounts

        self.engine_counts = CoreCounts(dataplane.repository)  # generations the workers run on their engine clients
        self._opening: set[int] = set()
        self._refused: set[int] = set()  # versions whose processes could not open theirs
        self._direct_dir: str | None = None
        if options.frontend_direct:
            self._direct_dir = tempfile.mkdtemp(prefix="tideserve-direct-")  # only this user may enter (0700)
            dataplane.direct_endpoints = {}

    # -- lifecycle ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        opts = self.options
        self._loop = asyncio.get_running_loop()
        if opts.allow_http and self.count:
            self._http = listening_socket(opts.host, opts.http_port)
            if self.count > 1:
                from .balance import create_table
                self._balance = create_table(self.count)
        if opts.allow_grpc and self.grpc_index is None:
            self._grpc = reserved_port(opts.host, opts.grpc_port)
        elif opts.allow_grpc:  # Envoy binds it itself
            from ..grpc.asgi_transport import check_port
            check_port(opts.host, opts.grpc_port)
        self.dataplane.repository.listeners.append(self.changed)
        if self._direct_dir is not None:  # the models loaded at start are reached directly from the first request
            self._open_direct()
            await asyncio.gather(*list(self._restarts), return_exceptions=True)
        starting = [self._spawn(i) for i in range(len(self.links))]
        links = await asyncio.gather(*starting)
        try:
            await asyncio.gather(*(link.ready for link in links))
            await self._grpc_listening()
        except RuntimeError as exc:
            await self.stop(grace=2.0)
            raise InternalError(f"{exc} (its error is in the log above)") from None
        self._started = True
        self.push_all()
        self._ticker = self._loop.create_task(self._tick())

    async def _spawn(self, index: int) -> _Link:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        requests = responses = -1
        try:
            requests = arena.create_file(p.ARENA_BYTES, f"tideserve-worker{index}-requests")
            responses = arena.create_file(p.ARENA_BYTES, f"tideserve-worker{index}-responses")
            fds = [theirs.fileno(), requests, responses]
            args = [sys.executable, "-m", "tideserve.workers.main", "--link-fd", str(theirs.fileno()),
                    "--arena", f"{requests},{responses},{p.ARENA_BYTES}"]
            options = self.options
            if index == self.grpc_index:  # Envoy, in a session of its own: Ctrl-C is the core's to handle
                from ..grpc.asgi_transport import envoy_process

                args, env = envoy_process(options, theirs.fileno(), requests, responses, p.ARENA_BYTES)
                process = subprocess.Popen(args, pass_fds=fds, env=env, start_new_session=True)
            elif self.grpc_index is not None:  # HTTP only: the gRPC port is the Envoy process's
                options = dataclasses.replace(options, allow_grpc=False)
            if self._http is not None and index != self.grpc_index:
                fds.append(self._http.fileno())
                args += ["--http-fd", str(self._http.fileno())]
                if self._balance is not None:
                    fds.append(self._balance)
                    args += ["--balance", f"{self._balance},{self.count}"]
            # no preexec_fn: it would run the process's at-fork handlers (gRPC's among them) in a process whose
            # gRPC threads are live; the worker ignores Ctrl-C itself, first thing (workers/main.py)
            if index != self.grpc_index:
                if options.frontend_direct and self._ticker is None:  # the server's start: clients before Ready
                    args.append("--engine-clients-first")
                process = subprocess.Popen(args, pass_fds=fds, start_new_session=False)

            def new_link() -> _Link:
                link = _Link(self, index)
                link.attach(responses, requests, p.ARENA_BYTES)
                return link

            _, link = await loop.connect_accepted_socket(new_link, ours)
        finally:
            theirs.close()
            for fd in (requests, responses):
                if fd >= 0:
                    os.close(fd)
        link.process = process
        self.links[index] = link
        if index != self.grpc_index:  # from the first worker up (its listener is the group's first; later ones join
            link.ready.add_done_callback(self._steer_when_ready)  # behind it), again on a restart
        link.send(p.Start(pickle.dumps(options), index))
        self.push_to(link)
        return link

    async def _grpc_listening(self) -> None:
        """--grpc-frontend pyvoy: wait until Envoy's listener is open (it opens after its app said Ready)."""
        if self.grpc_index is None:
            return
        from ..grpc.asgi_transport import wait_listening

        link = self.links[self.grpc_index]
        await wait_listening(self.options.host, self.options.grpc_port, link.process)

    def _steer_when_ready(self, ready: asyncio.Future) -> None:
        if not ready.cancelled() and ready.exception() is None:
            self._steer_grpc()

    def _steer_grpc(self) -> None:
        """The workers' gRPC servers listen on the port with SO_REUSEPORT: where the HTTP connections go to the first
        takers only (workers/balance.py: as many workers as cores or more, unbounded fill), the gRPC port's new
        connections go to the first takers' listeners too, else to every worker's (a program on the group: in turn
        where the kernel loads an eBPF program, else at random, as the kernel's hash would)."""
        from .balance import grpc_takers, steer_reuseport

        if self._grpc is None or not self.options.grpc_port or not (first := grpc_takers(self.count)):
            return
        opts = self.options
        how = steer_reuseport(opts.host, opts.grpc_port, first)
        if how:
            log.debug("gRPC port %d: new connections go to the first %d of %d workers' listeners, %s",
                      opts.grpc_port, first, self.count, how)

    def lost(self, link: _Link) -> None:
        """A worker's connection closed: expected while stopping, else the worker died: start another."""
        if self._stopping or self.links[link.index] is not link or not link.served:
            return  # one that never served failed at start-up: start() reports it
        if self._balance is not None and link.index != self.grpc_index:  # no worker steps aside for it
            from .balance import mark_gone
            mark_gone(self._balance, link.index, self.count)
        code = link.process.poll() if link.process is not None else None
        log.error("frontend worker %d (pid %s) exited%s; starting another", link.index,
                  link.process.pid if link.process else "?", f" with code {code}" if code is not None else "")
        task = self._loop.create_task(self._restart(link.index))
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def _restart(self, index: int) -> None:
        old = self.links[index]
        if old is not None and old.process is not None:
            await asyncio.get_running_loop().run_in_executor(None, _reap, old.process, 5.0)
        await asyncio.sleep(RESTART_DELAY_S)
        if self._stopping:
            return
        try:
            link = await self._spawn(index)
            await link.ready
            if index == self.grpc_index:
                await self._grpc_listening()
        except Exception:
            log.exception("frontend worker %d failed to restart", index)

    async def stop(self, grace: float = 5.0, message: str = "") -> None:
        """Ask every worker to stop (they close their ports and exit), then reap them; ``message``: what the
        requests still in flight straight to the models' processes are answered (the exit timeout ran out)."""
        self._stopping = True
        if self._ticker is not None:
            self._ticker.cancel()
        for task in list(self._restarts):
            task.cancel()
        for link in self.links:
            if link is not None:
                link.send(p.Stop(message))
        loop = asyncio.get_running_loop()
        processes = [link.process for link in self.links if link is not None and link.process is not None]
        await asyncio.gather(*(loop.run_in_executor(None, _reap, proc, grace) for proc in processes))
        for link in self.links:
            if link is not None and link.transport is not None:
                link.transport.close()
        for sock in (self._http, self._grpc):
            if sock is not None:
                sock.close()
        if self._balance is not None:
            os.close(self._balance)
            self._balance = None
        if self._direct_dir is not None:
            shutil.rmtree(self._direct_dir, ignore_errors=True)
        try:
            self.dataplane.repository.listeners.remove(self.changed)
        except ValueError:
            pass

    def pids(self) -> list[int]:
        return [link.process.pid for link in self.links if link is not None and link.process is not None]

    # -- the repository as the workers see it ------------------------------------------------------------
    def changed(self) -> None:
        """A model changed state (any thread): push a snapshot to every worker soon (once for a burst)."""
        loop = self._loop
        if loop is None or self._push_scheduled:
            return
        self._push_scheduled = True
        try:
            loop.call_soon_threadsafe(self.push_all)
        except RuntimeError:  # the loop is closed
            pass

    def push_all(self) -> None:
        self._push_scheduled = False
        if self._direct_dir is not None:
            self._open_direct()
        for link in self.links:
            if link is not None:
                self.push_to(link)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(SNAPSHOT_INTERVAL_S)
            self.push_all()

    # -- --frontend-direct ------------------------------------------------------------------------------------
    @staticmethod
    def direct_eligible(runtime) -> bool:
        """Whether frontend workers may send the model's requests straight to its instance processes: a Python
        model in process mode whose requests the core would only batch (no sequence batching, response cache,
        ensemble or rate limiter)."""
        config = runtime.config
        if (runtime.rate_limiter is not None or config.HasField("sequence_batching") or config.response_cache.enable
                or runtime.steps or getattr(runtime.model, "create_scheduler", None) is not None
                or not runtime.slots):
            return False
        return all(hasattr(slot.instance, "open_direct") for slot in runtime.slots)

    def _open_direct(self) -> None:
        """Open the direct links of every READY eligible model not yet open; forget the others."""
        live = {}
        for runtime in self.dataplane.repository.runtimes():
            live[runtime.uid] = runtime
            if (runtime.state.value == "READY" and runtime.uid not in self.direct and runtime.uid not in self._opening
                    and runtime.uid not in self._refused and self.direct_eligible(runtime)):
                self._opening.add(runtime.uid)
                task = self._loop.create_task(self._open(runtime))
                self._restarts.add(task)
                task.add_done_callback(self._restarts.discard)
        endpoints = self.dataplane.direct_endpoints
        for uid in [uid for uid in self.direct if uid not in live]:
            for address in self.direct.pop(uid):
                endpoints.pop(address, None)

    async def _open(self, runtime) -> None:
        endpoints = self.dataplane.direct_endpoints
        addresses = []
        try:
            for index, slot in enumerate(list(runtime.slots)):
                address = os.path.join(self._direct_dir, f"{runtime.uid}-{index}.sock")
                endpoints[address] = await slot.instance.open_direct(address)
                addresses.append(address)
        except Exception:
            self._refused.add(runtime.uid)  # not tried again for this version
            log.exception("model '%s' version %s: frontend workers cannot reach its processes directly; its "
                          "requests go through the core", runtime.name, runtime.version)
            return
        finally:
            self._opening.discard(runtime.uid)
        self.direct[runtime.uid] = addresses
        if any(link is not None for link in self.links):
            self.push_all()

    def _direct_snapshot(self) -> dict[int, list[str]]:
        dataplane = self.dataplane
        if not self.direct or not dataplane.accepting or dataplane.tracer.active:
            return {}
        ready = {r.uid for r in dataplane.repository.runtimes() if r.state.value == "READY"}
        return {uid: addresses for uid, addresses in self.direct.items() if uid in ready}

    def describe(self, link: _Link, runtime) -> int:
        uid = runtime.uid
        if uid not in link.known:
            self.push_to(link)  # a version the worker has not seen: describe it before its responses
        return uid

    def push_to(self, link: _Link) -> None:
        dataplane = self.dataplane
        repository = dataplane.repository
        lookups: dict[str, dict[str, Any]] = {}
        fresh: list[p.RuntimeInfo] = []
        seen: set[int] = set()
        for name in set(repository.entries) | set(_names(repository)):
            entry = repository.entries.get(name)
            versions = sorted(entry.versions) if entry is not None else []
            table: dict[str, Any] = {}
            for version in [""] + [str(v) for v in versions]:
                try:
                    runtime = repository.get(name, version)
                except ServerError as exc:
                    table[version] = wire.error_data(exc)
                    continue
                uid = runtime.uid
                table[version] = uid
                seen.add(uid)
                if uid not in link.known:
                    link.known.add(uid)
                    fresh.append(p.RuntimeInfo(uid, runtime.name, runtime.version,
                                               runtime.config.SerializeToString(), str(runtime.ctx.model_path),
                                               [str(r) for r in runtime.ctx.allowed_roots], versions,
                                               runtime.engine))
            lookups[name] = table
        link.known &= seen
        try:
            index = repository.index(False)
        except Exception:  # e.g. the repository directory went away
            log.exception("reading the repository index")
            index = []
        try:
            adapters = dataplane.adapters()
        except Exception:
            log.exception("listing the adapters")
            adapters = []
        # ready once every worker said Ready: one that serves first (each builds its engine clients before it
        # serves, workers/main.py) does not answer for the others still starting
        link.send(p.Snapshot(dataplane.accepting, self._started and dataplane.ready(), dataplane.healthy(), index,
                             lookups, fresh,
                             adapters, self._direct_snapshot()))


def _names(repository) -> list[str]:
    try:
        return repository.model_names()
    except OSError:
        return []


def _reap(process: subprocess.Popen, grace: float) -> None:
    deadline = time.monotonic() + grace
    try:
        process.wait(timeout=max(deadline - time.monotonic(), 0.01))
        return
    except subprocess.TimeoutExpired:
        pass
    log.warning("frontend worker pid %d did not exit within %.1fs; killing it", process.pid, grace)
    try:
        process.send_signal(signal.SIGKILL)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        log.error("frontend worker pid %d did not die", process.pid)


def worker_count(text: str | int | None) -> int:
    """The default number of frontend workers: one per two cores, at least 1, at most 8."""
    if text not in (None, "", "auto"):
        return int(text)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(8, cores // 2))
