"""Which server and which model the code running now belongs to.

``pb_utils`` is a module of free functions and classes (Triton gives every model instance its own
process, so globals are enough there). Here many models share one process, so the backend sets a
:class:`ModelScope` in a context variable on each model instance's threads; BLS, logging,
``get_model_dir`` and custom metrics read it. Threads a model starts itself have no scope and fall
back to the most recently started server.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import TritonModelException

if TYPE_CHECKING:
    from tideserve.backend_api import Infer, ModelControl


@dataclass(frozen=True)
class ServerLink:
    """The handles of a running server (from the model's context) and the event loop they run on."""

    infer: Infer | None
    control: ModelControl | None
    loop: asyncio.AbstractEventLoop
    metrics: Any = None  # the server's metrics (in the server process), whose registry custom metrics join
    metrics_collector: Any = None  # in a model process: the collector that shares its series with the server

    def on_loop(self) -> bool:
        """Whether the caller runs on the server's event loop (where blocking would deadlock)."""
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    def require_infer(self) -> Infer:
        if self.infer is None:
            raise TritonModelException("this server has no data plane: models cannot call other models")
        return self.infer

    def require_control(self) -> ModelControl:
        if self.control is None:
            raise TritonModelException("this server has no data plane: models cannot control other models")
        return self.control


@dataclass(frozen=True)
class ModelScope:
    link: ServerLink | None
    model_name: str
    model_version: int
    version_dir: Path
    logger: logging.Logger


_scope: contextvars.ContextVar[ModelScope | None] = contextvars.ContextVar("tideserve_python_model", default=None)
_last_link: ServerLink | None = None
# On an instance's thread, while it runs a batch that frontend workers sent straight to the instance (direct.py)
_direct = threading.local()


def remember_link(link: ServerLink) -> None:
    global _last_link
    _last_link = link


def set_scope(scope: ModelScope | None) -> contextvars.Token:
    return _scope.set(scope)


def reset_scope(token: contextvars.Token) -> None:
    _scope.reset(token)


def current_scope() -> ModelScope | None:
    return _scope.get()


def current_link() -> ServerLink:
    scope = _scope.get()
    link = scope.link if scope is not None and scope.link is not None else _last_link
    if link is None or link.loop.is_closed():
        raise TritonModelException("no tideserve server is running in this process: BLS is unavailable")
    return link


MODEL_LOGGER = logging.getLogger("tideserve.python_model")


def current_logger() -> logging.Logger:
    scope = _scope.get()
    return scope.logger if scope is not None else MODEL_LOGGER


def set_direct_batch(running: bool) -> None:
    """Called on an instance's thread around a batch that frontend workers sent straight to it (``direct.py``)."""
    _direct.batch = running


def in_direct_batch() -> bool:
    """Whether this thread runs such a batch: the core does not know the instance is busy, and a BLS call the
    batch waits on tells it (``holds``), so that it sends the instance no work meanwhile."""
    return getattr(_direct, "batch", False)
