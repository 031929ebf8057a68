"""Schedulers sit between a model and its instances and decide what each instance runs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import Scheduler
from .direct import DirectScheduler
from .dynamic_batcher import DynamicBatcher
from .iterative import IterativeSequenceBatcher
from .passthrough import PassThroughScheduler
from .sequence import SequenceBatcher

if TYPE_CHECKING:
    from ..runtime import ModelRuntime

__all__ = ["Scheduler", "DirectScheduler", "DynamicBatcher", "PassThroughScheduler", "SequenceBatcher",
           "IterativeSequenceBatcher", "make_scheduler"]


def make_scheduler(runtime: "ModelRuntime") -> Scheduler:
    """The scheduler a model's config asks for; a backend's model may supply its own."""
    custom = getattr(runtime.model, "create_scheduler", None)
    if custom is not None:
        return custom(runtime)
    if runtime.config.HasField("sequence_batching"):
        if runtime.config.sequence_batching.iterative_sequence:
            return IterativeSequenceBatcher(runtime)
        return SequenceBatcher(runtime)
    if runtime.config.HasField("dynamic_batching"):
        return DynamicBatcher(runtime)
    return DirectScheduler(runtime)
