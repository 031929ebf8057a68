"""The instance process's side of ``--frontend-direct`` alone: CPU per add_sub request in the process, driven straight
through its direct socket (no HTTP, no frontend worker), so that its own cost shows without the workers' noise.

    python bench/direct_instance.py [--concurrency 1 2 4 8] [--seconds 4] [--rounds 2] [--servers . /tmp/prev]

Each server (a checkout of this repository: ``.`` is this one; another is run as bench/addsub.py's
``tideserve:wN@PATH`` runs it) serves add_sub (Triton's repository, one instance) with ``--frontend-workers 2
--frontend-direct on``; this script links to the instance process's socket as a frontend worker would, keeps C
requests in flight (the replacements of one read leave in one ``DirectSubmit``, as a worker's loop turn sends them),
and reads the process's CPU time (every thread, user + system, /proc) over the run. Rounds alternate the servers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import addsub  # noqa: E402  (the peers' repository, the server's start and stop, another checkout's environment)

from tideserve import wire  # noqa: E402
from tideserve.types import InferenceRequest, Tensor  # noqa: E402
from tideserve.workers.direct import DirectAnswers, DirectSubmit, DirectToWorker  # noqa: E402


def instance_socket(server_pid: int) -> tuple[str, int]:
    """(the direct socket's path, the instance process's pid) of add_sub under ``server_pid``."""
    descendants, todo = set(), [server_pid]
    while todo:
        pid = todo.pop()
        descendants.add(pid)
        for child in Path(f"/proc/{pid}/task").glob("*/children"):
            todo.extend(int(c) for c in child.read_text().split())
    out = subprocess.run(["ss", "-xlpH"], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        m = re.search(r"(\S+\.sock)\s.*pid=(\d+)", line)
        if m and int(m.group(2)) in descendants:
            return m.group(1), int(m.group(2))
    raise RuntimeError("no direct socket (is --frontend-direct on, and a request sent?)")


def cpu_ticks(pid: int) -> int:
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total


class Driver(asyncio.Protocol):
    def __init__(self, concurrency: int) -> None:
        self.reader = wire.FrameReader(DirectToWorker)
        self.concurrency = concurrency
        self.done = self.rid = self.reads = 0
        self.errors: list = []
        self.stopping = False
        a = np.arange(4, dtype=np.float32).reshape(1, 4)
        self.request = InferenceRequest("add_sub", {"INPUT0": Tensor("INPUT0", "FP32", (1, 4), a),
                                                    "INPUT1": Tensor("INPUT1", "FP32", (1, 4), a)})

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.send(self.concurrency)

    def send(self, count: int) -> None:
        messages = []
        for _ in range(count):
            self.rid += 1
            self.request.arrival_ns = time.monotonic_ns()
            messages.append(wire.request_message(self.rid, self.request))
        self.transport.write(wire.frame(DirectSubmit(messages)))

    def data_received(self, data: bytes) -> None:
        finished = 0
        for message in self.reader.feed(data):
            for answer in message.answers if type(message) is DirectAnswers else (message,):
                if answer.response.error is not None:
                    self.errors.append(answer.response.error)
                finished += answer.response.final
        self.done += finished
        self.reads += 1
        if finished and not self.stopping:
            self.send(finished)


async def drive(path: str, pid: int, concurrency: int, seconds: float) -> dict:
    loop = asyncio.get_running_loop()
    transport, driver = await loop.create_unix_connection(lambda: Driver(concurrency), path)
    await asyncio.sleep(0.5)  # warm
    done, ticks, start = driver.done, cpu_ticks(pid), time.monotonic()
    await asyncio.sleep(seconds)
    done, ticks, wall = driver.done - done, cpu_ticks(pid) - ticks, time.monotonic() - start
    driver.stopping = True
    await asyncio.sleep(0.2)
    transport.close()
    if driver.errors:
        raise RuntimeError(f"errors: {driver.errors[:3]}")
    return {"per_s": done / wall, "cpu_us_per_request": ticks / os.sysconf("SC_CLK_TCK") / done * 1e6,
            "requests_per_read": done / max(driver.reads, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--servers", nargs="+", default=["."], help="checkouts to run the server from")
    args = parser.parse_args()
    addsub.ensure_peers(triton=False)
    work = Path(tempfile.mkdtemp(prefix="bench-direct-instance-"))
    rows: dict[tuple[str, int], list[dict]] = {}
    for round_ in range(args.rounds):
        for tree in args.servers:
            resolved = Path(tree).resolve()
            label = "tideserve:w2:direct" + ("" if resolved == addsub.ROOT else f"@{resolved}")
            repo = work / f"repo-{round_}-{len(rows)}"
            shutil.copytree(addsub.SHARED / "peers" / "repos" / "triton", repo)
            addsub.set_instances(repo, 1)
            proc, http, _ = addsub.start_server(label, repo, work / f"server-{round_}-{len(rows)}.log")
            try:
                # a request through each worker, so that the instance process is linked and its socket listed
                subprocess.run([str(addsub.PEERS_HOME / "bin" / "perf_analyzer"), "-m", "add_sub", "-u",
                                f"127.0.0.1:{http}", "--concurrency-range", "2", "-p", "500"],
                               capture_output=True, timeout=120)
                path, pid = instance_socket(proc.pid)
                for c in args.concurrency:
                    r = asyncio.run(drive(path, pid, c, args.seconds))
                    rows.setdefault((tree, c), []).append(r)
                    print(f"round {round_ + 1} {tree} c={c}: {r['per_s']:.0f} requests/s, instance process "
                          f"{r['cpu_us_per_request']:.1f} us CPU per request, {r['requests_per_read']:.1f} "
                          f"requests per read", flush=True)
            finally:
                addsub.stop_server(proc)
    print("\n| server | c | requests/s (median) | instance CPU us/request (median) |\n|---|---|---|---|")
    for (tree, c), results in rows.items():
        mid = sorted(results, key=lambda r: r["cpu_us_per_request"])[len(results) // 2]
        print(f"| {tree} | {c} | {mid['per_s']:.0f} | {mid['cpu_us_per_request']:.1f} |")
    print(f"\nload {open('/proc/loadavg').read().split()[:3]}; logs: {work}")


if __name__ == "__main__":
    main()
