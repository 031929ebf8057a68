"""The README against the repository, without a server: its two set-up commands are the Makefile's, and it
describes every example model (its commands and code run against the example server in tests/e2e/test_readme.py)."""

from __future__ import annotations

import re

import pytest
from example_fixtures import EXAMPLE_MODELS, README, ROOT, TALKING


def test_readme_has_exactly_the_two_setup_commands():
    block = re.search(r"## Set-up: the two commands\s+```sh\n(.*?)```", README, re.DOTALL).group(1)
    commands = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    assert commands == ["make serve", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    serve = makefile.split("\nserve:")[1].split("\n\n")[0]
    assert "tideserve.bench.examples.prepare model_repository" in serve  # the models git does not hold
    assert "--model-repository model_repository" in serve
    assert "pytest" in makefile.split("test:")[1].split("\n\n")[0]
    assert "make test" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("model", EXAMPLE_MODELS)
def test_readme_describes_every_example_model(model):
    assert f"`{model}`" in TALKING
