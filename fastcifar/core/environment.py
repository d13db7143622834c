"""The environment variables fastcifar's behaviour depends on, read here and nowhere else in the
package, except the launcher's (torchrun's and Slurm's: ``parallel.distributed`` turns them into
the process group) and Triton's own ``TRITON_INTERPRET`` (``fastcifar.kernels``). A test harness
switch is a flag that --help leaves out (``core.config``, group "testing"), never a variable: a
variable left in a user's environment would change their run without a word in its log.

The thread counts are checked before torch is imported.

``OMP_NUM_THREADS`` is read by libgomp when torch loads: a value it cannot parse (0, -4, abc, 1.5)
is skipped with libgomp's own warning and the run goes on with a thread per core, which on a shared
machine ran the README's CPU example at half speed; ``MKL_NUM_THREADS`` set to abc or -4 gave torch
one thread on 2 cores, without a word. So the commands refuse both first, in one line of their
own (exit 2), from ``fastcifar.cli.main`` and, for ``python -m fastcifar.<command>``, from the
package's import (``fastcifar/__init__.py``), both before any ``import torch``. The syntax is a
positive whole number (OpenMP also takes a comma-separated list, one per nesting level); empty is the same as unset.
"""

from __future__ import annotations

import os
import sys
import tempfile

# name -> whether a comma-separated list (one count per nesting level) is allowed. MKL reads its
# own variable silently: MKL_NUM_THREADS=abc or -4 gave torch 1 thread on 2 cores, no warning.
THREAD_VARIABLES = {"OMP_NUM_THREADS": True, "MKL_NUM_THREADS": False}
MAX_THREADS = 1024  # per nesting level: twice the hardware threads of a 2-socket, 128-core SMT-2 host


# "1": --kernels triton without a GPU runs Triton's interpreter (correct, minutes per epoch: the
# kernel tests' path); anything else refuses it (models.blocks.resolve_kernels says how to ask)
ALLOW_INTERPRETER = "FASTCIFAR_ALLOW_INTERPRETER"


def interpreter_allowed() -> bool:
    return os.environ.get(ALLOW_INTERPRETER) == "1"


# --deterministic on a GPU: cuBLAS's reductions repeat only with a fixed workspace per stream; torch
# asks for ":4096:8" (8 buffers of 4 MiB) or ":16:8" and reads the variable when it makes the
# process's first cuBLAS handle, so a later change does nothing there.
CUBLAS_WORKSPACE = "CUBLAS_WORKSPACE_CONFIG"
DETERMINISTIC_CUBLAS = ":4096:8"


def deterministic_cublas() -> tuple[str, bool]:
    """(the ``CUBLAS_WORKSPACE_CONFIG`` in force, whether it was set here): the user's own when
    set, else ``DETERMINISTIC_CUBLAS``, set for this process and the ones it starts."""
    value = os.environ.get(CUBLAS_WORKSPACE, "")
    if value:
        return value, False
    os.environ[CUBLAS_WORKSPACE] = DETERMINISTIC_CUBLAS
    return DETERMINISTIC_CUBLAS, True


def launcher_rank() -> str:
    """This process's rank as its launcher set it (torchrun's ``RANK``), "0" without one: whether
    to print a line before the process group exists or after it is gone."""
    return os.environ.get("RANK", "0")


def threads_given() -> bool:
    """Whether the user chose torch's CPU thread count (``OMP_NUM_THREADS``)."""
    return bool(os.environ.get("OMP_NUM_THREADS"))


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity where the OS keeps one (Linux: taskset's or
    a container's limit), else every core (macOS has no ``sched_getaffinity``)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def home() -> str:
    return os.environ.get("HOME", "")


def xdg_cache_home() -> str:
    return os.environ.get("XDG_CACHE_HOME", "")


def home_is_a_folder() -> bool:
    folder = home()
    return bool(folder) and os.path.isabs(folder) and os.path.isdir(folder)


def place_triton_cache(device_type: str) -> str:
    """Triton keeps compiled kernels under ``$TRITON_HOME/.triton``, by default the home folder, and
    makes it with ``os.makedirs``: a ``HOME`` that does not exist would be created from ``/`` down.
    On a GPU (where Triton compiles) with such a HOME and no TRITON_HOME, this run's kernels go to a
    fresh temporary folder instead; returns the note saying so, or ""."""
    if device_type != "cuda" or home_is_a_folder() or os.environ.get("TRITON_HOME"):
        return ""
    os.environ["TRITON_HOME"] = tempfile.mkdtemp(prefix="fastcifar-triton-")
    return (
        f"note: HOME {os.environ.get('HOME', '')!r} is not an existing folder: Triton's kernel cache is "
        f"{os.environ['TRITON_HOME']} for this run (set TRITON_HOME to keep it)"
    )


def running_a_command() -> bool:
    """Whether this process is one of fastcifar's commands: ``python -m fastcifar[.x]`` (runpy
    imports the package with sys.argv[0] "-m"; ``sys.orig_argv`` names the module) or a console
    script named ``fastcifar`` or ``fastcifar-train``. False for a program that imports the package."""
    if sys.argv[:1] == ["-m"]:
        argv = list(getattr(sys, "orig_argv", []))
        for i, arg in enumerate(argv):
            name = argv[i + 1] if arg == "-m" and i + 1 < len(argv) else arg[2:] if arg.startswith("-m") else ""
            if name:
                return name == "fastcifar" or name.startswith("fastcifar.")
        return False
    return os.path.basename(sys.argv[0] if sys.argv else "") in ("fastcifar", "fastcifar-train")


def visible_gpu_names(count: int, environ=None) -> list[str]:
    """The CUDA_VISIBLE_DEVICES entry of each of the ``count`` GPUs this process sees (0..count-1
    without the variable): a child process given one of them sees that GPU, also when a scheduler
    (Slurm: --gpus) left this process GPUs 2,3 or their UUIDs."""
    environ = os.environ if environ is None else environ
    given = [v.strip() for v in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if "CUDA_VISIBLE_DEVICES" not in environ or len(given) < count:
        return [str(i) for i in range(count)]
    return given[:count]


def slurm_array_task(environ=None) -> tuple[int, int] | None:
    """(this task's index from 0, the array's task count) of a Slurm job array (``sbatch --array``):
    SLURM_ARRAY_TASK_ID less SLURM_ARRAY_TASK_MIN (--array=1-64 counts from 1), out of
    SLURM_ARRAY_TASK_COUNT; None outside an array. ValueError, one line, for values that cannot be
    (not whole numbers, an index outside the count: an array with a step, --array=0-63:2, is one)."""
    environ = os.environ if environ is None else environ
    if "SLURM_ARRAY_TASK_ID" not in environ:
        return None
    names = ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_MIN")
    values = {n: environ.get(n, "0" if n.endswith("MIN") else "").strip() for n in names}
    bad = [n for n, v in values.items() if not (v.isascii() and v.isdigit())]
    if bad:
        raise ValueError(f"{bad[0]} must be a whole number, not {values[bad[0]]!r}")
    task, count, low = (int(values[n]) for n in names)
    if not 0 <= task - low < count:
        raise ValueError(
            f"SLURM_ARRAY_TASK_ID {task} (from {low}) is not one of SLURM_ARRAY_TASK_COUNT {count} tasks: "
            "an array of consecutive indices (--array=0-63, not a step or a list with gaps)"
        )
    return task - low, count


def environment_problem(environ=None) -> str | None:
    """One line saying which variable is unusable and why; None when all are fine."""
    environ = os.environ if environ is None else environ
    for name, lists in THREAD_VARIABLES.items():
        value = environ.get(name)
        if value is None or not value.strip():
            continue
        parts = [p.strip() for p in value.strip().split(",")] if lists else [value.strip()]
        if not all(p.isascii() and p.isdigit() and int(p) >= 1 for p in parts):
            return (
                f"{name} must be a positive whole number of threads (e.g. {name}=1), not {value!r}; "
                f"unset it for torch's default (a thread per core)"
            )
        if max(int(p) for p in parts) > MAX_THREADS:
            return (
                f"{name}={value.strip()} asks for more than {MAX_THREADS} threads; unset it for torch's "
                f"default (a thread per core)"
            )
    return None
