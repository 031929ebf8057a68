"""Limits on the tensors one request may declare, shared by the HTTP and gRPC codecs.

A request's shapes are checked as they are read, before any array is allocated or reshaped: numpy
refuses more than 64 dimensions and sizes past its address space with a ``ValueError`` that would
otherwise surface as an internal error. The body and message size limits bound how much data a
request can carry; these bound what its shapes can claim.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidArgument

DEFAULT_MAX_TENSOR_RANK = 32
DEFAULT_MAX_TENSOR_ELEMENTS = 1 << 28


@dataclass(frozen=True, slots=True)
class TensorLimits:
    max_rank: int = DEFAULT_MAX_TENSOR_RANK
    """Most dimensions an input tensor may have (``--max-tensor-rank``)."""
    max_elements: int = DEFAULT_MAX_TENSOR_ELEMENTS
    """Most elements an input tensor may hold, counting its non-zero dimensions (``--max-tensor-elements``)."""

    def check(self, where: str, shape, count: int) -> None:
        """Raise InvalidArgument unless ``shape`` (whose product is ``count``) is within the limits.

        ``where`` names the tensor ("input 'x'" or "input 'x' for model 'm'"). An empty tensor is
        measured by its non-zero dimensions, so ``[2**62, 2**62, 0]`` is refused as well.
        """
        if len(shape) > self.max_rank:
            raise InvalidArgument(f"{where} has {len(shape)} dimensions, more than the limit of {self.max_rank} "
                                  "(--max-tensor-rank)")
        what = "holds"
        if count == 0:
            what = "spans, its zero-size dimensions aside,"
            count = 1
            for dim in shape:
                count *= dim or 1
        if count > self.max_elements:
            raise InvalidArgument(f"{where}: shape {list(shape)} {what} {count} elements, more than the limit of "
                                  f"{self.max_elements} (--max-tensor-elements)")
