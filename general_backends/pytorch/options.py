"""Execution settings of a PyTorch model, read from its config's ``parameters`` under Triton's names."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from tideserve.backend_api import InvalidArgument, ModelContext

log = logging.getLogger(__name__)

DEFAULT_INTRA_OP_THREADS = max(1, min(4, os.cpu_count() or 1))

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _unset(value: str | None) -> bool:
    """Empty, or a ``${...}`` placeholder of Triton's fill_template.py left unfilled."""
    return value is None or not value.strip() or (value.startswith("${") and value.endswith("}"))


def _bool(ctx: ModelContext, key: str) -> bool | None:
    value = ctx.parameter(key)
    if _unset(value):
        return None
    text = value.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise InvalidArgument(f"model '{ctx.name}': parameter {key} must be true or false, got '{value}'")


def _positive_int(ctx: ModelContext, *keys: str) -> int | None:
    for key in keys:
        value = ctx.parameter(key)
        if _unset(value):
            continue
        try:
            number = int(value.strip())
        except ValueError:
            number = 0
        if number < 1:
            raise InvalidArgument(f"model '{ctx.name}': parameter {key} must be a positive integer, got '{value}'")
        return number
    return None


@dataclass(frozen=True)
class TorchOptions:
    """What the ``parameters`` of a ``pytorch`` model config ask for (Triton's PyTorch-backend names)."""

    optimized_execution: bool = True
    """``DISABLE_OPTIMIZED_EXECUTION: true`` turns it off: the TorchScript graph executor then skips its
    profiling and optimisation passes (faster first calls, sometimes slower steady state)."""
    inference_mode: bool = True
    """``INFERENCE_MODE``: run under ``torch.inference_mode()`` (default); ``false`` runs under ``torch.no_grad()``."""
    cudnn: bool = True
    """``DISABLE_CUDNN: true`` sets ``torch.backends.cudnn.enabled = False`` (process-wide) at load."""
    cache_cleaning: bool = False
    """``ENABLE_CACHE_CLEANING``: ``torch.cuda.empty_cache()`` after each execution on a GPU."""
    weight_sharing: bool = False
    """``ENABLE_WEIGHT_SHARING``: instances on the same device share one loaded module."""
    tensor_fuser: bool | None = None
    """``ENABLE_TENSOR_FUSER``: ``torch._C._jit_set_texpr_fuser_enabled`` before each execution; unset: untouched."""
    jit_profiling: bool | None = None
    """``ENABLE_JIT_PROFILING``: ``torch._C._jit_set_profiling_mode``; unset: untouched."""
    jit_executor: bool | None = None
    """``ENABLE_JIT_EXECUTOR``: ``torch._C._jit_set_profiling_executor``; unset: untouched."""
    intra_op_threads: int = DEFAULT_INTRA_OP_THREADS
    """``INTRA_OP_THREAD_COUNT`` (alias ``NUM_THREADS``): ``torch.set_num_threads`` on each instance's own
    thread. Default: min(4, CPU count), so parallel instances do not oversubscribe the cores."""
    inter_op_threads: int | None = None
    """``INTER_OP_THREAD_COUNT`` (alias ``NUM_INTEROP_THREADS``): ``torch.set_num_interop_threads``, process-wide
    and settable once; later different values are ignored with a warning."""

    @classmethod
    def from_context(cls, ctx: ModelContext) -> TorchOptions:
        disable_optimized = _bool(ctx, "DISABLE_OPTIMIZED_EXECUTION")
        inference_mode = _bool(ctx, "INFERENCE_MODE")
        disable_cudnn = _bool(ctx, "DISABLE_CUDNN")
        if _bool(ctx, "ENABLE_NVFUSER"):
            log.warning("model '%s': ENABLE_NVFUSER is ignored: nvFuser is no longer part of PyTorch", ctx.name)
        return cls(
            optimized_execution=not disable_optimized,
            inference_mode=True if inference_mode is None else inference_mode,
            cudnn=not disable_cudnn,
            cache_cleaning=bool(_bool(ctx, "ENABLE_CACHE_CLEANING")),
            weight_sharing=bool(_bool(ctx, "ENABLE_WEIGHT_SHARING")),
            tensor_fuser=_bool(ctx, "ENABLE_TENSOR_FUSER"),
            jit_profiling=_bool(ctx, "ENABLE_JIT_PROFILING"),
            jit_executor=_bool(ctx, "ENABLE_JIT_EXECUTOR"),
            intra_op_threads=_positive_int(ctx, "INTRA_OP_THREAD_COUNT", "NUM_THREADS") or DEFAULT_INTRA_OP_THREADS,
            inter_op_threads=_positive_int(ctx, "INTER_OP_THREAD_COUNT", "NUM_INTEROP_THREADS"),
        )
