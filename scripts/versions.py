"""One line of the versions a run of the tests meets (CI's log prints it):

    python scripts/versions.py   ->   versions: python 3.11.7, torch 2.14.1, torchvision 0.29.1, ...

Read from the installed packages' metadata, nothing imported: it prints also where an import fails
(a torchvision built for another torch)."""

from __future__ import annotations

import platform
from importlib import metadata

PACKAGES = ("torch", "torchvision", "triton", "numpy", "nvidia-dali-cuda130")


def version_of(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def line() -> str:
    return "versions: " + ", ".join(
        [f"python {platform.python_version()}"] + [f"{p} {version_of(p)}" for p in PACKAGES]
    )


if __name__ == "__main__":
    print(line(), flush=True)
