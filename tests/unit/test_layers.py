"""The package's layers: each folder of fastcifar/ imports only the folders below it, and nothing
imports in a circle. Every import counts, also one inside a function (a late import still ties the
modules together)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

# bottom to top; folders on one rank are siblings and import neither each other
LAYERS = {"core": 0, "ops": 1, "kernels": 2, "models": 3, "data": 3, "parallel": 4, "run": 5, "": 6, "sweep": 7}


def package_folder(package: str) -> Path:
    """The folder Python imports ``package`` from (fastcifar.kernels: kernels/, by setuptools' package-dir)."""
    return Path(importlib.util.find_spec(package).submodule_search_locations[0])


def module_files() -> dict[str, Path]:
    """Every module of the package as Python imports it: fastcifar's folder, then each layer's package
    wherever it is mapped from (a folder of fastcifar/ missing from LAYERS fails the tests below)."""
    files = {}
    roots = {"fastcifar": package_folder("fastcifar")}
    roots |= {f"fastcifar.{folder}": package_folder(f"fastcifar.{folder}") for folder in LAYERS if folder}
    for package, root in roots.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files.setdefault(".".join([package, *parts]), path)
    return files


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The fastcifar modules ``path`` imports (a name imported from a package counts as its
    submodule when there is one)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {m for m in found if m in known and m != name}


def layer(module: str) -> tuple[str, int]:
    parts = module.split(".")
    folder = parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else ""
    return folder, LAYERS[folder]


GRAPH = {name: imports_of(name, path, set(module_files())) for name, path in module_files().items()}


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_only_layers_below(module):
    folder, rank = layer(module)
    wrong = sorted(m for m in GRAPH[module] if layer(m)[1] > rank or (layer(m)[1] == rank and layer(m)[0] != folder))
    assert not wrong, f"{module} ({folder or 'commands'}, layer {rank}) imports {wrong}, which are not below it"


def test_no_import_cycle():
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(GRAPH[m]):
            if n.startswith(m + "."):  # a package importing its own submodule (its __init__)
                continue
            if state.get(n) == 1:
                cycle = stack[stack.index(n) :] + [n]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)


def test_the_check_sees_a_violation(tmp_path):
    """The checker itself: an upward import and a cycle in a made-up pair are caught."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from fastcifar.run import recipe\n")
    b.write_text("def f():\n    from fastcifar.core import config\n")
    known = {"fastcifar.run.recipe", "fastcifar.core.config", "fastcifar.core", "fastcifar.run"}
    assert imports_of("fastcifar.core.x", a, known) == {"fastcifar.run.recipe"}
    assert imports_of("fastcifar.core.y", b, known) == {"fastcifar.core.config"}
    assert layer("fastcifar.run.recipe")[1] > layer("fastcifar.core.x")[1]
