"""The backend API is the backends' only way into the server (their imports, read from the source)."""

from __future__ import annotations

import ast
from pathlib import Path

import api_backend


def test_the_api_backend_imports_only_the_backend_api():
    tree = ast.parse(Path(api_backend.__file__).read_text())
    modules = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    modules |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert {m for m in modules if m.startswith("tideserve")} == {"tideserve.backend_api"}


def test_the_backends_import_only_the_backend_api():
    """general_backends, llm_backends and ensembles reach the server through tideserve.backend_api."""
    project = Path(__file__).resolve().parents[2]
    own = ("tideserve.backend_api", "tideserve.general_backends", "tideserve.llm_backends", "tideserve.ensembles")
    found = []
    for package in ("general_backends", "llm_backends", "ensembles"):
        for path in sorted((project / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                         else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
                found += [f"{path.relative_to(project)}: {name}" for name in names
                          if (name == "tideserve" or name.startswith("tideserve.")) and not name.startswith(own)]
    assert found == []
