"""The HTTP port: KServe v2 / Triton REST, Triton's generate extension and the OpenAI-compatible routes,
put together on one app by :func:`create_app` (:mod:`.app`)."""

from .app import HttpApp, create_app
from .kserve import HttpFrontend

__all__ = ["HttpApp", "HttpFrontend", "create_app"]
