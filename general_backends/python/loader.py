"""Import a model's ``model.py`` as its own module, as Triton's stub does, in a shared process.

Triton puts ``<model>/<version>`` and ``<model>`` at the end of ``sys.path`` and imports
``<version>.model``, so a model can import the files beside it (``import helpers``,
``from . import helpers``). Here every model version becomes a package with a unique name whose
path is its version directory, and the modules a model imports from its own directories are taken
out of ``sys.modules`` once it has loaded, so the next model's ``import helpers`` finds its own
file rather than another model's.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import itertools
import re
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

_lock = threading.Lock()
_counter = itertools.count()
_model_paths: list[str] = []  # sys.path entries added for loaded models (one per model and entry)


@dataclass
class ModelModule:
    module: ModuleType
    package: str
    paths: list[str] = field(default_factory=list)

    def unload(self) -> None:
        with _lock:
            prefix = self.package + "."
            for name in [n for n in sys.modules if n == self.package or n.startswith(prefix)]:
                del sys.modules[name]
            for path in self.paths:
                if path in _model_paths:
                    _model_paths.remove(path)
                    if path not in _model_paths and path in sys.path:
                        sys.path.remove(path)
            self.paths = []


def model_paths() -> list[str]:
    """The ``sys.path`` entries added for the models loaded in this process."""
    with _lock:
        return list(_model_paths)


def _inside(module: ModuleType, directories: tuple[str, ...]) -> bool:
    # Read the module's own attributes only: ``getattr`` on a lazy module (transformers has many)
    # would import it, and that import may fail.
    attrs = getattr(module, "__dict__", None) or {}
    file = attrs.get("__file__")
    if not file:
        paths = list(attrs.get("__path__") or [])
        file = paths[0] if paths else None
    return bool(file) and any(str(file).startswith(d) for d in directories)


def import_model_file(model_name: str, version: int, path: Path) -> ModelModule:
    """Import ``path`` (``<model>/<version>/model.py``) under a name no other model uses."""
    path = path.resolve()
    version_dir, model_dir = path.parent, path.parent.parent
    package = f"tideserve_model_{re.sub(r'[^0-9A-Za-z_]', '_', model_name)}_{version}_{next(_counter)}"
    own = (str(version_dir), str(model_dir))
    own_prefixes = tuple(d + "/" for d in own)
    with _lock:
        others = [p for p in _model_paths if p not in own]
        saved_path = list(sys.path)
        # Stash modules other models imported lazily, so they cannot stand in for this model's files.
        stashed = {name: module for name, module in list(sys.modules.items())
                   if module is not None and others and _inside(module, tuple(o + "/" for o in others))}
        for name in stashed:
            del sys.modules[name]
        before = set(sys.modules)
        sys.path[:] = [p for p in sys.path if p not in others] + [p for p in own if p not in sys.path]
        loaded = False
        write_bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # keep repositories clean
        try:
            package_spec = importlib.machinery.ModuleSpec(package, None, is_package=True)
            package_spec.submodule_search_locations = [str(version_dir)]
            package_module = importlib.util.module_from_spec(package_spec)
            sys.modules[package] = package_module
            spec = importlib.util.spec_from_file_location(f"{package}.{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            try:
                # From the source every time: a model edited within the same second as its last load
                # must not come back from a stale bytecode cache.
                exec(compile(path.read_bytes(), str(path), "exec"), module.__dict__)  # noqa: S102
            except BaseException:
                sys.modules.pop(spec.name, None)
                sys.modules.pop(package, None)
                raise
            loaded = True
        finally:
            sys.dont_write_bytecode = write_bytecode
            for name in set(sys.modules) - before:
                ours = name == package or name.startswith(package + ".")
                if not ours and _inside(sys.modules[name], own_prefixes):
                    del sys.modules[name]
            sys.modules.update(stashed)
            sys.path[:] = saved_path + [p for p in own if loaded and p not in saved_path]
        _model_paths.extend(own)
    return ModelModule(module, package, list(own))
