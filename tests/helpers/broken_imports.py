"""A package that is installed and fails to import, as a build for another torch (or numpy ABI)
fails: a stand-in put first on the path whose ``__init__`` raises RuntimeError (issue 71)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from cli import ROOT


def broken_package(name: str, where: Path, message: str) -> Path:
    """The package ``name`` under the folder ``where`` (made here), its import raising
    ``RuntimeError(message)``; returns ``where``, the folder to put first on the path."""
    (where / name).mkdir(parents=True)
    (where / name / "__init__.py").write_text(f"raise RuntimeError({message!r})\n")
    return where


def break_import(name: str, where: Path, message: str, monkeypatch) -> None:
    """In this process, from now on until the test ends: ``import name`` raises as above (the
    stand-in first on sys.path, the real package's modules already imported forgotten)."""
    monkeypatch.syspath_prepend(str(broken_package(name, where, message)))
    for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        monkeypatch.delitem(sys.modules, module)


def broken_import_env(name: str, where: Path, message: str) -> dict[str, str]:
    """For a subprocess: the variables (PYTHONPATH: the stand-in, then the repository) under which
    ``import name`` raises as above; to go on top of cli.env() (run_train's extra_env)."""
    return {"PYTHONPATH": os.pathsep.join([str(broken_package(name, where, message)), str(ROOT)])}
