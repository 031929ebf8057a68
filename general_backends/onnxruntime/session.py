"""ONNX Runtime session settings read from a Triton model config, in Triton's terms.

Model-level ``parameters``: ``intra_op_thread_count``, ``inter_op_thread_count``, ``execution_mode``
(0 sequential, 1 parallel), ``enable_mem_arena``, ``enable_mem_pattern``, any ``session.*`` key
(a session config entry), any ``memory.*`` key (a run config entry), and the CUDA options Triton
still reads there (``cudnn_conv_algo_search``, ``gpu_mem_limit``, ``arena_extend_strategy``,
``do_copy_in_default_stream``). ``optimization { graph { level } }``: -1 basic, 1 extended,
2 none, otherwise all. ``optimization { execution_accelerators { ... } }``: ``tensorrt`` and
``cuda`` for GPU instances, ``openvino`` for CPU instances.

Unlike Triton, an unset thread count is not "all cores": the cores are shared among the model's
CPU instances, so several instances do not oversubscribe a small machine. ``"0"`` asks for
ONNX Runtime's own default.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import onnxruntime as ort
from tritonclient.grpc import model_config_pb2 as mc

from tideserve.backend_api import InvalidArgument, Unavailable

log = logging.getLogger(__name__)

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
TENSORRT = "TensorrtExecutionProvider"
OPENVINO = "OpenVINOExecutionProvider"

_GRAPH_LEVELS = {
    -1: ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    1: ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    2: ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
}
_CUDA_MODEL_PARAMETERS = ("cudnn_conv_algo_search", "gpu_mem_limit", "arena_extend_strategy",
                          "do_copy_in_default_stream")
_TRT_PRECISIONS = {"FP32": None, "FP16": "trt_fp16_enable", "BF16": "trt_bf16_enable", "INT8": "trt_int8_enable"}
_TRT_RENAMED = {
    "max_workspace_size_bytes": "trt_max_workspace_size",
    "int8_calibration_table_name": "trt_int8_calibration_table_name",
    "int8_use_native_calibration_table": "trt_int8_use_native_calibration_table",
}
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def cpu_instance_count(config: mc.ModelConfig) -> int:
    """How many CPU instances the model's instance groups make (at least 1)."""
    count = sum(g.count * max(len(g.gpus), 1) for g in config.instance_group
                if g.kind != mc.ModelInstanceGroup.KIND_GPU)
    return max(count, 1)


@dataclass
class SessionSettings:
    """Everything an instance needs to open its session; built once per model version."""

    model: str
    graph_level: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    parallel: bool = False
    intra_op_threads: int = 0  # 0: ONNX Runtime's default
    inter_op_threads: int = 0
    mem_arena: bool | None = None  # None: ONNX Runtime's default
    mem_pattern: bool | None = None
    session_entries: dict[str, str] = field(default_factory=dict)
    run_entries: dict[str, str] = field(default_factory=dict)
    cuda_options: dict[str, str] = field(default_factory=dict)
    tensorrt_options: dict[str, str] | None = None  # None: TensorRT not asked for
    openvino_options: dict[str, str] | None = None

    @classmethod
    def from_config(cls, config: mc.ModelConfig, cores: int | None = None) -> SessionSettings:
        settings = cls(config.name)
        params = {key: value.string_value for key, value in config.parameters.items()}
        settings.graph_level = _GRAPH_LEVELS.get(config.optimization.graph.level, settings.graph_level)
        mode = _int(config.name, params, "execution_mode", 0)
        if mode not in (0, 1):
            raise InvalidArgument(f"model '{config.name}': execution_mode must be 0 (sequential) or 1 (parallel), "
                                  f"got {mode}")
        settings.parallel = mode == 1
        shared = max(1, (cores or available_cores()) // cpu_instance_count(config))
        settings.intra_op_threads = _int(config.name, params, "intra_op_thread_count", shared)
        settings.inter_op_threads = _int(config.name, params, "inter_op_thread_count", shared)
        settings.mem_arena = _bool(config.name, params, "enable_mem_arena")
        settings.mem_pattern = _bool(config.name, params, "enable_mem_pattern")
        settings.session_entries = {k: v for k, v in params.items() if k.startswith("session.")}
        settings.run_entries = {k: v for k, v in params.items() if k.startswith("memory.")}
        settings.cuda_options = {k: params[k] for k in _CUDA_MODEL_PARAMETERS if k in params}
        settings._read_accelerators(config.optimization.execution_accelerators)
        return settings

    def _read_accelerators(self, accelerators: mc.ModelOptimizationPolicy.ExecutionAccelerators) -> None:
        for accelerator in accelerators.gpu_execution_accelerator:
            options = dict(accelerator.parameters)
            if accelerator.name == "tensorrt":
                self.tensorrt_options = _tensorrt_options(self.model, options)
            elif accelerator.name == "cuda":
                self.cuda_options.update(options)
            else:
                raise InvalidArgument(f"model '{self.model}': unknown gpu_execution_accelerator "
                                      f"'{accelerator.name}' (known: tensorrt, cuda)")
        for accelerator in accelerators.cpu_execution_accelerator:
            if accelerator.name == "openvino":
                self.openvino_options = dict(accelerator.parameters)
            else:
                raise InvalidArgument(f"model '{self.model}': unknown cpu_execution_accelerator "
                                      f"'{accelerator.name}' (known: openvino)")

    def session_options(self) -> ort.SessionOptions:
        options = ort.SessionOptions()
        options.graph_optimization_level = self.graph_level
        options.execution_mode = ort.ExecutionMode.ORT_PARALLEL if self.parallel else ort.ExecutionMode.ORT_SEQUENTIAL
        options.intra_op_num_threads = self.intra_op_threads
        options.inter_op_num_threads = self.inter_op_threads
        if self.mem_arena is not None:
            options.enable_cpu_mem_arena = self.mem_arena
        if self.mem_pattern is not None:
            options.enable_mem_pattern = self.mem_pattern
        for key, value in self.session_entries.items():
            options.add_session_config_entry(key, value)
        return options

    def run_options(self) -> ort.RunOptions | None:
        if not self.run_entries:
            return None
        options = ort.RunOptions()
        for key, value in self.run_entries.items():
            options.add_run_config_entry(key, value)
        return options

    def providers(self, kind: str, device_id: int, available: list[str] | None = None) -> list:
        """Execution providers, best first, for an instance of ``kind`` on ``device_id``."""
        available = ort.get_available_providers() if available is None else available
        providers: list = []
        if kind == "KIND_GPU":
            if CUDA not in available:
                raise Unavailable(
                    f"model '{self.model}': instance kind KIND_GPU needs ONNX Runtime's CUDA execution provider, "
                    f"which this onnxruntime lacks (it has {available}); install onnxruntime-gpu or use KIND_CPU")
            if self.tensorrt_options is not None:
                _require(self.model, TENSORRT, available, "the tensorrt gpu_execution_accelerator")
                providers.append((TENSORRT, {**self.tensorrt_options, "device_id": str(device_id)}))
            providers.append((CUDA, {**self.cuda_options, "device_id": str(device_id)}))
        elif self.openvino_options is not None:
            _require(self.model, OPENVINO, available, "the openvino cpu_execution_accelerator")
            providers.append((OPENVINO, dict(self.openvino_options)))
        providers.append(CPU)
        return providers


def _tensorrt_options(model: str, params: dict[str, str]) -> dict[str, str]:
    """Triton's TensorRT accelerator parameters as ONNX Runtime TensorRT provider options."""
    options = {}
    for key, value in params.items():
        if key == "precision_mode":
            if value not in _TRT_PRECISIONS:
                raise InvalidArgument(f"model '{model}': unsupported TensorRT precision_mode '{value}' "
                                      f"(known: {', '.join(_TRT_PRECISIONS)})")
            if _TRT_PRECISIONS[value]:
                options[_TRT_PRECISIONS[value]] = "1"
        elif key in _TRT_RENAMED:
            options[_TRT_RENAMED[key]] = value
        elif key.startswith("trt_"):
            options[key] = value
        else:
            raise InvalidArgument(f"model '{model}': unknown TensorRT accelerator parameter '{key}'")
    return options


def _require(model: str, provider: str, available: list[str], what: str) -> None:
    if provider not in available:
        raise Unavailable(f"model '{model}': {what} needs ONNX Runtime's {provider}, which this onnxruntime "
                          f"lacks (it has {available})")


def _int(model: str, params: dict[str, str], key: str, default: int) -> int:
    if key not in params:
        return default
    try:
        value = int(params[key])
    except ValueError:
        raise InvalidArgument(f"model '{model}': parameter '{key}' must be an integer, got '{params[key]}'") from None
    if value < 0:
        raise InvalidArgument(f"model '{model}': parameter '{key}' must be >= 0, got {value}")
    return value


def _bool(model: str, params: dict[str, str], key: str) -> bool | None:
    if key not in params:
        return None
    value = params[key].strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise InvalidArgument(f"model '{model}': parameter '{key}' must be a boolean (1/0, true/false), "
                          f"got '{params[key]}'")
