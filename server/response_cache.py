"""Triton's response cache (the ``local`` cache): identical requests answered without running the model.

``--cache-config local,size=N`` gives the server one cache of ``N`` bytes shared by every model whose config
has ``response_cache { enable: true }``. A request's key hashes, as Triton's does, the model name and version
and each input (sorted by name) with its bytes; here it also takes each input's datatype and shape, the
requested output names and the request parameters, so that two requests share an answer only when the model
would see the same thing. The hash is BLAKE2b of 128 bits (Triton's is 64). Entries are the responses'
outputs, evicted least recently used first; a response larger than the whole cache is not stored (an ERROR
log line says so, in Triton's words: ``Failed to insert key [...] into response cache: ...``).

The DataPlane looks a request up before it is scheduled and stores the final response of a request that
succeeded. Decoupled models and models with a sequence batcher never use it (their config is refused, as
Triton refuses it; an ensemble with a decoupled step is decoupled, so it is refused too).
"""

from __future__ import annotations

import collections
import hashlib
import logging
from dataclasses import dataclass

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from .datatypes import to_raw
from .errors import InvalidArgument
from .types import InferenceRequest, InferenceResponse, Tensor

log = logging.getLogger(__name__)

ENTRY_OVERHEAD = 128  # bytes charged per entry on top of its tensors (key, bookkeeping)


def parse_cache_config(values: list[str]) -> int | None:
    """The local cache's size from ``--cache-config`` values (``local,size=N``, repeatable); None: no cache.
    ValueError for anything else (Triton's other caches, such as redis, are not available here)."""
    size = None
    caches = set()
    for value in values:
        cache, sep, setting = value.partition(",")
        key, eq, number = setting.partition("=")
        if not sep or not eq or not cache:
            raise ValueError(f"--cache-config '{value}': expected <cache>,<key>=<value>")
        caches.add(cache)
        if len(caches) > 1:
            raise ValueError("--cache-config: multiple cache configurations given; only one cache can be used")
        if cache != "local":
            raise ValueError(f"--cache-config: cache '{cache}' is not available; this server has the 'local' "
                                  "cache")
        if key != "size":
            raise ValueError(f"--cache-config local: unknown setting '{key}' (the local cache takes 'size')")
        try:
            size = int(number)
        except ValueError:
            raise ValueError(f"--cache-config local,size: '{number}' is not a number of bytes") from None
        if size < 0:
            raise ValueError("--cache-config local,size must be >= 0")
    return size or None


def check_config(config: mc.ModelConfig) -> None:
    """Triton's load-time refusal of a cache on models that cannot use one."""
    if not config.response_cache.enable:
        return
    if config.model_transaction_policy.decoupled:
        raise InvalidArgument(f"Response Cache does not currently support model {config.name} with 'decoupled' "
                              "transaction policy. Please disable the response cache.")
    if config.HasField("sequence_batching"):
        raise InvalidArgument(f"Response Cache does not currently support model {config.name} with sequence "
                              "batching scheduler. Please disable the response cache.")


def request_key(request: InferenceRequest, version: str) -> bytes:
    """The cache key of ``request`` for version ``version`` of its model."""
    digest = hashlib.blake2b(digest_size=16)
    update = digest.update
    for part in (request.model_name, version):
        update(part.encode())
        update(b"\x00")
    for name in sorted(request.inputs):
        tensor = request.inputs[name]
        update(f"{name}\x00{tensor.datatype}\x00{tuple(tensor.shape)}\x00".encode())
        data = tensor.data
        if tensor.datatype == "BYTES" or type(data) is not np.ndarray:
            update(to_raw(np.asarray(data, dtype=np.object_ if tensor.datatype == "BYTES" else None),
                          tensor.datatype))
        else:
            update(np.ascontiguousarray(data).data)
    if request.outputs:
        update(("\x00".join(sorted(o.name for o in request.outputs))).encode())
    if request.parameters:
        update(repr(sorted(request.parameters.items())).encode())
    return digest.digest()


@dataclass(slots=True)
class _Entry:
    outputs: list[Tensor]
    parameters: dict
    size: int


def _size(outputs: list[Tensor]) -> int:
    total = ENTRY_OVERHEAD
    for tensor in outputs:
        data = tensor.data
        if type(data) is np.ndarray and data.dtype != np.object_:
            total += data.nbytes
        else:
            total += sum(len(x) + 4 if isinstance(x, (bytes, str)) else 8 for x in np.asarray(data).ravel())
    return total


class ResponseCache:
    """A least-recently-used map of request keys to responses, bounded in bytes (event-loop thread only)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.used = 0
        self._entries: collections.OrderedDict[bytes, _Entry] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, key: bytes, request: InferenceRequest) -> InferenceResponse | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return InferenceResponse(request.model_name, "", request.id, list(entry.outputs), dict(entry.parameters))

    def insert(self, key: bytes, response: InferenceResponse) -> bool:
        """Store a copy of ``response``'s outputs; False when it cannot fit in the whole cache."""
        outputs = []
        for tensor in response.outputs:
            data = tensor.data
            if type(data) is np.ndarray:
                data = data.copy()  # the model may reuse its buffers
                data.flags.writeable = False
            outputs.append(Tensor(tensor.name, tensor.datatype, tuple(tensor.shape), data,
                                  dict(tensor.parameters) if tensor.parameters else {}))
        size = _size(outputs)
        if size > self.size:  # logged as Triton logs it (the local cache's own words after the key)
            log.error("Failed to insert key [%s] into response cache: Requested byte_size: %d is greater than total "
                      "cache size: %d", key.hex(), size, self.size)
            return False
        old = self._entries.pop(key, None)
        if old is not None:
            self.used -= old.size
        while self.used + size > self.size and self._entries:
            _, evicted = self._entries.popitem(last=False)
            self.used -= evicted.size
        self._entries[key] = _Entry(outputs, dict(response.parameters) if response.parameters else {}, size)
        self.used += size
        return True
