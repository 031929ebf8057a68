"""The tensorrt_llm backend's tensor interface without an engine: stop and bad word lists in Triton's layout."""

from __future__ import annotations

import numpy as np
import pytest

from tideserve.errors import InvalidArgument
from tideserve.llm_backends.tensorrt_llm.interface import decode_word_list, encode_word_list


def test_word_list_layout():
    words = [[5], [6, 7, 8], [9, 10]]
    layout = encode_word_list(words)
    assert layout.tolist() == [[5, 6, 7, 8, 9, 10], [1, 4, 6, -1, -1, -1]]
    assert decode_word_list("stop_words_list", layout) == words
    with pytest.raises(InvalidArgument, match="stop_words_list"):
        decode_word_list("stop_words_list", np.array([[1, 2], [3, 1]], np.int32))
