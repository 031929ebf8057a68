"""The ``pytorch`` backend: TorchScript models (``<version>/model.pt``) as Triton's PyTorch backend runs them.

A model loads its file once on the CPU to read ``forward()``'s signature and bind the config's tensor
names to it (:mod:`.naming`); a bad file or names that cannot bind make the model UNAVAILABLE with
the reason. Each instance then holds its own copy of the module on its device (``KIND_CPU``: cpu,
``KIND_GPU``: ``cuda:<device_id>``, ``KIND_MODEL``: where the file put it), unless
``ENABLE_WEIGHT_SHARING`` lets instances on one device share it. Instances run on threads of their
own; TorchScript releases the GIL while it runs, so instances execute in parallel.

A batch (the dynamic batcher's requests concatenated along dimension 0, by
:class:`~tideserve.batching.TensorModelInstance`) becomes one ``forward()`` call under
``torch.inference_mode()``. Outputs are the tensors ``forward()`` returned, copied to numpy as they are.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tritonclient.grpc import model_config_pb2 as mc

from tideserve.backend_api import (
    Backend,
    InstanceContext,
    InternalError,
    InvalidArgument,
    Model,
    TensorModelInstance,
    Unavailable,
    config_to_datatype,
)

from .naming import Argument, InputBinding, OutputBinding, bind_inputs, bind_outputs
from .options import TorchOptions

log = logging.getLogger(__name__)

# torch dtype -> Triton datatype (BF16 has no numpy dtype, so it cannot cross the wire here)
TORCH_DATATYPES: dict[torch.dtype, str] = {
    torch.bool: "BOOL", torch.uint8: "UINT8", torch.uint16: "UINT16", torch.uint32: "UINT32",
    torch.uint64: "UINT64", torch.int8: "INT8", torch.int16: "INT16", torch.int32: "INT32", torch.int64: "INT64",
    torch.float16: "FP16", torch.float32: "FP32", torch.float64: "FP64",
}
SUPPORTED_DATATYPES = frozenset(TORCH_DATATYPES.values()) | {"BYTES"}  # BYTES: a List[str] argument or result


def model_file(ctx) -> Path:
    """``<model>/<version>/<default_model_filename or model.pt>``."""
    path = ctx.version_path / (ctx.config.default_model_filename or "model.pt")
    if not path.is_file():
        raise Unavailable(f"model '{ctx.name}' version {ctx.version}: TorchScript file {path} not found")
    return path


def load_module(path: Path, map_location: torch.device | str | None) -> torch.jit.ScriptModule:
    try:
        return torch.jit.load(str(path), map_location=map_location)
    except Exception as exc:  # torch raises RuntimeError, ValueError... for a file it cannot read
        raise Unavailable(f"failed to load TorchScript model {path}: {type(exc).__name__}: {exc}. model.pt must "
                          f"be a TorchScript module saved with torch.jit.script(...).save() or "
                          f"torch.jit.trace(...).save()") from exc


def forward_arguments(module: torch.jit.ScriptModule) -> list[Argument]:
    """``forward()``'s parameters as the TorchScript schema states them, ``self`` left out."""
    arguments = list(module.forward.schema.arguments)
    if arguments and arguments[0].name == "self":
        arguments = arguments[1:]
    return [Argument(a.name, str(a.type), a.has_default_value()) for a in arguments]


def instance_device(ctx: InstanceContext) -> torch.device | None:
    """The device an instance runs on; None for ``KIND_MODEL`` (the module's own placement)."""
    if ctx.kind == "KIND_GPU":
        if not torch.cuda.is_available():
            raise Unavailable(
                f"instance '{ctx.name}' is KIND_GPU, but PyTorch sees no CUDA device (torch {torch.__version__}, "
                f"CUDA {torch.version.cuda or 'not built in'}); use KIND_CPU, or a CUDA build of torch on a GPU")
        if ctx.device_id >= torch.cuda.device_count():
            raise Unavailable(f"instance '{ctx.name}' wants GPU {ctx.device_id}, but PyTorch sees "
                              f"{torch.cuda.device_count()} CUDA device(s)")
        return torch.device("cuda", ctx.device_id)
    if ctx.kind == "KIND_MODEL":
        return None
    return torch.device("cpu")


# -- tensors ---------------------------------------------------------------------------------------
def to_torch(name: str, array: np.ndarray, device: torch.device) -> torch.Tensor | list[str]:
    """A request input as ``forward()`` takes it: a tensor on ``device``, or a list of str for BYTES."""
    if array.dtype == np.object_:
        try:
            return [x.decode("utf-8") if isinstance(x, bytes) else str(x) for x in array.reshape(-1)]
        except UnicodeDecodeError as exc:
            raise InvalidArgument(f"input '{name}': BYTES elements must be UTF-8 for a List[str] argument "
                                  f"({exc})") from None
    if not array.flags.writeable or not array.flags.c_contiguous:
        array = np.array(array)  # torch wants writable memory; the request's buffer stays untouched
    tensor = torch.from_numpy(array)
    return tensor if device.type == "cpu" else tensor.to(device)


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(x, str) for x in value)


def to_numpy(name: str, value: Any) -> tuple[np.ndarray, str]:
    """One result of ``forward()`` as (numpy array, Triton datatype), the tensor's bytes unchanged."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        datatype = TORCH_DATATYPES.get(tensor.dtype)
        if datatype is None:
            raise InternalError(f"output '{name}' is a {tensor.dtype} tensor, which has no tensor datatype here")
        return tensor.numpy(), datatype
    if _is_str_list(value):
        array = np.empty(len(value), dtype=np.object_)
        array[:] = [s.encode("utf-8") for s in value]
        return array, "BYTES"
    raise InternalError(f"output '{name}' is a {type(value).__name__}; forward() must return Tensors or "
                        f"List[str] (alone, or in a tuple, list or dict)")


def flatten_result(result: Any) -> list[Any] | dict[str, Any]:
    """``forward()``'s return value as a list of results, or the dict it returned."""
    if isinstance(result, dict):
        return result
    if isinstance(result, (tuple, list)) and not _is_str_list(result):
        return list(result)
    return [result]


def pick_outputs(result: Any, binding: OutputBinding) -> dict[str, Any]:
    """The value of each config output in ``forward()``'s return value."""
    flat = flatten_result(result)
    if isinstance(flat, dict):
        if all(name in flat for name in binding.index):
            return {name: flat[name] for name in binding.index}
        flat = list(flat.values())
    picked = {}
    for name, index in binding.index.items():
        if index >= len(flat):
            raise InternalError(f"output '{name}' is result {index} of forward(), which returned {len(flat)}")
        picked[name] = flat[index]
    return picked


def client_shape(array: np.ndarray, tensor, batching: bool) -> np.ndarray:
    """An output with ``reshape`` comes out of the model in the reshape's shape; clients see its ``dims``."""
    if not tensor.HasField("reshape"):
        return array
    lead = (array.shape[0],) if batching else ()
    return array.reshape(lead + tuple(tensor.dims))


# -- the backend -----------------------------------------------------------------------------------
class PyTorchInstance(TensorModelInstance):
    """One copy of the module on one device, run on this instance's own thread."""

    model: PyTorchModel

    def initialize(self) -> None:
        self.device = instance_device(self.ctx)
        self.module = self.model.module_for(self.device)
        self.input_device = self.device if self.device is not None else _first_parameter_device(self.module)
        self.on_gpu = self.input_device.type == "cuda"
        torch.set_num_threads(self.model.options.intra_op_threads)  # OpenMP keeps it per thread: this one

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        model, options = self.model, self.model.options
        if torch.get_num_threads() != options.intra_op_threads:
            torch.set_num_threads(options.intra_op_threads)
        missing = [n for n in model.required_inputs if n not in inputs]
        if missing:
            raise InvalidArgument(f"input '{missing[0]}' is required: forward() argument "
                                  f"'{model.inputs.arguments[missing[0]]}' has no default")
        tensors = {name: to_torch(name, array, self.input_device) for name, array in inputs.items()}
        with self._execution_mode():
            try:
                if model.inputs.dict_input:
                    result = self.module(tensors)
                else:
                    result = self.module(**{model.inputs.arguments[n]: t for n, t in tensors.items()})
            except RuntimeError as exc:
                raise InternalError(f"PyTorch execute failure: {exc}") from exc
        outputs = {}
        for name, value in pick_outputs(result, model.outputs).items():
            array, datatype = to_numpy(name, value)
            expected = self.output_datatypes[name]
            if datatype != expected:
                raise InternalError(f"configuration expects datatype TYPE_{expected} for output '{name}', "
                                    f"model provides TYPE_{datatype}")
            outputs[name] = client_shape(array, model.output_specs[name], model.config.max_batch_size > 0)
        if options.cache_cleaning and self.on_gpu:
            torch.cuda.empty_cache()
        return outputs

    @contextlib.contextmanager
    def _execution_mode(self):
        """Triton's per-execution switches: cuDNN and JIT flags (process-wide, only those the config sets),
        inference mode or no_grad, optimized execution (this thread)."""
        options = self.model.options
        if self.on_gpu:
            torch.backends.cudnn.enabled = options.cudnn
        if options.tensor_fuser is not None:
            torch._C._jit_set_texpr_fuser_enabled(options.tensor_fuser)
        if options.jit_profiling is not None:
            torch._C._jit_set_profiling_mode(options.jit_profiling)
        if options.jit_executor is not None:
            torch._C._jit_set_profiling_executor(options.jit_executor)
        grad_mode = torch.inference_mode() if options.inference_mode else torch.no_grad()
        with grad_mode, torch.jit.optimized_execution(options.optimized_execution):
            yield

    def finalize(self) -> None:
        self.module = None
        if getattr(self, "on_gpu", False):
            torch.cuda.empty_cache()


def _first_parameter_device(module: torch.jit.ScriptModule) -> torch.device:
    for parameter in module.parameters():
        return parameter.device
    return torch.device("cpu")


class PyTorchModel(Model):
    """A TorchScript file, its names bound to ``forward()``, and the modules its instances share or copy."""

    instance_class = PyTorchInstance

    def __init__(self, backend: Backend, ctx) -> None:
        super().__init__(backend, ctx)
        self._lock = threading.Lock()
        self._spare: torch.jit.ScriptModule | None = None  # loaded to read forward(); the first CPU instance takes it
        self._shared: dict[str, torch.jit.ScriptModule] = {}  # device -> module, with ENABLE_WEIGHT_SHARING

    def initialize(self) -> None:
        config = self.config
        self.options = TorchOptions.from_context(self.ctx)
        _check_datatypes(config)
        self.path = model_file(self.ctx)
        module = load_module(self.path, "cpu")
        arguments = forward_arguments(module)
        input_names = [t.name for t in config.input] + [n for b in config.batch_input for n in b.target_name]
        self.inputs: InputBinding = bind_inputs(config.name, input_names, arguments)
        self.outputs: OutputBinding = bind_outputs(config.name, [t.name for t in config.output])
        self.output_specs = {t.name: t for t in config.output}
        defaults = {a.name for a in arguments if a.has_default}
        self.required_inputs = [] if self.inputs.dict_input else [
            n for n, arg in self.inputs.arguments.items() if arg not in defaults]
        log.info("model '%s': inputs bind by %s, outputs by %s", config.name, self.inputs.convention,
                 self.outputs.convention)
        set_interop_threads(self.options.inter_op_threads, config.name)
        if any(g.kind == mc.ModelInstanceGroup.KIND_CPU for g in config.instance_group):
            self._spare = module  # else nobody takes it: let it go rather than hold a CPU copy

    def module_for(self, device: torch.device | None) -> torch.jit.ScriptModule:
        """The module an instance on ``device`` runs: shared per device with ENABLE_WEIGHT_SHARING, else its own."""
        key = str(device) if device is not None else "model"
        with self._lock:
            if self.options.weight_sharing and key in self._shared:
                return self._shared[key]
            if key == "cpu" and self._spare is not None:
                module, self._spare = self._spare, None
            else:
                module = load_module(self.path, device)
            if self.options.weight_sharing:
                self._shared[key] = module
            return module

    def finalize(self) -> None:
        self._spare = None
        self._shared.clear()


def _check_datatypes(config: mc.ModelConfig) -> None:
    for kind, tensors in (("input", config.input), ("output", config.output)):
        for tensor in tensors:
            datatype = config_to_datatype(mc.DataType.Name(tensor.data_type))
            if datatype not in SUPPORTED_DATATYPES:
                raise InvalidArgument(f"model '{config.name}': unsupported datatype "
                                      f"{mc.DataType.Name(tensor.data_type)} for {kind} '{tensor.name}'")


_interop_lock = threading.Lock()


def set_interop_threads(count: int | None, model: str) -> None:
    """``torch.set_num_interop_threads`` once per process (PyTorch refuses a second call)."""
    if count is None:
        return
    with _interop_lock:
        if torch.get_num_interop_threads() == count:
            return
        try:
            torch.set_num_interop_threads(count)
        except RuntimeError as exc:
            log.warning("model '%s': INTER_OP_THREAD_COUNT %d ignored, the process keeps %d inter-op threads (%s)",
                        model, count, torch.get_num_interop_threads(), exc)


class PyTorchBackend(Backend):
    """``backend: "pytorch"`` / ``platform: "pytorch_libtorch"``."""

    model_class = PyTorchModel
