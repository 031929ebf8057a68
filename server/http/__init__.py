"""The HTTP port: KServe v2 / Triton REST, Triton's generate extension and the OpenAI-compatible routes,
put together on one app by :func:`create_app` (:mod:`.app`).

The app is imported when first asked for, so that a process that needs only the KServe codec (:mod:`.codec`: a
model's instance process decoding the HTTP bodies frontend workers hand it, ``workers/direct.py``) does not load the
web framework and every route."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .app import HttpApp, create_app
    from .kserve import HttpFrontend

__all__ = ["HttpApp", "HttpFrontend", "create_app"]


def __getattr__(name: str):
    if name in ("HttpApp", "create_app"):
        from . import app
        return getattr(app, name)
    if name == "HttpFrontend":
        from .kserve import HttpFrontend
        return HttpFrontend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
