"""Sweep the fused conv's launch settings (--fused-conv, kernels/conv_stats.py) on a GPU.

    python bench/sweep_conv_stats.py                       # the default preset's six convs, every setting
    python bench/sweep_conv_stats.py --convs 3 4 --settings base n128 m256
    python bench/sweep_conv_stats.py --smoke               # CPU check of this script (interpreter, tiny shapes)

kernels/conv_stats.py fixes one tile shape, warp count and pipeline depth for every fp16 conv (its
``LAUNCH``), chosen by register counts, never timed. Its forward took 2.4-6.2x the time of cuDNN's
forward plus the normalize block's statistics (bench/results/visits/visit-11.md, 11c). This times
the fused forward (training mode: the statistics and, where the block pools first, the pool in its
epilogue) at the default preset's convs (``bench/kernel_registers.py``'s DEFAULT_CONVS) under each
named setting, as CUDA-graph replays (do_bench median), beside ``cudnn+triton``'s forward (cuDNN's
conv, then the fused normalize kernel's statistics and apply: what the trainer runs by default),
and prints one table: milliseconds per conv and setting, the best setting and its time against the
base setting's and against cuDNN's. A setting whose output differs from ``cudnn+triton``'s by more
than bench_conv_stats.DIFF_TOL is an error cell, never a best. Rows go to
bench/results/conv_sweep.jsonl conv by conv.

Every setting here compiles without register spills on sm_90 at the default's convs (ptxas through
``bench/aot.py``, triton 3.8.0 on the CPU; the GPU machine's is 3.6.0; 256 x 128
and 128 x 256 x 64 tiles spilled, 48 and 2084 bytes, and are left out). The backward is not swept:
it is cuDNN's and the normalize block's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import smoke_mode

SMOKE = smoke_mode()  # before triton is imported: --smoke runs the kernels in its interpreter

import torch

from bench.bench_bn_act_pool import graph_timings
from bench.bench_conv_stats import CL, CONVS, DIFF_TOL, SMOKE_CONVS, impls
from bench.common import (
    add_index_argument,
    append_results,
    best_setting,
    copy_bandwidth_gbs,
    environment,
    markdown_table,
    print_header,
    require_cuda,
    time_ms,
)
from fastcifar.kernels import conv_stats as cs

C = cs.ConvLaunch
PROGRAMS = cs.LAUNCH.programs_per_sm
# name: (output pixels per tile, output channels, input channels per K step, warps, pipeline stages);
# "base" is the module's own LAUNCH. m256 gives the pooled variant 64-row accumulators, the least
# Hopper's warpgroup MMA takes (the base's are 32).
SETTINGS = {
    "base": cs.LAUNCH,
    "n128": C(128, 128, 32, 8, 2, PROGRAMS),
    "k64": C(128, 64, 64, 8, 2, PROGRAMS),
    "s3": C(128, 64, 32, 8, 3, PROGRAMS),
    "s4": C(128, 64, 32, 8, 4, PROGRAMS),
    "n128k64s3": C(128, 128, 64, 8, 3, PROGRAMS),
    "m256": C(256, 64, 32, 8, 2, PROGRAMS),
    "m256s3": C(256, 64, 32, 8, 3, PROGRAMS),
    "w4": C(128, 64, 32, 4, 2, PROGRAMS),
    "m64n128k64w4s3": C(64, 128, 64, 4, 3, PROGRAMS),
}


def forward_ms(block, x, device) -> float:
    """The block's training-mode forward, as a graph replay (on the CPU: one eager call): median ms."""

    def fwd():
        block(x)

    if device == "cpu":
        return time_ms(fwd, smoke=True)["median_ms"]
    return graph_timings({"fwd": fwd}, torch.cuda.Stream())["fwd"]["median_ms"]


def sweep_conv(conv, settings, device) -> dict:
    """One row: ``conv``'s fused forward under each setting (ms, or the error), cuDNN's beside it."""
    n, c_in, c_out, side, pool = conv
    g = torch.Generator().manual_seed(side)
    x = torch.randn(n, c_in, side, side, generator=g).half().to(device).contiguous(memory_format=CL)
    blocks = impls(c_in, c_out, pool, device)
    reference, fused = blocks["cudnn+triton"][0], blocks["fused"][0]
    row = {"batch": n, "conv": f"{c_in}->{c_out} {side}x{side} pool={pool}"}
    with torch.no_grad():
        want = reference(x).float()
        bound = DIFF_TOL * max(1.0, want.abs().max().item())
        row["cudnn+triton"] = round(forward_ms(reference, x, device), 4)
        for name in settings:
            cs.LAUNCH = SETTINGS[name]
            try:
                diff = (fused(x).float() - want).abs().max().item()
                if not diff <= bound:  # a wrong kernel is an error cell, never the best
                    row[name] = f"output off by {diff:.3g} > {bound:.3g}"
                    continue
                row[name] = round(forward_ms(fused, x, device), 4)
            except Exception as e:  # a setting that fails to compile or run is reported, not fatal
                row[name] = f"{type(e).__name__}: {str(e)[:60]}"
            finally:
                cs.LAUNCH = SETTINGS["base"]
    best = best_setting(row, settings)
    if best:
        row["best / cudnn+triton"] = round(row[best] / row["cudnn+triton"], 3)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_index_argument(
        p, "--convs", len(CONVS), "indices into bench/kernel_registers.py's DEFAULT_CONVS (default: all)"
    )
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--smoke", action="store_true", help="tiny CPU run of the script's logic; writes nothing")
    args = p.parse_args(argv)
    if SMOKE:  # the two smoke convs, two settings: the script's logic, not figures
        convs, args.settings = SMOKE_CONVS, ["base", "w4"]
    else:
        require_cuda("sweep_conv_stats")
        torch.backends.cudnn.benchmark = True  # as the trainer: cuDNN's fastest algorithm per shape
        convs = [CONVS[i] for i in args.convs]
    device = "cpu" if SMOKE else "cuda"
    env = environment()
    copy_gbs = copy_bandwidth_gbs(smoke=SMOKE)
    print_header(
        "fused conv launch settings: training-mode forward (conv + statistics [+ pool]), graph replays, "
        "beside cuDNN + the normalize block",
        env,
        copy_gbs,
    )
    for name in args.settings:
        print(f"- {name}: {SETTINGS[name]}")
    rows = []
    for conv in convs:
        row = sweep_conv(conv, args.settings, device)
        print(row, flush=True)
        rows.append(row)
        if not SMOKE:  # conv by conv: a call cut off at its time limit keeps the convs it finished
            append_results("conv_sweep", [row], env, copy_gbs)
    print()
    print(
        markdown_table(
            rows, ["batch", "conv", "cudnn+triton", *args.settings, "best", "best vs base", "best / cudnn+triton"]
        )
    )
    if SMOKE:
        print("\n(smoke run on the CPU under the Triton interpreter: timings meaningless, nothing written)")
        return 0
    print("\nrows appended to bench/results/conv_sweep.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
