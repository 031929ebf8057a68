"""Packaging: one import package, ``tideserve``, from the folders of the layout; no import cycles.

``pip install`` must not put ``server``, ``bench`` or the backend folders into site-packages as
top-level names (they collide with other distributions); only ``triton_python_backend_utils`` stays
top-level, because Triton models import it by that name.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]


def _package_folders() -> dict[str, Path]:
    """Import name -> folder of every package the package-dir mapping reaches."""
    found = {}
    for name, folder in SETUPTOOLS["package-dir"].items():
        for init in sorted((REPO / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(REPO / folder)
            dotted = ".".join((name, *rel.parts))
            mapped = [n for n in SETUPTOOLS["package-dir"] if dotted == n or dotted.startswith(n + ".")]
            if max(mapped, key=len) == name:  # the longest mapping owns the folder
                found[dotted] = init.parent
    return found


def test_every_package_folder_is_installed():
    assert sorted(_package_folders()) == sorted(SETUPTOOLS["packages"])


def test_the_wheel_holds_one_package_and_the_triton_shim(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(REPO)], check=True, capture_output=True, timeout=300)
    wheel = next(tmp_path.glob("tideserve-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        top = {name.split("/")[0] for name in archive.namelist() if not name.startswith("tideserve-")}
        assert "tideserve/bench/examples/data/corpus.txt" in archive.namelist()
    assert top == {"tideserve", "triton_python_backend_utils.py"}


def test_importing_the_core_as_server_is_refused():
    done = subprocess.run([sys.executable, "-c", "import server"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode != 0 and "import it as 'tideserve'" in done.stderr


# -- import cycles ----------------------------------------------------------------------------------
def _modules() -> dict[str, Path]:
    modules = {}
    for package, folder in _package_folders().items():
        for path in folder.glob("*.py"):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports anywhere in its code, except under ``if TYPE_CHECKING``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")
                    parts = parts[:len(parts) - child.level + 1]
                    base = ".".join(parts + ([child.module] if child.module else []))
                for alias in child.names:
                    found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
            visit(child)

    visit(ast.parse(path.read_text()))
    resolved = set()
    for target in found:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            resolved.add(target)
    return resolved


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_no_import_cycles():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _cycles(graph) == []


def test_a_model_process_loads_no_scheduler_runtime_or_frontend():
    """What a backend imports (tideserve.backend_api) and the Python backend's model process do not pull the
    schedulers, the runtime, statistics or any frontend into the process; the scheduler names load on first use."""
    code = ("import sys, tideserve.backend_api, tideserve.general_backends.python.stub; "
            "print(' '.join(m for m in sys.modules if m.startswith('tideserve')))")
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
                 .stdout.split())
    heavy = {m for m in loaded if m.startswith(("tideserve.schedulers", "tideserve.openai", "tideserve.http",
                                               "tideserve.grpc", "tideserve.tool_parsers", "tideserve.reasoning_parsers"))
             or m in ("tideserve.runtime", "tideserve.stats", "tideserve.dataplane", "tideserve.repository")}
    assert heavy == set(), heavy
    from tideserve import backend_api
    from tideserve.schedulers import PassThroughScheduler

    assert backend_api.PassThroughScheduler is PassThroughScheduler
