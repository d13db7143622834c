"""A copy of this checkout that imports as installed, for a Python without fastcifar installed.

    python scripts/stage_tree.py DEST     # then, e.g.: cd DEST && PYTHONPATH=DEST python -m pytest ...

kernels/ installs as fastcifar.kernels (pyproject.toml's [tool.setuptools] package-dir); a checkout
imports it only once installed (``pip install -e .``). The GPU machine's Python has no install of
this project (and may lack setuptools and the network to get it), so its commands run from DEST: the
checkout's files, with each package-dir folder also copied where the package puts it
(kernels/ -> DEST/fastcifar/kernels). Run from DEST, every way in is served at once: ``python -m``
(the working folder first on sys.path), pytest (its ``pythonpath = ["."]``), bench/ and scripts/
(each puts its checkout first on sys.path) and the tests' subprocesses (PYTHONPATH is their checkout).
Placing a built fastcifar/ first on PYTHONPATH alone would not do: each of those puts the checkout's
own fastcifar/, which has no kernels/, ahead of it.

Results stay in the checkout: DEST/bench/results and DEST/.stage are links to the checkout's. Needs
only the standard library (on Python 3.10, which has no tomllib, the package-dir table is read line
by line: it holds plain "name" = "folder" pairs).
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# never copied: version control, environments, staged data, run output, build output
SKIP = {
    ".git",
    ".venv",
    "venv",
    ".stage",
    ".ruff_cache",
    ".pytest_cache",
    ".mypy_cache",
    "data",
    "runs",
    "gpu-visit",
    "build",
    "dist",
    ".whl",
    ".cache",
}
# at any depth: CI's venv is .ci/venv (.ci/run)
SKIP_PATTERNS = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "*.npz", "*.npy", "*.pt", "venv", ".venv")
LINKED = ("bench/results", ".stage")  # shared with the checkout, not copied


def package_dirs(root: Path = ROOT) -> dict[str, str]:
    """pyproject.toml's package-dir: package name -> the folder it installs from."""
    text = (root / "pyproject.toml").read_text()
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        table = re.search(r"^\[tool\.setuptools\.package-dir\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
        pairs = re.findall(r'^"([^"]+)"\s*=\s*"([^"]+)"', table.group(1), re.M) if table else []
        return dict(pairs)
    return tomllib.loads(text)["tool"]["setuptools"].get("package-dir", {})


def stage(dest: Path, root: Path = ROOT) -> Path:
    """Lay out ``dest`` (created; must not exist yet) from the checkout ``root``; returns it, absolute."""
    dest = dest.resolve()
    if dest.exists():
        raise FileExistsError(f"{dest} exists: give a new folder")
    if dest.is_relative_to(root):
        raise ValueError(f"{dest} is inside the checkout {root}: give a folder outside it")
    dest.mkdir(parents=True)
    for entry in sorted(root.iterdir()):
        if entry.name in SKIP or entry.name.endswith(".egg-info"):
            continue
        if entry.is_dir():
            shutil.copytree(entry, dest / entry.name, ignore=SKIP_PATTERNS, symlinks=True)
        else:
            shutil.copy2(entry, dest / entry.name)
    for package, folder in package_dirs(root).items():
        target = dest.joinpath(*package.split("."))
        if target.exists():
            raise FileExistsError(f"{target.relative_to(dest)} exists in the checkout and is also {folder}/'s place")
        shutil.copytree(root / folder, target, ignore=SKIP_PATTERNS)
    for name in LINKED:
        if (root / name).exists():
            shutil.rmtree(dest / name, ignore_errors=True)
            (dest / name).symlink_to(root / name, target_is_directory=True)
    return dest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dest", type=Path, help="a new folder outside the checkout")
    args = p.parse_args(argv)
    try:
        print(stage(args.dest))
    except (OSError, ValueError) as e:
        print(f"stage_tree: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
