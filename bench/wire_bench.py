"""Tensors across the frontend-worker link: inline in the frames vs in the link's shared-memory arenas.

Two processes joined as a frontend worker and the core are: the worker's real ``CoreLink`` and
``RemoteDataPlane.infer_unary`` on one side, the core's real per-worker link (``workers/pool.py``) on the other,
with both arenas attached. The core answers each request with its input as the output (an identity model, no
model code), so one round trip carries the tensor both ways; the worker reads the output once (as a frontend
writing it to its socket would). For each size the two modes alternate, round by round:

- inline: every tensor in the frame (``min_bytes`` past any size);
- shared memory: every tensor in an arena block (``min_bytes`` 0).

    python -m tideserve.bench.wire_bench [--sizes 64K 256K 1M 4M 16M] [--rounds 5] [--seconds 1]

Prints a markdown table (median µs per round trip of each mode, and their ratio) and writes
bench/results/wire-<time>.json. The threshold ``tideserve.arena.SHARED_MEMORY_MIN_BYTES`` comes from it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tideserve import arena
from tideserve.types import InferenceRequest, Tensor
from tideserve.workers import protocol as p

RESULTS = Path(__file__).resolve().parent / "results"
NEVER = 1 << 62  # min_bytes that no message reaches: always inline
UNITS = {"K": 1 << 10, "M": 1 << 20}


# -- the core's side ------------------------------------------------------------------------------------------
class _EchoStream:
    """One request's responses as the DataPlane would give them: its inputs, as outputs."""

    def __init__(self, request: InferenceRequest) -> None:
        self.request = request
        self.runtime = _Runtime()

    async def aclose(self) -> None:
        pass

    def cancel(self) -> None:
        pass


class _Runtime:
    uid = 1


class _EchoPlane:
    def infer(self, request: InferenceRequest) -> _EchoStream:
        return _EchoStream(request)

    async def collect_unary(self, stream: _EchoStream):
        from tideserve.types import InferenceResponse

        return InferenceResponse(stream.request.model_name, "1", stream.request.id,
                                 [Tensor(t.name, t.datatype, t.shape, t.data) for t in stream.request.inputs.values()])


class _EchoPool:
    """What the core's link asks of its pool, for an identity model."""

    def __init__(self) -> None:
        self.dataplane = _EchoPlane()

    def describe(self, link, runtime) -> int:
        return runtime.uid

    def lost(self, link) -> None:
        self.closed.set()


async def serve_core(sock_fd: int, send_fd: int, receive_fd: int, size: int) -> None:
    from tideserve.workers.pool import _Link

    loop = asyncio.get_running_loop()
    pool = _EchoPool()
    pool.closed = asyncio.Event()
    link: _Link | None = None

    def make() -> _Link:
        nonlocal link
        link = _Link(pool, 0)
        link.attach(send_fd, receive_fd, size)
        return link

    await loop.connect_accepted_socket(make, socket.socket(fileno=sock_fd))
    control = sys.stdin.buffer
    while True:  # the worker's side says which mode comes next (a line: min_bytes), or closes stdin to stop
        line = await loop.run_in_executor(None, control.readline)
        if not line:
            return
        link.outbox.min_bytes = int(line)


# -- the worker's side ----------------------------------------------------------------------------------------
async def measure(sizes: list[int], rounds: int, seconds: float) -> list[dict]:
    from tideserve.workers.remote import CoreLink, RemoteDataPlane

    ours, theirs = socket.socketpair()
    size = p.ARENA_BYTES
    requests = arena.create_file(size, "bench-requests")
    responses = arena.create_file(size, "bench-responses")
    core = subprocess.Popen([sys.executable, "-m", "tideserve.bench.wire_bench", "--core",
                             f"{theirs.fileno()},{responses},{requests},{size}"],
                            pass_fds=[theirs.fileno(), requests, responses], stdin=subprocess.PIPE)
    theirs.close()
    loop = asyncio.get_running_loop()
    _, link = await loop.connect_accepted_socket(CoreLink, ours)
    link.attach(requests, responses, size)
    os.close(requests)
    os.close(responses)
    link.snapshot = p.Snapshot(True, True, True, [], {}, [], [])
    plane = RemoteDataPlane(link)

    def mode(min_bytes: int) -> None:
        link.outbox.min_bytes = min_bytes
        core.stdin.write(f"{min_bytes}\n".encode())
        core.stdin.flush()

    async def round_trip(data: np.ndarray) -> None:
        request = InferenceRequest("echo", {"x": Tensor("x", "FP32", data.shape, data)})
        response = await plane.infer_unary(request)
        out = response.outputs[0].data
        np.bitwise_xor.reduce(out.view(np.uint64))  # read once, as a frontend sending it would

    rows = []
    try:
        for nbytes in sizes:
            data = np.random.default_rng(0).standard_normal(nbytes // 4).astype(np.float32)
            times: dict[str, list[float]] = {"inline": [], "shared memory": []}
            for _ in range(rounds):
                for name, min_bytes in (("inline", NEVER), ("shared memory", 0)):
                    mode(min_bytes)
                    await asyncio.sleep(0.05)  # the core has read the mode
                    for _ in range(3):
                        await round_trip(data)
                    count, started = 0, time.perf_counter()
                    while time.perf_counter() - started < seconds:
                        await round_trip(data)
                        count += 1
                    times[name].append((time.perf_counter() - started) / count * 1e6)
            inline, shared = statistics.median(times["inline"]), statistics.median(times["shared memory"])
            rows.append({"bytes": nbytes, "inline_us": inline, "shared_memory_us": shared,
                         "shared_over_inline": shared / inline, "rounds": times})
            print(f"{_label(nbytes):>6}: inline {inline:9.1f} us, shared memory {shared:9.1f} us, "
                  f"ratio {shared / inline:.2f}", flush=True)
    finally:
        core.stdin.close()
        core.wait(timeout=10)
        link.transport.close()
    return rows


def _label(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _size(text: str) -> int:
    unit = UNITS.get(text[-1].upper(), 1)
    return int(text[:-1] if unit > 1 else text) * unit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tideserve.bench.wire_bench")
    parser.add_argument("--sizes", nargs="+", default=["64K", "256K", "1M", "4M", "16M"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0, help="per mode, size and round")
    parser.add_argument("--core", help=argparse.SUPPRESS)  # SOCK,SEND,RECEIVE,BYTES: run the core's side
    args = parser.parse_args(argv)
    if args.core:
        sock_fd, send_fd, receive_fd, size = (int(x) for x in args.core.split(","))
        asyncio.run(serve_core(sock_fd, send_fd, receive_fd, size))
        return 0
    rows = asyncio.run(measure([_size(s) for s in args.sizes], args.rounds, args.seconds))
    print("\n| size | inline µs | shared memory µs | shared memory / inline |\n|---|---|---|---|")
    for row in rows:
        print(f"| {_label(row['bytes'])} | {row['inline_us']:.0f} | {row['shared_memory_us']:.0f} | "
              f"{row['shared_over_inline']:.2f}x |")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"wire-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"load_average": os.getloadavg(), "rows": rows}, indent=1))
    print(f"\nwritten to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
