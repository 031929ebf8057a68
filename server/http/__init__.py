"""KServe v2 / Triton HTTP/REST frontend."""

from .app import HttpApp, HttpFrontend, create_app

__all__ = ["HttpApp", "HttpFrontend", "create_app"]
