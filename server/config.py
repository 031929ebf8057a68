"""Model configuration: Triton's ``ModelConfig`` message read from ``config.pbtxt``.

Parsing is protobuf text format against the message shipped with ``tritonclient`` (no
hand-written parser). :func:`normalize` fills the defaults Triton fills and :func:`validate`
holds every cross-field check in one place.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from google.protobuf import json_format, text_format
from google.protobuf.descriptor import FieldDescriptor
from tritonclient.grpc import model_config_pb2 as mc

from .errors import InvalidArgument

ModelConfig = mc.ModelConfig

CONFIG_FILE = "config.pbtxt"

# platform -> backend, as Triton resolves them
PLATFORM_BACKENDS = {
    "onnxruntime_onnx": "onnxruntime",
    "pytorch_libtorch": "pytorch",
    "tensorrt_plan": "tensorrt",
    "tensorflow_savedmodel": "tensorflow",
    "tensorflow_graphdef": "tensorflow",
}
# default model file name per backend, as Triton names them
DEFAULT_MODEL_FILES = {
    "onnxruntime": "model.onnx",
    "pytorch": "model.pt",
    "tensorrt": "model.plan",
    "python": "model.py",
}


def parse_text(text: str, source: str = CONFIG_FILE) -> mc.ModelConfig:
    config = mc.ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        raise InvalidArgument(f"failed to parse {source}: {exc}") from None
    return config


def parse_json(text: str | bytes, source: str = "config override") -> mc.ModelConfig:
    config = mc.ModelConfig()
    try:
        doc = json.loads(text)
        if not isinstance(doc, dict):  # json_format takes a JSON array as an empty message
            raise ValueError(f"the configuration must be a JSON object, got {json.dumps(doc)[:40]}")
        json_format.ParseDict(doc, config)
    except (json_format.ParseError, ValueError) as exc:
        raise InvalidArgument(f"failed to parse {source}: {exc}") from None
    return config


def read_config(model_dir: Path) -> mc.ModelConfig:
    """Read ``<model_dir>/config.pbtxt``; an absent file gives an empty config to auto-complete."""
    path = model_dir / CONFIG_FILE
    if not path.exists():
        return mc.ModelConfig()
    return parse_text(path.read_text(encoding="utf-8"), str(path))


def to_dict(message) -> dict[str, Any]:
    """A message as JSON-ready dict with proto field names and int64 values as numbers."""
    data = json_format.MessageToDict(message, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)
    return _fix_int64(message.DESCRIPTOR, data)


def to_json(message) -> str:
    return json.dumps(to_dict(message))


_INT64_TYPES = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
                FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}


def _fix_int64(descriptor, data: dict) -> dict:
    for field in descriptor.fields:
        if field.name not in data:
            continue
        value = data[field.name]
        if field.type in _INT64_TYPES:
            data[field.name] = [int(v) for v in value] if isinstance(value, list) else int(value)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            sub = field.message_type
            if sub.GetOptions().map_entry:
                value_field = sub.fields_by_name["value"]
                if value_field.type == FieldDescriptor.TYPE_MESSAGE:
                    for key in value:
                        _fix_int64(value_field.message_type, value[key])
                elif value_field.type in _INT64_TYPES:
                    data[field.name] = {k: int(v) for k, v in value.items()}
            elif isinstance(value, list):
                for item in value:
                    _fix_int64(sub, item)
            elif isinstance(value, dict):
                _fix_int64(sub, value)
    return data


def resolve_backend(config: mc.ModelConfig, model_dir: Path) -> str:
    """The backend name: ``backend``, else derived from ``platform``, else ``model.py`` -> python."""
    if config.backend:
        return config.backend
    if config.platform == "ensemble":
        return "ensemble"
    if config.platform:
        if config.platform in PLATFORM_BACKENDS:
            return PLATFORM_BACKENDS[config.platform]
        raise InvalidArgument(f"unknown platform '{config.platform}'")
    if any((p / "model.py").exists() for p in model_dir.iterdir() if p.is_dir()):
        return "python"
    raise InvalidArgument("the model configuration must name a 'backend' or a 'platform'")


def normalize(config: mc.ModelConfig, model_name: str, model_dir: Path) -> mc.ModelConfig:
    """Fill Triton's defaults (name, backend, version policy, instance groups)."""
    if not config.name:
        config.name = model_name
    elif config.name != model_name:
        raise InvalidArgument(
            f"model name '{config.name}' in {CONFIG_FILE} does not match the directory name '{model_name}'")
    config.backend = resolve_backend(config, model_dir)
    if not config.HasField("version_policy"):
        config.version_policy.latest.num_versions = 1
    if config.platform != "ensemble" and not config.instance_group:
        config.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)
    for index, group in enumerate(config.instance_group):
        if not group.name:
            group.name = f"{config.name}_{index}"
        if group.kind == mc.ModelInstanceGroup.KIND_AUTO:
            group.kind = mc.ModelInstanceGroup.KIND_CPU
        if group.count == 0:  # proto3 default: Triton reads an unset count as 1
            group.count = 1
    if not config.default_model_filename and config.backend in DEFAULT_MODEL_FILES:
        config.default_model_filename = DEFAULT_MODEL_FILES[config.backend]
    return config


def validate(config: mc.ModelConfig) -> None:
    """Cross-field checks; raises InvalidArgument naming the field."""
    name = config.name
    if config.max_batch_size < 0:
        raise InvalidArgument(f"model '{name}': max_batch_size must be >= 0")
    for kind, tensors in (("input", config.input), ("output", config.output)):
        seen = set()
        for tensor in tensors:
            if not tensor.name:
                raise InvalidArgument(f"model '{name}': an {kind} has no name")
            if tensor.name in seen:
                raise InvalidArgument(f"model '{name}': duplicate {kind} '{tensor.name}'")
            seen.add(tensor.name)
            if tensor.data_type == mc.TYPE_INVALID:
                raise InvalidArgument(f"model '{name}': {kind} '{tensor.name}' must specify 'data_type'")
            if any(d < -1 for d in tensor.dims):
                raise InvalidArgument(f"model '{name}': {kind} '{tensor.name}' has invalid dims {list(tensor.dims)}")
            if tensor.HasField("reshape"):
                _check_reshape(name, kind, tensor)
    if config.HasField("dynamic_batching"):
        _validate_dynamic_batching(config)
    for group in config.instance_group:
        if group.count < 0:
            raise InvalidArgument(f"model '{name}': instance_group '{group.name}' count must be >= 1")
    policy = config.version_policy
    if policy.HasField("latest") and policy.latest.num_versions < 1:
        raise InvalidArgument(f"model '{name}': version_policy latest num_versions must be >= 1")
    _check_output_parsers(config)


def _check_output_parsers(config: mc.ModelConfig) -> None:
    """The parameters ``tool_call_parser`` / ``reasoning_parser`` (the OpenAI frontend's) name known parsers."""
    from .reasoning_parsers import REASONING_PARSERS
    from .tool_parsers import TOOL_PARSERS

    for key, known in (("tool_call_parser", TOOL_PARSERS), ("reasoning_parser", REASONING_PARSERS)):
        value = config.parameters[key].string_value if key in config.parameters else ""
        if value and value not in known:
            raise InvalidArgument(f"model '{config.name}': parameter '{key}' names an unknown parser '{value}' "
                                  f"(known: {', '.join(known)})")


def _check_reshape(name: str, kind: str, tensor) -> None:
    def count(dims):
        total = 1
        for d in dims:
            if d == -1:
                return None
            total *= d
        return total

    a, b = count(tensor.dims), count(tensor.reshape.shape)
    if a is not None and b is not None and a != b:
        raise InvalidArgument(
            f"model '{name}': {kind} '{tensor.name}' reshape {list(tensor.reshape.shape)} "
            f"has a different element count than dims {list(tensor.dims)}")


def _validate_dynamic_batching(config: mc.ModelConfig) -> None:
    name, db = config.name, config.dynamic_batching
    if config.max_batch_size == 0:
        raise InvalidArgument(
            f"model '{name}': dynamic_batching requires max_batch_size > 0 (the model does not batch)")
    for size in db.preferred_batch_size:
        if size < 1 or size > config.max_batch_size:
            raise InvalidArgument(
                f"model '{name}': preferred_batch_size {size} must be in [1, max_batch_size={config.max_batch_size}]")
    if db.priority_levels:
        if not 1 <= db.default_priority_level <= db.priority_levels:
            raise InvalidArgument(
                f"model '{name}': default_priority_level must be in [1, priority_levels={db.priority_levels}]")
        for level in db.priority_queue_policy:
            if not 1 <= level <= db.priority_levels:
                raise InvalidArgument(
                    f"model '{name}': priority_queue_policy level {level} is outside [1, {db.priority_levels}]")
    elif db.default_priority_level:
        raise InvalidArgument(f"model '{name}': default_priority_level is set but priority_levels is 0")
