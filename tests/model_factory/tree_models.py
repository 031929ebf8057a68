"""The tree models of the tests: :mod:`server.examples.tree_models` (installed, the example deployment
trains its ``tabular`` model with it), re-exported under the tests' import path."""

from server.examples.tree_models import (  # noqa: F401
    KINDS,
    N_TREES,
    SEED,
    Kind,
    TreeModel,
    fil_config,
    train,
    write_fil_model,
)
