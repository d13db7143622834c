"""Compile every kernel variant the launchers produce for a real GPU (sm_80, sm_90), without a GPU.

    python -m fastcifar.kernels.aot --set ci   --arch 80,90          # the CI subset (tests/test_kernel_compile.py)
    python -m fastcifar.kernels.aot --set full --arch 80,90 --out bench/results/kernel_registers

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

import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from fastcifar.norm_act_pool import ACTIVATIONS

ARCHS = (80, 90)


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
        return json.dumps([self.kernel, self.signature, {str(k): v for k, v in self.constexprs.items()},
                           {str(k): v for k, v in self.attrs.items()}, self.options], sort_keys=True, default=str)

    def label(self) -> str:
        ptrs = sorted({v[1:] for v in self.signature.values() if isinstance(v, str) and v.startswith("*")})
        names = getattr(self.fn, "arg_names", [])
        consts = ",".join(f"{names[k[0]] if isinstance(k, tuple) and k[0] < len(names) else k}={v}"
                          for k, v in self.constexprs.items())
        ints = []
        for k, val in self.attrs.items():
            name = names[k[0]] if names else k
            if val and self.signature.get(name, "") not in ("constexpr",) and not self.signature[name].startswith("*"):
                ints.append(name)
        div16 = f"; {'/'.join(ints)} %16" if ints else ""  # integer arguments Triton specialized as multiples of 16
        return f"{self.kernel}[{'/'.join(ptrs)}; {consts}{div16}; warps={self.options.get('num_warps')}]"


# ----------------------------------------------------------------------------------------------
# Recording the launches
# ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def recording(arch: int, out: list):
    """Inside: every ``kernel[grid](...)`` appends Variants to ``out`` instead of launching, and the
    launchers accept CPU tensors."""
    from triton.compiler import make_backend
    from triton.backends.compiler import GPUTarget
    from triton.runtime import jit
    from . import checks

    backend = make_backend(GPUTarget("cuda", arch, 32))
    binders = {}

    def run(self, *args, grid, warmup, **kwargs):
        if self not in binders:
            binders[self] = jit.create_function_from_signature(self.signature, self.params, backend)
        bound, specialization, options = binders[self](*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, specialization, options)
        out.append(Variant(self.__name__, dict(signature), dict(constexprs), dict(attrs),
                           {"num_warps": options.num_warps, "num_stages": options.num_stages},
                           self, recording.where))

    real_run, real_interpreted = jit.JITFunction.run, checks.interpreted
    jit.JITFunction.run = run
    checks.interpreted = lambda: True  # CPU tensors stand in for CUDA ones: nothing is launched
    try:
        yield
    finally:
        jit.JITFunction.run, checks.interpreted = real_run, real_interpreted


recording.where = ""


# ----------------------------------------------------------------------------------------------
# The launcher calls: presets' real shapes and odd ones
# ----------------------------------------------------------------------------------------------

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# (batch, channels, map side, pool) of each NormActPool in the presets, at their per-GPU batch
FAST_BLOCKS = [(1024, 64, 31, "before"), (1024, 64, 15, None), (1024, 256, 15, "before"),
               (1024, 256, 7, None), (1024, 256, 7, "before"), (1024, 256, 3, None)]
RESNET9_BLOCKS = [(512, 64, 32, None), (512, 128, 32, "after"), (512, 128, 16, None),
                  (512, 256, 16, "after"), (512, 512, 8, "after"), (512, 512, 4, None)]
# the default preset, fast-muon320: `fast`'s blocks at 2000 images, the wide ones at 320 channels
DEFAULT_BLOCKS = [(2000, 64 if c == 64 else 320, s, pool) for _, c, s, pool in FAST_BLOCKS]
# the same with each preset's activation, (batch, channels, side, act, pool): the blocks the
# kernel benchmark times and the CUDA kernel tests check (the default's last, so the indices of
# the first twelve, which bench/results/ quote, stay)
PRESET_BLOCKS = ([(b, c, s, "gelu", pool) for b, c, s, pool in FAST_BLOCKS]
                 + [(b, c, s, "relu", pool) for b, c, s, pool in RESNET9_BLOCKS]
                 + [(b, c, s, "gelu", pool) for b, c, s, pool in DEFAULT_BLOCKS])
# odd shapes: two with every pool mode, one more odd map pooled before; each listed once
ODD_BLOCKS = ([(3, 5, 7, pool) for pool in (None, "before", "after")]
              + [(2, 24, 6, pool) for pool in (None, "before", "after")] + [(1, 3, 9, "before")])


def bn_call(batch, channels, side, pool, dtype, act, training) -> Callable[[], None]:
    def call():
        from .bn_act_pool import bn_act_pool_backward, bn_act_pool_forward
        x = torch.empty(batch, channels, side, side, dtype=dtype).contiguous(memory_format=torch.channels_last)
        vec = lambda: torch.ones(channels)  # noqa: E731
        y, saved = bn_act_pool_forward(x, vec(), vec(), vec(), vec(), training, 0.1, 1e-5, act, pool)
        dy = torch.empty_like(y, memory_format=torch.channels_last)
        bn_act_pool_backward(dy, saved, vec(), vec(), x.shape, training, act, pool)
    call.__name__ = f"bn_act_pool {dtype} {act} pool={pool} training={training} {batch}x{channels}x{side}x{side}"
    return call


def augment_call(batch, data, pad, cutout, dtype, indexed) -> Callable[[], None]:
    def call():
        from fastcifar.augment import AugmentParams
        from .augment import augment
        side = 32 + 2 * pad
        images = torch.empty(data, side, side, 3, dtype=torch.uint8)
        p = [torch.zeros(batch, dtype=torch.int64) for _ in range(5)]
        index = torch.zeros(batch, dtype=torch.int64) if indexed else None
        augment(images if indexed else images[:batch], AugmentParams(*p), cutout, dtype=dtype, index=index)
    call.__name__ = f"augment {dtype} batch={batch} pad={pad} cutout={cutout} indexed={indexed}"
    return call


def cutout_call(batch, channels, side, size, dtype) -> Callable[[], None]:
    def call():
        from .cutout import cutout_forward
        x = torch.empty(batch, channels, side, side, dtype=dtype).contiguous(memory_format=torch.channels_last)
        pos = torch.zeros(batch, dtype=torch.int64)
        cutout_forward(x, pos, pos, size)
    call.__name__ = f"cutout {dtype} {batch}x{channels}x{side}x{side} size={size}"
    return call


def calls(which: str) -> list[Callable[[], None]]:
    """``ci``: one of each kind the presets launch (fp16 on the GPU: `fast`'s GELU with pool before BN,
    training and evaluation; `resnet9`'s ReLU with pool after; the augmentation and cutout) and an
    odd fp32 shape with CELU, about 20 compiles per arch; ``presets``: every block of the `fast`,
    `resnet9` and default (`fast-muon320`) presets in fp16, training and evaluation, with the
    augmentation and cutout; ``full``: every dtype x activation x pool x mode over the presets' and
    odd shapes, every augmentation and cutout dtype."""
    out = []
    if which == "ci":
        fp16 = torch.float16
        out += [bn_call(1024, 64, 31, "before", fp16, "gelu", True), bn_call(1024, 64, 15, None, fp16, "gelu", True),
                bn_call(1024, 256, 7, "before", fp16, "gelu", False),
                bn_call(512, 128, 32, "after", fp16, "relu", True), bn_call(3, 5, 7, None, torch.float32, "celu", True),
                augment_call(1024, 50000, 2, 0, fp16, True), cutout_call(512, 3, 32, 8, fp16)]
        return out
    if which == "presets":
        for training in (True, False):
            out += [bn_call(b, c, s, pool, torch.float16, act, training) for b, c, s, act, pool in PRESET_BLOCKS]
        return out + [augment_call(1024, 50000, 2, 0, torch.float16, True),
                      augment_call(512, 50000, 4, 8, torch.float16, True), cutout_call(512, 3, 32, 8, torch.float16)]
    if which != "full":
        raise ValueError(f"unknown variant set {which!r}: ci, presets or full")
    for dtype in DTYPES.values():
        for act in ACTIVATIONS:
            for training in (True, False):
                for b, c, s, pool in FAST_BLOCKS + RESNET9_BLOCKS + DEFAULT_BLOCKS + ODD_BLOCKS:
                    out.append(bn_call(b, c, s, pool, dtype, act, training))
        for indexed in (True, False):
            out += [augment_call(1024, 50000 if indexed else 1024, 2, 0, dtype, indexed),
                    augment_call(512, 50000 if indexed else 512, 4, 8, dtype, indexed),
                    augment_call(5, 7, 1, 3, dtype, indexed)]
        out += [cutout_call(512, 3, 32, 8, dtype), cutout_call(3, 5, 7, 3, dtype)]
    return out


def record(arch: int, which: str) -> list[Variant]:
    """The distinct variants the calls of set ``which`` launch, for ``arch``."""
    launched: list[Variant] = []
    with recording(arch, launched):
        for call in calls(which):
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
    row = {"arch": f"sm_{arch}", "kernel": v.kernel, "variant": v.label(), "from": v.where,
           **parse_ptxas(buf.getvalue()), "shared_bytes": int(compiled.metadata.shared),
           "ptx_bytes": len(compiled.asm["ptx"]), "cubin_bytes": len(compiled.asm["cubin"]),
           "compile_s": round(time.perf_counter() - t0, 2)}
    return row


def sweep(archs: Iterable[int], which: str, log=print, on_row=lambda row: None) -> list[dict]:
    """Compile set ``which`` for each arch; ``on_row`` sees each row as soon as it exists (a long
    sweep that is cut short keeps what it did)."""
    rows = []
    for arch in archs:
        variants = record(arch, which)
        log(f"sm_{arch}: {len(variants)} variants ({which})")
        for v in variants:
            try:
                rows.append(compile_variant(v, arch))
            except Exception as exc:  # a failure is a result: reported in the table, fails the test
                rows.append({"arch": f"sm_{arch}", "kernel": v.kernel, "variant": v.label(), "from": v.where,
                             "error": f"{type(exc).__name__}: {str(exc)[:500]}"})
            on_row(rows[-1])
    return rows


def table(rows: list[dict], header: str) -> str:
    lines = [header, "",
             "| arch | kernel | variant | regs | spill st/ld B | stack B | smem B | compile s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['arch']} | {r['kernel']} | {r['variant']} | FAILED: {r['error'][:120]} | | | | |")
        else:
            lines.append(f"| {r['arch']} | {r['kernel']} | {r['variant']} | {r['registers']} | "
                         f"{r['spill_store_bytes']}/{r['spill_load_bytes']} | {r['stack_bytes']} | "
                         f"{r['shared_bytes']} | {r['compile_s']} |")
    return "\n".join(lines) + "\n"


def problems(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """What fails a sweep (main's exit status, tests/test_kernel_compile.py): the rows that did not
    compile, and the compiled rows that spill registers."""
    failed = [r for r in rows if "error" in r]
    spilled = [r for r in rows if "error" not in r and (r["spill_store_bytes"] or r["spill_load_bytes"])]
    return failed, spilled


def summary(rows: list[dict]) -> str:
    ok = [r for r in rows if "error" not in r]
    failed, spilled = problems(rows)
    out = [f"{len(rows)} variants compiled, {len(failed)} failed, {len(spilled)} with spills", ""]
    for arch in sorted({r["arch"] for r in ok}):
        for kernel in sorted({r["kernel"] for r in ok if r["arch"] == arch}):
            regs = [r["registers"] for r in ok if r["arch"] == arch and r["kernel"] == kernel]
            out.append(f"- {arch} {kernel}: {len(regs)} variants, registers {min(regs)}-{max(regs)}")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--set", default="ci", choices=("ci", "presets", "full"), help="which launcher calls (see calls())")
    p.add_argument("--arch", default="80,90", help="compute capabilities, comma-separated")
    p.add_argument("--out", default="", help="write OUT.md (table) and OUT.jsonl (one row per variant)")
    p.add_argument("--json", action="store_true", help="print the rows as one JSON list on the last line")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("fastcifar: error: unset TRITON_INTERPRET: the interpreter compiles nothing", file=sys.stderr)
        return 2
    import triton

    env = {}
    if args.out:  # the table joins bench/results/: its rows carry what every row there does (versions, date, commit)
        try:
            from bench.common import environment
        except ImportError:
            print("fastcifar: error: --out needs bench/common.py importable: run from the repository root",
                  file=sys.stderr)
            return 2
        env = environment()

    def on_row(row):
        if args.out:
            with open(args.out + ".jsonl", "a") as f:
                f.write(json.dumps({**env, "set": args.set, **row}) + "\n")

    # scope(): the deleted folder does not stay Triton's cache after main (tests call it in-process)
    with triton.knobs.cache.scope(), tempfile.TemporaryDirectory() as cache:
        triton.knobs.cache.dir = cache  # a fresh cache: every variant really compiles, and ptxas reports
        rows = sweep([int(a) for a in args.arch.split(",")], args.set, log=lambda m: print(m, file=sys.stderr),
                     on_row=on_row)
    print(summary(rows), file=sys.stderr)
    if args.out:
        header = (f"### Triton {env['triton']}, torch {env['torch']}, compiled on the CPU (no GPU) for "
                  f"{', '.join('sm_' + a for a in args.arch.split(','))}, set `{args.set}`, {env['date']}, "
                  f"commit {env['commit'] or 'unknown'}\n\n"
                  f"{summary(rows)}\n\nregisters per thread, spills and stack from ptxas -v of the real compile; "
                  "shared memory from Triton's metadata; compile s is wall time on this machine "
                  f"({os.cpu_count()} CPUs, possibly shared).")
        with open(args.out + ".md", "a") as f:
            f.write(table(rows, header) + "\n")
    if args.json:
        print(json.dumps(rows))
    failed, spilled = problems(rows)
    return 1 if failed or spilled else 0


if __name__ == "__main__":
    sys.exit(main())
