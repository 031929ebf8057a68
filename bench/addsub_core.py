"""The core's own CPU per add_sub HTTP request, without the network or a load generator: an A/B that a busy machine
does not blur as much as a throughput run.

One process runs the server's core as ``tideserve`` does (its repository with Triton's add_sub Python model, two
instance processes, the dynamic batcher; the HTTP app behind the server's own uvicorn protocol with its
connection limits) but its connections are in-memory: ``--concurrency`` clients, each a protocol object whose
transport hands every answer back to the client, which sends its next request on the next turn of the loop (a
closed loop, as perf_analyzer's). The request is perf_analyzer's JSON add_sub request (FP32 [1, 4] inputs, JSON
outputs). Measured: the event-loop thread's CPU time (``time.thread_time``: user and system, the model-process
link's socket calls included, the time the thread waits for a CPU not) per request, and the model processes' CPU
per request, over ``--requests`` requests after a warm-up.

What it leaves out: the kernel's TCP work for the client's connections (a send and a receive per request, the same
for any server) and the load generator. So its numbers are below the core's CPU per request under perf_analyzer
(bench/addsub_profile.py); the difference between two trees is the number to read.

    python bench/addsub_core.py                                    # this checkout, 3 rounds
    python bench/addsub_core.py --trees /tmp/prev . --rounds 5     # A/B: the rounds alternate the trees

(``git worktree add /tmp/prev HEAD~`` or ``git archive HEAD~ | tar -x -C /tmp/prev`` makes the other tree.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import addsub  # noqa: E402  (bench/addsub.py: tree_env, tree_cpu_seconds, the shared repository)

BODY = json.dumps({
    "inputs": [{"name": f"INPUT{i}", "shape": [1, 4], "datatype": "FP32", "data": [1.5, 2.5, 3.5, 4.5]}
               for i in (0, 1)],
    "outputs": [{"name": f"OUTPUT{i}", "parameters": {"binary_data": False}} for i in (0, 1)],
}, separators=(",", ":")).encode()
REQUEST = (b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nAccept: */*\r\n"
           b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(BODY)) + BODY


class Client:
    """One keep-alive connection: the server's protocol object over an in-memory transport."""

    def __init__(self, bench: Bench, index: int) -> None:
        self.bench = bench
        self.port = 40000 + index
        self.closing = False
        self.protocol = None

    # -- the transport the protocol writes to ---------------------------------------------------
    def write(self, data: bytes) -> None:
        if not data.startswith(b"HTTP/1.1 200 "):
            raise RuntimeError(f"unexpected answer: {bytes(data[:300])!r}")
        self.bench.answered(self)

    def writelines(self, chunks) -> None:
        self.write(b"".join(chunks))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", self.port), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        pass

    def send(self) -> None:
        self.protocol.data_received(REQUEST)


class Bench:
    """The clients' closed loop, run in phases of a given number of answers."""

    def __init__(self, concurrency: int) -> None:
        self.concurrency = concurrency
        self.count = 0
        self.limit = 0
        self.loop = asyncio.get_running_loop()
        self.done: asyncio.Future | None = None
        self.parked: list[Client] = []

    def answered(self, client: Client) -> None:
        self.count += 1
        if self.count < self.limit:
            self.loop.call_soon(client.send)
            return
        self.parked.append(client)  # the phase has its answers: this client waits for the next phase
        if len(self.parked) == self.concurrency and not self.done.done():
            self.done.set_result(None)

    async def phase(self, requests: int) -> int:
        """Run until ``requests`` more answers (and the ones in flight then) are in; the answers counted."""
        first = self.count
        self.limit = first + requests
        self.done = self.loop.create_future()
        for client in self.parked:
            self.loop.call_soon(client.send)
        self.parked = []
        await asyncio.wait_for(self.done, 900)
        return self.count - first


def model_cpu() -> float:
    """CPU seconds of this process's descendants: the zygote and the model processes."""
    fields = Path(f"/proc/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return sum(addsub.tree_cpu_seconds(os.getpid()).values()) - own


async def start(repo: Path, concurrency: int):
    import uvicorn
    from tideserve import heap
    from tideserve.app import Server, ServerOptions
    from tideserve.http import create_app
    from tideserve.http.limits import ConnectionLimits
    from uvicorn.server import ServerState

    server = Server(ServerOptions(model_repositories=[repo], allow_grpc=False, allow_metrics=False))
    await server.repository.start()
    heap.freeze()  # as the CLI's server does once its models are loaded
    app = create_app(server.dataplane)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", proxy_headers=False,
                            **ConnectionLimits().uvicorn_settings())
    config.load()
    state = ServerState()
    bench = Bench(concurrency)
    for index in range(concurrency):
        client = Client(bench, index)
        client.protocol = config.http_protocol_class(config=config, server_state=state, app_state={})
        client.protocol.connection_made(client)
        bench.parked.append(client)
    return server, bench


async def stop(server, bench) -> None:
    for client in bench.parked:
        client.protocol.connection_lost(None)
    await server.repository.shutdown(drain_timeout=0)


async def instrument() -> None:
    """Under callgrind (``--instr-atstart=no``): switch its instrumentation on, and wait until it is."""
    proc = subprocess.Popen(["callgrind_control", "-i", "on", str(os.getpid())], stdout=subprocess.DEVNULL)
    while proc.poll() is None:
        await asyncio.sleep(0.05)


def one(args) -> None:
    """Run in a child: one measurement of this interpreter's tree, printed as JSON. With ``--callgrind`` the
    measured phase runs inside ``functools.reduce``, which callgrind's ``--toggle-collect`` counts (the warm-up and
    the start are not counted)."""
    import functools

    import uvloop
    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    server, bench = loop.run_until_complete(start(Path(args.repo), args.concurrency))
    try:
        loop.run_until_complete(bench.phase(args.warmup))
        if args.callgrind:
            loop.run_until_complete(instrument())
            loop.run_until_complete(bench.phase(args.concurrency * 4))  # instrumented, not counted
        cpu0, t0, m0 = time.thread_time(), time.monotonic(), model_cpu()
        if args.callgrind:
            answered = functools.reduce(lambda _a, _b: loop.run_until_complete(bench.phase(args.requests)), [0, 1])
        elif args.profile:
            import cProfile
            profile = cProfile.Profile(time.thread_time)  # CPU time: the waits for a CPU on a busy machine left out
            answered = profile.runcall(loop.run_until_complete, bench.phase(args.requests))
            profile.dump_stats(args.profile)
        else:
            answered = loop.run_until_complete(bench.phase(args.requests))
        cpu1, t1, m1 = time.thread_time(), time.monotonic(), model_cpu()
        result = {"core_us": (cpu1 - cpu0) / answered * 1e6, "models_us": (m1 - m0) / answered * 1e6,
                  "rate": answered / (t1 - t0), "answered": answered}
    finally:
        loop.run_until_complete(stop(server, bench))
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", nargs="+", default=["."], help="checkouts to compare ('.': this one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--warmup", type=int, default=3000)
    parser.add_argument("--callgrind", action="store_true",
                        help="count instructions (valgrind's callgrind) instead of CPU time: the core's event-loop "
                             "thread's instructions per request, the same on a busy machine as on a quiet one "
                             "(slow: use --requests 2000)")
    parser.add_argument("--profile", metavar="FILE", help="with --one: cProfile the measured phase into FILE")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--repo", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one(args)
        return
    work = Path(tempfile.mkdtemp(prefix="bench-addsub-core-"))
    repo = work / "repo"
    shutil.copytree(addsub.SHARED / "peers" / "repos" / "triton", repo)
    print(f"load {open('/proc/loadavg').read().split()[:3]}; c={args.concurrency}, {args.requests} requests "
          f"per round", flush=True)
    found: dict[str, list[dict]] = {tree: [] for tree in args.trees}
    for round_ in range(args.rounds):
        for tree in args.trees:
            own = tree in (".", str(addsub.ROOT))
            env = dict(os.environ, **({} if own else addsub.tree_env(tree)))
            cmd = [sys.executable, str(Path(__file__).resolve()), "--one", "--repo", str(repo),
                   "--concurrency", str(args.concurrency), "--requests", str(args.requests),
                   "--warmup", str(args.warmup)]
            if args.callgrind:
                cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
                       "--toggle-collect=functools_reduce", f"--callgrind-out-file={work}/callgrind.%p", *cmd,
                       "--callgrind"]
            run = subprocess.run(cmd, env=env, cwd=addsub.ROOT if own else tree, capture_output=True, text=True,
                                 check=False, timeout=1800)
            line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise RuntimeError(f"tree {tree}: no result\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}")
            result = json.loads(line[7:])
            if args.callgrind:
                collected = re.search(r"Collected : (\d+)", run.stderr)
                if collected is None:
                    raise RuntimeError(f"tree {tree}: callgrind counted nothing\n{run.stderr[-4000:]}")
                result["instructions"] = int(collected.group(1)) / result["answered"]
            found[tree].append(result)
            print(f"  round {round_ + 1} {tree:24s} core {result['core_us']:6.1f} us/request, model processes "
                  f"{result['models_us']:5.1f}, {result['rate']:6.0f} req/s"
                  + (f", {result['instructions'] / 1000:.1f}k instructions/request" if args.callgrind else ""),
                  flush=True)
    key, unit = ("instructions", "k instructions") if args.callgrind else ("core_us", "CPU us")
    scale = 1000 if args.callgrind else 1
    print(f"\ncore {unit} per request (min / median over rounds):")
    for tree, rows in found.items():
        values = sorted(r[key] / scale for r in rows)
        models = sorted(r["models_us"] for r in rows)
        print(f"  {tree:24s} {values[0]:6.1f} / {statistics.median(values):6.1f}   model processes CPU us "
              f"{models[0]:5.1f} / {statistics.median(models):5.1f}")
    if len(args.trees) == 2:
        a, b = (sorted(r[key] for r in found[t]) for t in args.trees)
        print(f"  {args.trees[1]} / {args.trees[0]}: min {b[0] / a[0]:.3f}x, median "
              f"{statistics.median(b) / statistics.median(a):.3f}x")
    print(f"load {open('/proc/loadavg').read().split()[:3]}")


if __name__ == "__main__":
    main()
