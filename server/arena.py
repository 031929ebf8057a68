"""Shared memory for the process links (:mod:`tideserve.wire`): arenas, blocks of their own, and the choice between
a message's tensors inline or in shared memory.

Each direction of a link has an arena, one shared-memory file that the sending side allocates from and the
receiving side maps once. The tensors of one message lie in one block of the sender's arena; the receiver reads
them in place (numpy arrays over its mapping) and hands the block back (a :class:`~tideserve.wire.Release` message)
once the last array over it is gone, whoever held it. A message whose tensors do not fit (larger than the arena,
or the arena full) gets a file of its own, whose descriptor travels with the message, on a link that passes
descriptors; on one that does not its tensors go inline.

The files are anonymous (``memfd_create`` on Linux, an unlinked temporary file elsewhere): nothing is left behind
when a process dies.
"""

from __future__ import annotations

import bisect
import mmap
import os
import tempfile
import threading
import weakref
from collections.abc import Callable

import numpy as np

from . import wire
from .types import Tensor

RELEASE_DELAY_S = 0.005  # blocks read go back with the next message, or after this long when none goes out
OWN_FILE = -1  # Payload.offset of a message whose tensors came in a file of their own
# A message's tensors of at least this many bytes in all cross a process link (both links, both directions) in
# shared memory, smaller ones inline. Measured (docs/performance.md, "One wire: tensors inline or in shared
# memory"): across the worker link (bench/wire_bench.py) from 64 KiB on a round trip through shared memory took
# 0.04-0.82x the time of one inline in every run, below the two were within the noise of each other (0.85-1.32x);
# across the model link, add_sub's 16-byte tensors inline cut a request's hop (bench/python_processes.py) from
# about 160 to 122 us of wall time.
SHARED_MEMORY_MIN_BYTES = 64 * 1024


def create_file(size: int, name: str) -> int:
    """A new anonymous shared-memory file of ``size`` bytes (its descriptor, not inheritable)."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
    else:
        with tempfile.TemporaryFile(prefix=f"{name}-") as file:  # unlinked at once; the mapping keeps it
            fd = os.dup(file.fileno())
    try:
        os.ftruncate(fd, max(size, 1))
    except BaseException:
        os.close(fd)
        raise
    return fd


def map_file(fd: int, size: int) -> mmap.mmap:
    return mmap.mmap(fd, max(size, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


class Arena:
    """The sending side of one direction: a shared-memory file and a first-fit allocator over it."""

    def __init__(self, size: int, name: str, fd: int | None = None) -> None:
        """A new file of ``size`` bytes, or the file ``fd`` (made by the other side) to allocate from."""
        self.size = size
        self.fd = create_file(size, name) if fd is None else fd
        self._map = map_file(self.fd, size)
        self.view = memoryview(self._map)
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, size)]  # (start, end), sorted, never adjacent
        self._used: dict[int, int] = {}  # start -> end

    def close_fd(self) -> None:
        """Close the descriptor once the other side has its own (the mapping stays)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def allocate(self, size: int) -> int | None:
        """The offset of a free block of ``size`` bytes, or None when no such block is free."""
        size = wire.aligned(max(size, 1))
        with self._lock:
            for index, (start, end) in enumerate(self._free):
                if end - start >= size:
                    if end - start == size:
                        del self._free[index]
                    else:
                        self._free[index] = (start + size, end)
                    self._used[start] = start + size
                    return start
        return None

    def release(self, offset: int) -> None:
        with self._lock:
            end = self._used.pop(offset, None)
            if end is None:
                return
            index = bisect.bisect_left(self._free, (offset, end))
            if index < len(self._free) and self._free[index][0] == end:
                end = self._free.pop(index)[1]
            if index > 0 and self._free[index - 1][1] == offset:
                index -= 1
                offset = self._free.pop(index)[0]
            self._free.insert(index, (offset, end))

    @property
    def in_use(self) -> int:
        with self._lock:
            return sum(end - start for start, end in self._used.items())


class Outbox:
    """The sending side of one direction: describes a message's tensors, inline or in a block of the arena.

    ``min_bytes``: tensors of fewer bytes in all go inline (0: always shared memory). ``own_files``: a message
    that finds no room in the arena gets a file of its own (the link passes descriptors); else it goes inline."""

    def __init__(self, arena: Arena, min_bytes: int = SHARED_MEMORY_MIN_BYTES, own_files: bool = True) -> None:
        self.arena = arena
        self.min_bytes = min_bytes
        self.own_files = own_files

    def put(self, tensors: list[Tensor]) -> tuple[list[wire.Tensor], wire.Payload | None, int | None]:
        """(the tensors described, the payload, a descriptor to send with the message or None). The descriptor is
        the sender's to close once the message is sent."""
        if not tensors:
            return [], None, None
        if self.min_bytes and wire.data_bytes(tensors) < self.min_bytes:
            return [wire.inline_tensor(t) for t in tensors], None, None
        placed = wire.layout(tensors)
        if placed.size == 0:
            return placed.tensors, None, None
        offset = self.arena.allocate(placed.size) if placed.size <= self.arena.size else None
        if offset is not None:
            wire.copy_into(self.arena.view[offset:offset + placed.size], placed)
            return placed.tensors, wire.Payload(offset, placed.size), None
        if not self.own_files:
            return [wire.inline_tensor(t) for t in tensors], None, None
        fd = create_file(placed.size, "tideserve-tensors")
        try:
            with map_file(fd, placed.size) as mapping, memoryview(mapping) as block:
                wire.copy_into(block, placed)
        except BaseException:
            os.close(fd)
            raise
        return placed.tensors, wire.Payload(OWN_FILE, placed.size), fd


class Inbox:
    """The receiving side of one direction: the peer's arena mapped once; blocks go back through ``release`` when
    the last array over them is gone (called from whatever thread drops it)."""

    def __init__(self, fd: int, size: int, release: Callable[[int], None]) -> None:
        self._map = map_file(fd, size)
        self._release = release

    def block(self, payload: wire.Payload | None, fd: int | None = None) -> np.ndarray | None:
        """The bytes of ``payload``: a view of the arena (handed back once unused) or of the file that came with the
        message."""
        if payload is None:
            return None
        if payload.offset == OWN_FILE:
            try:
                mapping = map_file(fd, payload.size)
            finally:
                os.close(fd)
            return np.frombuffer(mapping, np.uint8, payload.size)  # unmapped when the last view goes
        # A fresh array over the mapping, not a slice of an array of the whole mapping: numpy points every view of
        # a slice at the array it was sliced from, so the slice would go (and the block with it) while its views
        # still read it. This array lives exactly as long as the last view of it.
        block = np.frombuffer(self._map, np.uint8, payload.size, payload.offset)
        weakref.finalize(block, self._release, payload.offset).atexit = False
        return block


__all__ = [
    "OWN_FILE",
    "RELEASE_DELAY_S",
    "SHARED_MEMORY_MIN_BYTES",
    "Arena",
    "Inbox",
    "Outbox",
    "create_file",
    "map_file",
]
