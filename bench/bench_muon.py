"""The Muon step of a preset's filters: Newton-Schulz as a loop over filter shapes or as one padded stack.

For each layout (``--newton-schulz loop | stacked``, ``fastcifar.run.optim.Muon``): the operators one
Muon step dispatches (top-level aten ops in a torch.profiler trace, and those of them that compute
rather than make a view; on a GPU also its kernels), the step's
median time eager and replayed from a CUDA graph (the trainer's form), the Newton-Schulz arithmetic
(GFLOP: the padded stack's is larger) and the TFLOP/s it reaches beside the device's measured fp16
matmul rate. The step runs at the trainer's precision (the filters in fp16 and Newton-Schulz in
``core.gpu.newton_schulz_dtype`` on a GPU).

    python bench/bench_muon.py                       # on a GPU: the table for the default preset
    python bench/bench_muon.py --preset fast-muon320 --save    # rows appended to bench/results/muon.jsonl
    python bench/bench_muon.py --cpu                 # the operator counts on the CPU (fp32; times are the CPU's)
    python bench/bench_muon.py --smoke               # the script's logic on the CPU, narrow filters, nothing written

The operator count is the launch-bound step's proxy that a CPU can count: each aten op of the step
is at least one kernel on a GPU (the default's loop: 168 kernels a step, 0.35 ms on an H100,
bench/results/visits/visit-12.md). Rows are written only with ``--save``, and only from a GPU.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    append_results,
    copy_bandwidth_gbs,
    environment,
    markdown_table,
    matmul_tflops,
    print_header,
    require_cuda,
    smoke_mode,
    time_ms,
)

SMOKE = smoke_mode()

import torch

from fastcifar.core import gpu
from fastcifar.core.config import from_preset
from fastcifar.core.presets import DEFAULT_PRESET, PRESETS
from fastcifar.models.network import make_network
from fastcifar.ops.norm_act_pool import NormActPool
from fastcifar.run.graphs import capture
from fastcifar.run.optim import NEWTON_SCHULZ, Muon
from fastcifar.run.recipe import conv_filters, param_groups

COLUMNS = [
    "layout",
    "filters",
    "stacks",
    "aten_ops",
    "compute_ops",
    "kernels",
    "eager_ms",
    "graph_ms",
    "graph_p20_ms",
    "graph_p80_ms",
    "ns_gflop",
    "tflops",
    "ceiling_tflops",
]


def filter_shapes(preset: str, narrow: bool) -> list[tuple[int, ...]]:
    """The trainable conv filters of the preset's network (an eighth of its widths with ``narrow``)."""
    cfg = from_preset(preset)
    if narrow:
        cfg = from_preset(preset, widths=tuple(max(w // 8, 1) for w in cfg.widths))
    model = make_network(cfg, NormActPool)
    return [tuple(p.shape) for p in conv_filters(param_groups(model, cfg, 8))[1]]


def ns_gflop(stacks: list[tuple[int, int, int]], steps: int) -> float:
    """Newton-Schulz arithmetic of one step: per matrix of sides r <= c and iteration, X X^T
    (2 r^2 c), its square (2 r^3) and the product with X (2 r^2 c)."""
    total = 0
    for n, a, b in stacks:
        r, c = min(a, b), max(a, b)
        total += n * steps * (4 * r * r * c + 2 * r**3)
    return total / 1e9


def stack_shapes(muon: Muon) -> list[tuple[int, int, int]]:
    """The (count, rows, cols) of each Newton-Schulz call the step makes."""
    if muon.stack is not None:
        return [tuple(muon.stack.buffer.shape)]
    return [(len(idx), *shape) for shape, idx in muon.groups.items()]


def build(shapes, layout: str, device: torch.device, steps: int) -> Muon:
    dtype = torch.float16 if device.type == "cuda" else torch.float32  # the trainer's weights
    params = [torch.randn(s, device=device, dtype=dtype).requires_grad_() for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    rate = torch.tensor(0.01, device=device)
    return Muon(params, rate, 1.0, ns_steps=steps, ns_dtype=gpu.newton_schulz_dtype(device), layout=layout)


# aten ops that make a view (no kernel on a GPU; reshape of a contiguous tensor is one)
VIEW_OPS = {"aten::" + n for n in ("reshape", "view", "select", "slice", "mT", "transpose", "unsqueeze", "unbind")}


def count_ops(muon: Muon, device: torch.device) -> tuple[int, int, int | None]:
    """Top-level aten operators of one step (each one dispatch from Python), those of them that
    compute (not a view: at least one kernel each on a GPU) and, on a GPU, its kernels."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    muon.step()  # first-time work (allocations, cuBLAS handles) outside the trace
    with profile(activities=activities) as prof:
        muon.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = prof.events()
    ops = Counter(e.name for e in events if e.name.startswith("aten::") and e.cpu_parent is None)
    kernels = None
    if device.type == "cuda":
        kernels = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return sum(ops.values()), sum(n for name, n in ops.items() if name not in VIEW_OPS), kernels


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--preset", default=DEFAULT_PRESET, choices=list(PRESETS), help="whose filters (default: %(default)s)"
    )
    p.add_argument("--steps", type=int, default=None, help="Newton-Schulz iterations (default: the preset's)")
    p.add_argument("--cpu", action="store_true", help="count operators on the CPU (fp32), full widths; nothing written")
    p.add_argument("--save", action="store_true", help="append the rows to bench/results/muon.jsonl (GPU only)")
    p.add_argument("--smoke", action="store_true", help="CPU, narrow filters: checks the script, writes nothing")
    args = p.parse_args()
    on_cpu = SMOKE or args.cpu
    if not on_cpu:
        require_cuda("bench_muon")
    if args.save and on_cpu:
        sys.exit("bench_muon: --save writes a GPU's figures; a CPU run writes nothing")
    device = torch.device("cpu" if on_cpu else "cuda")
    steps = args.steps or from_preset(args.preset).muon_ns_steps
    shapes = filter_shapes(args.preset, narrow=SMOKE)
    env = environment()
    copy_gbs = copy_bandwidth_gbs(smoke=on_cpu)
    ceiling = matmul_tflops(smoke=on_cpu)
    print_header(f"Muon step, {args.preset}'s {len(shapes)} filters, {steps} Newton-Schulz iterations", env, copy_gbs)
    if on_cpu:
        print("CPU: the operator counts hold; the times and rates are the CPU's (fp32), not a device's\n")
    rows = []
    for layout in NEWTON_SCHULZ:
        muon = build(shapes, layout, device, steps)
        stacks = stack_shapes(muon)
        ops, compute, kernels = count_ops(muon, device)
        eager = time_ms(muon.step, on_cpu)["median_ms"]
        graph = {"median_ms": None, "p20_ms": None, "p80_ms": None}
        if device.type == "cuda":
            replay = capture(muon.step, 2)
            graph = time_ms(replay.replay)
        gflop = ns_gflop(stacks, steps)
        best = graph["median_ms"] or eager
        rows.append(
            {
                "preset": args.preset,
                "layout": layout,
                "filters": len(shapes),
                "stacks": " ".join("x".join(map(str, s)) for s in stacks),
                "aten_ops": ops,
                "compute_ops": compute,
                "kernels": kernels,
                "eager_ms": eager,
                "graph_ms": graph["median_ms"],
                "graph_p20_ms": graph["p20_ms"],
                "graph_p80_ms": graph["p80_ms"],
                "ns_gflop": gflop,
                "tflops": gflop / best,  # GFLOP per ms = TFLOP/s
                "ceiling_tflops": ceiling,
            }
        )
    print(markdown_table(rows, COLUMNS))
    if SMOKE:
        print("\nsmoke run: figures meaningless, nothing written")
    elif args.save:
        print(f"\nappended {len(rows)} rows to {append_results('muon', rows, env, copy_gbs)}")


if __name__ == "__main__":
    main()
