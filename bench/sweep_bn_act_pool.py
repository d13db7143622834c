"""Sweep the fused batchnorm + activation + pool kernels' launch settings on a GPU.

    python bench/sweep_bn_act_pool.py                     # every block of both presets, every setting
    python bench/sweep_bn_act_pool.py --blocks 0 1 6      # some blocks (indices into kernel_registers.PRESET_BLOCKS)
    python bench/sweep_bn_act_pool.py --settings base p1024 w8
    python bench/sweep_bn_act_pool.py --per-kernel --settings base   # where each block's time goes
    python bench/sweep_bn_act_pool.py --smoke             # CPU check of this script (interpreter, tiny shapes)

kernels/bn_act_pool.py fixes its tile sizes, warps and the number of stage-1 reduction programs per
place of the pool (its ``LAUNCH`` table). This times forward + backward of
``TritonNormActPool`` at the presets' shapes (fp16, channels-last, a CUDA-graph replay as the trainer
runs it, do_bench median) under each named setting of that table, and prints one
table: milliseconds per block and setting, the best setting per block and its share of the measured
copy bandwidth (the kernels' own bytes, bench_bn_act_pool.traffic_bytes). Rows go to
bench/results/bn_sweep.jsonl block by block. Each setting compiles its own kernels (about 20 per tile shape).

``--per-kernel`` splits the same replay by kernel instead (torch.profiler, bench_step.traced_kernels):
microseconds per replay of each of the six kernels and, for the four that stream the activations,
their own bytes (bench_bn_act_pool.kernel_bytes) against the copy bandwidth; rows go to
bench/results/bn_kernels.jsonl.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import smoke_mode

SMOKE = smoke_mode()  # before triton is imported: --smoke runs the kernels in its interpreter

import torch

from bench.bench_bn_act_pool import (
    BLOCKS,
    CL,
    GRAPH_WARMUP,
    SMOKE_BLOCKS,
    add_blocks_argument,
    direction_bodies,
    graph_timings,
    kernel_bytes,
    traffic_bytes,
)
from bench.bench_step import traced_kernels
from bench.common import (
    append_results,
    best_setting,
    copy_bandwidth_gbs,
    environment,
    markdown_table,
    print_header,
    require_cuda,
    time_ms,
)
from fastcifar.kernels import bn_act_pool as bn
from fastcifar.kernels.bn_act_pool import TritonNormActPool
from fastcifar.run.graphs import capture

# name: one Launch for every block (tile, pooled tile, warps, reduction programs); "base" is the
# module's own table, one Launch per pool place (bn.LAUNCH); "before-2026-11-22" the single setting
# every block had before this sweep chose one per pool place (its rows in bench/results/ keep the name)
L = bn.Launch
SETTINGS = {
    "base": dict(bn.LAUNCH),
    "before-2026-11-22": L(2048, 1024, 4, 512),
    "p1024": L(2048, 1024, 4, 1024),
    "p2048": L(2048, 1024, 4, 2048),
    "w8": L(2048, 1024, 8, 512),
    "w8p1024": L(2048, 1024, 8, 1024),
    "t4096w8": L(4096, 2048, 8, 1024),
    "t1024p1024": L(1024, 512, 4, 1024),
    "t4096w4p1024": L(4096, 2048, 4, 1024),
    "p256": L(2048, 1024, 4, 256),
    "p132": L(2048, 1024, 4, 132),
    "w2": L(2048, 1024, 2, 512),
    "w2p256": L(2048, 1024, 2, 256),
    "pt2048": L(2048, 2048, 4, 512),
    "t4096p256": L(4096, 2048, 4, 256),
    "pt4096": L(2048, 4096, 4, 512),
    "pt2048w2": L(2048, 2048, 2, 512),
    "pt4096w8": L(2048, 4096, 8, 512),
    "t4096pt2048w2": L(4096, 2048, 2, 512),
    "pt2048p384": L(2048, 2048, 4, 384),
    "pt2048p1024": L(2048, 2048, 4, 1024),
    "w2p1024": L(2048, 1024, 2, 1024),
}


def apply(setting):
    """Make ``setting`` the launchers' table: a per-pool-place dict as is, one Launch for all places."""
    bn.LAUNCH.update(setting if isinstance(setting, dict) else dict.fromkeys(bn.LAUNCH, setting))


def block_body(block, device):
    """Forward + backward of one block (fp16 channels-last, random data), run once."""
    n, c, hw, act, pool = block
    torch.manual_seed(0)
    x = torch.randn(n, c, hw, hw, device=device).half().contiguous(memory_format=CL).requires_grad_()
    oh = hw // 2 if pool else hw
    dy = torch.randn(n, c, oh, oh, device=device).half().contiguous(memory_format=CL)
    mod = TritonNormActPool(c, act=act, pool=pool).to(device)
    both = direction_bodies(mod, x, dy, [x, mod.weight, mod.bias])["both"]
    both()
    return both


def time_block(block, device):
    """Forward + backward of one block as a graph replay (on the CPU: eager calls): median ms."""
    both = block_body(block, device)
    if device == "cpu":
        return time_ms(both, smoke=True)["median_ms"]
    return graph_timings({"both": both}, torch.cuda.Stream())["both"]["median_ms"]


def kernel_split(block, device, replays: int = 50) -> dict:
    """Microseconds per replay of each kernel of the block's forward + backward graph (on the CPU,
    where the interpreter launches no CUDA kernels: {})."""
    both = block_body(block, device)
    if device == "cpu":
        return {}
    graph = capture(both, GRAPH_WARMUP, stream=torch.cuda.Stream())
    per_kernel = {}
    for name, start, end in traced_kernels(graph.replay, replays):
        per_kernel[name] = per_kernel.get(name, 0.0) + (end - start) / replays
    return per_kernel


def kernel_rows(block, setting: str, per_kernel: dict, copy_gbs: float) -> list[dict]:
    """One row per kernel: its microseconds and, for the kernels that stream the activations, its
    own bytes' rate against the copy bandwidth."""
    n, c, hw, act, pool = block
    own = kernel_bytes(n, c, hw, hw, pool)
    rows = []
    for name, us in per_kernel.items():
        row = {"block": f"{n} c{c} {hw}x{hw} {act} pool={pool}", "setting": setting, "kernel": name, "us": round(us, 2)}
        if name in own:
            gbs = own[name] / (us * 1e-6) / 1e9
            row.update({"GB/s (own bytes)": round(gbs, 1), "% copy (own)": round(100 * gbs / copy_gbs, 1)})
        rows.append(row)
    return rows


def per_kernel_main(args, blocks, device, env, copy_gbs) -> int:
    rows = []
    for i in args.blocks:
        for name in args.settings:
            apply(SETTINGS[name])
            block_rows = kernel_rows(blocks[i], name, kernel_split(blocks[i], device), copy_gbs)
            for r in block_rows:
                print(r, flush=True)
            rows += block_rows
            if not SMOKE:
                append_results("bn_kernels", block_rows, env, copy_gbs)
        apply(SETTINGS["base"])
    print()
    print(markdown_table(rows, ["block", "setting", "kernel", "us", "GB/s (own bytes)", "% copy (own)"]))
    if not SMOKE:
        print("\nrows appended to bench/results/bn_kernels.jsonl")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_blocks_argument(p)
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--per-kernel", action="store_true", help="split each replay by kernel (torch.profiler)")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run of the script's logic; writes nothing")
    args = p.parse_args()
    blocks = BLOCKS
    if SMOKE:  # one block at batch 2, two settings: the script's logic, not figures
        blocks, args.blocks, args.settings = SMOKE_BLOCKS[-1:], [0], ["base", "w2"]  # the pool-before block
    else:
        require_cuda("sweep_bn_act_pool")
    device = "cpu" if SMOKE else "cuda"
    env = environment()
    copy_gbs = copy_bandwidth_gbs(smoke=SMOKE)
    print_header("bn_act_pool launch settings: forward + backward, graph replays", env, copy_gbs)
    for name in args.settings:
        print(f"- {name}: {SETTINGS[name]}")
    if args.per_kernel:
        return per_kernel_main(args, blocks, device, env, copy_gbs)
    rows = []
    for i in args.blocks:
        n, c, hw, act, pool = blocks[i]
        own = traffic_bytes(n, c, hw, hw, pool)[1]["both"]
        row = {"block": f"{n} c{c} {hw}x{hw} {act} pool={pool}"}
        for name in args.settings:
            apply(SETTINGS[name])
            try:
                row[name] = round(time_block(blocks[i], device), 4)
            except Exception as e:  # a setting that fails to compile or run is reported, not fatal
                row[name] = f"{type(e).__name__}: {str(e)[:60]}"
        apply(SETTINGS["base"])
        best = best_setting(row, args.settings)
        if best:
            row["best % copy (own)"] = round(100 * own / (row[best] * 1e-3) / 1e9 / copy_gbs, 1)
        print(row, flush=True)
        rows.append(row)
        if not SMOKE:  # block by block: a call cut off at its time limit keeps the blocks it finished
            append_results("bn_sweep", [row], env, copy_gbs)
    print()
    print(markdown_table(rows, ["block", *args.settings, "best", "best vs base", "best % copy (own)"]))
    if SMOKE:
        print("\n(smoke run on the CPU under the Triton interpreter: timings meaningless, nothing written)")
        return 0
    print("\nrows appended to bench/results/bn_sweep.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
