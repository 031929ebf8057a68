"""A sibling module: the auto_complete model has a helpers.py of its own."""

import numpy as np

NAME = "identity_bytes"


def identity(array: np.ndarray) -> np.ndarray:
    return array
