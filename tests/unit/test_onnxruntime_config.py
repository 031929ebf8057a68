"""The onnxruntime backend's configuration without a server: auto-complete from the graph, session settings and
execution providers from the model configuration."""

from __future__ import annotations

import pytest

ort = pytest.importorskip("onnxruntime")

from tritonclient.grpc import model_config_pb2 as mc

from tideserve.config import parse_text
from tideserve.errors import InvalidArgument, Unavailable
from tideserve.general_backends.onnxruntime.session import SessionSettings
from tideserve.general_backends.onnxruntime.signature import auto_complete, check_config
from tideserve.general_backends.onnxruntime.tensors import GraphTensor


def test_auto_complete_rules():
    batchable = [GraphTensor("X", "tensor(float)", (-1, 3)), GraphTensor("S", "tensor(int64)", (-1,))]
    out = [GraphTensor("Y", "tensor(string)", (-1, -1))]
    config = parse_text('name: "m"')
    auto_complete(config, batchable, out)
    assert config.max_batch_size == 4 and config.HasField("dynamic_batching")
    scalar = config.input[1]  # [batch] in the graph: dims [1] with an empty reshape
    assert list(scalar.dims) == [1] and scalar.HasField("reshape") and not scalar.reshape.shape
    assert config.output[0].data_type == mc.TYPE_STRING and list(config.output[0].dims) == [-1]
    check_config(config, batchable, out)

    single = parse_text('name: "m" max_batch_size: 1')  # batch 1: no dynamic batcher added
    auto_complete(single, batchable, out)
    assert single.max_batch_size == 1 and not single.HasField("dynamic_batching")

    given = parse_text('name: "m" input { name: "X" data_type: TYPE_FP32 dims: [-1, 3] } '
                       'output { name: "Y" data_type: TYPE_STRING dims: [-1, -1] }')
    auto_complete(given, batchable, out)  # inputs and outputs given: nothing changes
    assert given.max_batch_size == 0 and len(given.input) == 1
    with pytest.raises(InvalidArgument, match="the ONNX graph's input 'S' is not in the model configuration"):
        check_config(given, batchable, out)


# -- session settings --------------------------------------------------------------------------
def _settings(text: str, cores: int = 8) -> SessionSettings:
    return SessionSettings.from_config(parse_text('name: "m"\n' + text), cores=cores)


def test_session_settings_from_config():
    default = _settings('instance_group [ { count: 2 kind: KIND_CPU }, { count: 1 kind: KIND_CPU } ]', cores=6)
    assert default.intra_op_threads == 2 and default.inter_op_threads == 2  # 6 cores among 3 instances
    assert default.graph_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL and not default.parallel
    assert _settings('instance_group [ { count: 4 } ]', cores=2).intra_op_threads == 1
    tuned = _settings("""
        optimization { graph { level: -1 } }
        parameters { key: "intra_op_thread_count" value: { string_value: "0" } }
        parameters { key: "inter_op_thread_count" value: { string_value: "3" } }
        parameters { key: "execution_mode" value: { string_value: "1" } }
        parameters { key: "enable_mem_arena" value: { string_value: "false" } }
        parameters { key: "session.use_device_allocator_for_initializers" value: { string_value: "1" } }
        parameters { key: "memory.enable_memory_arena_shrinkage" value: { string_value: "cpu:0" } }
    """)
    assert tuned.intra_op_threads == 0 and tuned.inter_op_threads == 3 and tuned.parallel
    assert tuned.graph_level == ort.GraphOptimizationLevel.ORT_ENABLE_BASIC and tuned.mem_arena is False
    options = tuned.session_options()
    assert options.execution_mode == ort.ExecutionMode.ORT_PARALLEL and options.enable_cpu_mem_arena is False
    assert options.get_session_config_entry("session.use_device_allocator_for_initializers") == "1"
    assert tuned.run_options() is not None and _settings("").run_options() is None
    assert _settings("optimization { graph { level: 2 } }").graph_level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    for bad, message in [('parameters { key: "intra_op_thread_count" value: { string_value: "many" } }',
                          "must be an integer"),
                         ('parameters { key: "enable_mem_pattern" value: { string_value: "maybe" } }',
                          "must be a boolean"),
                         ('optimization { execution_accelerators { gpu_execution_accelerator [ { name: "x" } ] } }',
                          "unknown gpu_execution_accelerator 'x'")]:
        with pytest.raises(InvalidArgument, match=message):
            _settings(bad)


def test_execution_providers():
    cpu_only = ["CPUExecutionProvider"]
    settings = _settings('parameters { key: "gpu_mem_limit" value: { string_value: "1000" } }')
    assert settings.providers("KIND_CPU", 0, cpu_only) == ["CPUExecutionProvider"]
    with pytest.raises(Unavailable, match="KIND_GPU needs ONNX Runtime's CUDA execution provider"):
        settings.providers("KIND_GPU", 0, cpu_only)
    gpu = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    assert settings.providers("KIND_GPU", 1, gpu) == [
        ("CUDAExecutionProvider", {"gpu_mem_limit": "1000", "device_id": "1"}), "CPUExecutionProvider"]
    trt = _settings("""optimization { execution_accelerators { gpu_execution_accelerator [
        { name: "tensorrt" parameters { key: "precision_mode" value: "FP16" }
          parameters { key: "max_workspace_size_bytes" value: "1073741824" }
          parameters { key: "trt_engine_cache_enable" value: "1" } } ] } }""")
    assert trt.providers("KIND_GPU", 0, gpu) == [
        ("TensorrtExecutionProvider", {"trt_fp16_enable": "1", "trt_max_workspace_size": "1073741824",
                                       "trt_engine_cache_enable": "1", "device_id": "0"}),
        ("CUDAExecutionProvider", {"device_id": "0"}), "CPUExecutionProvider"]
    assert trt.providers("KIND_CPU", 0, gpu) == ["CPUExecutionProvider"]  # GPU accelerators: GPU instances only
    with pytest.raises(Unavailable, match="TensorrtExecutionProvider"):
        trt.providers("KIND_GPU", 0, gpu[1:])
    openvino = _settings('optimization { execution_accelerators { cpu_execution_accelerator [ { name: "openvino" } ] } }')
    with pytest.raises(Unavailable, match="OpenVINOExecutionProvider"):
        openvino.providers("KIND_CPU", 0, cpu_only)
