"""Command-line plumbing shared by the commands (train, evaluate, predict, checkpoint): the one-line
error and exit status, and modules that are also functions. Only the command modules import it.

Naming: ``fastcifar.train`` is also the trainer module (``python -m fastcifar.train``), and
importing a submodule sets the package attribute of that name to the module, replacing any
function defined there. So the modules ``train``, ``evaluate`` and ``predict`` are themselves
callable (``CallableModule``): ``fastcifar.train(cfg)`` is the same call whether or not something
imported ``fastcifar.train`` first, and the package imports none of them eagerly, which keeps
``python -m fastcifar.train`` free of runpy's "found in sys.modules" warning.
"""

from __future__ import annotations

import importlib
import sys
import types

from fastcifar.core.errors import ConfigError, DataError


class CallableModule(types.ModuleType):
    """A module that is also a function: calling it calls its ``__api_call__``, a function or a
    "module:name" string imported at the first call (so the trainer names ``fastcifar.api:train``
    without importing the API, which imports the trainer)."""

    def __call__(self, *args, **kwargs):
        if isinstance(self.__api_call__, str):
            module, name = self.__api_call__.split(":")
            self.__api_call__ = getattr(importlib.import_module(module), name)
        return self.__api_call__(*args, **kwargs)


def run_command(body) -> int:
    """Run a command line's ``body`` (evaluate, predict): its bad input is one line on stderr and
    exit 2, as the trainer's is."""
    try:
        return body()
    except (ConfigError, DataError) as exc:  # a CheckpointError is a DataError
        print(f"fastcifar: error: {exc}", file=sys.stderr)
    except RuntimeError as exc:  # e.g. --device cuda without one
        print(f"fastcifar: error: {str(exc).splitlines()[0]}", file=sys.stderr)
    return 2


def make_callable(module_name: str, function) -> None:
    """Make ``sys.modules[module_name]`` callable: ``function`` is a callable or a "module:name"."""
    module = sys.modules[module_name]
    module.__class__ = CallableModule
    module.__api_call__ = function
