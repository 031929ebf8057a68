"""Device buffers and a CUDA stream for TensorRT, held as PyTorch CUDA tensors.

TensorRT's Python runtime takes raw device addresses (``set_tensor_address``) and a stream handle
(``execute_async_v3``). :class:`TorchCudaDevice` gets both from PyTorch: a batch's inputs are copied
into CUDA tensors (PyTorch's caching allocator reuses the memory from batch to batch), outputs are
allocated the same way, and everything runs on one CUDA stream per instance, in order, so the copy
back to the host waits for the engine. :class:`CudaDevice` is the surface the backend uses, so a
test double can stand in for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from tideserve.backend_api import Unavailable


@dataclass
class DeviceBuffer:
    """A device allocation: its address for TensorRT, and the object that keeps it alive."""

    ptr: int
    owner: Any


class CudaDevice(Protocol):
    """One GPU as an instance uses it: a current-device scope, one stream, buffers in and out."""

    device_id: int

    def activate(self) -> contextlib.AbstractContextManager: ...

    @property
    def stream_handle(self) -> int: ...

    def upload(self, array: np.ndarray) -> DeviceBuffer: ...

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> DeviceBuffer: ...

    def download(self, buffer: DeviceBuffer) -> np.ndarray: ...

    def synchronize(self) -> None: ...


class TorchCudaDevice:
    """:class:`CudaDevice` over PyTorch CUDA tensors and a ``torch.cuda.Stream``."""

    def __init__(self, device_id: int) -> None:
        try:
            import torch
        except ImportError as exc:
            raise Unavailable("the tensorrt backend holds device buffers as PyTorch CUDA tensors, and torch is not "
                              f"installed ({exc}); pip install torch (a CUDA build)") from exc
        if not torch.cuda.is_available():
            raise Unavailable(f"TensorRT needs an NVIDIA GPU: PyTorch sees no CUDA device (torch {torch.__version__}, "
                              f"CUDA {torch.version.cuda or 'not built in'})")
        if device_id >= torch.cuda.device_count():
            raise Unavailable(f"GPU {device_id} does not exist: PyTorch sees {torch.cuda.device_count()} CUDA device(s)")
        self._torch = torch
        self.device_id = device_id
        self.device = torch.device("cuda", device_id)
        self.stream = torch.cuda.Stream(self.device)

    @contextlib.contextmanager
    def activate(self) -> Iterator[None]:
        """This GPU current and this instance's stream current (deserializing, creating contexts, running)."""
        with self._torch.cuda.device(self.device), self._torch.cuda.stream(self.stream):
            yield

    @property
    def stream_handle(self) -> int:
        return self.stream.cuda_stream

    def upload(self, array: np.ndarray) -> DeviceBuffer:
        if not array.flags.writeable or not array.flags.c_contiguous:
            array = np.array(array)
        with self._torch.cuda.stream(self.stream):
            tensor = self._torch.from_numpy(array).to(self.device, non_blocking=True)
        return DeviceBuffer(tensor.data_ptr(), tensor)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> DeviceBuffer:
        torch_dtype = self._torch.from_numpy(np.empty(0, dtype)).dtype
        with self._torch.cuda.stream(self.stream):
            tensor = self._torch.empty(shape, dtype=torch_dtype, device=self.device)
        return DeviceBuffer(tensor.data_ptr(), tensor)

    def download(self, buffer: DeviceBuffer) -> np.ndarray:
        with self._torch.cuda.stream(self.stream):
            return buffer.owner.cpu().numpy()  # ordered after the engine on this stream; waits for it

    def synchronize(self) -> None:
        self.stream.synchronize()
