"""The ``fil`` backend: tree models (XGBoost, LightGBM, scikit-learn via Treelite) as Triton's FIL serves them.

One FP32 input ``input__0`` [num_features] and one FP32 output ``output__0`` (see :mod:`.outputs`);
the model file is ``<version>/<default_model_filename>`` or the name Triton's FIL expects for the
``model_type``. The model loads once at model load and its instances share it where its predictor is
thread-safe; each instance predicts a whole dynamic batch at once on its own worker thread
(:class:`TensorModelInstance`), with the cores shared among the instances.
The config is checked against the model at load, so a wrong feature count or output width leaves
the model UNAVAILABLE with the reason, and the other models serve. Like Triton's FIL, the backend
does not auto-complete a config: it must declare its input, output and ``max_batch_size``.
"""

from __future__ import annotations

import logging
import os

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from tideserve.backend_api import Backend, InvalidArgument, Model, TensorModelInstance

from .forests import Forest, load_forest
from .options import MODEL_FILES, FilOptions, read_options
from .outputs import make_output, output_widths

log = logging.getLogger(__name__)

INPUT = "input__0"
OUTPUT = "output__0"


class FilInstance(TensorModelInstance):
    """Predicts one batch: rows of ``input__0`` in, ``output__0`` out."""

    forest: Forest

    def initialize(self) -> None:
        self.forest = self.model.forest if self.ctx.index == 0 else self.model.forest.for_instance()

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        model: FilModel = self.model
        rows = np.ascontiguousarray(inputs[INPUT], dtype=np.float32)
        scores = self.forest.predict(rows)
        return {OUTPUT: make_output(scores, model.options, model.output_width)}


class FilModel(Model):
    instance_class = FilInstance

    forest: Forest
    options: FilOptions
    output_width: int

    def initialize(self) -> None:
        self.options = read_options(self.ctx)
        _check_tensors(self.config)
        if any(group.kind == mc.ModelInstanceGroup.KIND_GPU for group in self.config.instance_group):
            log.warning("model '%s': KIND_GPU instances of the fil backend predict on the CPU", self.ctx.name)
        filename = self.config.default_model_filename or MODEL_FILES[self.options.model_type]
        nthread = _thread_count(self.config, self.options)
        self.forest = load_forest(self.ctx.version_path / filename, self.options, nthread)
        self.output_width = _check_dims(self.config, self.forest, self.options)
        log.info("model '%s': %s %s, %d features, %d class score(s), %s predictor, %d thread(s) per instance",
                 self.ctx.name, self.options.model_type, filename, self.forest.num_features,
                 self.forest.num_classes, self.forest.predictor, nthread)


class FilBackend(Backend):
    model_class = FilModel


def _check_tensors(config: mc.ModelConfig) -> None:
    """The tensors Triton's FIL serves: batching, one FP32 input__0 and one FP32 output__0."""
    name = config.name
    if config.max_batch_size <= 0:
        raise InvalidArgument(f"model '{name}': the fil backend needs max_batch_size > 0 (rows are batched)")
    for kind, tensors, wanted in (("input", config.input, INPUT), ("output", config.output, OUTPUT)):
        names = [t.name for t in tensors]
        if names != [wanted]:
            raise InvalidArgument(f"model '{name}': the fil backend takes exactly one {kind} '{wanted}' "
                                  f"(TYPE_FP32); the config declares {names or 'none'}")
        tensor = tensors[0]
        if tensor.data_type != mc.TYPE_FP32:
            raise InvalidArgument(f"model '{name}': {kind} '{wanted}' must be TYPE_FP32, not "
                                  f"{mc.DataType.Name(tensor.data_type)}")


def _check_dims(config: mc.ModelConfig, forest: Forest, options: FilOptions) -> int:
    """Input dims must be [num_features] and output dims one the options allow; the output width."""
    name = config.name
    dims = list(config.input[0].dims)
    if dims != [forest.num_features]:
        raise InvalidArgument(f"model '{name}': input '{INPUT}' has dims {dims}, but the model takes "
                              f"{forest.num_features} features: use dims: [ {forest.num_features} ]")
    dims = list(config.output[0].dims)
    widths = output_widths(forest.num_classes, options)
    if len(dims) != 1 or dims[0] not in widths:
        mode = ("probabilities" if options.predict_proba else "class index") if options.is_classifier \
            else "scores"
        raise InvalidArgument(f"model '{name}': output '{OUTPUT}' has dims {dims}, but this model answers "
                              f"{mode} of width {' or '.join(map(str, widths))}: use dims: [ {widths[0]} ]")
    return dims[0]


def _thread_count(config: mc.ModelConfig, options: FilOptions) -> int:
    """``cpu_nthread`` if set (<= 0: every core), else the cores shared among the model's instances."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if options.cpu_nthread is not None:
        return options.cpu_nthread if options.cpu_nthread > 0 else cores
    instances = sum(max(group.count, 1) * max(len(group.gpus), 1) for group in config.instance_group)
    return max(1, cores // max(instances, 1))
