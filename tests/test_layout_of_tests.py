"""The tests' own layout: each file under tests/unit/ is named for the module it tests
(test_<module>.py for fastcifar/<layer>/<module>.py or kernels/<module>.py; test_<folder>_<module>.py
where two modules share a name), so a reader finds a module's tests by its name. Stories that walk
a user's session end to end live in tests/acceptance/, the commands' tests in tests/cli/."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# unit files that test the package as a whole rather than one module, and why
WHOLE_PACKAGE = {"test_layers.py": "the layer rule: every module's imports"}


def module_names() -> set[str]:
    """Every module a unit test may be named for: ``name`` and ``folder_name`` for each module
    (a package counts by its folder's name)."""
    names = set()
    for top in ("fastcifar", "kernels"):
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if parts[-1] == "__main__":
                continue
            names.add(parts[-1])
            if len(parts) > 1:
                names.add(f"{parts[-2]}_{parts[-1]}")
    return names


def misnamed(files: list[str], modules: set[str]) -> list[str]:
    """The unit test files among ``files`` that name no module."""
    return [
        name for name in files if name not in WHOLE_PACKAGE and not (name.startswith("test_") and name[5:-3] in modules)
    ]


def test_each_unit_test_file_names_a_module():
    files = sorted(p.name for p in (ROOT / "tests" / "unit").glob("*.py") if p.name != "__init__.py")
    assert files, "no unit tests found"
    bad = misnamed(files, module_names())
    assert not bad, f"tests/unit/ files that name no module of fastcifar/ or kernels/: {bad}"


def test_the_check_refuses_a_file_named_for_a_topic():
    modules = module_names()
    assert {"augment", "ops_augment", "kernels_augment", "state", "data", "sparse"} <= modules
    assert misnamed(["test_state.py", "test_ops_augment.py", "test_layers.py"], modules) == []
    assert misnamed(["test_model.py", "test_failures.py", "test_capability.py", "state.py"], modules) == [
        "test_model.py",
        "test_failures.py",
        "test_capability.py",
        "state.py",
    ]


def test_the_story_tests_are_acceptance_tests():
    stories = {"test_first_hour.py", "test_second_day.py", "test_newcomer.py"}
    assert stories <= {p.name for p in (ROOT / "tests" / "acceptance").glob("test_*.py")}
    assert not stories & {p.name for p in (ROOT / "tests").rglob("test_*.py") if p.parent.name != "acceptance"}
