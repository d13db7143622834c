"""A file of bench/ or scripts/ loaded as a module: they are scripts, not packages the tests import.

(Not named scripts.py: that would hide the repository's scripts/ folder, which tests/conftest.py
imports scripts.versions from.)"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from cli import ROOT


def load_script(relpath: str | Path, name: str | None = None, register: bool = False, monkeypatch=None) -> ModuleType:
    """``ROOT / relpath`` (an absolute path is taken as it is) executed as the module ``name`` (by
    default the file's stem); its ``if __name__ == "__main__"`` part does not run. ``register``: in
    sys.modules under ``name`` before it runs, for good (its dataclasses look their module up there);
    ``monkeypatch``: the same, undone after the test."""
    path = ROOT / relpath
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    if monkeypatch is not None:
        monkeypatch.setitem(sys.modules, spec.name, module)
    elif register:
        sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
