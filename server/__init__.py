"""tideserve core: model repository, backend API, schedulers, DataPlane, frontends, CLI."""

__version__ = "0.1.0"
