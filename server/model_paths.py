"""Files a model configuration names must stay inside the model repository.

A configuration (``config.pbtxt``, a config override sent with a load request, ``model.json``)
names files: ``default_model_filename``, label files, tokenizer and template paths, engine and
checkpoint directories. Each one is resolved here, symlinks first, and refused unless it lies
inside the model repository the model lives in, or under a root the operator allowed with
``--allowed-model-root``. Without this a load request could make the server run or read any
file on the machine (docs/security.md).

The repository, not the model directory, is the boundary: models of one repository share files
(the example deployment's tokenizer models read the LLM's tokenizer), and everything in the
repository is the operator's own.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .errors import InvalidArgument

# ``org/name`` or ``name``: what a model hub id looks like (never ``..``, never absolute)
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def model_roots(model_path: Path, allowed_roots: tuple[Path, ...] = ()) -> tuple[Path, ...]:
    """The directories a model's files may resolve into: its repository, then the allowed roots."""
    repository = Path(os.path.realpath(model_path)).parent
    return (repository, *(Path(os.path.realpath(root)) for root in allowed_roots))


def inside(path: Path, roots: tuple[Path, ...]) -> bool:
    """Whether ``path``, symlinks resolved, lies in one of ``roots``."""
    real = Path(os.path.realpath(path))
    return any(real == root or real.is_relative_to(root) for root in roots)


def check_inside(path: Path, roots: tuple[Path, ...], model: str, field: str, value: str) -> Path:
    """``path`` with symlinks resolved; InvalidArgument naming ``field`` if it leaves ``roots``."""
    if not inside(path, roots):
        raise InvalidArgument(
            f"model '{model}': {field} '{value}' names a file outside the model repository; a model may only "
            "use files inside its model repository (or under an --allowed-model-root)")
    return Path(os.path.realpath(path))


def candidates(value: str, bases: list[Path]) -> list[Path]:
    """Where ``value`` may be: itself when absolute, else under each base in turn."""
    path = Path(value)
    if path.is_absolute():
        return [path]
    return [base / path for base in bases]


def is_hub_id(value: str) -> bool:
    """Whether ``value`` can only be a model hub id (``org/name``), never a local path."""
    return bool(_HUB_ID.match(value)) and ".." not in value.split("/") and not os.path.exists(value)
