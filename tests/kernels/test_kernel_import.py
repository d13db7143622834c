"""How the kernels package is installed and imported.

- It installs as ``fastcifar.kernels`` (a top-level ``kernels`` would clash with another
  distribution of that name), and no kernel file imports the trainer's model.
- Importing it for the CPU interpreter leaves ``TRITON_INTERPRET`` out of the process environment.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli import env_without_interpreter

ROOT = Path(__file__).resolve().parents[2]
KERNEL_FILES = sorted((ROOT / "kernels").glob("*.py"))


def _imports(path: Path) -> set[str]:
    """Every module a file imports, relative imports resolved against fastcifar.kernels."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from .x import y / from . import y, inside fastcifar.kernels
                parent = "fastcifar.kernels".rsplit(".", node.level - 1)[0]
                base = f"{parent}.{base}" if base else parent
                names.update(f"{base}.{a.name}" for a in node.names)
            names.add(base)
    return names


def test_kernel_files_do_not_import_the_model_or_a_top_level_kernels():
    assert KERNEL_FILES, "no kernel files found"
    for path in KERNEL_FILES:
        names = _imports(path)
        assert not any(n == "fastcifar.models.blocks" or n.startswith("fastcifar.models.blocks.") for n in names), (
            f"{path.name} imports fastcifar.models.blocks (models import the kernels: an import circle)"
        )
        assert not any(n == "kernels" or n.startswith("kernels.") for n in names), (
            f"{path.name} imports the top-level 'kernels' name"
        )


def test_import_graph_helper_sees_relative_and_absolute_imports(tmp_path):
    """The check above would pass vacuously if _imports missed imports."""
    f = tmp_path / "k.py"
    f.write_text("from ..models.blocks import ConvBlock\nimport kernels.x\nfrom .checks import check_device\n")
    assert {"fastcifar.models.blocks", "kernels.x", "fastcifar.kernels.checks"} <= _imports(f)


@pytest.mark.slow  # over 2 s on 2 cores
def test_importing_kernels_does_not_load_the_model():
    code = (
        "import sys, fastcifar.kernels.bn_act_pool, fastcifar.kernels.augment, fastcifar.kernels.conv_stats;"
        "print('fastcifar.models.blocks' in sys.modules, 'kernels' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"},
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_pyproject_names_every_package():
    """setuptools installs the packages pyproject.toml lists (its package-dir, which maps kernels/ to
    fastcifar.kernels, rules out package discovery): the list is every folder with an ``__init__.py``
    under fastcifar/ and under each mapped folder, so no subpackage is left out of the wheel, and no
    top-level ``kernels`` is in it."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setup["package-dir"] == {"fastcifar.kernels": "kernels"}
    roots = {"fastcifar": ROOT / "fastcifar"} | {name: ROOT / folder for name, folder in setup["package-dir"].items()}
    found = {
        ".".join([name, *init.parent.relative_to(folder).parts])
        for name, folder in roots.items()
        for init in folder.rglob("__init__.py")
    }
    assert sorted(setup["packages"]) == sorted(found)


@pytest.mark.slow  # over 2 s on 2 cores
def test_triton_kernels_on_cpu_leave_no_triton_interpret_behind():
    """norm_factory("triton") and the Triton loader without a GPU: kernels interpreted, a forward
    runs on CPU tensors, and TRITON_INTERPRET is not left set (it used to leak into every later
    test and subprocess)."""
    code = """
import os, torch
assert "TRITON_INTERPRET" not in os.environ
from fastcifar.models.blocks import norm_factory, resolve_kernels
assert resolve_kernels("triton", torch.device("cpu")) == "triton"
norm = norm_factory("triton")(8, act="relu", pool="after")
x = torch.randn(2, 8, 4, 4).contiguous(memory_format=torch.channels_last)
y = norm(x)
from fastcifar.kernels.checks import interpreted
print(tuple(y.shape), interpreted(), "TRITON_INTERPRET" in os.environ)
"""
    env = env_without_interpreter(PYTHONPATH=str(ROOT))
    env["CUDA_VISIBLE_DEVICES"] = ""  # the machine without a GPU this is about (CI's), also on one with
    env["FASTCIFAR_ALLOW_INTERPRETER"] = "1"  # resolve_kernels refuses the interpreter unless asked for
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["(2,", "8,", "2,", "2)", "True", "False"], out.stdout


def test_interpreter_requested_after_triton_was_imported_says_so():
    """Triton imported (compiled mode) before ``load(..., interpret=True)``: the kernels' helpers are
    compiled-mode, so a launch would blame the tensor ("x is on cpu"). load refuses in one line instead."""
    code = """
import triton
from fastcifar.kernels import load
try:
    load("augment", interpret=True)
except RuntimeError as e:
    print("refused:", e)
else:
    print("loaded")
"""
    env = env_without_interpreter(PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("refused:") and "triton was imported before its interpreter" in out.stdout, out.stdout
    assert out.stdout.count("\n") == 1, out.stdout


def test_a_checkout_without_its_kernels_is_refused_in_one_line_before_any_work(monkeypatch):
    """A checkout's fastcifar/ found ahead of the install (`python -m` in it beside a non-editable
    install) has no fastcifar.kernels: --kernels triton says so and how to proceed, not a traceback."""
    import importlib.util

    import torch

    from fastcifar.core.config import ConfigError
    from fastcifar.models.blocks import resolve_kernels

    monkeypatch.setenv("FASTCIFAR_ALLOW_INTERPRETER", "1")
    assert resolve_kernels("triton", torch.device("cpu")) == "triton"
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "fastcifar.kernels" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"not importable beside .*pip install -e \.") as err:
        resolve_kernels("triton", torch.device("cpu"))
    assert "\n" not in str(err.value)
    assert resolve_kernels("torch", torch.device("cpu")) == "torch"  # the torch path needs no kernels
