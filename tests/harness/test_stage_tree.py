"""scripts/stage_tree.py: the copy of the checkout that a Python without fastcifar installed (the GPU
machine's) runs from. kernels/ lands where pyproject.toml's package-dir puts it, and a Python with no
site customization (no editable install's finder) and only the copy on its path imports
fastcifar.kernels and the bench/ and scripts/ entry points that scripts/gpu_visit.sh runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from script_modules import load_script

ROOT = Path(__file__).resolve().parents[2]
stage_tree = load_script(ROOT / "scripts" / "stage_tree.py", "_stage_tree")

# what gpu_visit.sh runs from the copy, beside python -m fastcifar.train and pytest
ENTRY_POINTS = [
    "bench/bench_step.py",
    "bench/bench_augment.py",
    "bench/bench_loader.py",
    "bench/bench_bn_act_pool.py",
    "bench/sweep_bn_act_pool.py",
    "bench/bench_conv_stats.py",
    "bench/sweep_conv_stats.py",
    "bench/kernel_registers.py",
    "scripts/gpu_visit_report.py",
    "scripts/race.py",
    "scripts/export_tensors.py",
    "scripts/kill_rank.py",
]


def bare_python_env(tree: Path) -> dict[str, str]:
    """The copy, then this interpreter's third-party folders as plain entries (``python -S`` reads no
    .pth file, so no editable install's finder); the working folder is not added (PYTHONSAFEPATH)."""
    sites = [p for p in sys.path if p.endswith("site-packages")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), *sites]), PYTHONSAFEPATH="1")
    env.pop("PYTHONHOME", None)
    return env


def test_lays_out_the_package_as_installed(tmp_path):
    tree = stage_tree.stage(tmp_path / "tree")
    assert stage_tree.package_dirs() == {"fastcifar.kernels": "kernels"}
    kernels = sorted(p.name for p in (ROOT / "kernels").glob("*.py"))
    assert sorted(p.name for p in (tree / "fastcifar" / "kernels").glob("*.py")) == kernels
    for name in kernels:
        assert (tree / "fastcifar" / "kernels" / name).read_bytes() == (ROOT / "kernels" / name).read_bytes()
    assert (tree / "bench" / "results").resolve() == (ROOT / "bench" / "results").resolve()  # results stay here
    assert (tree / "pyproject.toml").is_file() and (tree / "tests" / "conftest.py").is_file()
    assert not (tree / ".git").exists() and not (tree / ".venv").exists()
    assert not list(tree.rglob("__pycache__"))
    # CI's venv (.ci/venv) is left out at any depth
    assert (tree / ".ci" / "run").is_file() and stage_tree.SKIP_PATTERNS(".ci", ["run", "venv"]) == {"venv"}


def test_refuses_a_folder_that_exists_or_sits_inside_the_checkout(tmp_path, capsys):
    (tmp_path / "there").mkdir()
    assert stage_tree.main([str(tmp_path / "there")]) == 2
    assert "exists" in capsys.readouterr().err
    with pytest.raises(ValueError, match="inside the checkout"):
        stage_tree.stage(ROOT / "tests" / "tree")
    assert not (ROOT / "tests" / "tree").exists()


@pytest.mark.slow  # a Python that imports torch, triton and the entry points: over 2 s on 2 cores
def test_a_python_without_the_install_imports_the_copy(tmp_path):
    tree = stage_tree.stage(tmp_path / "tree")
    venvs = (str(ROOT / ".venv"), sys.prefix)  # a developer's venv, or CI's (.ci/venv): inside the checkout
    # each entry point as `python FILE` imports it: its folder first on sys.path
    code = f"""
import importlib, os, sys
import fastcifar.kernels.bn_act_pool, fastcifar.kernels.augment, fastcifar.kernels.conv_stats, fastcifar.models.network
for path in {ENTRY_POINTS!r}:
    sys.path.insert(0, os.path.join({str(tree)!r}, os.path.dirname(path)))
    importlib.import_module(os.path.basename(path)[:-3])
files = [getattr(m, "__file__", None) or "" for m in list(sys.modules.values())]
checkout = [f for f in files if f.startswith({str(ROOT) + os.sep!r}) and not f.startswith({venvs!r})]
print(fastcifar.kernels.__file__.startswith({str(tree)!r}), "from the checkout:", checkout,
      "finders:", [f.__name__ for f in sys.meta_path if "editable" in f.__name__])
"""
    out = subprocess.run(
        [sys.executable, "-S", "-c", code], cwd=tmp_path, env=bare_python_env(tree), capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["True", "from", "the", "checkout:", "[]", "finders:", "[]"], out.stdout
    # pytest from the copy: its pythonpath ["."] and the layer test find fastcifar.kernels there
    out = subprocess.run(
        [sys.executable, "-S", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/unit/test_layers.py"],
        cwd=tree,
        env=bare_python_env(tree),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]


@pytest.mark.slow  # a Python that imports torch
def test_without_the_copy_the_checkout_does_not_import_the_kernels(tmp_path):
    """The check above can fail: the checkout itself, uninstalled, has no fastcifar.kernels."""
    code = "import fastcifar.kernels"
    env = bare_python_env(ROOT)
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "No module named 'fastcifar.kernels'" in out.stderr, out.stderr[-2000:]


def test_package_dir_is_read_the_same_without_tomllib(monkeypatch, tmp_path):
    """Python 3.10 (requires-python) has no tomllib: the table is read line by line, to the same
    mapping, and a pyproject without the table maps nothing."""
    import builtins

    with_tomllib = stage_tree.package_dirs()
    assert with_tomllib == {"fastcifar.kernels": "kernels"}
    real_import = builtins.__import__

    def no_tomllib(name, *args, **kwargs):
        if name == "tomllib":
            raise ModuleNotFoundError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tomllib)
    assert stage_tree.package_dirs() == with_tomllib
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n\n[tool.setuptools]\npackages = ["x"]\n')
    assert stage_tree.package_dirs(tmp_path) == {}
