"""Compile every kernel variant the launchers produce for a real GPU (sm_70 to sm_90), without a GPU.

The command that sweeps the presets' shapes is ``bench/kernel_registers.py``; this module, beside it, is the
machinery (recording the launches, compiling them, reading ptxas's report).

How: the launchers are called on CPU tensors of the presets' real shapes (and odd ones) with each
kernel's ``run`` replaced by a recorder, so what is compiled is exactly what a launcher would launch:
its block sizes, its constexprs, and Triton's own specialization of the arguments (integer
divisibility by 16, pointer alignment). Each distinct variant is then compiled by ``triton.compile``
for ``GPUTarget("cuda", arch, 32)``: Triton's front end, LLVM and the ptxas that ships inside Triton,
down to a cubin. ptxas's ``-v`` report (Triton runs it with ``-v`` and prints it on request) gives
the registers per thread, spill stores/loads and stack; Triton's metadata the shared memory.

Needs the real compiler: run with ``TRITON_INTERPRET`` unset (the tests' interpreter would turn the
kernels into Python). Uses Triton's launch-time helpers (``create_function_from_signature``,
``JITFunction._pack_args``) so the specialization is Triton's own: written against Triton 3.8.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from fastcifar.core import gpu

ARCHS = (70, 75, 80, 90)  # Volta, Turing, Ampere, Hopper: what CI compiles for (tests/kernels/test_kernel_compile.py)


@dataclass
class Variant:
    """One compilation: a kernel with its argument types, constexprs and launch options."""

    kernel: str
    signature: dict
    constexprs: dict
    attrs: dict  # as Triton's _pack_args returns it: {(arg index,): [[attribute, value], ...]}
    options: dict
    fn: object = field(repr=False, compare=False)
    where: str = ""  # the first launcher call that produced it

    def key(self) -> str:
        return json.dumps(
            [
                self.kernel,
                self.signature,
                {str(k): v for k, v in self.constexprs.items()},
                {str(k): v for k, v in self.attrs.items()},
                self.options,
            ],
            sort_keys=True,
            default=str,
        )

    def label(self) -> str:
        ptrs = sorted({v[1:] for v in self.signature.values() if isinstance(v, str) and v.startswith("*")})
        names = getattr(self.fn, "arg_names", [])
        consts = ",".join(
            f"{names[k[0]] if isinstance(k, tuple) and k[0] < len(names) else k}={v}"
            for k, v in self.constexprs.items()
        )
        ints = []
        for k, val in self.attrs.items():
            name = names[k[0]] if names else k
            if val and self.signature.get(name, "") not in ("constexpr",) and not self.signature[name].startswith("*"):
                ints.append(name)
        div16 = f"; {'/'.join(ints)} %16" if ints else ""  # integer arguments Triton specialized as multiples of 16
        fusion = "; no fp fusion" if self.options.get("enable_fp_fusion") is False else ""
        return f"{self.kernel}[{'/'.join(ptrs)}; {consts}{div16}; warps={self.options.get('num_warps')}{fusion}]"


# ----------------------------------------------------------------------------------------------
# Recording the launches
# ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def recording(arch: int, out: list):
    """Inside: every ``kernel[grid](...)`` appends Variants to ``out`` instead of launching, and the
    launchers accept CPU tensors."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime import jit

    from fastcifar.kernels import checks

    backend = make_backend(GPUTarget("cuda", arch, 32))
    binders = {}

    def run(self, *args, grid, warmup, **kwargs):
        if self not in binders:
            binders[self] = jit.create_function_from_signature(self.signature, self.params, backend)
        bound, specialization, options = binders[self](*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, specialization, options)
        launch = {"num_warps": options.num_warps, "num_stages": options.num_stages}
        if not options.enable_fp_fusion:  # only where a launch turns it off: the other variants' keys stay
            launch["enable_fp_fusion"] = False
        out.append(
            Variant(self.__name__, dict(signature), dict(constexprs), dict(attrs), launch, self, recording.where)
        )

    real_run, real_interpreted = jit.JITFunction.run, checks.interpreted
    jit.JITFunction.run = run
    checks.interpreted = lambda: True  # CPU tensors stand in for CUDA ones: nothing is launched
    try:
        with gpu.standing_in((arch // 10, arch % 10)):  # the launchers choose as on that GPU (conv_stats' tiles)
            yield
    finally:
        jit.JITFunction.run, checks.interpreted = real_run, real_interpreted


recording.where = ""


def record(arch: int, calls: Iterable[Callable[[], None]]) -> list[Variant]:
    """The distinct variants that ``calls`` (launcher calls on CPU tensors, each named by its
    ``__name__``) launch, for ``arch``."""
    launched: list[Variant] = []
    with recording(arch, launched):
        for call in calls:
            recording.where = call.__name__
            call()
    unique = {}
    for v in launched:
        unique.setdefault(v.key(), v)
    return list(unique.values())


# ----------------------------------------------------------------------------------------------
# Compiling and reading the resource usage
# ----------------------------------------------------------------------------------------------

_USED = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas(log: str) -> dict:
    """Registers, stack and spills from a ptxas ``-v`` report of one kernel."""
    used = _USED.findall(log)
    spill = _SPILL.findall(log)
    if not used or not spill:
        raise ValueError(f"no register/spill report in ptxas output:\n{log}")
    stack, stores, loads = (int(v) for v in spill[-1])
    return {"registers": int(used[-1]), "stack_bytes": stack, "spill_store_bytes": stores, "spill_load_bytes": loads}


def compile_variant(v: Variant, arch: int) -> dict:
    """Compile ``v`` for sm_``arch``: the row of the register table (plus the PTX/cubin sizes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(v.fn, v.signature, v.constexprs, v.attrs)
    buf = io.StringIO()
    t0 = time.perf_counter()
    old = triton.knobs.nvidia.dump_ptxas_log
    triton.knobs.nvidia.dump_ptxas_log = True  # Triton prints ptxas's -v report of the real compile
    try:
        with contextlib.redirect_stdout(buf):
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(v.options))
    finally:
        triton.knobs.nvidia.dump_ptxas_log = old
    row = {
        "arch": f"sm_{arch}",
        "kernel": v.kernel,
        "variant": v.label(),
        "from": v.where,
        **parse_ptxas(buf.getvalue()),
        "shared_bytes": int(compiled.metadata.shared),
        "ptx_bytes": len(compiled.asm["ptx"]),
        "cubin_bytes": len(compiled.asm["cubin"]),
        "compile_s": round(time.perf_counter() - t0, 2),
    }
    return row
