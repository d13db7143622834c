"""Every script of bench/ and scripts/ imports: the fast tier's guard for the entry points whose smoke
runs are slow (a renamed module, such as fastcifar.dist -> fastcifar.parallel, breaks them at import,
and only their slow smoke tests would say so otherwise)."""

import os
import sys
from pathlib import Path

import pytest
from script_modules import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted([*ROOT.glob("bench/*.py"), *ROOT.glob("scripts/*.py")])


@pytest.mark.parametrize("path", SCRIPTS, ids=[str(p.relative_to(ROOT)) for p in SCRIPTS])
def test_entry_point_imports(path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(path)])  # no --smoke: nothing is set for the interpreter
    # run as a script, its folder is first on sys.path (gpu_visit_report imports race beside it); undone after
    monkeypatch.setattr(sys, "path", [str(path.parent), *sys.path])
    before = dict(os.environ)
    try:  # each script's work sits under `if __name__ == "__main__"`; its dataclasses look it up in sys.modules
        module = load_script(path, f"_entry_{path.parent.name}_{path.stem}", monkeypatch=monkeypatch)
    finally:
        os.environ.clear()
        os.environ.update(before)
    assert module.__doc__, f"{path.name} says nowhere what it is for"
