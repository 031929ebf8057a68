"""A replica's load, as routers read it: ``GET /load`` and the ORCA ``endpoint-load-metrics`` response header.

Per model version (``?model=`` picks one model): the requests it has in flight (``server_load``, vLLM's name for
its API server's count), and, for a model with an engine of its own (vLLM), the engine's running and waiting
requests and KV-cache usage after its last step (``Model.engine_load``); another model reports its scheduler's
queue as waiting and the rest of its requests in flight as running, with no KV cache. The server's figures sum
the models' counts and take the highest KV-cache usage (the engine a new request would most likely wait for).

The ORCA header follows vLLM's OpenAI server: a request that carries ``endpoint-load-metrics-format: TEXT`` (or
``JSON``) gets ``endpoint-load-metrics: TEXT named_metrics.kv_cache_usage_perc=0.1, named_metrics.
num_requests_waiting=0.0`` (or ``JSON {"named_metrics": {...}}``) on its JSON answer; another format gets none.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .runtime import ModelRuntime

LOAD_PATH = "/load"
FORMAT_HEADER = "endpoint-load-metrics-format"  # the request header asking for the report (vLLM's name)
REPORT_HEADER = "endpoint-load-metrics"  # the response header carrying it
ORCA_METRICS = ("kv_cache_usage_perc", "num_requests_waiting")  # the named metrics vLLM reports


def model_load(runtime: ModelRuntime) -> dict[str, Any]:
    """One model version's figures. With --frontend-direct, the requests the model's instance processes took
    straight from the frontend workers count too (as of their last counters: ``DataPlane.load_report`` asks for
    them first)."""
    inflight = runtime.inflight
    engine = runtime.model.engine_load()
    if engine is not None:
        running = int(engine.get("num_requests_running", 0))
        waiting = int(engine.get("num_requests_waiting", 0))
        usage = float(engine.get("kv_cache_usage_perc", 0.0))
    else:
        scheduler = runtime.scheduler
        waiting = min(inflight, scheduler.pending()) if scheduler is not None else 0
        for counters in getattr(runtime.stats, "remote", {}).values():
            direct = int(counters.get("inflight", 0))
            inflight += direct
            waiting += min(direct, int(counters.get("pending", 0)))
        running, usage = inflight - waiting, 0.0
    return {"model_name": runtime.name, "version": str(runtime.version), "server_load": inflight,
            "num_requests_running": running, "num_requests_waiting": waiting, "kv_cache_usage_perc": usage}


def report(runtimes: Iterable[ModelRuntime]) -> dict[str, Any]:
    """The figures of ``runtimes`` and their sums: ``{"server_load", "num_requests_running",
    "num_requests_waiting", "kv_cache_usage_perc", "models": [...]}``."""
    models = [model_load(runtime) for runtime in runtimes]
    return {"server_load": sum(m["server_load"] for m in models),
            "num_requests_running": sum(m["num_requests_running"] for m in models),
            "num_requests_waiting": sum(m["num_requests_waiting"] for m in models),
            "kv_cache_usage_perc": max((m["kv_cache_usage_perc"] for m in models), default=0.0),
            "models": models}


def orca_header(metrics_format: str, figures: dict[str, Any]) -> tuple[bytes, bytes] | None:
    """The ``endpoint-load-metrics`` header for ``figures`` (a :func:`report` or :func:`model_load`) in
    ``metrics_format`` (``TEXT`` or ``JSON``, any case); None for another format."""
    kind = metrics_format.strip().lower()
    named = {name: float(figures.get(name, 0.0)) for name in ORCA_METRICS}
    if kind == "text":
        value = "TEXT " + ", ".join(f"named_metrics.{name}={number}" for name, number in named.items())
    elif kind == "json":
        value = "JSON " + json.dumps({"named_metrics": named})
    else:
        return None
    return REPORT_HEADER.encode(), value.encode()


def requested_format(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The value of the request's ``endpoint-load-metrics-format`` header ("" when absent)."""
    wanted = FORMAT_HEADER.encode()
    for key, value in headers:
        if key.lower() == wanted:
            return value.decode("latin-1")
    return ""
