"""The frontend worker processes of a running server, as the tests find them (``/proc``), and add_sub's inputs for
the requests they send through them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

WORKER_MODULE = "tideserve.workers.main"


def proc_stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        fields = proc_stat(int(entry.name))
        if fields is not None and int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def workers(pid: int) -> list[int]:
    return sorted(c for c in children(pid) if WORKER_MODULE in cmdline(c))


def add_sub_inputs(module):
    a = np.arange(4, dtype=np.float32).reshape(1, 4)
    inputs = [module.InferInput("INPUT0", [1, 4], "FP32"), module.InferInput("INPUT1", [1, 4], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(np.ones_like(a))
    return inputs
