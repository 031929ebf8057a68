"""config.pbtxt parsing against Triton's ModelConfig, defaults, and cross-field validation."""

from __future__ import annotations

import pytest

from tideserve import config
from tideserve.errors import InvalidArgument
from tideserve.repository import check_model_name, select_versions

FULL = """
name: "add_sub"
backend: "python"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
        { name: "TEXT" data_type: TYPE_STRING dims: [ -1 ] optional: true } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
version_policy: { latest: { num_versions: 2 } }
instance_group [ { count: 2 kind: KIND_CPU } ]
dynamic_batching {
  preferred_batch_size: [ 4, 8 ]
  max_queue_delay_microseconds: 100
  preserve_ordering: true
  priority_levels: 2
  default_priority_level: 2
  default_queue_policy { max_queue_size: 16 timeout_action: DELAY default_timeout_microseconds: 5000 }
  priority_queue_policy { key: 1 value: { allow_timeout_override: true } }
}
parameters { key: "k" value: { string_value: "v" } }
model_transaction_policy { decoupled: false }
"""


def test_full_config_parses_into_model_config(tmp_path):
    cfg = config.normalize(config.parse_text(FULL), "add_sub", tmp_path)
    config.validate(cfg)
    assert cfg.max_batch_size == 8 and cfg.backend == "python"
    assert [i.name for i in cfg.input] == ["INPUT0", "TEXT"] and cfg.input[1].optional
    db = cfg.dynamic_batching
    assert list(db.preferred_batch_size) == [4, 8] and db.priority_levels == 2
    assert db.default_queue_policy.max_queue_size == 16
    assert db.priority_queue_policy[1].allow_timeout_override
    assert cfg.instance_group[0].count == 2 and cfg.instance_group[0].name == "add_sub_0"
    assert cfg.parameters["k"].string_value == "v"


def test_json_form_has_proto_names_and_numeric_dims(tmp_path):
    cfg = config.normalize(config.parse_text(FULL), "add_sub", tmp_path)
    data = config.to_dict(cfg)
    assert data["input"][0]["dims"] == [4]
    assert data["input"][0]["data_type"] == "TYPE_FP32"
    assert data["dynamic_batching"]["default_queue_policy"]["default_timeout_microseconds"] == 5000
    assert data["max_batch_size"] == 8
    # round trip through the JSON override path
    assert config.parse_json(config.to_json(cfg)) == cfg


@pytest.mark.parametrize("text", ["[]", "null", "1", '"x"'])
def test_json_override_must_be_an_object(text):
    """protobuf's json_format reads a JSON array as an empty config; a load request must not (found by fuzzing)."""
    with pytest.raises(InvalidArgument, match="must be a JSON object"):
        config.parse_json(text)


def test_syntax_error_names_file_and_position():
    with pytest.raises(InvalidArgument, match=r"config.pbtxt.*2:"):
        config.parse_text('name: "x"\nmax_batch_size: "eight"\n')
    with pytest.raises(InvalidArgument, match="unknown_field"):
        config.parse_text("unknown_field: 1")


def test_defaults_filled_like_triton(tmp_path):
    cfg = config.normalize(config.parse_text('platform: "onnxruntime_onnx"'), "m", tmp_path)
    assert cfg.name == "m" and cfg.backend == "onnxruntime"
    assert cfg.version_policy.latest.num_versions == 1
    assert len(cfg.instance_group) == 1 and cfg.instance_group[0].count == 1
    assert cfg.default_model_filename == "model.onnx"


def test_python_backend_inferred_from_model_py(tmp_path):
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.py").write_text("")
    assert config.normalize(config.parse_text(""), "m", tmp_path).backend == "python"


def test_name_mismatch_and_missing_backend_are_errors(tmp_path):
    with pytest.raises(InvalidArgument, match="does not match the directory name"):
        config.normalize(config.parse_text('name: "other" backend: "python"'), "m", tmp_path)
    with pytest.raises(InvalidArgument, match="'backend' or a 'platform'"):
        config.normalize(config.parse_text(""), "m", tmp_path)


@pytest.mark.parametrize("text, message", [
    ('backend: "x" max_batch_size: 0 dynamic_batching { }', "requires max_batch_size > 0"),
    ('backend: "x" max_batch_size: 4 dynamic_batching { preferred_batch_size: [ 8 ] }', "preferred_batch_size 8"),
    ('backend: "x" max_batch_size: 4 dynamic_batching { priority_levels: 2 default_priority_level: 3 }',
     "default_priority_level"),
    ('backend: "x" input [ { name: "a" data_type: TYPE_FP32 dims: [1] }, { name: "a" data_type: TYPE_FP32 '
     'dims: [1] } ]', "duplicate input 'a'"),
    ('backend: "x" output [ { name: "o" dims: [1] } ]', "must specify 'data_type'"),
    ('backend: "x" input [ { name: "a" data_type: TYPE_FP32 dims: [4] reshape: { shape: [3] } } ]', "reshape"),
])
def test_cross_field_validation(tmp_path, text, message):
    cfg = config.normalize(config.parse_text(text), "m", tmp_path)
    with pytest.raises(InvalidArgument, match=message):
        config.validate(cfg)


def test_version_policies():
    policy = config.ModelConfig().version_policy
    assert select_versions(policy, [1, 2, 3]) == [3]
    policy.latest.num_versions = 2
    assert select_versions(policy, [1, 2, 3]) == [2, 3]
    policy.all.SetInParent()
    assert select_versions(policy, [1, 2, 3]) == [1, 2, 3]
    policy.specific.versions.extend([1, 3, 7])
    assert select_versions(policy, [1, 2, 3]) == [1, 3]


@pytest.mark.parametrize("name", ["..", ".", "/etc", "a/b", "../x", "a\\b", ""])
def test_model_names_that_escape_the_repository_are_rejected(name):
    with pytest.raises(InvalidArgument, match="invalid model name"):
        check_model_name(name)
