"""The response cache without a server: its key and its least-recently-used eviction within the size."""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2 as mc

from tideserve.errors import InvalidArgument
from tideserve.response_cache import ENTRY_OVERHEAD, ResponseCache, check_config, request_key
from tideserve.types import InferenceRequest, InferenceResponse, RequestedOutput, Tensor


def _request(values, name="m", datatype="FP32", shape=None, outputs=(), parameters=None) -> InferenceRequest:
    array = np.asarray(values, dtype=np.float32 if datatype == "FP32" else np.float64)
    if shape is not None:
        array = array.reshape(shape)
    return InferenceRequest(name, {"X": Tensor("X", datatype, tuple(array.shape), array)},
                            outputs=[RequestedOutput(o) for o in outputs], parameters=parameters)


def _response(nbytes: int) -> InferenceResponse:
    data = np.zeros(nbytes, dtype=np.uint8)
    return InferenceResponse(outputs=[Tensor("Y", "UINT8", data.shape, data)])


def test_key_takes_model_version_inputs_outputs_and_parameters():
    key = request_key(_request([1, 2, 3, 4]), "1")
    assert key == request_key(_request([1, 2, 3, 4]), "1")
    for other in (request_key(_request([1, 2, 3, 4], name="n"), "1"), request_key(_request([1, 2, 3, 4]), "2"),
                  request_key(_request([1, 2, 3, 5]), "1"), request_key(_request([1, 2, 3, 4], shape=(2, 2)), "1"),
                  request_key(_request([1, 2], datatype="FP64"), "1"),
                  request_key(_request([1, 2, 3, 4], outputs=("Y",)), "1"),
                  request_key(_request([1, 2, 3, 4], parameters={"p": 1}), "1")):
        assert other != key


def test_bytes_inputs_are_keyed_by_their_bytes():
    def words(*items):
        data = np.array(items, dtype=np.object_)
        return InferenceRequest("m", {"T": Tensor("T", "BYTES", data.shape, data)})

    assert request_key(words(b"ab", b"c"), "1") == request_key(words(b"ab", b"c"), "1")
    assert request_key(words(b"ab", b"c"), "1") != request_key(words(b"a", b"bc"), "1")


def test_least_recently_used_goes_first_and_oversized_answers_are_not_kept():
    entry = ENTRY_OVERHEAD + 100
    cache = ResponseCache(3 * entry)
    request = _request([0])
    for key in (b"a", b"b", b"c"):
        assert cache.insert(key, _response(100))
    assert cache.lookup(b"a", request) is not None  # a is now the most recently used
    cache.insert(b"d", _response(100))
    assert cache.lookup(b"b", request) is None
    assert [k for k in (b"a", b"c", b"d") if cache.lookup(k, request) is not None] == [b"a", b"c", b"d"]
    assert cache.used == 3 * entry
    assert not cache.insert(b"huge", _response(3 * entry))
    assert len(cache) == 3


def test_stored_answers_are_copies():
    cache = ResponseCache(1 << 20)
    response = _response(8)
    cache.insert(b"k", response)
    response.outputs[0].data[:] = 7  # the model reuses its buffer
    assert not cache.lookup(b"k", _request([0])).outputs[0].data.any()


def test_decoupled_and_sequence_models_cannot_enable_the_cache():
    config = mc.ModelConfig(name="m")
    config.response_cache.enable = True
    check_config(config)
    config.sequence_batching.SetInParent()
    with pytest.raises(InvalidArgument, match="does not currently support model m with sequence batching"):
        check_config(config)
    config.ClearField("sequence_batching")
    config.model_transaction_policy.decoupled = True
    with pytest.raises(InvalidArgument, match="with 'decoupled' transaction policy"):
        check_config(config)
    config.response_cache.enable = False
    check_config(config)


def test_cache_config_flags_are_checked(tmp_path):
    from tideserve.cli import build_parser, options_from_args

    def options(*flags):
        return options_from_args(build_parser().parse_args(["--model-repository", str(tmp_path), *flags]))

    assert options("--cache-config", "local,size=1048576").response_cache_size == 1048576
    assert options("--response-cache-byte-size", "8192").response_cache_size == 8192
    assert options().response_cache_size is None
    for flags, message in ((("--cache-config", "redis,host=localhost"), "cache 'redis' is not available"),
                           (("--cache-config", "local,size=10", "--cache-config", "redis,port=1"),
                            "multiple cache configurations"),
                           (("--response-cache-byte-size", "1", "--cache-config", "local,size=2"),
                            "incompatible flags"),
                           (("--cache-config", "local,size=big"), "not a number of bytes"),
                           (("--cache-config", "local"), "expected <cache>,<key>=<value>")):
        with pytest.raises(ValueError, match=message):
            options(*flags)
