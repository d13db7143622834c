"""Benchmark the fused conv (--fused-conv, kernels/conv_stats.py) against the library's conv followed
by the normalize block, at the default preset's blocks (fp16, channels-last, training mode).

    python bench/bench_conv_stats.py              # on a CUDA machine: the default preset's six convs
    python bench/bench_conv_stats.py --convs 0 2  # some of them (indices into DEFAULT_CONVS)
    python bench/bench_conv_stats.py --smoke      # CPU check of this script (interpreter, tiny shapes)

Per conv of the default preset (``bench/kernel_registers.py``'s DEFAULT_CONVS: FastNet 64/256/256
at 2000 images, GELU, the first conv of each block pooling before its batchnorm), three ways of
computing conv -> [pool] -> batchnorm -> GELU: ``cudnn+eager`` (F.conv2d, then ``NormActPool``:
cuDNN's batchnorm), ``cudnn+triton`` (F.conv2d, then the fused normalize kernel: the trainer's
default) and ``fused`` (``TritonConvBlock``: the conv kernel takes the statistics and the pool);
forward, backward (through one retained forward) and both, timed as CUDA-graph replays (as the
trainer runs them; bench_bn_act_pool.py says why eager timings mislead), do_bench median with
20th/80th percentiles.

Beside each time: the conv's TFLOP/s (forward 2 N H W C_in C_out k^2 multiply-adds x 2; backward
twice that) against the fp16 matmul rate measured in the same run, the ceiling a conv could reach,
and for ``fused`` the largest difference of its forward output from ``cudnn+triton``'s (fp16 steps:
the summation orders differ; beyond DIFF_TOL the row is an error and the script exits 1). Rows are
appended to bench/results/conv_stats.jsonl.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import smoke_mode

SMOKE = smoke_mode()

import torch

from bench import kernel_registers
from bench.bench_bn_act_pool import direction_rows
from bench.common import (
    add_index_argument,
    append_results,
    copy_bandwidth_gbs,
    environment,
    markdown_table,
    matmul_tflops,
    print_header,
    require_cuda,
)
from fastcifar.kernels.bn_act_pool import TritonNormActPool
from fastcifar.kernels.conv_stats import TritonConvBlock
from fastcifar.ops.norm_act_pool import ConvBlock, NormActPool

CL = torch.channels_last
CONVS = kernel_registers.DEFAULT_CONVS  # (batch, c_in, c_out, side, pool)
# --smoke: a pool-first conv on an odd map and a plain one, at batch 2, narrow
SMOKE_CONVS = [(2, 6, 8, 7, "before"), (2, 8, 8, 5, None)]
ACT = "gelu"  # the default preset's activation
DIRECTION_FLOPS = {"fwd": 1, "bwd": 2, "both": 3}  # x the forward's FLOPs
# the fused forward against cuDNN + the normalize block: the kernel tests' fp16 tolerance (a few fp16
# steps at O(1) values, where the summation orders differ), x max(1, max |output|)
DIFF_TOL = 1e-2


def conv_flops(n, c_in, c_out, side, k=3) -> int:
    """Forward FLOPs of a stride-1 "same" conv: two per multiply-add."""
    return 2 * n * side * side * c_in * c_out * k * k


def impls(c_in, c_out, pool, device):
    """The three blocks, same weights and state: (module, parameters gradients are taken for)."""
    torch.manual_seed(0)
    base = ConvBlock(c_in, c_out, NormActPool, act=ACT, pool=pool)
    out = {}
    for name, norm, cls in (
        ("cudnn+eager", NormActPool, ConvBlock),
        ("cudnn+triton", TritonNormActPool, ConvBlock),
        ("fused", TritonNormActPool, TritonConvBlock),
    ):
        block = ConvBlock(c_in, c_out, norm, act=ACT, pool=pool)
        block.load_state_dict(base.state_dict())
        block.__class__ = cls  # TritonConvBlock: ConvBlock's state, the fused forward
        block = block.to(device, memory_format=CL)
        block.conv.half()  # fp16 filter, fp32 batchnorm (as build_model leaves a network)
        out[name] = (block, [block.conv.weight, block.norm.weight, block.norm.bias])
    return out


def bench_convs(device, convs, tflops, graphs, record=None):
    rows = []
    for n, c_in, c_out, side, pool in convs:
        first = len(rows)
        conv = f"{c_in}->{c_out} {side}x{side} pool={pool}"
        g = torch.Generator().manual_seed(side)
        x = torch.randn(n, c_in, side, side, generator=g).half().to(device).contiguous(memory_format=CL)
        x.requires_grad_()
        oh = side // 2 if pool == "before" else side
        dy = torch.randn(n, c_out, oh, oh, generator=g).half().to(device).contiguous(memory_format=CL)
        blocks = impls(c_in, c_out, pool, device)
        with torch.no_grad():
            reference = blocks["cudnn+triton"][0](x).float()
            diff = (blocks["fused"][0](x).float() - reference).abs().max().item()
            bound = DIFF_TOL * max(1.0, reference.abs().max().item())
        flops = conv_flops(n, c_in, c_out, side)
        for name, (block, params) in blocks.items():

            def figures(direction, ms, name=name, flops=flops, diff=diff, bound=bound):
                rate = DIRECTION_FLOPS[direction] * flops / (ms * 1e-3) / 1e12
                cells = {"TFLOP/s": round(rate, 1), "% matmul": round(100 * rate / tflops, 1)}
                if name == "fused" and direction == "fwd":
                    cells["max |fused - cudnn+triton|"] = diff
                    if not diff <= bound:  # a wrong kernel fails the stage, not just a slow one
                        cells["error"] = f"fused output off by {diff:.3g} > {bound:.3g}"
                return cells

            rows += direction_rows({"batch": n, "conv": conv, "impl": name}, block, x, dy, params, graphs, figures)
        print(f"{conv}: {len(rows) - first} rows", flush=True)
        if record is not None:
            record(rows[first:])
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_index_argument(
        p, "--convs", len(CONVS), "indices into bench/kernel_registers.py's DEFAULT_CONVS (default: all)"
    )
    p.add_argument("--smoke", action="store_true", help="tiny CPU run of the script's logic; writes nothing")
    args = p.parse_args(argv)
    if not SMOKE:
        require_cuda("bench_conv_stats")
    device = "cpu" if SMOKE else "cuda"
    if not SMOKE:
        torch.backends.cudnn.benchmark = True  # as the trainer: the fastest algorithm per shape
    env = environment()
    copy_gbs = copy_bandwidth_gbs(smoke=SMOKE)
    tflops = matmul_tflops(smoke=SMOKE)
    print_header(
        "conv + batchnorm statistics (+ 2x2 pool): fused Triton conv vs the library's conv + the "
        "normalize block, fp16 channels-last, training mode",
        env,
        copy_gbs,
    )
    print(f"measured fp16 matmul rate: {tflops:.0f} TFLOP/s (the ceiling the % matmul column compares with)\n")

    def record(conv_rows):  # appended conv by conv: a stage cut off at its limit keeps what it measured
        append_results("conv_stats", conv_rows, env, copy_gbs)

    convs = SMOKE_CONVS if SMOKE else [CONVS[i] for i in args.convs]
    rows = bench_convs(device, convs, tflops, graphs=device == "cuda", record=None if SMOKE else record)
    print(
        markdown_table(
            rows,
            [
                "batch",
                "conv",
                "impl",
                "dir",
                "timing",
                "median_ms",
                "p20_ms",
                "p80_ms",
                "launch_ms",
                "TFLOP/s",
                "% matmul",
                "max |fused - cudnn+triton|",
                "error",
            ],
        )
    )
    if SMOKE:
        print("\n(smoke run on CPU under the Triton interpreter: timings meaningless, nothing written)")
    failed = [r for r in rows if r.get("error")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
