"""Triton kernels for fastcifar: one file per fused op (kernel, launcher, autograd.Function, module); each
op's plain-PyTorch reference, which the tests and benchmarks compare it with, is in ``fastcifar.ops``."""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType


def load(name: str, interpret: bool) -> ModuleType:
    """Import ``fastcifar.kernels.<name>``; ``interpret``: define its kernels in Triton's interpreter.

    Triton picks interpreter or compiler when a ``@triton.jit`` function is defined (its own helpers
    when triton is first imported), so ``TRITON_INTERPRET=1`` must be set during the import only. It
    is removed again afterwards: a process-wide setting would leak into every later test and into
    subprocesses (a GPU benchmark started from a CPU test would silently run interpreted). The
    interpreter asks again at launch time (Triton imports some of its modules lazily), so the answer
    stays on in this process through Triton's own setting, ``triton.knobs`` (Triton >= 3.4), which
    subprocesses do not inherit; an older Triton keeps the variable set."""
    qualified = f"{__name__}.{name}"
    if not interpret or os.environ.get("TRITON_INTERPRET") == "1":
        return importlib.import_module(qualified)
    if "triton" in sys.modules:
        from .checks import interpreted

        if not interpreted():  # its helpers are compiled-mode: the kernels would refuse CPU tensors later
            raise RuntimeError(
                "fastcifar.kernels.load: triton was imported before its interpreter could be switched "
                "on; import fastcifar's kernels first or set TRITON_INTERPRET=1 before starting Python"
            )
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        module = importlib.import_module(qualified)
    finally:
        import triton

        if hasattr(triton, "knobs"):
            triton.knobs.runtime.interpret = True  # sets the variable again: removed on the next line
            del os.environ["TRITON_INTERPRET"]
    return module


def module(name: str) -> ModuleType:
    """``fastcifar.kernels.<name>`` as this machine runs it: compiled for the GPU, or interpreted
    where there is none (the caller refuses Triton on CPU tensors where there is one).
    ``TRITON_INTERPRET`` is set for the import only, never left in the process environment."""
    import torch

    return load(name, interpret=not torch.cuda.is_available())
