"""One line of the versions a run of the tests meets (CI's log prints it):

    python scripts/versions.py   ->   versions: python 3.11.7, torch 2.14.1, torchvision 0.29.1, ...

Read from the installed packages' metadata, nothing imported: it prints also where an import fails
(a torchvision built for another torch)."""

from __future__ import annotations

import platform
import re
from importlib import metadata

PACKAGES = ("torch", "torchvision", "triton", "numpy")
# DALI is one distribution per CUDA major: nvidia-dali-cuda130 (the dali extra), nvidia-dali-cuda120
# (the volta extra). The line names whichever is installed, both when two are (gpu.preflight refuses that).
DALI_BUILD = re.compile(r"nvidia-dali-cuda\d+")


def version_of(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def dali_builds() -> list[str]:
    names = {(dist.metadata["Name"] or "").lower().replace("_", "-") for dist in metadata.distributions()}
    return sorted(name for name in names if DALI_BUILD.fullmatch(name))


def line() -> str:
    dali = [f"{name} {version_of(name)}" for name in dali_builds()] or ["nvidia-dali absent"]
    return "versions: " + ", ".join(
        [f"python {platform.python_version()}"] + [f"{p} {version_of(p)}" for p in PACKAGES] + dali
    )


if __name__ == "__main__":
    print(line(), flush=True)
