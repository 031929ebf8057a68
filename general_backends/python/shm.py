"""Shared memory between the server and a model process: arenas, blocks of their own, tensor layout.

Each direction of a model process's connection has an arena, one shared-memory file that the sending
side allocates from and the receiving side maps once. The tensors of one message lie in one block of
the sender's arena; the receiver reads them in place (numpy arrays over its mapping) and hands the
block back (a ``Release`` message) once the last array over it is gone, whoever held it. A message
whose tensors do not fit (larger than the arena, or the arena full) gets a file of its own, whose
descriptor travels with the message and which disappears when the receiver drops its arrays.

The files are anonymous (``memfd_create`` on Linux, an unlinked temporary file elsewhere): nothing is
left behind when a process dies.
"""

from __future__ import annotations

import bisect
import mmap
import os
import tempfile
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tideserve.backend_api import Tensor as CoreTensor

from . import wire

ALIGN = 64  # every tensor starts on a cache line
RELEASE_DELAY_S = 0.005  # blocks read go back with the next message, or after this long when none goes out
OWN_FILE = -1  # Payload.offset of a message whose tensors came in a file of their own


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


def _aligned(size: int) -> int:
    return (size + ALIGN - 1) & ~(ALIGN - 1)


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
        size = _aligned(max(size, 1))
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


# -- tensors into and out of a block ------------------------------------------------------------------
@dataclass
class Outgoing:
    """The tensors of one message, laid out: where each goes and how many bytes the block needs."""

    refs: list[wire.TensorRef]
    parts: list[tuple[int, np.ndarray | bytes]]  # (offset in the block, what to copy there)
    size: int


def _as_bytes(item) -> bytes:
    if type(item) is bytes:
        return item
    if isinstance(item, str):
        return item.encode("utf-8")
    return bytes(item)


def layout(tensors: list[CoreTensor]) -> Outgoing:
    """Place ``tensors`` one after the other. BYTES tensors become their element lengths (uint32) and
    then the elements' bytes."""
    refs, parts, offset = [], [], 0
    for tensor in tensors:
        data = tensor.data
        if tensor.datatype == "BYTES" or data.dtype == np.object_:
            items = [_as_bytes(x) for x in data.reshape(-1)]
            lengths = np.fromiter(map(len, items), np.uint32, len(items))
            body = b"".join(items)
            nbytes = lengths.nbytes + len(body)
            parts.append((offset, lengths))
            parts.append((offset + lengths.nbytes, body))
            dtype = "|O"
        else:
            nbytes = data.nbytes
            parts.append((offset, data))
            dtype = data.dtype.str
        refs.append(wire.TensorRef(tensor.name, tensor.datatype, dtype, tuple(data.shape), offset, nbytes,
                                   tensor.parameters or {}))
        offset += _aligned(nbytes)
    return Outgoing(refs, parts, offset)


def copy_into(block: memoryview, outgoing: Outgoing) -> None:
    """Copy the tensors of ``outgoing`` into ``block`` (a view of shared memory)."""
    for offset, part in outgoing.parts:
        if isinstance(part, bytes):
            block[offset:offset + len(part)] = part
        elif part.nbytes:
            if part.flags.c_contiguous:
                block[offset:offset + part.nbytes] = memoryview(part).cast("B")
            else:
                target = np.frombuffer(block, np.uint8, part.nbytes, offset)
                np.copyto(target.view(part.dtype).reshape(part.shape), part)


_DTYPES: dict[str, np.dtype] = {}


def _dtype(text: str) -> np.dtype:
    dtype = _DTYPES.get(text)
    if dtype is None:
        dtype = _DTYPES[text] = np.dtype(text)
    return dtype


def read_tensors(block: np.ndarray | None, refs: list[wire.TensorRef]) -> list[CoreTensor]:
    """The tensors ``refs`` describe, as arrays over ``block`` (BYTES tensors are copied out)."""
    tensors = []
    for ref in refs:
        if ref.dtype == "|O":
            count = int(np.prod(ref.shape)) if ref.shape else 1
            lengths = block[ref.offset:ref.offset + 4 * count].view(np.uint32)
            body = block[ref.offset + 4 * count:ref.offset + ref.nbytes].tobytes()
            items = np.empty(count, np.object_)
            start = 0
            for index, length in enumerate(lengths.tolist()):
                items[index] = body[start:start + length]
                start += length
            data = items.reshape(ref.shape)
        elif ref.nbytes:
            data = block[ref.offset:ref.offset + ref.nbytes].view(_dtype(ref.dtype)).reshape(ref.shape)
        else:
            data = np.empty(ref.shape, _dtype(ref.dtype))
        tensors.append(CoreTensor(ref.name, ref.datatype, tuple(ref.shape), data, dict(ref.parameters)))
    return tensors


class Outbox:
    """The sending side of one direction: puts a message's tensors into the arena, or into a file of
    their own when the arena has no room."""

    def __init__(self, arena: Arena) -> None:
        self.arena = arena

    def put(self, tensors: list[CoreTensor]) -> tuple[list[wire.TensorRef], wire.Payload | None, int | None]:
        """(tensor refs, payload, descriptor to send with the message or None). The descriptor is the
        sender's to close once the message is sent."""
        if not tensors:
            return [], None, None
        outgoing = layout(tensors)
        if outgoing.size == 0:
            return outgoing.refs, None, None
        offset = self.arena.allocate(outgoing.size) if outgoing.size <= self.arena.size else None
        if offset is not None:
            copy_into(self.arena.view[offset:offset + outgoing.size], outgoing)
            return outgoing.refs, wire.Payload(offset, outgoing.size), None
        fd = create_file(outgoing.size, "tideserve-tensors")
        try:
            with map_file(fd, outgoing.size) as mapping, memoryview(mapping) as block:
                copy_into(block, outgoing)
        except BaseException:
            os.close(fd)
            raise
        return outgoing.refs, wire.Payload(OWN_FILE, outgoing.size), fd


class Inbox:
    """The receiving side of one direction: the peer's arena mapped once; blocks go back through
    ``release`` when the last array over them is gone (called from whatever thread drops it)."""

    def __init__(self, fd: int, size: int, release: Callable[[int], None]) -> None:
        self._map = map_file(fd, size)
        self._release = release

    def block(self, payload: wire.Payload | None, fd: int | None) -> np.ndarray | None:
        """The bytes of ``payload``: a view of the arena (handed back once unused) or of the file that
        came with the message."""
        if payload is None:
            return None
        if payload.offset == OWN_FILE:
            try:
                mapping = map_file(fd, payload.size)
            finally:
                os.close(fd)
            return np.frombuffer(mapping, np.uint8, payload.size)  # unmapped when the last view goes
        # A fresh array over the mapping, not a slice of an array of the whole mapping: numpy points every
        # view of a slice at the array it was sliced from, so the slice would go (and the block with it)
        # while its views still read it. This array lives exactly as long as the last view of it.
        block = np.frombuffer(self._map, np.uint8, payload.size, payload.offset)
        weakref.finalize(block, self._release, payload.offset).atexit = False
        return block
