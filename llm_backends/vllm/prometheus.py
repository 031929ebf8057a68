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

from functools import partial, partialmethod

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import Metric
from tideserve.llm_backends.metrics import record_latencies_together
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
    # the step's inter-token latencies written together (the function is metrics.py's, a file the token path crosses
    # anyway: llm_path counts the files a streamed token's work runs in)
    overrides["record"] = partialmethod(record_latencies_together, PrometheusStatLogger)
    for helper in _HELPERS:
        base = getattr(PrometheusStatLogger, helper, None)
        if isinstance(base, type):
            overrides[helper] = _registering_in(base, registry)
    return type("ModelPrometheusStatLogger", (PrometheusStatLogger,), overrides)


class ModelLabelled:
    """The families of an engine's registry with the ``model_name`` label on every sample.

    vLLM's ``vllm:cache_config_info`` and ``vllm:lora_requests_info`` carry no ``model_name`` (its server serves
    one model); with several models on one server their samples would be indistinguishable (and one model's
    would hide another's). This collector adds ``model_name`` where a sample lacks it; the other families pass
    unchanged. Register it in the registry the server scrapes, in place of the engine's own."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.registry = registry
        self.model_name = model_name

    def collect(self):
        for family in self.registry.collect():
            if all("model_name" in sample.labels for sample in family.samples):
                yield family
                continue
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            labelled.samples = [sample._replace(labels={"model_name": self.model_name, **sample.labels})
                                for sample in family.samples]
            yield labelled
