"""vLLM's own Prometheus stat logger, writing the ``vllm:*`` families into a registry of one model version.

vLLM's ``PrometheusStatLogger`` makes the families its OpenAI server exports (names, types, labels
``model_name`` and ``engine``, buckets) and fills them from each engine step's scheduler and iteration
stats. It registers them in prometheus_client's process-wide registry, which one server with several
vLLM models cannot share (each engine's logger would drop the others'). :func:`prometheus_logger`
builds a subclass whose metric classes register in the model's own registry instead; the server's
``/metrics`` merges the models' registries (:class:`tideserve.llm_backends.metrics.EngineFamilies`).
Nothing is recomputed here: the engine's logger records every value.
"""

from __future__ import annotations

from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.v1.metrics.loggers import PrometheusStatLogger

_METRIC_CLASSES = {"_gauge_cls": Gauge, "_counter_cls": Counter, "_histogram_cls": Histogram}
# the helpers PrometheusStatLogger builds its optional families with (speculative decoding, KV / EC
# connectors, performance estimates): each makes its metrics through the same three attributes
_HELPERS = ("_spec_decoding_cls", "_kv_connector_cls", "_ec_connector_cls", "_perf_metrics_cls")


def _registering_in(cls: type, registry: CollectorRegistry) -> type:
    """A subclass of ``cls`` whose metric classes (those it has) register in ``registry``."""
    overrides = {attr: partial(metric, registry=registry) for attr, metric in _METRIC_CLASSES.items()
                 if hasattr(cls, attr)}
    return type(cls.__name__, (cls,), overrides)


def prometheus_logger(registry: CollectorRegistry) -> type[PrometheusStatLogger]:
    """A ``PrometheusStatLogger`` class (a stat-logger factory for ``AsyncLLM``) writing into ``registry``."""
    overrides = {attr: partial(metric, registry=registry) for attr, metric in _METRIC_CLASSES.items()}
    for helper in _HELPERS:
        base = getattr(PrometheusStatLogger, helper, None)
        if isinstance(base, type):
            overrides[helper] = _registering_in(base, registry)
    return type("ModelPrometheusStatLogger", (PrometheusStatLogger,), overrides)
