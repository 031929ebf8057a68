"""The generate endpoint's shape rule: how a JSON value fits a model input's declared dims."""

from __future__ import annotations

import pytest

from tideserve.http.generate import fit_shape


@pytest.mark.parametrize("count, declared, given, expected", [
    (1, [1], None, [1]),
    (1, [-1, 1], None, [1, 1]),          # batched: batch of 1
    (3, [-1, -1], (3,), [1, 3]),          # innermost variable dim takes the elements
    (4, [-1, -1, 2], None, [1, 2, 2]),
    (4, [-1, 2], (2, 2), [2, 2]),         # a nested array of matching rank keeps its shape
    (3, [2], None, None),
    (0, [-1], (0,), [0]),
    (0, [-1, -1], (0,), [1, 0]),
    (0, [1], None, None),
    (1, [], None, []),
])
def test_fit_shape(count, declared, given, expected):
    assert fit_shape(count, declared, given) == expected
