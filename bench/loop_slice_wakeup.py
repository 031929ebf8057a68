"""How soon a thread woken by a socket runs while busy processes hold every core: the kernel's default time slice
against a short one (what ``ask_for_short_slice`` in llm_backends/vllm/generation.py asks for the server's loop).

A sender process writes a timestamp to a socket pair every 4 ms; a receiver thread, with the default slice or with
``--slice-us``, reads it and notes how late it woke. Meanwhile one spinning process per core keeps them all busy,
as a vLLM engine's processes keep this machine's two. The sides alternate, ``--rounds`` times each.

    python bench/loop_slice_wakeup.py [--rounds 6] [--wakeups 200] [--slice-us 100]

Linux only; on a kernel without EEVDF's custom slices (before 6.12) both sides are the same.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import struct
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere


def spin(stop) -> None:
    while not stop.is_set():
        for _ in range(10_000):
            pass


def receive(slice_us: int, conn: socket.socket, count: int, out: list[float], ask) -> None:
    if slice_us:
        ask(slice_us)
    for _ in range(count):
        sent = struct.unpack("d", conn.recv(8))[0]
        out.append((time.monotonic() - sent) * 1000)


def side(slice_us: int, count: int, ask) -> list[float]:
    a, b = socket.socketpair()
    out: list[float] = []
    receiver = threading.Thread(target=receive, args=(slice_us, a, count, out, ask))
    receiver.start()
    pid = os.fork()
    if pid == 0:
        for _ in range(count):
            time.sleep(0.004)
            b.send(struct.pack("d", time.monotonic()))
        os._exit(0)
    receiver.join()
    os.waitpid(pid, 0)
    a.close()
    b.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--wakeups", type=int, default=200, help="per side and round")
    parser.add_argument("--slice-us", type=int, default=100)
    args = parser.parse_args()
    from tideserve.llm_backends.vllm.generation import ask_for_short_slice  # (imports vLLM: a while)

    stop = multiprocessing.Event()
    spinners = [multiprocessing.Process(target=spin, args=(stop,)) for _ in range(os.cpu_count() or 1)]
    for process in spinners:
        process.start()
    lateness: dict[int, list[float]] = {0: [], args.slice_us: []}
    try:
        for _ in range(args.rounds):
            for slice_us in lateness:
                lateness[slice_us] += side(slice_us, args.wakeups, ask_for_short_slice)
    finally:
        stop.set()
        for process in spinners:
            process.join()
    print(f"load average {os.getloadavg()[0]:.2f}; {len(spinners)} spinning processes")
    for slice_us, values in lateness.items():
        values.sort()
        n = len(values)
        print(f"{'default slice' if not slice_us else f'{slice_us} us slice'}: {n} wake-ups, ms late p50 "
              f"{values[n // 2]:.3f}, p90 {values[int(n * 0.9)]:.3f}, p99 {values[int(n * 0.99)]:.3f}, max "
              f"{values[-1]:.3f}")


if __name__ == "__main__":
    main()
