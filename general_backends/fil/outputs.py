"""What ``output__0`` holds, as Triton's FIL defines it.

- regressor (``is_classifier`` false): the model's scores, one column per class (usually one);
- classifier with ``predict_proba``: one probability per class; a binary model (one score column)
  answers both columns ``[1 - p, p]`` when ``output__0`` has dims ``[2]``, ``p`` alone with ``[1]``;
- classifier without it: the class index as FP32 -- ``p > threshold`` for a binary model, the
  arg-max of the class scores otherwise.
"""

from __future__ import annotations

import numpy as np

from .options import FilOptions


def output_widths(num_classes: int, options: FilOptions) -> tuple[int, ...]:
    """The ``output__0`` dims a model may declare (the first one is what an error message suggests)."""
    if not options.is_classifier:
        return (num_classes,)
    if not options.predict_proba:
        return (1,)
    return (2, 1) if num_classes == 1 else (num_classes,)


def make_output(scores: np.ndarray, options: FilOptions, width: int) -> np.ndarray:
    """``scores`` (n, num_classes) from a Forest -> float32 (n, width) for ``output__0``."""
    if options.is_classifier:
        binary = scores.shape[1] == 1
        if options.predict_proba:
            if binary and width == 2:
                scores = np.concatenate([1 - scores, scores], axis=1)  # in the library's precision
        elif binary:
            scores = scores > options.threshold
        else:
            scores = np.argmax(scores, axis=1)[:, None]
    return scores.astype(np.float32, copy=False)
