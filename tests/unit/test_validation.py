"""The shape rule between a request's tensors and a model's declared inputs."""

from __future__ import annotations


def test_the_shape_rule_between_models():
    from tideserve.validation import conform_shape

    assert conform_shape((1, 1), (1, 1), False, 1) == (1, 1)      # mock_llm: as declared
    assert conform_shape((1, 1), (1,), False, 1) == (1,)          # a vLLM model: the batch of one goes
    assert conform_shape((1, 3), (-1,), False, 1) == (3,)
    assert conform_shape((1, 3), (-1,), True, 1) == (1, 3)        # a batching model keeps it
    assert conform_shape((1,), (-1,), True, 0) == (1, 1)          # made without a batch: gains one
    assert conform_shape((2, 1), (1,), False, 2) == (2, 1)        # a batch of 2 stays (validation judges it)
    assert conform_shape((4,), (2, 2), True, 0) == (4,)           # no match: left for validation
