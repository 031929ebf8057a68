"""The tree models of the tests: :mod:`tideserve.bench.examples.tree_models` (installed, the example deployment
trains its ``tabular`` model with it), re-exported under the tests' import path."""

from tideserve.bench.examples.tree_models import (  # noqa: F401
    KINDS,
    N_TREES,
    SEED,
    Kind,
    TreeModel,
    fil_config,
    train,
    write_fil_model,
)
