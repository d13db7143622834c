"""The installed torch, torchvision and Triton against the combinations this project has met
(fastcifar needs no torchvision; one installed beside torch must match it).

A combination known to break fails, in one line; one merely not met yet is skipped with one line
naming it (pytest's -ra summary shows it), so a new release is seen without failing the suite.
"""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]

# (torch, torchvision, triton) public versions, and what ran with them (device, date); torchvision "*":
# not recorded there (fastcifar needs none).
KNOWN_GOOD = {
    ("2.14.1", "0.29.1", "3.8.0"): "the whole suite, 2-core CPU, 2026-11-26 (constraints/cpu.txt)",
    ("2.11.0", "*", "3.6.0"): "the GPU measurements, one H100, 2026-11-22..26 (constraints/gpu.txt)",
    ("2.14.1", "0.29.1", "3.9.0"): "the Triton tests (scripts/check_triton.sh), 2-core CPU, 2026-12-03",
    ("2.14.1", "0.29.1", "3.6.0"): "the Triton tests with numpy 2.3.5 (not 2.4: triton_numpy_break), 2026-12-03",
}


def installed(name: str) -> str | None:
    try:
        return Version(metadata.version(name)).public  # 2.14.1+cpu and 2.14.1+cu130 are one release
    except metadata.PackageNotFoundError:
        return None


def torchvision_mismatch(torch_version: str, torchvision_version: str) -> str | None:
    """Why the pair cannot work, or None. torchvision's compiled operators are built against one torch
    release: torchvision 0.N+15 pairs with torch 2.N (torchvision's compatibility table, 2.0/0.15
    through 2.14/0.29); beside another torch its import fails ("operator torchvision::nms does not exist")."""
    t, v = Version(torch_version), Version(torchvision_version)
    if t.major == 2 and v.major == 0 and v.minor != t.minor + 15:
        return f"torchvision {torchvision_version} is built for torch 2.{v.minor - 15}, not torch {torch_version}"
    return None


def triton_numpy_break(triton_version: str, numpy_version: str) -> str | None:
    """Why the kernel tests cannot run, or None. Triton 3.6's interpreter turns a one-element array into
    a Python int (a loop bound: ``range(start, tl.minimum(...))``), which numpy 2.4 refuses ("only
    0-dimensional arrays can be converted to Python scalars": 223 kernel tests failed; with numpy 2.3.5
    they pass). Triton 3.8's does not (3.7 was not tried: not on this machine's index)."""
    if Version(triton_version) < Version("3.7") and Version(numpy_version) >= Version("2.4"):
        return f"Triton {triton_version}'s interpreter (the kernel tests) fails with numpy {numpy_version}: numpy<2.4"
    return None


def test_the_pairing_rule():
    assert torchvision_mismatch("2.14.1", "0.29.1") is None
    assert torchvision_mismatch("2.4.0", "0.19.1") is None
    assert "built for torch 2.14" in torchvision_mismatch("2.15.0", "0.29.1")
    assert triton_numpy_break("3.8.0", "2.4.6") is None and triton_numpy_break("3.6.0", "2.3.5") is None
    assert "numpy<2.4" in triton_numpy_break("3.6.0", "2.4.0")


def known(torch_v: str | None, vision_v: str | None, triton_v: str | None) -> bool:
    return any((t, tr) == (torch_v, triton_v) and (v == "*" or vision_v in (None, v)) for t, v, tr in KNOWN_GOOD)


@pytest.mark.parametrize("name", ["cpu.txt", "gpu.txt"])
def test_the_constraints_files_are_known_good_combinations(name):
    pins = {}
    for line in (ROOT / "constraints" / name).read_text().splitlines():
        package, sep, version = line.split("#")[0].strip().partition("==")
        if sep:
            pins[package] = version
    assert known(pins["torch"], pins.get("torchvision"), pins["triton"])


def test_installed_versions_are_known_good():
    torch_v, vision_v, triton_v = installed("torch"), installed("torchvision"), installed("triton")
    combo = f"torch {torch_v}, torchvision {vision_v}, triton {triton_v}"
    numpy_v = installed("numpy")
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # tests/conftest.py, without a GPU
    why = (torchvision_mismatch(torch_v, vision_v) if torch_v and vision_v else None) or (
        triton_numpy_break(triton_v, numpy_v) if triton_v and numpy_v and interpreted else None
    )
    assert why is None, f"{combo}: known to break: {why} (pip install -c constraints/cpu.txt)"
    if not known(torch_v, vision_v, triton_v):  # without torchvision: a known torch and Triton suffice
        pytest.skip(f"{combo}: not a combination this project has met (constraints/*.txt list two)")


@pytest.mark.parametrize(
    "dali, shown",
    [
        ({"nvidia-dali-cuda130": "2.4.0"}, "nvidia-dali-cuda130 2.4.0"),
        ({"nvidia_dali_cuda120": "2.4.0"}, "nvidia-dali-cuda120 2.4.0"),  # the volta extra's build
        ({}, "nvidia-dali absent"),
    ],
)
def test_the_versions_line_names_the_dali_build_installed(dali, shown, monkeypatch):
    """scripts/versions.py named nvidia-dali-cuda130 alone: "absent" under the volta extra's cuda120."""
    from types import SimpleNamespace

    from scripts import versions

    installed = {"torch": "2.10.0", "numpy": "2.3.5", **{k.replace("_", "-"): v for k, v in dali.items()}}

    def version(name):
        if name not in installed:
            raise metadata.PackageNotFoundError(name)
        return installed[name]

    dists = [SimpleNamespace(metadata={"Name": name}) for name in ["torch", "numpy", *dali]]
    fake = SimpleNamespace(
        distributions=lambda: dists, version=version, PackageNotFoundError=metadata.PackageNotFoundError
    )
    monkeypatch.setattr(versions, "metadata", fake)
    assert versions.line().endswith(f"torch 2.10.0, torchvision absent, triton absent, numpy 2.3.5, {shown}")
