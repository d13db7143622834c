"""Command-line plumbing shared by the commands (train, evaluate, predict, checkpoint, export): the
one-line error and exit status, modules that are also functions, and the ``fastcifar`` command.

    fastcifar train|evaluate|predict|checkpoint|export|sweep [ARGS ...]     (also python -m fastcifar ...)

``main`` is the installed ``fastcifar`` console script: it hands ARGS to the named command's own
``main(argv, prog="fastcifar NAME")``, so ``fastcifar train ARGS`` is ``python -m fastcifar.train
ARGS`` (and ``fastcifar-train ARGS``) under another name. The command modules are imported by name
when called (they import this module: a plain import would be a cycle).

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

from fastcifar.core.errors import ConfigError, DataError, first_line
from fastcifar.core.names import printable


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
    """Run a command line's ``body`` (evaluate, predict, export, checkpoint) as the trainer runs its
    own: bad input is one line on stderr and exit 2; SIGINT or SIGTERM is one line and exit 130 or
    143 (``core.signals``: finally blocks run, so ``write_atomic`` removes its temporary, and no
    KeyboardInterrupt traceback), also when the main thread is blocked in C++ (the signal watcher
    then prints the line and ends the process)."""
    from fastcifar.core import signals
    from fastcifar.core.environment import environment_problem

    previous = signals.install(on_blocked=_say_stopped)
    try:
        problem = environment_problem()  # also when called as python -m's module or from a script
        if problem is not None:
            raise ConfigError(problem)
        return body()
    except (ConfigError, DataError) as exc:  # a CheckpointError is a DataError
        # printable: a message may quote a file's text (a name, a setting); it stays one line
        print(f"fastcifar: error: {printable(str(exc))}", file=sys.stderr)
    except RuntimeError as exc:  # e.g. --device cuda without one
        print(f"fastcifar: error: {printable(first_line(str(exc)) or type(exc).__name__)}", file=sys.stderr)
    except signals.StopRun as exc:
        return signals.end_run(exc, _say_stopped)
    except BrokenPipeError:  # `... | head -1`: the reader left; quiet, as a shell's SIGPIPE'd command
        return signals.stdout_gone()
    finally:
        signals.restore(previous)  # the caller's Ctrl-C works again (pytest, a notebook)
    return 2


def _say_stopped(exc: BaseException) -> None:
    print(f"fastcifar: {exc}", file=sys.stderr, flush=True)


def make_callable(module_name: str, function) -> None:
    """Make ``sys.modules[module_name]`` callable: ``function`` is a callable or a "module:name"."""
    module = sys.modules[module_name]
    module.__class__ = CallableModule
    module.__api_call__ = function


# name -> (module, one line for `fastcifar --help`)
COMMANDS = {
    "train": ("fastcifar.train", "train a network on CIFAR (default: {default}), on one device or under torchrun"),
    "evaluate": ("fastcifar.evaluate", "test accuracy, overall and per class, of a saved model"),
    "predict": ("fastcifar.predict", "top classes, with probabilities, of your own images"),
    "checkpoint": (
        "fastcifar.checkpoint",
        "inspect sparse diffs, restore a model file from a chain of them, or seal an older model file",
    ),
    "export": ("fastcifar.export", "write a saved model as an ONNX file (for onnxruntime and others)"),
    "sweep": ("fastcifar.sweep.cli", "train a study of many runs into one store; status and compare read it"),
}


def usage(prog: str = "fastcifar") -> str:
    return f"usage: {prog} {{{','.join(COMMANDS)}}} [ARGS ...]"


def help_text(prog: str = "fastcifar") -> str:
    width = max(map(len, COMMANDS))
    lines = [
        usage(prog),
        "",
        "fastcifar: a fast CIFAR-10 trainer, and tools for the models it writes.",
        "",
        "commands:",
    ]
    from fastcifar.core.config import from_preset
    from fastcifar.core.options import ARCH_NAMES
    from fastcifar.core.presets import DEFAULT_PRESET

    default = f"{ARCH_NAMES[from_preset(DEFAULT_PRESET).arch]}, preset {DEFAULT_PRESET}"
    lines += [f"  {name:<{width}}  {text.format(default=default)}" for name, (_, text) in COMMANDS.items()]
    lines += ["", f"'{prog} COMMAND --help' gives a command's options; '{prog} --version' the version."]
    return "\n".join(lines)


def _say(text: str) -> int:
    """Print ``text`` to stdout: 0, or quietly the shell's 141 when the reader has left
    (``fastcifar --help | head -1``), as the commands end; flushed here, where the error is caught,
    not at the interpreter's exit, where it would be a traceback."""
    from fastcifar.core import signals

    try:
        print(text, flush=True)
    except BrokenPipeError:
        return signals.stdout_gone()
    return 0


def main(argv: list[str] | None = None, prog: str = "fastcifar") -> int:
    """``fastcifar COMMAND ARGS``: the exit status of the command; 2 with the usage (no command) or
    one line (an unknown one); 0 after ``--help``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        print(help_text(prog), file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    if name in ("-h", "--help") and not rest:
        return _say(help_text(prog))
    if name == "--version" and not rest:
        from fastcifar import __version__

        return _say(f"fastcifar {__version__}")
    if name not in COMMANDS:
        print(
            f"fastcifar: error: unknown command {name!r}; choose from {', '.join(COMMANDS)} "
            f"('{prog} --help' says what each does)",
            file=sys.stderr,
        )
        return 2
    from fastcifar.core import signals
    from fastcifar.core.environment import environment_problem

    problem = environment_problem()  # before the command imports torch (its libgomp reads OMP_NUM_THREADS)
    if problem is not None:
        print(f"fastcifar: error: {problem}", file=sys.stderr)
        return 2
    # from here, not from the command's own main: importing torch takes seconds, and a Ctrl-C then
    # would end in a KeyboardInterrupt traceback; the command installs its own on top
    previous = signals.install(on_blocked=_say_stopped)
    try:
        module = importlib.import_module(COMMANDS[name][0])  # by name: the commands import this module
        return module.main(rest, prog=f"{prog} {name}")
    except signals.StopRun as exc:
        return signals.end_run(exc, _say_stopped)
    finally:
        signals.restore(previous)
