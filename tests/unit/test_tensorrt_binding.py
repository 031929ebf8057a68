"""TensorRT's binding logic without a server: engine descriptions, auto-complete, max batch size from profiles,
binding errors in Triton's words, profile choice (against the test double of tests/tensorrt_double.py)."""

from __future__ import annotations

import pytest
from tensorrt_double import (
    ADD_SUB,
    AFFINE,
    DOUBLE,
    FP8,
    FakeTensorRT,
    Logger,
    Runtime,
    fake_plan,
    io_tensor,
)
from tritonclient.grpc import model_config_pb2 as mc

from tideserve.config import parse_text
from tideserve.errors import InvalidArgument, Unsupported
from tideserve.general_backends.tensorrt.binding import (
    auto_complete,
    bind,
    choose_profile,
    config_profiles,
    engine_max_batch_size,
)
from tideserve.general_backends.tensorrt.engine import describe_engine


def _engine(plan: bytes, fake_tensorrt: FakeTensorRT):
    return describe_engine(Runtime(Logger(Logger.WARNING), fake_tensorrt).deserialize_cuda_engine(plan), fake_tensorrt)


def _config(text: str) -> mc.ModelConfig:
    config = parse_text('name: "m"\nbackend: "tensorrt"\n' + text)
    if not config.instance_group:
        config.instance_group.add(name="m_0", count=1, kind=mc.ModelInstanceGroup.KIND_GPU)
    return config


def test_describe_engine_maps_datatypes_and_profiles(fake_tensorrt):
    info = _engine(ADD_SUB, fake_tensorrt)
    assert [(t.name, t.is_input, t.datatype, t.shape) for t in info.tensors] == [
        ("a", True, "INT32", (-1, -1)), ("b", True, "INT32", (-1, -1)),
        ("sum", False, "INT32", (-1, -1)), ("diff", False, "INT32", (-1, -1))]
    assert info.num_profiles == 2
    assert info.inputs[0].profiles[1] == ((1, 5), (2, 8), (4, 16))
    static = _engine(DOUBLE, fake_tensorrt).inputs[0]
    assert (static.datatype, static.profiles, static.dynamic) == ("FP16", (((2, 3), (2, 3), (2, 3)),), False)
    assert _engine(FP8, fake_tensorrt).inputs[0].datatype is None


def test_auto_complete_from_the_engine_alone(fake_tensorrt):
    config = _config("")
    auto_complete(config, _engine(ADD_SUB, fake_tensorrt))
    assert config.max_batch_size == 4 and config.HasField("dynamic_batching")
    assert [(t.name, mc.DataType.Name(t.data_type), list(t.dims)) for t in config.input] == [
        ("a", "TYPE_INT32", [-1]), ("b", "TYPE_INT32", [-1])]
    assert [t.name for t in config.output] == ["sum", "diff"]


def test_auto_complete_follows_the_configs_dims(fake_tensorrt):
    full_rank = _config('input [ { name: "x" data_type: TYPE_FP32 dims: [ -1, 16 ] } ]\n')
    auto_complete(full_rank, _engine(AFFINE, fake_tensorrt))
    assert full_rank.max_batch_size == 0 and not full_rank.HasField("dynamic_batching")
    assert list(full_rank.output[0].dims) == [-1, 4]  # outputs keep the engine's batch dimension as a dim
    with pytest.raises(InvalidArgument, match="contradict each other"):
        auto_complete(_config('input [ { name: "x" data_type: TYPE_FP32 dims: [ 16 ] } ]\n'
                              'output [ { name: "y" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]\n'),
                      _engine(AFFINE, fake_tensorrt))
    with pytest.raises(InvalidArgument, match="specified max-batch 9 but TensorRT engine only supports max-batch 8"):
        auto_complete(_config("max_batch_size: 9\n"), _engine(AFFINE, fake_tensorrt))


def test_max_batch_size_follows_the_profiles_instances_use(fake_tensorrt):
    info = _engine(ADD_SUB, fake_tensorrt)
    assert engine_max_batch_size(info, [0]) == 4
    config = _config('instance_group [ { kind: KIND_GPU profile: [ "1" ] } ]\n')
    assert config_profiles(config, info) == [1]
    with pytest.raises(InvalidArgument, match="optimization profile 5 does not exist; the engine has 2"):
        config_profiles(_config('instance_group [ { kind: KIND_GPU profile: [ "5" ] } ]\n'), info)


@pytest.mark.parametrize("text, error, message", [
    ('input [ { name: "z" data_type: TYPE_FP32 dims: [ 16 ] } ]', InvalidArgument,
     "unexpected input 'z'; the engine's inputs are: x"),
    ('input [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]', InvalidArgument, "unexpected input 'y'"),
    ('input [ { name: "x" data_type: TYPE_FP32 dims: [ 4, 4 ] } ]', InvalidArgument,
     "the model expects 2 dimensions (shape [-1,16]) but the model configuration specifies 3 dimensions"),
    ('input [ { name: "x" data_type: TYPE_FP32 dims: [ 15 ] } ]', InvalidArgument, "making complete shape [-1,15]"),
    (('input [ { name: "x" data_type: TYPE_FP32 dims: [ 16 ] } ]\n'
     'output [ { name: "y" data_type: TYPE_INT32 dims: [ 4 ] } ]'), InvalidArgument,
     "unexpected datatype TYPE_FP32 for output 'y', expecting TYPE_INT32"),
])
def test_binding_errors(fake_tensorrt, text, error, message):
    config = _config("max_batch_size: 8\n" + text)
    with pytest.raises(error) as info:
        bind(config, _engine(AFFINE, fake_tensorrt))
    assert message in str(info.value)


def test_every_engine_input_must_be_fed_and_shape_tensors_are_refused(fake_tensorrt):
    config = _config('max_batch_size: 4\ninput [ { name: "a" data_type: TYPE_INT32 dims: [ -1 ] } ]\n')
    with pytest.raises(InvalidArgument, match="engine input 'b' is not in the model configuration"):
        bind(config, _engine(ADD_SUB, fake_tensorrt))
    shaped = fake_plan([io_tensor("n", "INPUT", "INT32", [1], [[[1], [1], [1]]], shape_tensor=True),
                        io_tensor("y", "OUTPUT", "FLOAT", [-1])], "fail")
    with pytest.raises(Unsupported, match="'n' is a shape tensor"):
        auto_complete(_config(""), _engine(shaped, fake_tensorrt))


def test_engine_names_with_a_space_bind_by_their_first_word(fake_tensorrt):
    plan = fake_plan([io_tensor("x (input)", "INPUT", "FLOAT", [-1, 2], [[[1, 2], [1, 2], [2, 2]]]),
                      io_tensor("y", "OUTPUT", "FLOAT", [-1, 2])], "fail")
    config = _config("")
    auto_complete(config, _engine(plan, fake_tensorrt))
    bindings = bind(config, _engine(plan, fake_tensorrt))
    assert [(b.name, b.engine_name) for b in bindings.inputs] == [("x", "x (input)")]


def test_choose_profile_takes_the_closest_profile_that_fits(fake_tensorrt):
    info = _engine(ADD_SUB, fake_tensorrt)
    assert choose_profile(info, [0, 1], {"a": (2, 2), "b": (2, 2)}) == 0
    assert choose_profile(info, [0, 1], {"a": (4, 9), "b": (4, 9)}) == 1
    with pytest.raises(InvalidArgument, match="no optimization profile"):
        choose_profile(info, [0], {"a": (1, 9), "b": (1, 9)})  # this instance may only use profile 0
