"""tideserve: model repository, backend API, schedulers, DataPlane, frontends, CLI.

The folder ``server/`` is installed as the package ``tideserve``; the backends, ensembles and the bench
are its subpackages (``tideserve.llm_backends``, ...). See pyproject.toml.
"""

if __name__ != "tideserve":  # e.g. ``import server`` from a checkout: the same modules twice, under two names
    raise ImportError(f"the tideserve core was imported as '{__name__}'; import it as 'tideserve' "
                      "(pip install -e . maps server/ to that name)")

__version__ = "0.1.0"
