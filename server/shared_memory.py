"""Triton's shared-memory extension: system shared memory regions clients register, read and written in place.

A client creates a POSIX shared memory object (``shm_open``: a file under ``/dev/shm``), registers a *region*
of it under a name (key, offset, byte size), then names the region in an input's or a requested output's
parameters (``shared_memory_region``, ``shared_memory_byte_size``, ``shared_memory_offset``). The registry
lives in the core (the DataPlane holds one) so that every frontend, in whatever process it runs, reaches the
same regions: the DataPlane reads inputs from them before validation and writes outputs into them.

Safety: a key is one POSIX shared-memory name (leading ``/`` and no other), opened under
``/dev/shm`` without following links, and must be a regular file; the region must lie inside the object as it
is when registered, and every tensor inside its region. Keys of the Python backend's own shared memory
(``triton_python_backend_shm_region_``) are refused as Triton refuses them. CUDA shared memory needs a GPU and
CuPy; without them its endpoints answer that it is not supported on this machine.

In use: a request holds every region it reads an input from or writes an output to (``held``) from the moment
it is accepted until its final response; unregistering a held region is refused as Triton 2.51 refuses it
("Cannot unregister shared memory region 'r', it is currently in use."; unregistering all regions unregisters
those that are free and names the others).
"""

from __future__ import annotations

import mmap
import os
import re
import stat
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from .datatypes import element_size, from_raw, numpy_dtype, to_raw
from .errors import InvalidArgument, NotFound, ServerError, Status, Unsupported
from .types import InferenceRequest, InferenceResponse, Tensor

SHM_DIR = "/dev/shm"
RESERVED_PREFIX = "triton_python_backend_shm_region_"  # the Python backend's own regions (as Triton's)
REGION = "shared_memory_region"
BYTE_SIZE = "shared_memory_byte_size"
OFFSET = "shared_memory_offset"
PARAMS = (REGION, BYTE_SIZE, OFFSET)
_NAME = re.compile(r"[^/\x00]{1,255}")  # one path component, as shm_open takes it


class RegionInUse(ServerError):
    """Unregistering a region a request is using: 409 over HTTP, UNAVAILABLE over gRPC (retry once it is done).
    Triton answers INTERNAL (500) with the same words."""

    status = Status.UNAVAILABLE
    http_code = 409


class NotOnThisMachine(Unsupported):
    """A feature this machine cannot offer (CUDA shared memory without a GPU): 400 over HTTP, UNIMPLEMENTED
    over gRPC."""

    http_code = 400


@dataclass(slots=True)
class OutputTarget:
    """Where one requested output goes: ``byte_size`` bytes at ``offset`` of region ``region``."""

    region: "_Region"
    offset: int
    byte_size: int


class _Region:
    __slots__ = ("name", "key", "offset", "byte_size", "map", "users")

    def __init__(self, name: str, key: str, offset: int, byte_size: int, mapping: mmap.mmap) -> None:
        self.name, self.key, self.offset, self.byte_size, self.map = name, key, offset, byte_size, mapping
        self.users = 0  # requests holding it (guarded by the registry's lock)

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}


def _uint(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise InvalidArgument(f"{what} must be a non-negative integer, got {value!r}")
    return value


def _open_key(name: str, key: str) -> int:
    """A descriptor of the shared memory object ``key``; InvalidArgument for anything but one under /dev/shm."""
    stripped = key.lstrip("/")
    if not stripped:
        raise InvalidArgument(f"cannot register shared memory region '{name}' - invalid shm key '{key}'")
    if stripped.startswith(RESERVED_PREFIX):
        raise InvalidArgument(f"cannot register shared memory region '{name}' with key '{key}' as the key "
                              f"contains the reserved prefix '{RESERVED_PREFIX}'")
    if not _NAME.fullmatch(stripped) or stripped in (".", ".."):
        raise InvalidArgument(f"cannot register shared memory region '{name}' - invalid shm key '{key}': a key is "
                              "one POSIX shared memory name ('/name', no other '/')")
    try:
        fd = os.open(os.path.join(SHM_DIR, stripped), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise InvalidArgument(f"Unable to open shared memory region: '{key}' ({exc.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InvalidArgument(f"Invalid shared memory region: '{key}' is not a shared memory object")
    return fd


class SharedMemoryRegistry:
    """The system shared memory regions registered with this server (thread-safe)."""

    def __init__(self) -> None:
        self._regions: dict[str, _Region] = {}
        self._lock = threading.Lock()

    # -- the extension's endpoints ---------------------------------------------------------------
    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if not name:
            raise InvalidArgument("a shared memory region needs a name")
        _uint(offset, "'offset'")
        _uint(byte_size, "'byte_size'")
        with self._lock:
            if name in self._regions:
                raise ServerError(f"shared memory region '{name}' already in manager", Status.ALREADY_EXISTS)
            fd = _open_key(name, key)
            try:
                size = os.fstat(fd).st_size
                if offset + byte_size > size or byte_size == 0:
                    raise InvalidArgument(f"failed to register shared memory region '{name}': invalid args (offset "
                                          f"{offset} + byte_size {byte_size} must lie within the {size} bytes of "
                                          f"'{key}', byte_size > 0)")
                # mmap offsets must be page-aligned: map from the page that holds ``offset``
                page = offset - offset % mmap.ALLOCATIONGRANULARITY
                mapping = mmap.mmap(fd, offset + byte_size - page, mmap.MAP_SHARED,
                                    mmap.PROT_READ | mmap.PROT_WRITE, offset=page)
            finally:
                os.close(fd)
            self._regions[name] = _Region(name, key, offset, byte_size, _View(mapping, offset - page))

    def unregister(self, name: str = "") -> None:
        """Forget region ``name`` (every region when empty); RegionInUse for a region a request holds (the
        others are still unregistered). An unknown name is no error, as in Triton."""
        with self._lock:
            if name:
                region = self._regions.get(name)
                if region is not None and region.users:
                    raise RegionInUse(f"Cannot unregister shared memory region '{name}', it is currently in use.")
                self._regions.pop(name, None)
                return
            busy = sorted(n for n, r in self._regions.items() if r.users)
            self._regions = {n: r for n, r in self._regions.items() if r.users}
        if busy:
            raise RegionInUse("Failed to unregister the following system shared memory regions: "
                              + "".join(f"{n} ," for n in busy))

    def release(self, held: list[_Region]) -> None:
        """The request that holds ``held`` (from :meth:`resolve_inputs` / :meth:`output_targets`) is done."""
        with self._lock:
            for region in held:
                region.users -= 1
        held.clear()

    def status(self, name: str = "") -> list[dict[str, Any]]:
        with self._lock:
            if not name:
                return [r.status() for r in self._regions.values()]
            region = self._regions.get(name)
        if region is None:
            raise NotFound(f"Unable to find system shared memory region: '{name}'")
        return [region.status()]

    # -- tensors ----------------------------------------------------------------------------------
    def _locate(self, params: dict, what: str, held: list[_Region]) -> tuple[_Region, int, int]:
        region_name = params.get(REGION)
        if type(region_name) is not str or not region_name:
            raise InvalidArgument(f"{what}: '{REGION}' must be a region name (string)")
        if BYTE_SIZE not in params:
            raise InvalidArgument(f"{what}: '{REGION}' needs '{BYTE_SIZE}'")
        byte_size = _uint(params[BYTE_SIZE], f"{what}: '{BYTE_SIZE}'")
        offset = _uint(params.get(OFFSET, 0), f"{what}: '{OFFSET}'")
        with self._lock:
            region = self._regions.get(region_name)
            if region is None:
                raise NotFound(f"Unable to find shared memory region: '{region_name}'")
            if offset >= region.byte_size:
                raise InvalidArgument(f"Invalid offset for shared memory region: '{region_name}' ({what}: offset "
                                      f"{offset}, the region holds {region.byte_size} bytes)")
            if offset + byte_size > region.byte_size:
                raise InvalidArgument(f"Invalid offset + byte size for shared memory region: '{region_name}' "
                                      f"({what}: {offset} + {byte_size} bytes, the region holds {region.byte_size})")
            region.users += 1
            held.append(region)
        return region, offset, byte_size

    def resolve_inputs(self, request: InferenceRequest, held: list[_Region]) -> None:
        """Give every input that names a region its data from there (numbers in place, read-only); the regions
        read are added to ``held`` (give them back with :meth:`release`)."""
        for name, tensor in request.inputs.items():
            params = tensor.parameters
            if not params or REGION not in params:
                continue
            what = f"input '{name}' for model '{request.model_name}'"
            region, offset, byte_size = self._locate(params, what, held)
            view = region.map.slice(offset, byte_size)
            datatype, shape = tensor.datatype, tuple(tensor.shape)
            itemsize = element_size(datatype)
            if itemsize:
                expected = itemsize * int(np.prod(shape, dtype=np.int64))
                if expected != byte_size:
                    raise InvalidArgument(f"input byte size mismatch for input '{name}' for model "
                                          f"'{request.model_name}'. Expected {expected}, got {byte_size}")
                if datatype == "BF16":
                    raise InvalidArgument(f"{what}: BF16 tensors are not supported")
                array = np.frombuffer(view, numpy_dtype(datatype)).reshape(shape)
                array.flags.writeable = False
            else:
                array = from_raw(bytes(view), datatype, shape, name)
            tensor.data = array
            tensor.parameters = {k: v for k, v in params.items() if k not in PARAMS}

    def output_targets(self, request: InferenceRequest, held: list[_Region]) -> dict[str, OutputTarget] | None:
        """The requested outputs to be written to shared memory, checked against their regions now (which are
        added to ``held``)."""
        targets = None
        for output in request.outputs:
            params = output.parameters
            if not params or REGION not in params:
                continue
            what = f"output '{output.name}' for model '{request.model_name}'"
            if params.get("classification"):
                raise InvalidArgument(f"{what}: classification results cannot be written to shared memory")
            region, offset, byte_size = self._locate(params, what, held)
            targets = targets or {}
            targets[output.name] = OutputTarget(region, offset, byte_size)
        return targets

    @staticmethod
    def write_outputs(response: InferenceResponse, targets: dict[str, OutputTarget]) -> InferenceResponse:
        """Write the outputs ``targets`` names into their regions; they go back with no data (``data`` None).

        Returns a new response, so a cached one stays whole."""
        outputs = []
        for tensor in response.outputs:
            target = targets.get(tensor.name)
            if target is None:
                outputs.append(tensor)
                continue
            array = tensor.data
            if type(array) is not np.ndarray:
                array = np.asarray(array, dtype=np.object_ if tensor.datatype == "BYTES" else None)
            if tensor.datatype not in ("BYTES", "BF16"):
                dtype = numpy_dtype(tensor.datatype)
                if array.dtype != dtype:
                    array = array.astype(dtype)
                size = array.nbytes
                raw = None
            else:
                raw = to_raw(array, tensor.datatype)
                size = len(raw)
            if size > target.byte_size:
                raise InvalidArgument(f"shared memory size specified with the request for output '{tensor.name}' "
                                      f"({target.byte_size} bytes) should be at least {size} bytes to hold the "
                                      "results")
            view = target.region.map.slice(target.offset, size)
            if raw is None:
                np.copyto(np.frombuffer(view, array.dtype).reshape(array.shape), array, casting="no")
            else:
                view[:] = raw
            params = dict(tensor.parameters) if tensor.parameters else {}
            outputs.append(Tensor(tensor.name, tensor.datatype, tuple(array.shape), None, params))
        return InferenceResponse(response.model_name, response.model_version, response.id, outputs,
                                 response.parameters, response.error, response.final, response.empty)


class _View:
    """A region's mapping and where the region starts in it (mappings begin on a page boundary)."""

    __slots__ = ("mapping", "start")

    def __init__(self, mapping: mmap.mmap, start: int) -> None:
        self.mapping, self.start = mapping, start

    def slice(self, offset: int, size: int) -> memoryview:
        begin = self.start + offset
        return memoryview(self.mapping)[begin:begin + size]


# -- CUDA shared memory ----------------------------------------------------------------------------
def cuda_available() -> bool:
    """Whether this machine could serve CUDA shared memory: CuPy importable and a GPU it can see."""
    try:
        import cupy  # noqa: F401
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device
        return False


def cuda_unsupported() -> NotOnThisMachine:
    return NotOnThisMachine("CUDA shared memory is not supported on this machine (it needs a GPU and CuPy); "
                            "use system shared memory or send the tensor data in the request")


