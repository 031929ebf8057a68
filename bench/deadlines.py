"""Queue deadlines under an admission flood: how late a refusal comes, and what the flood costs the goodput.

One tideserve process serves a random Llama (``tideserve.bench.examples.tiny_llama``, ``--size``; the default
100m, because the ``tiny`` one steps faster than HTTP streams its tokens and its engine never has requests
waiting) through the vllm backend with ``max_num_seqs`` S (and, optionally, the config parameter
``max_queue_size`` Q): the engine holds H = S + Q requests at once. Every request carries a deadline of
``--deadline-ms``, the time it may wait for its first token; a request still waiting then is refused with 503 +
``Retry-After`` and removed from the engine. Two modes (``--api``), each a series of rounds of its own:

* ``generate``: ``POST /v2/models/llm/generate_stream``, the deadline as Triton's request parameter ``timeout``
  (microseconds);
* ``openai``: ``POST /v1/completions`` with ``stream`` true, the deadline as the ``x-request-timeout-ms`` header.

Requests are streamed, ``--tokens`` tokens each (greedy, ``ignore_eos``). Sides alternate (ABAB... per mode),
``--duration`` seconds each:

* unflooded: a steady workload the engine can serve: S closed-loop clients (each sends its next request when
  the last one ends), so the engine is full and nothing waits;
* flooded: the same S clients plus an admission flood of ``--flood-factor`` x H more closed-loop clients (3x what
  the engine holds by default). A refused client sends again after ``--retry-ms`` (Retry-After is ignored: a
  retry storm); a served one sends again at once.

Before each side the engine's prefix cache is reset (``POST /reset_prefix_cache``) and every prompt is sent once
(one token each, no deadline), so every side starts from the same engine state (``--no-prime``: not). The
clients run in ``--client-processes`` processes (one event loop alone falls behind the flood on a busy
machine, and its lag would count as the server's); each reports its own loop lag (how late a 5 ms sleep wakes).
``--observers`` of the flood's clients (8) run apart, in a process of their own, a thread each on a blocking
socket: the kernel stamps each of their requests' last byte sent and each answer's first byte received
(``SO_TIMESTAMPING``, software TX and RX stamps), so their refusals' lateness does not depend on when a client
got a CPU (a client starved by its own flood measures itself).
The server's ``GET /load`` is sampled every 0.25 s: requests in flight and those the engine has waiting, so a
flood that did not reach the engine shows.

Reported, all rounds of a mode pooled:

1. refusal lateness: the time the 503 arrives (its status line, at the client) minus the request's deadline
   counted from the client's send time, p50 / p99 / max, over the deadline refusals (503s whose error names the
   deadline); target p99 <= 10 ms; also counted from the moment the request's bytes left the client (aiohttp's
   trace), without the client's own time before that. The server counts the deadline from the request's arrival, a little after
   the send, so this includes the request's way in and the answer's way out. Split with the server's own
   account (each refusal's ``tideserve-deadline-late-us`` header, in the server's time after the deadline it
   counted): (a) its timer, and of that, with the server run under ``TIDESERVE_DEADLINE_PROBE=1`` (the default
   here; ``--no-probe``), the time its loop thread waited for a CPU and what is left, the loop's own work (or
   the thread blocked: the GIL, a virtual CPU the host did not run); (b)
   from the timer to the answer written; (c) the rest of what the client saw (the way in, the way back, the
   client's loop). The way in is split again where aiohttp's trace says when the request's bytes were written:
   the client's own part (send to bytes written) and the rest (to the server's first parsed byte: the server's
   loop getting to the connection); and each way carries the time the client's own loop was stalled within it
   (late wake-ups of its lag probe), so a tail made by the client shows as such. Per side, the server loop thread's share of the wall time on a CPU and waiting for one
   (``/proc/<pid>/task/<pid>/schedstat``): on a machine whose cores are all busy, (a) is mostly that wait; and
   the engine processes' CPU and run-queue wait (all their threads, in cores), which moves the goodput; the
   server process's own CPU (every thread); and, from the server's ``TIDESERVE_DEADLINE_PROBE_FILE`` counts
   (``probe_*`` in the JSON), the requests the engine's scheduler took in, those whose first token came before
   their deadline, those that ran on with a place in the engine at their deadline, and the refusals (before the
   engine had them, and after its prefill had run): what the engine spent on requests then refused.
   The same, on the observer's refusals, as the kernel timed them: TX stamp to RX stamp less the deadline (and from
   the observer's clock read just before its send), beside the same refusals as its thread read them, split by the
   server's header into the way in (TX stamp to the server's counted start), the server's own and the way back (its
   answer written to the RX stamp). The client processes' measure above counts their refusals alone.
2. goodput: requests per second that got their whole stream with TTFT (send to first token) <= ``--ttft-slo``
   (2 s), among those sent during the side's window; flooded vs unflooded (target >= 0.9x), for all clients and
   for the S steady clients alone. Also the counts: served, refused at the deadline, refused busy (the queue
   bound), other errors.

    python bench/deadlines.py [--api both] [--size 100m] [--max-num-seqs 8] [--max-queue-size 0] [--tokens 32]
                              [--deadline-ms 1000] [--duration 15] [--rounds 2] [--loop-nice -10]
                              [--loop-slice-us 100] [--engine-nice 10] [--same-session] [--client-nice 5]

About 6 minutes for ``--rounds 2`` (one engine start, 8 sides of 15 s). Writes bench/results/deadlines-<time>.json
(the pooled summary and each side of each round, with the load average at its start).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import itertools
import json
import os
import select
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import aiohttp
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere
from tideserve.bench.llm_servers import (engine_env, percentile, start_tideserve, stop_process, story_prompts,
                                         write_vllm_repository)

MODEL = "llm"
APIS = ("generate", "openai")
# the generate extension's tensor path in the same server: the prompt as an array of one string (the typed path
# leaves that form to the tensors), for an A/B of the two paths under the same load
GENERATE_TENSORS = "generate-tensors"
LATE_HEADER = "tideserve-deadline-late-us"
PROMPTS = 64  # the prompts every client cycles through (story_prompts)
BURST_MS = 10  # a request's way in is split by how many others' bytes were written in the BURST_MS before its own


def server_lateness(value: str | None) -> tuple[float, float, float | None, float | None] | None:
    """The server's own account of a deadline refusal (its ``tideserve-deadline-late-us`` header): how late its
    timer fired and how late it wrote the answer, in ms after the deadline it counted from the request's first
    byte, and how long its loop waited for a CPU in between (None unless the server runs with
    ``TIDESERVE_DEADLINE_PROBE=1``), and then also when it answered on this host's monotonic clock (s); None
    without the header."""
    if not value:
        return None
    try:
        fields = dict(part.strip().split("=", 1) for part in value.split(","))
        wait = int(fields["cpu_wait"]) / 1000 if "cpu_wait" in fields else None
        at = int(fields["at"]) / 1e9 if "at" in fields else None
        return int(fields["timer"]) / 1000, int(fields["answer"]) / 1000, wait, at
    except (KeyError, ValueError):
        return None


async def one_request(session: aiohttp.ClientSession, base: str, api: str, prompt: str, tokens: int,
                      deadline_ms: float) -> dict:
    """One streamed request with a deadline: when it was sent, its status, when the first token / the refusal came,
    whether the stream finished, and the error text of a refusal."""
    if api in ("generate", GENERATE_TENSORS):
        url = f"{base}/v2/models/{MODEL}/generate_stream"
        body = {"text_input": [prompt] if api == GENERATE_TENSORS else prompt, "stream": True,
                "parameters": {"max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                               "timeout": int(deadline_ms * 1000)}}
        headers = {}
    else:
        url = f"{base}/v1/completions"
        body = {"model": MODEL, "prompt": prompt, "stream": True, "max_tokens": tokens, "temperature": 0,
                "ignore_eos": True}
        headers = {"x-request-timeout-ms": str(int(deadline_ms))}
    result = {"sent": time.monotonic(), "status": None, "first": None, "answered": None, "complete": False,
              "error": None, "written": None}
    try:
        async with session.post(url, json=body, headers=headers, trace_request_ctx=result) as response:
            result["answered"] = time.monotonic()
            result["status"] = response.status
            if response.status != 200:
                result["error"] = (await response.text(errors="replace"))[:300]
                result["retry_after"] = response.headers.get("retry-after")
                result["server_late"] = server_lateness(response.headers.get(LATE_HEADER))
                return result
            # the first event is parsed (a token, or an error: the refusal inside a stream); after it the stream is
            # read as raw bytes, its end checked for completion or an error (the client must keep up with the flood)
            tail = b""
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    result["complete"] = True
                    return result
                event = json.loads(data)
                if "error" in event:
                    result["error"] = json.dumps(event)[:300]
                    result["answered"] = time.monotonic()
                    return result
                result["first"] = time.monotonic()
                break
            async for chunk in response.content.iter_any():
                tail = (tail + chunk)[-4096:]
            if b'{"error"' in tail:  # an error ends a stream
                result["error"] = tail[tail.index(b'{"error"'):].decode(errors="replace")[:300]
            elif result["first"] is not None:  # generate_stream ends with its last event; /v1 with [DONE]
                result["complete"] = api != "openai" or b"data: [DONE]" in tail
    except (aiohttp.ClientError, TimeoutError) as exc:
        result["status"] = f"client error: {type(exc).__name__}"
    return result


async def closed_loop(session: aiohttp.ClientSession, base: str, api: str, role: str, index: int, tokens: int,
                      deadline_ms: float, until: float, retry_s: float, out: list[dict]) -> None:
    prompts = story_prompts(PROMPTS)
    sent = 0
    while time.monotonic() < until:
        result = await one_request(session, base, api, prompts[(index + sent) % len(prompts)], tokens, deadline_ms)
        result["role"] = role
        out.append(result)
        sent += 1
        if result["status"] != 200 and retry_s:
            await asyncio.sleep(retry_s)


async def loop_lag(stop: asyncio.Event, lags: list[float], every_s: float = 0.005,
                   stalls: list[tuple[float, float]] | None = None) -> None:
    """The client's own event-loop lag (how late a 5 ms sleep wakes), which inflates every client-side time; with
    ``stalls``, also each late wake-up as (from, to) on the monotonic clock: the loop could not run meanwhile."""
    while not stop.is_set():
        start = time.monotonic()
        await asyncio.sleep(every_s)
        now = time.monotonic()
        lags.append((now - start - every_s) * 1000)
        if stalls is not None and now - start - every_s > 0.0005:
            stalls.append((start + every_s, now))


def stalled_ms(stalls: list[tuple[float, float]], start: float, end: float) -> float:
    """ms of ``[start, end]`` during which the client's loop was stalled (late wake-ups of its lag probe)."""
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in stalls if b > start and a < end) * 1000


async def _on_chunk_sent(session, context, params) -> None:
    """aiohttp's trace: the request's body is about to be written (with its head): its bytes leave now."""
    result = context.trace_request_ctx
    if isinstance(result, dict) and result.get("written") is None:
        result["written"] = time.monotonic()


async def run_clients(base: str, api: str, roles: list[tuple[str, int]], tokens: int, deadline_ms: float,
                      until: float, retry_s: float) -> tuple[list[dict], list[float]]:
    connector = aiohttp.TCPConnector(limit=len(roles) + 4)
    trace = aiohttp.TraceConfig()
    trace.on_request_chunk_sent.append(_on_chunk_sent)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120),
                                     trace_configs=[trace]) as session:
        out: list[dict] = []
        lags: list[float] = []
        stalls: list[tuple[float, float]] = []
        stop = asyncio.Event()
        monitor = asyncio.ensure_future(loop_lag(stop, lags, stalls=stalls))
        await asyncio.gather(*(closed_loop(session, base, api, role, index, tokens, deadline_ms, until, retry_s, out)
                               for role, index in roles))
        stop.set()
        await monitor
    # each refusal that the server timed: how long this client's loop was stalled on its way in (send to the
    # server's first parsed byte) and on its way back (the answer written to read)
    for r in out:
        late = r.get("server_late")
        if r["status"] == 503 and late and late[3] is not None and r["answered"] is not None:
            received = late[3] - late[1] / 1000 - deadline_ms / 1000  # the server's arrival, its clock (the host's)
            r["stall_in_ms"] = stalled_ms(stalls, r["sent"], received)
            r["stall_back_ms"] = stalled_ms(stalls, late[3], r["answered"])
    return out, lags


# Kernel timestamps of the observer's requests (Linux, <linux/net_tstamp.h>): the software stamp of the request's
# last byte handed to the device (TX, read from the socket's error queue) and of the answer's first byte received
# (RX, recvmsg's ancillary data), both CLOCK_REALTIME
SO_TIMESTAMPING = 37
SOF_TIMESTAMPING = (1 << 1) | (1 << 3) | (1 << 4) | (1 << 7) | (1 << 11)  # TX_SOFTWARE RX_SOFTWARE SOFTWARE OPT_ID OPT_TSONLY


def _stamp(ancdata: list) -> float | None:
    """The software timestamp (``scm_timestamping``'s first timespec) in ``recvmsg``'s ancillary data, in s on
    CLOCK_REALTIME; None where there is none."""
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPING and len(data) >= 16:
            sec, nsec = struct.unpack_from("qq", data)
            if sec or nsec:
                return sec + nsec / 1e9
    return None


def _tx_stamp(sock: socket.socket) -> float | None:
    """The kernel's stamp of the request's last byte sent (the last of the error queue's stamps; on loopback they are
    queued within the send itself), CLOCK_REALTIME s; None where the kernel gave none within 50 ms."""
    stamp = None
    for _ in range(2):
        while True:
            try:
                _, ancdata, _, _ = sock.recvmsg(64, 512, socket.MSG_ERRQUEUE | socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            stamp = _stamp(ancdata) or stamp
        if stamp is not None:
            return stamp
        select.select([], [], [sock], 0.05)  # an error-queue entry wakes select's exceptional set
    return stamp


def request_bytes(api: str, host: str, prompt: str, tokens: int, deadline_ms: float) -> bytes:
    """The bytes of ``one_request``'s request (the same body and deadline), on a connection the server closes after
    its answer (the observer reads to the end)."""
    if api in ("generate", GENERATE_TENSORS):
        path = f"/v2/models/{MODEL}/generate_stream"
        body = {"text_input": [prompt] if api == GENERATE_TENSORS else prompt, "stream": True,
                "parameters": {"max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                               "timeout": int(deadline_ms * 1000)}}
        extra = ""
    else:
        path = "/v1/completions"
        body = {"model": MODEL, "prompt": prompt, "stream": True, "max_tokens": tokens, "temperature": 0,
                "ignore_eos": True}
        extra = f"x-request-timeout-ms: {int(deadline_ms)}\r\n"
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\ncontent-length: {len(data)}"
            f"\r\nconnection: close\r\n{extra}\r\n").encode() + data


def timed_request(host: str, port: int, api: str, prompt: str, tokens: int, deadline_ms: float,
                  mono_less_real: float) -> dict:
    """One request of the observer, on a blocking socket of its own, with ``one_request``'s fields (client times
    on CLOCK_MONOTONIC, read before the send and after the answer's first bytes were read) and the kernel's
    stamps, moved to CLOCK_MONOTONIC: ``kernel_sent`` (the request's last byte to the device) and
    ``kernel_answered`` (the answer's first byte received), which the client's scheduling does not move."""
    result = {"sent": None, "status": None, "first": None, "answered": None, "complete": False, "error": None,
              "written": None, "kernel_sent": None, "kernel_answered": None, "role": "observer"}
    payload = request_bytes(api, host, prompt, tokens, deadline_ms)
    try:
        with socket.create_connection((host, port), timeout=120) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPING, SOF_TIMESTAMPING)
            sock.settimeout(None)  # blocking: a MSG_DONTWAIT read returns at once (with a timeout Python waits)
            result["sent"] = time.monotonic()
            sock.sendall(payload)
            result["written"] = time.monotonic()
            if (tx := _tx_stamp(sock)) is not None:
                result["kernel_sent"] = tx + mono_less_real
            sock.settimeout(120)
            # the first byte alone: TCP gives the stamp of the last segment a read took from, so a read of one byte
            # has the stamp of the answer's first segment, however late this thread reads it
            first, ancdata, _, _ = sock.recvmsg(1, 512)
            result["answered"] = time.monotonic()
            if (rx := _stamp(ancdata)) is not None:
                result["kernel_answered"] = rx + mono_less_real
            raw = bytearray(first)
            while b"\r\n\r\n" not in raw and (chunk := sock.recv(65536)):
                raw += chunk
            head, _, body = bytes(raw).partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            result["status"] = int(lines[0].split()[1])
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
            rest = bytearray(body)
            while b"data:" not in rest and (chunk := sock.recv(65536)):
                rest += chunk
            if b"data:" in rest:
                result["first"] = time.monotonic()
            while chunk := sock.recv(65536):
                rest += chunk
            text = bytes(rest)
            if result["status"] != 200:
                result["error"] = text.decode(errors="replace")[:300]
                result["retry_after"] = headers.get("retry-after")
                result["server_late"] = server_lateness(headers.get(LATE_HEADER))
            elif b'{"error"' in text:
                result["error"] = text[text.index(b'{"error"'):].decode(errors="replace")[:300]
            elif result["first"] is not None:
                result["complete"] = api != "openai" or b"data: [DONE]" in text
    except (OSError, ValueError, IndexError) as exc:
        result["status"] = f"client error: {type(exc).__name__}"
    return result


def _observer_process(args: tuple) -> list[dict]:
    """``count`` closed-loop clients of the flood (a thread each, blocking sockets: no event loop to fall behind),
    their requests timed by the kernel (``timed_request``)."""
    base, api, count, first_index, tokens, deadline_ms, until, retry_s = args
    host, port = base.removeprefix("http://").rsplit(":", 1)
    mono_less_real = time.monotonic() - time.clock_gettime(time.CLOCK_REALTIME)
    prompts = story_prompts(PROMPTS)
    out: list[dict] = []

    def client(index: int) -> None:
        sent = 0
        while time.monotonic() < until:
            result = timed_request(host, int(port), api, prompts[(index + sent) % len(prompts)], tokens, deadline_ms,
                                   mono_less_real)
            out.append(result)
            sent += 1
            if result["status"] != 200 and retry_s:
                time.sleep(retry_s)

    threads = [threading.Thread(target=client, args=(first_index + i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return out


def _client_process(args: tuple) -> tuple[list[dict], list[float]]:
    return uvloop.run(run_clients(*args))


async def prime(base: str, api: str, count: int, concurrency: int) -> int:
    """Every one of the ``count`` prompts once, one token each, ``concurrency`` at a time, no deadline: the
    engine's prefix cache holds the same prompts before every side. The number served."""
    prompts = story_prompts(count)
    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async def one(prompt: str) -> bool:
            async with gate:
                result = await one_request(session, base, api, prompt, 1, 600_000)
                return result["status"] == 200 and result["complete"]
        return sum(await asyncio.gather(*(one(p) for p in prompts)))


def _prime_process(args: tuple) -> int:
    return uvloop.run(prime(*args))


def reset_prefix_cache(base: str) -> bool:
    """``POST /reset_prefix_cache`` of the model (True when the engine dropped its cache)."""
    request = urllib.request.Request(f"{base}/reset_prefix_cache?model={MODEL}", data=b"", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status == 200
    except OSError:
        return False


def schedstat(pid: int) -> tuple[int, int] | None:
    """The server's event-loop thread (its main thread) as the kernel's scheduler counts it: ns on a CPU and ns
    runnable but waiting for one (Linux ``/proc/<pid>/task/<pid>/schedstat``); None where not readable."""
    try:
        cpu, wait, _ = Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()
        return int(cpu), int(wait)
    except (OSError, ValueError):
        return None


def descendants(pid: int) -> list[int]:
    """The processes under ``pid`` (the engine's), from ``/proc/*/stat``."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        children = [child for child, of in parents.items() if of == parent]
        found += children
        todo += children
    return found


def processes_schedstat(pids: list[int]) -> tuple[int, int]:
    """CPU ns and run-queue wait ns of every thread of ``pids``, summed."""
    cpu = wait = 0
    for pid in pids:
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                fields = (task / "schedstat").read_text().split()
                cpu, wait = cpu + int(fields[0]), wait + int(fields[1])
            except (OSError, ValueError, IndexError):
                pass
    return cpu, wait


def sample_load(base: str, until: float, samples: list[tuple[int, int]], sched: list, pid: int | None = None,
                every_s: float = 0.25) -> None:
    """What the server holds while a side runs (``GET /load``): requests in flight, and those the engine has
    waiting, every ``every_s``; and, of the server's loop thread, (time, CPU ns, run-queue wait ns) each time."""
    while time.monotonic() < until:
        if pid is not None and (stat := schedstat(pid)) is not None:
            sched.append((time.monotonic(), *stat))
        try:
            with urllib.request.urlopen(f"{base}/load?model={MODEL}", timeout=5) as answer:
                load = json.loads(answer.read())
            samples.append((load["server_load"], load["num_requests_waiting"]))
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(every_s)
    if pid is not None and (stat := schedstat(pid)) is not None:
        sched.append((time.monotonic(), *stat))


def loop_thread_use(sched: list) -> dict:
    """The server loop thread's share of the side's wall time on a CPU and waiting for one, and its most
    wait for a CPU within one sampling interval (ms): a loop that waits for a CPU fires its timers late however
    little work it has."""
    engine = [x for x in sched if x[0] == "engine"]
    server = [x for x in sched if x[0] == "server"]
    probe = [x for x in sched if x[0] == "probe"]
    sched = [x for x in sched if x[0] not in ("engine", "server", "probe")]
    out = {"engine_cpu_cores": engine[0][1] if engine else float("nan"),
           "engine_wait_cores": engine[0][2] if engine else float("nan"),
           # the server's own process, every thread (loop, tokenizer threads, vLLM's output handling)
           "server_cpu_cores": server[0][1] if server else float("nan"),
           "server_wait_cores": server[0][2] if server else float("nan"),
           **{f"probe_{k}": v for k, v in (probe[0][1] if probe else {}).items()}}
    if len(sched) < 2:
        return {**out, "loop_cpu_share": float("nan"), "loop_wait_share": float("nan"),
                "loop_wait_max_ms": float("nan")}
    wall = (sched[-1][0] - sched[0][0]) * 1e9
    waits = [b[2] - a[2] for a, b in itertools.pairwise(sched)]
    return {**out, "loop_cpu_share": (sched[-1][1] - sched[0][1]) / wall,
            "loop_wait_share": (sched[-1][2] - sched[0][2]) / wall, "loop_wait_max_ms": max(waits) / 1e6}


def probe_counts(path: Path | None) -> dict[str, int]:
    """The server's deadline probe counts (``TIDESERVE_DEADLINE_PROBE_FILE``; {} where unreadable)."""
    try:
        return json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):
        return {}


def run_side(pool: ProcessPoolExecutor, processes: int, base: str, api: str, steady: int, flood: int, tokens: int,
             deadline_ms: float, duration: float, retry_s: float, pid: int | None = None,
             sched: list | None = None, probe: Path | None = None, observers: int = 0,
             observer_pool: ProcessPoolExecutor | None = None) -> tuple[list[dict], list[float], list]:
    """The side's clients, spread over ``processes`` client processes (each its own event loop), for ``duration``
    seconds from now (CLOCK_MONOTONIC: one clock for all of them), and the server's load sampled meanwhile. With a
    flood, ``observers`` of its clients run in ``observer_pool``'s process instead (``_observer_process``: the
    kernel times their requests)."""
    observers = min(observers, flood) if observer_pool is not None else 0
    flood -= observers
    roles = [("steady", i) for i in range(steady)] + [("flood", steady + i) for i in range(flood)]
    until = time.monotonic() + duration
    shares = [roles[k::processes] for k in range(processes) if roles[k::processes]]
    samples: list[tuple[int, int]] = []
    sampler = threading.Thread(target=sample_load, args=(base, until, samples, sched if sched is not None else [],
                                                         pid), daemon=True)
    engine = descendants(pid) if pid is not None else []
    engine_before, started = processes_schedstat(engine), time.monotonic()
    server_before, counts_before = processes_schedstat([pid] if pid is not None else []), probe_counts(probe)
    sampler.start()
    observed = observer_pool.submit(_observer_process, (base, api, observers, steady + flood, tokens, deadline_ms,
                                                        until, retry_s)) if observers else None
    results = list(pool.map(_client_process, [(base, api, share, tokens, deadline_ms, until, retry_s)
                                              for share in shares]))
    if observed is not None:
        results.append((observed.result(), []))
    sampler.join()
    if sched is not None and engine:  # the engine's processes (all their threads): CPU and run-queue wait, in cores
        engine_after, wall = processes_schedstat(engine), (time.monotonic() - started) * 1e9
        sched.append(("engine", (engine_after[0] - engine_before[0]) / wall, (engine_after[1] - engine_before[1]) / wall))
        server_after, counts_after = processes_schedstat([pid]), probe_counts(probe)
        sched.append(("server", (server_after[0] - server_before[0]) / wall, (server_after[1] - server_before[1]) / wall))
        sched.append(("probe", {k: v - counts_before.get(k, 0) for k, v in counts_after.items()}))
    return [r for out, _ in results for r in out], [x for _, lags in results for x in lags], samples


def spread_ms(name: str, values: list[float]) -> dict[str, float]:
    """``name``'s p50, p99 and max (ms) under the keys the JSON has always used."""
    return {f"{name}_p50_ms": percentile(values, 50), f"{name}_p99_ms": percentile(values, 99),
            f"{name}_max_ms": max(values, default=float("nan"))}


def summarize(requests: list[dict], lags: list[float], load: list[tuple[int, int]], seconds: float,
              deadline_ms: float, slo_s: float) -> dict:
    def good(r: dict) -> bool:
        return r["status"] == 200 and r["complete"] and r["first"] is not None and r["first"] - r["sent"] <= slo_s

    refused = [r for r in requests if r["status"] == 503]
    deadline_refusals = [r for r in refused if "deadline" in (r["error"] or "")]
    # the client processes' refusals, timed by the clients as before; the observer's (``_observer_process``) apart
    at_deadline = [r for r in deadline_refusals if r.get("role") != "observer"]
    observed = [r for r in deadline_refusals if r.get("role") == "observer"]
    # the observer's refusals as the kernel timed them: the request's last byte sent (TX stamp) to the answer's first
    # byte received (RX stamp), less the deadline: no client scheduling in it; the same from the observer's clock
    # read just before its send; and as the observer's thread read them (its clock after the read, like the
    # client processes' measure); and split where the server told its times: the way in (TX stamp to the server's
    # counted start), the server's own (its header) and the way back (its answer written to the RX stamp)
    stamped = [r for r in observed if r.get("kernel_sent") is not None and r.get("kernel_answered") is not None]
    kernel_ms = [(r["kernel_answered"] - r["kernel_sent"]) * 1000 - deadline_ms for r in stamped]
    kernel_from_send_ms = [(r["kernel_answered"] - r["sent"]) * 1000 - deadline_ms for r in stamped]
    observer_read_ms = [(r["answered"] - r["sent"]) * 1000 - deadline_ms for r in observed]
    kernel_in_ms: list[float] = []
    kernel_server_ms: list[float] = []
    kernel_back_ms: list[float] = []
    for r in stamped:
        late = r.get("server_late")
        if late and late[3] is not None:
            kernel_in_ms.append((late[3] - late[1] / 1000 - deadline_ms / 1000 - r["kernel_sent"]) * 1000)
            kernel_server_ms.append(late[1])
            kernel_back_ms.append((r["kernel_answered"] - late[3]) * 1000)
    late_ms = [(r["answered"] - r["sent"]) * 1000 - deadline_ms for r in at_deadline]
    # the same from the moment the request's bytes left the client (aiohttp's trace): the client's own time before
    # that (building the request, its loop busy with the flood's other clients) is not on the server's clock at all
    late_written_ms = [(r["answered"] - r["written"]) * 1000 - deadline_ms for r in at_deadline
                       if r.get("written") is not None]
    # the server's account (its header): (a) its timer after the deadline, (b) the timer to the answer's bytes;
    # (c) the rest of what the client saw: the request's way in (the client counts from its send, the server from
    # the first byte it parsed), the answer's way back and the client's own loop
    told = [(r["server_late"], (r["answered"] - r["sent"]) * 1000 - deadline_ms) for r in at_deadline
            if r.get("server_late")]
    timer_ms = [t for (t, _, _, _), _ in told]
    to_answer_ms = [a - t for (t, a, _, _), _ in told]
    answer_ms = [a for (_, a, _, _), _ in told]
    client_rest_ms = [c - a for (_, a, _, _), c in told]
    # (c) split where the server gave its clock (the same host's CLOCK_MONOTONIC): the answer's way back (written
    # to read by the client, its loop included), and the way in (the client's send to the server's first parsed
    # byte: a server loop that reads the request late starts its deadline late)
    in_ms: list[float] = []
    back_ms: list[float] = []
    # the way in split where aiohttp said when the request's bytes left (its trace): the client's own part (send
    # to bytes written: building the request, its loop) and the rest (bytes written to the server's first parsed
    # byte: the server's loop getting to the connection); and the client's loop stalls within each way
    prep_ms: list[float] = []
    in_server_ms: list[float] = []
    stall_in_ms: list[float] = []
    stall_back_ms: list[float] = []
    for r in at_deadline:
        late = r.get("server_late")
        if late and late[3] is not None:
            back_ms.append((r["answered"] - late[3]) * 1000)
            in_ms.append((r["answered"] - r["sent"]) * 1000 - deadline_ms - late[1] - back_ms[-1])
            if r.get("written") is not None:
                prep_ms.append((r["written"] - r["sent"]) * 1000)
                in_server_ms.append(in_ms[-1] - prep_ms[-1])
            if "stall_in_ms" in r:
                stall_in_ms.append(r["stall_in_ms"])
                stall_back_ms.append(r["stall_back_ms"])
    # (a) split where the server measured it: its loop waiting for a CPU (up to 2 ms before the deadline counted
    # in), and what is left: the loop's own work ahead of the timer, or the loop thread blocked (on the GIL while
    # another of the server's threads runs, or a virtual CPU the host did not run: neither is a run-queue wait)
    cpu_wait_ms = [w for (_, _, w, _), _ in told if w is not None]
    # the way in to the server by what came with it: the requests (of every client) whose bytes were written in the
    # BURST_MS before this one's: alone (at most 2 others) or in a retry burst (8 or more) queue differently in the
    # server's one loop; and the client's own share of each refusal's lateness (its send: send to bytes written;
    # its read: the way back), and what is left without it (the server's side and the way between)
    written_at = sorted(r["written"] for r in requests if r.get("written") is not None)
    alone_ms: list[float] = []
    burst_ms: list[float] = []
    client_own_ms: list[float] = []
    without_client_ms: list[float] = []
    for r in at_deadline:
        late = r.get("server_late")
        if not (late and late[3] is not None and r.get("written") is not None):
            continue
        before = bisect.bisect_left(written_at, r["written"]) - bisect.bisect_left(written_at,
                                                                                   r["written"] - BURST_MS / 1000)
        to_server = (late[3] - late[1] / 1000 - deadline_ms / 1000 - r["written"]) * 1000
        if before <= 2:
            alone_ms.append(to_server)
        elif before >= 8:
            burst_ms.append(to_server)
        own = (r["written"] - r["sent"] + r["answered"] - late[3]) * 1000
        client_own_ms.append(own)
        without_client_ms.append((r["answered"] - r["sent"]) * 1000 - deadline_ms - own)
    own_work_ms = [max(0.0, t - w) for (t, _, w, _), _ in told if w is not None]
    ttfts = [r["first"] - r["sent"] for r in requests if r["status"] == 200 and r["first"] is not None]
    return {
        "sent": len(requests), "seconds": seconds,
        "served": sum(1 for r in requests if r["status"] == 200 and r["complete"]),
        "good": sum(1 for r in requests if good(r)),
        "good_steady": sum(1 for r in requests if r["role"] == "steady" and good(r)),
        "goodput_rps": sum(1 for r in requests if good(r)) / seconds,
        "goodput_steady_rps": sum(1 for r in requests if r["role"] == "steady" and good(r)) / seconds,
        "refused_deadline": len(deadline_refusals), "refused_busy": len(refused) - len(deadline_refusals),
        "refused_deadline_clients": len(at_deadline), "refused_deadline_observer": len(observed),
        "observer_stamped": len(stamped), "observer_server_reported": len(kernel_server_ms),
        **spread_ms("kernel_lateness", kernel_ms),
        **spread_ms("kernel_lateness_from_send", kernel_from_send_ms),
        **spread_ms("observer_read_lateness", observer_read_ms),
        "kernel_early_refusals": sum(1 for ms in kernel_ms if ms < 0),
        **spread_ms("kernel_way_in", kernel_in_ms),
        # a counted start before the request's bytes were sent would refuse early: the least of the way in
        "kernel_way_in_min_ms": min(kernel_in_ms, default=float("nan")),
        **spread_ms("kernel_server", kernel_server_ms),
        **spread_ms("kernel_way_back", kernel_back_ms),
        "refused_with_retry_after": sum(1 for r in refused if r.get("retry_after")),
        "errors": sum(1 for r in requests if r["status"] not in (200, 503)
                      or (r["status"] == 200 and not r["complete"])),
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
        **spread_ms("lateness", late_ms),
        **spread_ms("lateness_from_written", late_written_ms),
        "early_refusals": sum(1 for ms in late_ms if ms < 0),
        "server_reported": len(told),
        **spread_ms("server_timer_late", timer_ms),
        **spread_ms("server_timer_to_answer", to_answer_ms),
        **spread_ms("server_answer_late", answer_ms),
        "server_early_refusals": sum(1 for ms in timer_ms if ms < 0),
        **spread_ms("server_cpu_wait", cpu_wait_ms),
        **spread_ms("server_timer_own_work", own_work_ms),
        **spread_ms("client_rest", client_rest_ms),
        **spread_ms("way_in", in_ms),
        **spread_ms("way_in_client", prep_ms),
        **spread_ms("way_in_to_server", in_server_ms),
        **spread_ms("way_in_client_stall", stall_in_ms),
        **spread_ms("way_back", back_ms),
        **spread_ms("way_back_client_stall", stall_back_ms),
        "way_in_to_server_alone": len(alone_ms), **spread_ms("way_in_to_server_alone", alone_ms),
        "way_in_to_server_burst": len(burst_ms), **spread_ms("way_in_to_server_burst", burst_ms),
        **spread_ms("client_own", client_own_ms),
        **spread_ms("lateness_without_client", without_client_ms),
        "in_flight_mean": sum(x for x, _ in load) / len(load) if load else float("nan"),
        "waiting_mean": sum(w for _, w in load) / len(load) if load else float("nan"),
        **spread_ms("client_lag", lags),
        "error_samples": sorted({str(r["status"]) + " " + (r["error"] or "")[:160] for r in requests
                                 if r["status"] not in (200, 503) or (r["status"] == 200 and not r["complete"])})[:5],
    }


def _trio(r: dict, key: str) -> str:
    """``key``'s p50 / p99 / max (ms) of one side's pooled summary, as the tables print them."""
    return f"{r[key + '_p50_ms']:.1f} / {r[key + '_p99_ms']:.1f} / {r[key + '_max_ms']:.1f}"


def flooded_table(summary: dict, apis: tuple[str, ...], title: str, columns: list) -> None:
    """One report table of the flooded sides (pooled), a row per mode: ``columns`` are (header, key), the key's
    p50 / p99 / max (``_trio``), or (header, function of the side's summary giving the cell)."""
    print(f"\n{title}")
    print("| mode | " + " | ".join(header for header, _ in columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for api in apis:
        r = summary[api]["flooded"]
        cells = [cell(r) if callable(cell) else _trio(r, cell) for _, cell in columns]
        print(f"| {api} | " + " | ".join(cells) + " |")


def start_py_spy(directory: Path | None, pid: int, name: str, duration: float, native: bool = False):
    """py-spy recording the server (``pid``) for ``duration`` s into ``directory/name.txt`` (None: not asked);
    ``native``: with the C frames too (uvloop, httptools, pyzmq), which py-spy takes only by pausing the process
    for each sample, so at 100 samples/s instead of 500 without pauses."""
    if directory is None:
        return None
    import subprocess

    directory.mkdir(parents=True, exist_ok=True)
    out = directory / f"{name}.txt"
    mode = ["--rate", "100", "--native"] if native else ["--rate", "500", "--nonblocking"]
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--duration", str(int(duration)), *mode,
                             "--threads", "--format", "raw", "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_py_spy(spy) -> None:
    import subprocess

    try:
        spy.wait(timeout=30)
    except subprocess.TimeoutExpired:
        spy.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--api", default="both",
                        help=f"the modes, comma-separated, of {', '.join((*APIS, GENERATE_TENSORS))}; 'both': "
                             f"{' and '.join(APIS)}")
    parser.add_argument("--size", default="100m",
                        help="tiny_llama size (default 100m: 'tiny' steps faster than HTTP streams its tokens, so "
                             "its engine never has requests waiting)")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-queue-size", type=int, default=0, help="config parameter max_queue_size (0: none)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per request")
    parser.add_argument("--deadline-ms", type=float, default=1000)
    parser.add_argument("--ttft-slo", type=float, default=2.0, help="goodput counts TTFT <= this (seconds)")
    parser.add_argument("--duration", type=float, default=15, help="seconds per side and round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per mode, sides alternating (pooled)")
    parser.add_argument("--flood-factor", type=int, default=3, help="flood clients = factor x (S + Q)")
    parser.add_argument("--retry-ms", type=float, default=50, help="a refused client's pause before it resends")
    parser.add_argument("--client-processes", type=int, default=2,
                        help="processes the clients are spread over (one event loop cannot keep up with the flood)")
    parser.add_argument("--observers", type=int, default=8,
                        help="of the flood's clients, this many run in a process of their own on blocking sockets, "
                             "their refusals timed by the kernel (the request's TX and the answer's RX software "
                             "timestamps, SO_TIMESTAMPING): the lateness without the client's scheduling (0: none)")
    parser.add_argument("--pause", type=float, default=2.0, help="seconds of rest before each side")
    parser.add_argument("--loop-nice", type=int, default=0,
                        help="a nice value for the server's event-loop thread alone (e.g. -10; needs the right to "
                             "raise priority): what the refusals' lateness is when the loop gets a CPU as soon as it "
                             "wants one, on a machine whose cores are shared (0: leave it)")
    parser.add_argument("--engine-nice", type=int, default=0,
                        help="the model's engine_nice config parameter (e.g. 10): the engine's processes at that nice "
                             "value, below the server's loop, with no privilege needed (0: the server's own)")
    parser.add_argument("--client-nice", type=int, default=0,
                        help="a nice value for the client processes (e.g. 5): the clients behind the server's loop "
                             "for a CPU, as if they ran on another machine; their own share of the lateness then "
                             "grows, which the last table takes out (with --same-session)")
    parser.add_argument("--same-session", action="store_true",
                        help="run the server in this process's session (one autogroup with the clients) instead of a "
                             "session of its own: with Linux's autogroup scheduling each session gets an equal share "
                             "of a busy machine, so nice values (--engine-nice) order the clients, the server's loop "
                             "and the engine on one scale only then (as if the clients ran on another machine, "
                             "not starved by the engine)")
    parser.add_argument("--loop-slice-us", type=int, default=None,
                        help="the server loop thread's time slice in us (TIDESERVE_LOOP_SLICE_US, e.g. 100; default: "
                             "the server's, the kernel's default slice), to see what it does to the lateness")
    parser.add_argument("--no-probe", dest="probe", action="store_false",
                        help="run the server without TIDESERVE_DEADLINE_PROBE=1 (its loop notes its CPU wait every "
                             "2 ms, so a refusal's header can tell the machine's share of a late timer from the "
                             "loop's own)")
    parser.add_argument("--no-kernel-arrival", dest="kernel_arrival", action="store_false",
                        help="run the server with TIDESERVE_KERNEL_ARRIVAL=0: a deadline counts from the parser's "
                             "first byte, not from when the kernel says the request's bytes arrived (TCP_INFO)")
    parser.add_argument("--no-tick-phase", dest="tick_phase", action="store_false",
                        help="run the server with TIDESERVE_TICK_PHASE=0: the kernel's arrival time without the time "
                             "since its current tick (a tick off the count)")
    parser.add_argument("--no-prime", dest="prime", action="store_false",
                        help="before each side, do not reset the engine's prefix cache and send every prompt once")
    parser.add_argument("--generate-tensors", action="store_true",
                        help="the server's generate extension sends every request as tensors "
                             "(TIDESERVE_GENERATE_TENSORS=1), not as a typed LLM request: the path before session 7")
    parser.add_argument("--py-spy", type=Path, default=None, metavar="DIR",
                        help="record the server process with py-spy during each flooded side (per thread, idle "
                             "samples left out), a collapsed-stack file per side in DIR (py-spy on the PATH)")
    parser.add_argument("--py-spy-native", action="store_true",
                        help="with --py-spy: record the native frames too (py-spy pauses the server for each "
                             "sample then: 100 samples/s, and the server runs slower while recorded)")
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "tideserve-bench-llm")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from tideserve.bench.examples.tiny_llama import make_model

    work = Path(tempfile.mkdtemp(prefix="tideserve-bench-deadlines-"))
    env = engine_env(work)
    if args.probe:
        env["TIDESERVE_DEADLINE_PROBE"] = "1"  # refusals say how long the loop waited for a CPU (see loop_thread_use)
        # and the server counts what the engine scheduled for requests then refused (engine.DeadlineProbe)
        env["TIDESERVE_DEADLINE_PROBE_FILE"] = str(work / "deadline-probe.json")
    if args.loop_slice_us is not None:
        env["TIDESERVE_LOOP_SLICE_US"] = str(args.loop_slice_us)
    if args.generate_tensors:
        env["TIDESERVE_GENERATE_TENSORS"] = "1"
    if not args.kernel_arrival:
        env["TIDESERVE_KERNEL_ARRIVAL"] = "0"
    if not args.tick_phase:
        env["TIDESERVE_TICK_PHASE"] = "0"
    probe_file = work / "deadline-probe.json" if args.probe else None
    model = make_model(args.model_dir / args.size, args.size)
    repo = write_vllm_repository(work, model, args.max_num_seqs, args.max_queue_size,
                                 engine_nice=args.engine_nice)
    holds = args.max_num_seqs + args.max_queue_size
    flood = args.flood_factor * holds
    apis = APIS if args.api == "both" else tuple(args.api.split(","))
    if unknown := [api for api in apis if api not in (*APIS, GENERATE_TENSORS)]:
        parser.error(f"unknown mode(s) {', '.join(unknown)}")
    print(f"engine holds {holds} (max_num_seqs {args.max_num_seqs} + max_queue_size {args.max_queue_size}); "
          f"steady: {args.max_num_seqs} closed-loop clients; flood: {flood} more; {args.tokens} tokens per request, "
          f"deadline {args.deadline_ms:g} ms, TTFT SLO {args.ttft_slo:g} s, {args.duration:g} s per side; "
          f"modes {', '.join(apis)}", flush=True)
    proc, http, _ = start_tideserve(repo, work / "tideserve.log", env, MODEL, weights=model,
                                   new_session=not args.same_session)
    base = f"http://127.0.0.1:{http}"
    if args.loop_nice:  # the loop thread only (Linux: a thread's own nice value), not the engine's process
        os.setpriority(os.PRIO_PROCESS, proc.pid, args.loop_nice)
        print(f"server loop thread {proc.pid}: nice {os.getpriority(os.PRIO_PROCESS, proc.pid)}", flush=True)
    sides = {api: {"unflooded": [], "flooded": []} for api in apis}
    rounds_out: list[dict] = []
    pool = ProcessPoolExecutor(args.client_processes, initializer=os.nice if args.client_nice else None,
                               initargs=(args.client_nice,) if args.client_nice else ())
    observer_pool = ProcessPoolExecutor(1, initializer=os.nice if args.client_nice else None,
                                        initargs=(args.client_nice,) if args.client_nice else ())
    try:
        for api in apis:  # warm-up: each path with the engine full (its first batches are slow), no deadline
            run_side(pool, args.client_processes, base, api, args.max_num_seqs, 0, args.tokens, 60_000, 3.0, 0)
        for round_index in range(args.rounds):
            order = ("unflooded", "flooded") if round_index % 2 == 0 else ("flooded", "unflooded")
            for api in apis:
                for side in order:
                    primed = ""
                    if args.prime:  # the same start for every side: the cache emptied, then every prompt once
                        reset = reset_prefix_cache(base)
                        served = pool.submit(_prime_process, (base, api, PROMPTS, args.max_num_seqs)).result()
                        primed = f" (cache reset {'ok' if reset else 'FAILED'}, primed {served}/{PROMPTS})"
                    time.sleep(args.pause)
                    loadavg = os.getloadavg()[0]
                    sched: list = []
                    spy = start_py_spy(args.py_spy, proc.pid, f"{api}-{side}-r{round_index + 1}", args.duration,
                                       args.py_spy_native) \
                        if side == "flooded" else None
                    requests, lags, load = run_side(pool, args.client_processes, base, api, args.max_num_seqs,
                                              flood if side == "flooded" else 0, args.tokens, args.deadline_ms,
                                              args.duration, args.retry_ms / 1000, proc.pid, sched, probe_file,
                                              args.observers, observer_pool)
                    sides[api][side].append((requests, lags, load))
                    if spy is not None:
                        stop_py_spy(spy)
                    row = summarize(requests, lags, load, args.duration, args.deadline_ms, args.ttft_slo)
                    row.update(loop_thread_use(sched))
                    rounds_out.append({"round": round_index + 1, "api": api, "side": side, "load_average": loadavg,
                                       **{k: v for k, v in row.items() if k != "error_samples"}})
                    print(f"round {round_index + 1} {api} {side}{primed}: load {loadavg:.2f}; sent {row['sent']}, "
                          f"good {row['good']} ({row['goodput_rps']:.2f}/s), TTFT p50 {row['ttft_p50_s']:.2f} s, "
                          f"refused at deadline {row['refused_deadline']} (lateness p99 {row['lateness_p99_ms']:.1f} "
                          f"ms; kernel-stamped p99 {row['kernel_lateness_p99_ms']:.1f} ms of "
                          f"{row['observer_stamped']}; server: timer p99 {row['server_timer_late_p99_ms']:.1f} (CPU wait p99 "
                          f"{row['server_cpu_wait_p99_ms']:.1f}, own work p99 {row['server_timer_own_work_p99_ms']:.1f}), "
                          f"answer p99 "
                          f"{row['server_answer_late_p99_ms']:.1f} ms; way in p99 {row['way_in_p99_ms']:.1f} (client "
                          f"{row['way_in_client_p99_ms']:.1f}, to the server {row['way_in_to_server_p99_ms']:.1f}), way "
                          f"back p99 {row['way_back_p99_ms']:.1f} ms), busy {row['refused_busy']}, "
                          f"errors {row['errors']}; in flight mean {row['in_flight_mean']:.1f}, engine waiting mean "
                          f"{row['waiting_mean']:.1f}; client loop lag p99 {row['client_lag_p99_ms']:.1f} ms (max {row['client_lag_max_ms']:.0f}); server "
                          f"loop thread on a CPU {row['loop_cpu_share']:.0%}, waiting for one {row['loop_wait_share']:.0%} "
                          f"(most in one sampling interval: {row['loop_wait_max_ms']:.0f} ms); engine processes on a CPU "
                          f"{row['engine_cpu_cores']:.2f} cores, waiting for one {row['engine_wait_cores']:.2f}; server "
                          f"process {row['server_cpu_cores']:.2f} cores (waiting {row['server_wait_cores']:.2f}); engine "
                          f"scheduled {row.get('probe_scheduled', '?')} in {row.get('probe_steps', '?')} steps, first "
                          f"tokens before the deadline {row.get('probe_started', '?')}, refused "
                          f"{row.get('probe_expired', '?')} (rendering {row.get('probe_expired_rendering', '?')}, "
                          f"prefill run {row.get('probe_expired_with_tokens', '?')})", flush=True)
    finally:
        pool.shutdown()
        observer_pool.shutdown()
        stop_process(proc)

    summary: dict = {}
    for api in apis:
        summary[api] = {side: summarize([r for rnd, _, _ in rounds for r in rnd],
                                        [x for _, lag, _ in rounds for x in lag],
                                        [x for _, _, load in rounds for x in load],
                                        args.duration * len(rounds), args.deadline_ms, args.ttft_slo)
                        for side, rounds in sides[api].items()}
        un, fl = summary[api]["unflooded"], summary[api]["flooded"]
        summary[api]["goodput_ratio"] = fl["goodput_rps"] / un["goodput_rps"] if un["goodput_rps"] else float("nan")
        summary[api]["goodput_steady_ratio"] = (fl["goodput_steady_rps"] / un["goodput_steady_rps"]
                                                if un["goodput_steady_rps"] else float("nan"))

    print(f"\n| mode | side | sent | served | good (TTFT <= {args.ttft_slo:g} s) | goodput (req/s) | steady goodput "
          "| refused at deadline | refused busy | errors | in flight / engine waiting (mean) | TTFT p50 / p99 (s) "
          "| refusal lateness p50 / p99 / max (ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for api in apis:
        for side in ("unflooded", "flooded"):
            r = summary[api][side]
            lateness = ("-" if not r["refused_deadline"] else
                        f"{r['lateness_p50_ms']:.1f} / {r['lateness_p99_ms']:.1f} / {r['lateness_max_ms']:.1f}")
            print(f"| {api} | {side} | {r['sent']} | {r['served']} | {r['good']} | {r['goodput_rps']:.2f} "
                  f"| {r['goodput_steady_rps']:.2f} | {r['refused_deadline']} | {r['refused_busy']} | {r['errors']} "
                  f"| {r['in_flight_mean']:.1f} / {r['waiting_mean']:.1f} | {r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f} | {lateness} |")
    flooded_table(summary, apis,
                  "Refusal lateness as the client processes read it (their refusals, not the observer's), split (ms "
                  "after the deadline, flooded sides pooled; p50 / p99 / max): (a) the "
                  "server's timer; (b) from the timer to the answer's bytes written; server total (a + b); (c) the "
                  "rest the client saw (way in, way back, client loop); client total",
                  [("refusals (server-reported)",
                    lambda r: f"{r['refused_deadline_clients']} ({r['server_reported']})"),
                   ("(a) timer", "server_timer_late"), ("of which: loop waiting for a CPU", "server_cpu_wait"),
                   ("(a) less that wait: the loop's own work (or blocked)", "server_timer_own_work"),
                   ("(b) timer to answer", "server_timer_to_answer"), ("server total", "server_answer_late"),
                   ("(c) client rest", "client_rest"), ("of which: way in", "way_in"), ("way back", "way_back"),
                   ("client total", "lateness"), ("client loop lag p99", lambda r: f"{r['client_lag_p99_ms']:.1f}")])
    flooded_table(summary, apis,
                  "The way in and the way back, flooded sides pooled (ms; p50 / p99 / max): the way in is the "
                  "client's part (send to the request's bytes written, aiohttp's trace) and the rest (bytes written to "
                  "the server's first parsed byte); the client's loop stalls (late wake-ups of its lag probe) within "
                  "each way",
                  [("way in", "way_in"), ("client's part", "way_in_client"), ("to the server", "way_in_to_server"),
                   ("client stalled, way in", "way_in_client_stall"), ("way back", "way_back"),
                   ("client stalled, way back", "way_back_client_stall")])
    flooded_table(summary, apis,
                  f"The way in to the server by what came with it (requests whose bytes were written in the {BURST_MS} "
                  "ms before: at most 2 = alone, 8 or more = a retry burst), and the client's own share of the "
                  "lateness (its send: send to bytes written; its read: the way back) and the lateness without it; "
                  "flooded sides pooled, ms, p50 / p99 / max",
                  [("to the server, alone (n)",
                    lambda r: f"{_trio(r, 'way_in_to_server_alone')} ({r['way_in_to_server_alone']})"),
                   ("to the server, in a burst (n)",
                    lambda r: f"{_trio(r, 'way_in_to_server_burst')} ({r['way_in_to_server_burst']})"),
                   ("client's own share", "client_own"), ("lateness without it", "lateness_without_client"),
                   ("lateness", "lateness")])
    flooded_table(summary, apis,
                  f"Refusal lateness as the kernel timed it ({args.observers} of the flood's clients in a process of "
                  "their own, blocking sockets; flooded sides pooled; ms after the deadline, p50 / p99 / max): the "
                  "request's last byte sent (TX software timestamp) to the answer's first byte received (RX software "
                  "timestamp); the same from the observer's clock just before its send; the same refusals as its "
                  "thread read them (its clock after the read: the client processes' measure); and split by the "
                  "server's account: the way in (TX stamp to the server's counted start), the server's own, the way "
                  "back (the answer written to the RX stamp)",
                  [("refusals (stamped, server-reported)",
                    lambda r: f"{r['refused_deadline_observer']} ({r['observer_stamped']}, "
                              f"{r['observer_server_reported']})"),
                   ("kernel: TX to RX", "kernel_lateness"), ("kernel: send to RX", "kernel_lateness_from_send"),
                   ("as the thread read them", "observer_read_lateness"), ("way in", "kernel_way_in"),
                   ("server", "kernel_server"), ("way back", "kernel_way_back"),
                   ("before the deadline", lambda r: str(r["kernel_early_refusals"])),
                   ("way in, least", lambda r: f"{r['kernel_way_in_min_ms']:.2f}"),
                   ("client processes' measure (for comparison)", "lateness")])
    for api in apis:
        for side in ("unflooded", "flooded"):
            rows = [r for r in rounds_out if r["api"] == api and r["side"] == side]
            summary[api][side]["loop_cpu_share"] = sum(r["loop_cpu_share"] for r in rows) / len(rows)
            summary[api][side]["loop_wait_share"] = sum(r["loop_wait_share"] for r in rows) / len(rows)
            summary[api][side]["engine_cpu_cores"] = sum(r["engine_cpu_cores"] for r in rows) / len(rows)
            summary[api][side]["server_cpu_cores"] = sum(r["server_cpu_cores"] for r in rows) / len(rows)
            for key in [k for k in rows[0] if k.startswith("probe_")]:
                summary[api][side][key] = sum(r.get(key, 0) for r in rows)
        s = summary[api]
        print(f"{api}: server loop thread on a CPU / waiting for one: unflooded {s['unflooded']['loop_cpu_share']:.0%} / "
              f"{s['unflooded']['loop_wait_share']:.0%}, flooded {s['flooded']['loop_cpu_share']:.0%} / "
              f"{s['flooded']['loop_wait_share']:.0%}; engine processes on a CPU unflooded "
              f"{s['unflooded']['engine_cpu_cores']:.2f} / flooded {s['flooded']['engine_cpu_cores']:.2f} cores; "
              "goodput per round (flooded / unflooded): " + ", ".join(
                  f"{f['goodput_rps']:.2f} / {u['goodput_rps']:.2f}" for f, u in zip(
                      [r for r in rounds_out if r["api"] == api and r["side"] == "flooded"],
                      [r for r in rounds_out if r["api"] == api and r["side"] == "unflooded"], strict=False)))
    for api in apis:
        s = summary[api]
        print(f"{api}: goodput flooded / unflooded {s['goodput_ratio']:.2f}x (steady clients alone "
              f"{s['goodput_steady_ratio']:.2f}x); refusal lateness p99 {s['flooded']['lateness_p99_ms']:.1f} ms "
              f"(from the request's bytes written {s['flooded']['lateness_from_written_p99_ms']:.1f} ms; the server's "
              f"own {s['flooded']['server_answer_late_p99_ms']:.1f} ms); "
              f"503s with Retry-After {s['flooded']['refused_with_retry_after']} of "
              f"{s['flooded']['refused_deadline'] + s['flooded']['refused_busy']}; as the kernel timed the observer's "
              f"refusals (TX to RX stamp) p99 {s['flooded']['kernel_lateness_p99_ms']:.1f} ms of "
              f"{s['flooded']['observer_stamped']}; the client's own loop lag "
              f"p50 / p99 {s['flooded']['client_lag_p50_ms']:.1f} / {s['flooded']['client_lag_p99_ms']:.1f} ms flooded, "
              f"{s['unflooded']['client_lag_p50_ms']:.1f} / {s['unflooded']['client_lag_p99_ms']:.1f} ms unflooded")
        for sample in s["flooded"]["error_samples"] + s["unflooded"]["error_samples"]:
            print(f"  error: {sample}")
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"deadlines-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary,
                               "rounds": rounds_out}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
