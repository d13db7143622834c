"""fastcifar: a fast, honest data-parallel CIFAR-10 trainer."""

from pathlib import Path as _Path

__version__ = "0.1.0"

# The Triton kernels live in the repository's top-level kernels/ folder and install as
# fastcifar.kernels (pyproject.toml maps the folder). Run from a source checkout without an
# install, this lets ``import fastcifar.kernels`` find that folder all the same.
if not (_Path(__file__).parent / "kernels").is_dir() and (_Path(__file__).parent.parent / "kernels").is_dir():
    __path__.append(str(_Path(__file__).parent.parent))
