"""Registers, spills and shared memory of every kernel variant the launchers produce at the presets'
shapes (and odd ones), compiled for a real GPU (sm_70 to sm_90) on a machine without one.

    python bench/kernel_registers.py --set ci --arch 70,75,80,90   # CI's (tests/kernels/test_kernel_compile.py)
    python bench/kernel_registers.py --set full --arch 80,90 --out bench/results/kernel_registers

The launchers are called on CPU tensors of the shapes below with each kernel's ``run`` replaced by
a recorder (``bench/aot.py``), so what is compiled is exactly what a launcher would
launch on a GPU of that capability (the fused conv takes smaller tiles below sm_80). Needs the
real compiler: run with ``TRITON_INTERPRET`` unset.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from bench import aot
from bench.common import environment
from fastcifar.ops.norm_act_pool import ACTIVATIONS

# ----------------------------------------------------------------------------------------------
# The launcher calls: presets' real shapes and odd ones
# ----------------------------------------------------------------------------------------------

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# (batch, channels, map side, pool) of each NormActPool in the presets, at their per-GPU batch
FAST_BLOCKS = [
    (1024, 64, 31, "before"),
    (1024, 64, 15, None),
    (1024, 256, 15, "before"),
    (1024, 256, 7, None),
    (1024, 256, 7, "before"),
    (1024, 256, 3, None),
]
RESNET9_BLOCKS = [
    (512, 64, 32, None),
    (512, 128, 32, "after"),
    (512, 128, 16, None),
    (512, 256, 16, "after"),
    (512, 512, 8, "after"),
    (512, 512, 4, None),
]
# fast-muon320 (a former default, docs/presets.md): `fast`'s blocks at 2000 images, the wide ones at 320 channels
MUON320_BLOCKS = [(2000, 64 if c == 64 else 320, s, pool) for _, c, s, pool in FAST_BLOCKS]
# the default preset, fast-jitter (fast-muon9's network): `fast`'s blocks (64/256/256) at 2000 images
DEFAULT_BLOCKS = [(2000, c, s, pool) for _, c, s, pool in FAST_BLOCKS]
# the same with each preset's activation, (batch, channels, side, act, pool): the blocks the
# kernel benchmark times and the CUDA kernel tests check (in the order they were added, so the
# indices that bench/results/ quote stay: 0-11 fast and resnet9, 12-17 fast-muon320, 18-23 the default)
PRESET_BLOCKS = (
    [(b, c, s, "gelu", pool) for b, c, s, pool in FAST_BLOCKS]
    + [(b, c, s, "relu", pool) for b, c, s, pool in RESNET9_BLOCKS]
    + [(b, c, s, "gelu", pool) for b, c, s, pool in MUON320_BLOCKS]
    + [(b, c, s, "gelu", pool) for b, c, s, pool in DEFAULT_BLOCKS]
)
# (batch, c_in, c_out, map side, pool) of each conv the default preset fuses with --fused-conv
# (kernels/conv_stats.py): its blocks' two convs, the first pooling before its batchnorm
DEFAULT_CONVS = [
    (2000, 24, 64, 31, "before"),
    (2000, 64, 64, 15, None),
    (2000, 64, 256, 15, "before"),
    (2000, 256, 256, 7, None),
    (2000, 256, 256, 7, "before"),
    (2000, 256, 256, 3, None),
]
ODD_CONVS = [(3, 5, 7, 7, None), (3, 5, 7, 7, "before"), (2, 3, 70, 9, None)]
# odd shapes: two with every pool mode, one more odd map pooled before; each listed once
ODD_BLOCKS = (
    [(3, 5, 7, pool) for pool in (None, "before", "after")]
    + [(2, 24, 6, pool) for pool in (None, "before", "after")]
    + [(1, 3, 9, "before")]
)


def bn_call(batch, channels, side, pool, dtype, act, training) -> Callable[[], None]:
    def call():
        from fastcifar.kernels.bn_act_pool import bn_act_pool_backward, bn_act_pool_forward

        x = torch.empty(batch, channels, side, side, dtype=dtype).contiguous(memory_format=torch.channels_last)
        vec = lambda: torch.ones(channels)  # noqa: E731
        y, saved = bn_act_pool_forward(x, vec(), vec(), vec(), vec(), training, 0.1, 1e-5, act, pool)
        dy = torch.empty_like(y, memory_format=torch.channels_last)
        bn_act_pool_backward(dy, saved, vec(), vec(), x.shape, training, act, pool)

    call.__name__ = f"bn_act_pool {dtype} {act} pool={pool} training={training} {batch}x{channels}x{side}x{side}"
    return call


def conv_call(batch, c_in, c_out, side, pool, dtype, training) -> Callable[[], None]:
    def call():
        from fastcifar.kernels.conv_stats import conv_stats_forward

        x = torch.empty(batch, c_in, side, side, dtype=dtype).contiguous(memory_format=torch.channels_last)
        w = torch.empty(c_out, c_in, 3, 3, dtype=dtype).contiguous(memory_format=torch.channels_last)
        conv_stats_forward(x, w, training, pool)

    call.__name__ = f"conv_stats {dtype} pool={pool} training={training} {batch}x{c_in}->{c_out}x{side}x{side}"
    return call


def augment_call(batch, data, pad, cutout, dtype, indexed, jitter=False) -> Callable[[], None]:
    def call():
        from fastcifar.kernels.augment import augment
        from fastcifar.ops.augment import AugmentSpec, draw_params

        side = 32 + 2 * pad
        images = torch.empty(data, side, side, 3, dtype=torch.uint8)
        # --brightness/--contrast: a shift and a scale per image, the JITTER variant
        spec = AugmentSpec(crop_pad=pad, cutout=cutout, brightness=0.1 if jitter else 0.0)
        params = draw_params(batch, spec, torch.Generator(), "cpu")
        index = torch.zeros(batch, dtype=torch.int64) if indexed else None
        augment(images if indexed else images[:batch], params, spec, dtype=dtype, index=index)

    call.__name__ = f"augment {dtype} batch={batch} pad={pad} cutout={cutout} indexed={indexed} jitter={jitter}"
    return call


def cutout_call(batch, channels, side, size, dtype) -> Callable[[], None]:
    def call():
        from bench.cutout import cutout_forward

        x = torch.empty(batch, channels, side, side, dtype=dtype).contiguous(memory_format=torch.channels_last)
        pos = torch.zeros(batch, dtype=torch.int64)
        cutout_forward(x, pos, pos, size)

    call.__name__ = f"cutout {dtype} {batch}x{channels}x{side}x{side} size={size}"
    return call


def calls(which: str) -> list[Callable[[], None]]:
    """``ci``: one of each kind the presets launch (fp16 on the GPU: `fast`'s GELU with pool before BN,
    training and evaluation; `resnet9`'s ReLU with pool after; the augmentation and cutout; the
    fused conv pooled and not, also in fp32 and bf16) and an odd fp32 shape with CELU, about 25
    compiles per arch; ``presets``: every block of the `fast`, `resnet9`, `fast-muon320` and default
    (`fast-jitter`) presets in fp16, training and evaluation, with the augmentation, cutout and the
    default's fused convs; ``full``: every dtype x activation x pool x mode over the presets' and
    odd shapes, every augmentation and cutout dtype, the fused convs at the default's and odd shapes."""
    out = []
    if which == "ci":
        fp16 = torch.float16
        out += [
            bn_call(1024, 64, 31, "before", fp16, "gelu", True),
            bn_call(1024, 64, 15, None, fp16, "gelu", True),
            bn_call(1024, 256, 7, "before", fp16, "gelu", False),
            bn_call(512, 128, 32, "after", fp16, "relu", True),
            bn_call(3, 5, 7, None, torch.float32, "celu", True),
            augment_call(1024, 50000, 2, 0, fp16, True),
            augment_call(1024, 50000, 2, 0, fp16, True, jitter=True),
            cutout_call(512, 3, 32, 8, fp16),
            conv_call(2000, 24, 64, 31, "before", fp16, True),
            conv_call(2000, 320, 320, 7, None, fp16, True),
            conv_call(2000, 320, 320, 7, "before", fp16, False),
            # fp32 has tiles of its own (conv_stats.LAUNCH_FP32: fp16's spilled); bf16 shares fp16's
            conv_call(2000, 24, 64, 31, "before", torch.float32, True),
            conv_call(2000, 320, 320, 7, None, torch.float32, True),
            conv_call(2000, 24, 64, 31, "before", torch.bfloat16, True),
        ]
        return out
    if which == "presets":
        for training in (True, False):
            out += [bn_call(b, c, s, pool, torch.float16, act, training) for b, c, s, act, pool in PRESET_BLOCKS]
            out += [conv_call(b, ci, co, s, pool, torch.float16, training) for b, ci, co, s, pool in DEFAULT_CONVS]
        return out + [
            augment_call(1024, 50000, 2, 0, torch.float16, True),
            augment_call(2000, 50000, 2, 0, torch.float16, True, jitter=True),
            augment_call(512, 50000, 4, 8, torch.float16, True),
            cutout_call(512, 3, 32, 8, torch.float16),
        ]
    if which != "full":
        raise ValueError(f"unknown variant set {which!r}: ci, presets or full")
    for dtype in DTYPES.values():
        for act in ACTIVATIONS:
            for training in (True, False):
                for b, c, s, pool in FAST_BLOCKS + RESNET9_BLOCKS + MUON320_BLOCKS + DEFAULT_BLOCKS + ODD_BLOCKS:
                    out.append(bn_call(b, c, s, pool, dtype, act, training))
        for indexed in (True, False):
            out += [
                augment_call(1024, 50000 if indexed else 1024, 2, 0, dtype, indexed),
                augment_call(512, 50000 if indexed else 512, 4, 8, dtype, indexed),
                augment_call(5, 7, 1, 3, dtype, indexed),
                augment_call(5, 7, 1, 3, dtype, indexed, jitter=True),
            ]
        out += [cutout_call(512, 3, 32, 8, dtype), cutout_call(3, 5, 7, 3, dtype)]
        for training in (True, False):
            out += [conv_call(b, ci, co, s, pool, dtype, training) for b, ci, co, s, pool in DEFAULT_CONVS + ODD_CONVS]
    return out


def sweep(archs: Iterable[int], which: str, log=print, on_row=lambda row: None) -> list[dict]:
    """Compile set ``which`` for each arch; ``on_row`` sees each row as soon as it exists (a long
    sweep that is cut short keeps what it did)."""
    rows = []
    for arch in archs:
        variants = aot.record(arch, calls(which))
        log(f"sm_{arch}: {len(variants)} variants ({which})")
        for v in variants:
            try:
                rows.append(aot.compile_variant(v, arch))
            except Exception as exc:  # a failure is a result: reported in the table, fails the test
                rows.append(
                    {
                        "arch": f"sm_{arch}",
                        "kernel": v.kernel,
                        "variant": v.label(),
                        "from": v.where,
                        "error": f"{type(exc).__name__}: {str(exc)[:500]}",
                    }
                )
            on_row(rows[-1])
    return rows


def table(rows: list[dict], header: str) -> str:
    lines = [
        header,
        "",
        "| arch | kernel | variant | regs | spill st/ld B | stack B | smem B | compile s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['arch']} | {r['kernel']} | {r['variant']} | FAILED: {r['error'][:120]} | | | | |")
        else:
            lines.append(
                f"| {r['arch']} | {r['kernel']} | {r['variant']} | {r['registers']} | "
                f"{r['spill_store_bytes']}/{r['spill_load_bytes']} | {r['stack_bytes']} | "
                f"{r['shared_bytes']} | {r['compile_s']} |"
            )
    return "\n".join(lines) + "\n"


def problems(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """What fails a sweep (main's exit status, tests/kernels/test_kernel_compile.py): the rows that did not
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
    p.add_argument("--arch", default=",".join(map(str, aot.ARCHS)), help="compute capabilities, comma-separated")
    p.add_argument("--out", default="", help="write OUT.md (table) and OUT.jsonl (one row per variant)")
    p.add_argument("--json", action="store_true", help="print the rows as one JSON list on the last line")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("fastcifar: error: unset TRITON_INTERPRET: the interpreter compiles nothing", file=sys.stderr)
        return 2
    import triton

    env = {}
    if args.out:  # the table joins bench/results/: its rows carry what every row there does (versions, date, commit)
        env = environment()

    def on_row(row):
        if args.out:
            with open(args.out + ".jsonl", "a") as f:
                f.write(json.dumps({**env, "set": args.set, **row}) + "\n")

    # scope(): the deleted folder does not stay Triton's cache after main (tests call it in-process)
    with triton.knobs.cache.scope(), tempfile.TemporaryDirectory() as cache:
        triton.knobs.cache.dir = cache  # a fresh cache: every variant really compiles, and ptxas reports
        rows = sweep(
            [int(a) for a in args.arch.split(",")], args.set, log=lambda m: print(m, file=sys.stderr), on_row=on_row
        )
    print(summary(rows), file=sys.stderr)
    if args.out:
        header = (
            f"### Triton {env['triton']}, torch {env['torch']}, compiled on the CPU (no GPU) for "
            f"{', '.join('sm_' + a for a in args.arch.split(','))}, set `{args.set}`, {env['date']}, "
            f"commit {env['commit'] or 'unknown'}\n\n"
            f"{summary(rows)}\n\nregisters per thread, spills and stack from ptxas -v of the real compile; "
            "shared memory from Triton's metadata; compile s is wall time on this machine "
            f"({os.cpu_count()} CPUs, possibly shared)."
        )
        with open(args.out + ".md", "a") as f:
            f.write(table(rows, header) + "\n")
    if args.json:
        print(json.dumps(rows))
    failed, spilled = problems(rows)
    return 1 if failed or spilled else 0


if __name__ == "__main__":
    sys.exit(main())
