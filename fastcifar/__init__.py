"""fastcifar: a fast, honest data-parallel CIFAR-10 trainer."""

__version__ = "0.1.0"

# A command (``python -m fastcifar...``, or the ``fastcifar`` / ``fastcifar-train`` scripts) imports
# this package first, seconds before its module has imported torch and its main runs: a bad
# OMP_NUM_THREADS is refused now, before libgomp prints its own warning and goes on
# (core.environment), and a Ctrl-C or SIGTERM meanwhile is one line, not an import's traceback
# (core.signals.install_early). A program that merely imports fastcifar is left alone.
from fastcifar.core.environment import running_a_command as _running_a_command  # noqa: E402


def _start_command() -> None:
    """The package's import for a command (a function so that tests/helpers/forkserver.py, whose
    commands find the package imported, can run it too)."""
    if not _running_a_command():
        return
    from fastcifar.core import signals
    from fastcifar.core.environment import environment_problem

    signals.install_early()
    problem = environment_problem()
    if problem is not None:
        print(f"fastcifar: error: {problem}", file=__import__("sys").stderr)
        raise SystemExit(2)


_start_command()

# The Python API (fastcifar.api). Config and presets are light and imported now; the trainer,
# evaluate and predict are modules that are also callable, imported on first use: importing
# fastcifar.train here would make `python -m fastcifar.train` warn (runpy finds it imported).
from fastcifar.core.config import Config, ConfigError, from_preset, validate  # noqa: E402
from fastcifar.core.presets import DEFAULT_PRESET, PRESETS  # noqa: E402
from fastcifar.data import DataError  # noqa: E402

_LAZY = {
    "train": None,
    "evaluate": None,
    "predict": None,
    "load_model": "models.files",
    "save_model": "models.files",
    "CheckpointError": "models.files",
    "TrainedRun": "api",
    "open_store": "sweep.store",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'fastcifar' has no attribute {name!r}")
    import importlib

    if _LAZY[name] is None:  # a callable submodule; importing it sets this attribute for next time
        return importlib.import_module(f".{name}", __name__)
    return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)


__all__ = ["Config", "ConfigError", "DataError", "DEFAULT_PRESET", "PRESETS", "from_preset", "validate", *_LAZY]
