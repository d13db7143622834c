"""Optional libraries (onnx, onnxruntime, tensorboard, matplotlib, ...): imported where a command
needs one, and a failed import is one line naming the package and the fix (``ConfigError``: exit 2).

A library can be installed and still fail to import with something other than ImportError: a
build for another torch raises RuntimeError ("operator torchvision::nms does not exist"), a broken
shared library OSError. Both end the command in the same one line as a missing package.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from fastcifar.core.errors import ConfigError, first_line
from fastcifar.core.signals import held


def reason(exc: BaseException) -> str:
    """The failure in one line: its type and the first line of its message."""
    first = first_line(str(exc))
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def load(module: str, fix: str, needed_for: str) -> ModuleType:
    """``module`` imported, or ConfigError: "<needed_for> needs the <module> package, which cannot be
    imported (<why>): <fix>"."""
    try:
        with held():  # a Ctrl-C meanwhile is taken when the import is over (``signals.held``)
            return importlib.import_module(module)
    except Exception as exc:  # ImportError, or the RuntimeError / OSError of a broken install
        why = "not installed" if isinstance(exc, ModuleNotFoundError) and exc.name == module else reason(exc)
        raise ConfigError(f"{needed_for} needs the {module} package, which cannot be imported ({why}): {fix}") from None


def installed(module: str) -> bool:
    """Whether ``module`` is there to import (not whether its import works: ``load`` says that)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that fails, or a module without a spec
        return False
