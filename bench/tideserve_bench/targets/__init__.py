"""The protocols tideserve-bench drives; one module each."""

from __future__ import annotations

from .base import Target, TargetOptions

TARGETS = {
    "openai-chat": ("openai", "ChatTarget"),
    "openai-completions": ("openai", "CompletionsTarget"),
    "openai-responses": ("responses", "ResponsesTarget"),
    "kserve-generate": ("kserve", "KServeTarget"),
    "grpc-stream": ("grpc", "GrpcStreamTarget"),
}


def make_target(name: str, options: TargetOptions) -> Target:
    import importlib

    try:
        module, cls = TARGETS[name]
    except KeyError:
        raise ValueError(f"unknown target {name!r}; choose one of {', '.join(TARGETS)}") from None
    return getattr(importlib.import_module(f".{module}", __name__), cls)(options)


__all__ = ["TARGETS", "Target", "TargetOptions", "make_target"]
