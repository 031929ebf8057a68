"""The ``onnxruntime`` backend: ``<model>/<version>/model.onnx`` served with ONNX Runtime.

The model reads its session settings once; each instance opens its own ``InferenceSession`` (on
its own worker thread, so instances run in parallel: ONNX Runtime releases the GIL while it runs)
and checks the config against the graph the session loaded. Batches come concatenated along the
batch dimension from :class:`~tideserve.batching.TensorModelInstance`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as ort_errors
from tritonclient.grpc import model_config_pb2 as mc

from tideserve.backend_api import (Backend, InternalError, InvalidArgument, Model, TensorModelInstance, Unavailable,
                                   config_to_datatype)

from .session import CPU, SessionSettings
from .signature import DEFAULT_MAX_BATCH_SIZE, auto_complete, check_config
from .tensors import GraphTensor, from_onnx, graph_tensor, to_onnx

log = logging.getLogger(__name__)

DEFAULT_MODEL_FILE = "model.onnx"
PLATFORM = "onnxruntime_onnx"
# What ONNX Runtime raises: its own status exceptions (no common base but Exception), and the
# Python errors its bindings raise for bad arguments.
ORT_ERRORS = tuple(getattr(ort_errors, name) for name in (
    "Fail", "InvalidArgument", "NoSuchFile", "NoModel", "EngineError", "RuntimeException", "InvalidProtobuf",
    "ModelLoaded", "NotImplemented", "InvalidGraph", "EPFail", "ModelLoadCanceled", "ModelRequiresCompilation",
    "NotFound") if hasattr(ort_errors, name)) + (RuntimeError, ValueError, TypeError, OSError)


def open_session(model: str, path: Path, options: ort.SessionOptions, providers: list) -> ort.InferenceSession:
    """An ``InferenceSession`` for ``path``; a file ONNX Runtime cannot load is a load error naming it."""
    try:
        return ort.InferenceSession(str(path), sess_options=options, providers=providers)
    except ORT_ERRORS as exc:
        raise InvalidArgument(f"unable to load model '{model}': ONNX Runtime cannot load '{path}': "
                              f"{type(exc).__name__}: {exc}") from None


def signature(session: ort.InferenceSession) -> tuple[list[GraphTensor], list[GraphTensor], list[GraphTensor]]:
    """The graph's inputs, outputs and overridable initializers (inputs a request may set)."""
    return ([graph_tensor(a) for a in session.get_inputs()], [graph_tensor(a) for a in session.get_outputs()],
            [graph_tensor(a) for a in session.get_overridable_initializers()])


class OnnxInstance(TensorModelInstance):
    """One ONNX Runtime session; runs each batch with one ``session.run``."""

    model: OnnxModel
    releases_gil = True  # session.run lets the GIL go for the whole run

    def __init__(self, model: OnnxModel, ctx) -> None:
        super().__init__(model, ctx)
        config = model.config
        self.output_names = [t.name for t in config.output]
        for state in config.sequence_batching.state:  # implicit state: the scheduler keeps it
            if state.output_name not in self.output_names:
                self.output_names.append(state.output_name)
                self.output_datatypes[state.output_name] = config_to_datatype(mc.DataType.Name(state.data_type))
        self.batched = config.max_batch_size > 0
        self.reshaped = {t.name: tuple(t.dims) for t in config.output if t.HasField("reshape")}
        self.session: ort.InferenceSession | None = None
        self.run_options: ort.RunOptions | None = None

    def initialize(self) -> None:
        model, settings = self.model, self.model.settings
        providers = settings.providers(self.ctx.kind, self.ctx.device_id)
        self.session = open_session(model.ctx.name, model.model_file(), settings.session_options(), providers)
        check_config(model.config, *signature(self.session))
        self.run_options = settings.run_options()
        log.info("model '%s' instance '%s': ONNX Runtime session on %s (intra-op threads %d)",
                 model.ctx.name, self.ctx.name, self.session.get_providers(), settings.intra_op_threads)

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feeds = {name: to_onnx(name, array) for name, array in inputs.items()}
        try:
            results = self.session.run(self.output_names, feeds, self.run_options)
        except ort_errors.InvalidArgument as exc:
            raise InvalidArgument(f"model '{self.model.ctx.name}': ONNX Runtime rejected the inputs: {exc}") from None
        except ORT_ERRORS as exc:  # Fail, RuntimeException...: the model failed on input it accepted
            raise InternalError(f"model '{self.model.ctx.name}': ONNX Runtime failed: {exc}") from None
        return {name: self._config_shape(name, from_onnx(array)) for name, array in zip(self.output_names, results)}

    def _config_shape(self, name: str, array: np.ndarray) -> np.ndarray:
        """An output with a config ``reshape`` goes out in the config's ``dims`` (per batch row)."""
        dims = self.reshaped.get(name)
        if dims is None or list(dims).count(-1) > 1:
            return array
        shape = ((array.shape[0] if array.ndim else 1), *dims) if self.batched else dims
        return array.reshape(shape)

    def finalize(self) -> None:
        self.session = None


class OnnxModel(Model):
    """One version of an ONNX model: its file, its session settings, its auto-completed config."""

    instance_class = OnnxInstance
    settings: SessionSettings

    def default_max_batch_size(self) -> int:
        """The max_batch_size auto-complete gives a model that can batch: ``--backend-config
        onnxruntime,default-max-batch-size=N`` (or the global one), else Triton's 4."""
        text = self.backend.settings.get("default-max-batch-size")
        if text is None:
            return DEFAULT_MAX_BATCH_SIZE
        try:
            value = int(text)
        except ValueError:
            raise InvalidArgument(f"--backend-config default-max-batch-size must be an integer, got '{text}'") from None
        if value < 0:
            raise InvalidArgument(f"--backend-config default-max-batch-size must be >= 0, got {value}")
        return value

    def model_file(self) -> Path:
        """``<version>/<default_model_filename>``; a directory there holds ``model.onnx``, as in Triton."""
        path = self.ctx.version_path / (self.config.default_model_filename or DEFAULT_MODEL_FILE)
        if path.is_dir():
            path = path / DEFAULT_MODEL_FILE
        if not path.is_file():
            raise Unavailable(f"unable to find '{path}' for model '{self.ctx.name}'")
        return path

    def auto_complete_config(self) -> None:
        config = self.config
        if not config.platform:  # as Triton names it (model metadata reports the platform)
            config.platform = PLATFORM
        if (config.input or config.batch_input) and config.output:
            return
        probe = ort.SessionOptions()  # only the signature is needed: skip optimisation, one thread
        probe.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        probe.intra_op_num_threads = 1
        session = open_session(self.ctx.name, self.model_file(), probe, [CPU])
        inputs, outputs, _ = signature(session)
        auto_complete(config, inputs, outputs, self.default_max_batch_size())
        log.debug("model '%s' auto-completed config: %s", self.ctx.name, config)

    def initialize(self) -> None:
        self.settings = SessionSettings.from_config(self.config)
        self.model_file()  # a missing file fails here, once, rather than in every instance


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"
    model_class = OnnxModel

    def initialize(self) -> None:
        log.info("onnxruntime %s, execution providers %s", ort.__version__, ort.get_available_providers())


