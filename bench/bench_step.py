"""The whole training step: eager vs CUDA graph, torch vs Triton kernels, 256 and 512 images per GPU.

For each combination: median step time (CUDA events over a window of replays, repeated), images/s,
the floor that the convolutions' FLOPs set at the device's measured fp16 matmul rate, and the GPU's
idle share of the step two ways: ``gpu_idle_pct`` = 1 - (union of kernel intervals) / (first kernel
start to last kernel end) of a torch.profiler trace of a few steps, and ``idle_vs_step_pct`` = 1 -
(that union per step) / (the step timed without the tracer). The trace runs longer than the plain
step (H100, `fast`: 3.42 ms against 3.12), so the first overstates; a graphed step should leave the
GPU idle for less than 5% of it. The header gives the gap between a graph's dependent kernels with
and without the tracer. The same trace splits the step by kernel name into convs, BN/act/pool,
optimizer, other and idle (ms per step), with the top 5 kernels and the kernels per step, then
every kernel of "other" by name, with the ops that launched it in an eager trace of the same step
(launches and ms per step; the jsonl row's ``per_kernel`` has all phases', ``launched_by`` every
kernel's ops). A graphed row takes its ops from the eager row of its batch and kernels, so the
column is empty with ``--graphs on`` alone; a kernel that only the capture chose is empty too.
``--preset fast`` times that preset's network (FastNet) instead of the default ResNet-9.

``--fake-world N`` times the step one rank of an N-rank run takes (the 8-GPU shapes on one GPU): the
process is rank 0 of a fake N-rank group (``torch.testing._internal.distributed.fake_pg``),
``--batches`` are global batches (default: the preset's) split over the N ranks, and the step is
built as the trainer builds a rank's, gradient buckets (``--comm bucketed``) and all. The fake
group's collectives complete at once without moving data, so the figure is the step's compute plus
the buckets' launch and division overheads: no communication (bench_allreduce.py and the 8-GPU model
in bench/results/ price that).

    python bench/bench_step.py                      # on a GPU: the full table, rows to bench/results/step.jsonl
    python bench/bench_step.py --preset fast-jitter --batches 2000   # the default preset's network and batch
    python bench/bench_step.py --preset fast-jitter --fake-world 8 --graphs on --kernels auto  # rank 0 of 8: 250 images
    python bench/bench_step.py --preset fast-jitter --batches 2000 --graphs on --kernels auto --fused-conv
                                                    # the same with the convs that take their BN statistics
    python bench/bench_step.py --preset fast-jitter --batches 2000 --graphs on --kernels auto \
        --variant="--tta-scope test" --variant="--whiten-bias-epochs 0.2"   # each beside the preset
    python bench/bench_step.py --smoke              # the script's logic on the CPU, tiny, nothing written

``--variant=FLAGS`` (repeatable): the preset's step, then each variant's (the preset with those flags, as the trainer
parses them), each row named by its flags (the jsonl field ``variant``, "" for the preset), and a
table of what each variant removed from the preset's step at the same batch, kernels and graphs:
ms per step by phase, idle and the whole step, and kernels per step (the row's ``removed``).

The step is the trainer's own (``fastcifar.run.step.make_step`` inside ``fastcifar.run.graphs.TrainStep``),
on a fixed random batch: loader time, augmentation included, is not in these figures
(bench_loader.py and bench_augment.py measure it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import itertools
import os
import re
import statistics
import sys
import time
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

from fastcifar.core.config import Config, ConfigError, from_preset, validate
from fastcifar.core.options import parse_command_line
from fastcifar.models.network import build_model
from fastcifar.ops.norm_act_pool import ConvBlock
from fastcifar.parallel.distributed import DistContext
from fastcifar.parallel.sync import GradientSync
from fastcifar.run.graphs import StaticBatch, TrainStep, capture
from fastcifar.run.recipe import make_optimizer, peak_rate
from fastcifar.run.schedule import DeviceSchedule
from fastcifar.run.step import make_step


def conv_flops_per_image(model: torch.nn.Module, device, dtype) -> float:
    """Forward FLOPs of the convolutions and the linear layer for one 32x32 image (2 per MAC);
    backward is counted as twice the forward (input and weight gradients). A fused conv block
    (--fused-conv: a ConvBlock subclass) never calls its nn.Conv2d: it is counted from its conv's
    shape at its input's size (stride 1, "same")."""
    total = 0.0

    def conv_flops(conv, h, w):
        k = conv.kernel_size[0] * conv.kernel_size[1]
        return 2.0 * conv.in_channels * conv.out_channels * k * h * w / conv.groups

    def hook(module, inputs, output):
        nonlocal total
        if isinstance(module, ConvBlock):
            total += conv_flops(module.conv, *inputs[0].shape[2:])
        elif isinstance(module, torch.nn.Conv2d):
            total += conv_flops(module, *output.shape[2:])
        elif isinstance(module, torch.nn.Linear):
            total += 2.0 * module.in_features * module.out_features

    handles = [
        m.register_forward_hook(hook)
        for m in model.modules()
        if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)) or (isinstance(m, ConvBlock) and type(m) is not ConvBlock)
    ]
    with torch.no_grad():
        model.eval()
        model(torch.zeros(1, 3, 32, 32, device=device, dtype=dtype).contiguous(memory_format=torch.channels_last))
    for h in handles:
        h.remove()
    return total


def build_step(cfg: Config, batch: int, graphs: bool, device, dtype, ctx: DistContext | None = None):
    """The trainer's step on ``batch`` images: (model, step, images, labels, sync). With ``ctx`` (a
    rank of a process group: ``fake_group``) it is a rank's step, built as train.py builds it:
    ``GradientSync`` (gradient buckets for --comm bucketed) around the model, the optimizer for the
    per-rank batch ``batch``; ``sync`` is None without ``ctx``."""
    torch.manual_seed(0)
    model = build_model(cfg, device, dtype)
    sync = GradientSync(model, cfg, ctx, seed=0) if ctx is not None else None
    # the trainer's optimizer for cfg (its parameter groups; Muon + SGD for fast-muon), at a constant peak rate
    peak = peak_rate(cfg, batch)
    opt = make_optimizer(model, cfg, batch, peak, ctx)
    schedule = DeviceSchedule([peak] * 10_000, device)
    net, buckets = (sync.net, sync.buckets) if sync is not None else (model, None)
    step = TrainStep(
        make_step(net, opt, schedule, cfg.label_smoothing, buckets=buckets, grads_to_none=cfg.grads_to_none),
        StaticBatch(batch, dtype, device),
        capture=graphs,
    )
    g = torch.Generator(device=device).manual_seed(0)
    images = (
        torch.randn(batch, 3, 32, 32, device=device, generator=g)
        .to(dtype)
        .contiguous(memory_format=torch.channels_last)
    )
    labels = torch.randint(0, 10, (batch,), device=device, generator=g)
    step.batch.load(images, labels)
    model.train()
    step.warm_up_and_capture(3)
    return model, step, images, labels, sync


# What a row timed under --fake-world says about its world (the jsonl field "world_emulated").
FAKE_WORLD = (
    "rank 0 of a fake process group (torch.testing._internal.distributed.fake_pg): its collectives "
    "complete at once without moving data, so the step is compute plus the buckets' launch and "
    "division overheads, no communication"
)


def fake_group(world: int, device) -> DistContext:
    """Make this process rank 0 of a fake ``world``-rank group (the default group, so GradBuckets and
    Muon's sharding issue their collectives to it) and return the rank's context. The module has
    lived at this path, with ``FakeStore`` and the backend name "fake", since torch 2.1 (2.11 and
    2.14 included); it is internal, so a release that moves it ends the run with one line."""
    import torch.distributed as dist

    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend
    except ImportError as exc:
        print(
            f"bench_step: --fake-world needs torch's fake process group "
            f"(torch.testing._internal.distributed.fake_pg), which this torch {torch.__version__} lacks: {exc}",
            file=sys.stderr,
        )
        sys.exit(2)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    return DistContext(rank=0, world_size=world, local_rank=0, device=device, backend="fake")


def time_steps(step, images, labels, device, window: int, repeats: int) -> float:
    """Median milliseconds per step over ``repeats`` windows of ``window`` consecutive steps."""
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(window):
                step(images, labels)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / window)
        else:
            t0 = time.perf_counter()
            for _ in range(window):
                step(images, labels)
            samples.append((time.perf_counter() - t0) * 1e3 / window)
    return statistics.median(samples)


# Phases of a step by CUDA kernel name. Triton kernels are named exactly as their functions in
# kernels/*.py; the library ones by substrings of the names cuDNN/cuBLAS/PyTorch use on sm_80/sm_90,
# tried in this order (batchnorm before convs: cuDNN names both "cudnn..."; convs before activations:
# a conv with a fused ReLU epilogue is a conv; "_apply_kernel" is exact because PyTorch's optimizer
# kernels are "multi_tensor_apply_kernel"). What matches none is "other"; the top-kernel list printed
# beside the breakdown shows what a new library version calls its kernels.
TRITON_PHASES = {
    "_stats_kernel": "bn_act_pool",
    "_stats_finalize_kernel": "bn_act_pool",
    "_apply_kernel": "bn_act_pool",
    "_bwd_reduce_kernel": "bn_act_pool",
    "_bwd_finalize_kernel": "bn_act_pool",
    "_bwd_dx_kernel": "bn_act_pool",
}
PHASE_SUBSTRINGS = (
    ("bn_act_pool", ("bn_fw", "bn_bw", "batch_norm", "batchnorm")),
    ("convs", ("conv", "gemm", "xmma", "cutlass", "fprop", "dgrad", "wgrad")),
    ("bn_act_pool", ("max_pool", "gelu", "relu", "clamp", "threshold")),  # eager ReLU: clamp fwd, threshold bwd
    ("optimizer", ("foreach", "multi_tensor")),
)
PHASES = ("convs", "bn_act_pool", "optimizer", "other")


def phase_of(name: str) -> str:
    if name in TRITON_PHASES:
        return TRITON_PHASES[name]
    low = name.lower()
    return next((phase for phase, keys in PHASE_SUBSTRINGS if any(k in low for k in keys)), "other")


def breakdown(kernels: list[tuple[str, float, float]], steps: int) -> dict:
    """Per-step milliseconds by phase, plus idle, from (name, start_us, end_us) kernel intervals:
    busy time is attributed by kernel, idle is the span minus the union of the intervals (launch
    gaps, syncs). ``top`` names the 5 kernels that took the most time, with their per-step ms;
    ``per_kernel`` lists every kernel name with its phase, launches and ms per step, the most time first
    (what "other" is made of, named rather than guessed)."""
    kernels = sorted((k for k in kernels if k[2] > k[1]), key=lambda k: k[1])  # by start time
    if not kernels:
        return {}
    per_phase = dict.fromkeys(PHASES, 0.0)
    per_name: dict[str, float] = {}
    calls: dict[str, int] = {}
    busy, cur_start, cur_end = 0.0, kernels[0][1], kernels[0][2]
    for name, start, end in kernels:
        per_phase[phase_of(name)] += end - start
        per_name[name] = per_name.get(name, 0.0) + end - start
        calls[name] = calls.get(name, 0) + 1
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    span = max(end for _, _, end in kernels) - kernels[0][1]
    ms = 1e-3 / steps  # microseconds over all steps -> milliseconds per step
    out = {f"{phase}_ms": v * ms for phase, v in per_phase.items()}
    out["idle_ms"] = (span - busy) * ms
    out["idle_share"] = 1.0 - busy / span
    out["busy_ms"] = busy * ms
    out["kernels_per_step"] = len(kernels) / steps  # every timed device event: kernels, copies, memsets
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1])
    out["top"] = [(name, v * ms) for name, v in ranked[:5]]
    out["per_kernel"] = [(name, phase_of(name), calls[name] / steps, v * ms) for name, v in ranked]
    return out


# What a kernel's name says past its namespaces: "void at::native::elementwise_kernel<128, 4,
# at::native::gpu_kernel_impl_nocast<at::native::CUDAFunctor_add<c10::Half> >..." cut at 90 characters
# showed only "...gpu_kernel_impl_nocast<at::nati" (bench/results/visits/visit-12.md, 12d), never the functor.
_NAMESPACES = re.compile(r"\b(?:at::native::|at::cuda::detail::|at::|c10::|std::)|\(anonymous namespace\)::")
_LAMBDAS = re.compile(r"\{lambda\(\)#\d+\}::operator\(\)\(\) const::")


def short_name(name: str, width: int = 90) -> str:
    """A kernel's name without ``void``, PyTorch's namespaces and its nested lambdas' scaffolding."""
    name = name[5:] if name.startswith("void ") else name
    return _LAMBDAS.sub("", _NAMESPACES.sub("", name))[:width]


BACKWARD = "autograd::engine::evaluate_function: "


def launch_label(event) -> str:
    """The op that launched a kernel (a profiler CPU event): the innermost op, and the outermost op
    around it where that is another (for backward work, the autograd node: ``aten::add_ in
    AccumulateGrad``)."""
    top = event
    while top.cpu_parent is not None:
        top = top.cpu_parent
    outer = top.name.removeprefix(BACKWARD).removeprefix("torch::autograd::")
    return event.name if top is event else f"{event.name} in {outer}"


def launched_by(events, steps: int) -> dict[str, str]:
    """Kernel name -> the ops that launched it in an eager trace of ``steps`` steps, the most launches
    first, each with its launches per step where there are several (torch.profiler ties each kernel
    to the innermost op running when it was launched)."""
    counts: dict[str, Counter] = {}
    for event in events:
        for kernel in event.kernels:
            counts.setdefault(kernel.name, Counter())[launch_label(event)] += 1
    return {
        name: next(iter(per))
        if len(per) == 1
        else "; ".join(f"{label} x{n / steps:g}" for label, n in per.most_common())
        for name, per in counts.items()
    }


def phase_kernels(row: dict, phase: str) -> list[str]:
    """One markdown line per kernel of ``phase`` in a row's ``per_kernel``: its short name, the ops
    that launched it (``launched_by``, from an eager trace), launches and ms per step."""
    origins = row.get("launched_by", {})
    return [
        f"| {short_name(name)} | {origins.get(name, '')} | {n:g} | {v:.4f} |"
        for name, p, n, v in row.get("per_kernel", ())
        if p == phase
    ]


def traced_kernels(run, steps: int) -> list[tuple[str, float, float]]:
    """(name, start_us, end_us) of every CUDA kernel ``run`` launches, ``steps`` times, under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA"]


def kernel_origins(run, steps: int = 2) -> dict[str, str]:
    """``launched_by`` of an eager ``run`` under torch.profiler with the CPU ops traced too. A graph's
    replay has no ops to tie its kernels to: its row borrows the eager row's (the same kernels)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    return launched_by(prof.events(), steps)


def profile_steps(step, images, labels, steps: int = 10) -> dict:
    """``breakdown`` of ``steps`` steps from a torch.profiler trace ({} without CUDA)."""
    if not torch.cuda.is_available():
        return {}
    return breakdown(traced_kernels(lambda: step(images, labels), steps), steps)


def idle_against_step(busy_ms: float, step_ms: float) -> float:
    """% of the step, timed without the tracer, in which no kernel ran: the trace's busy time against
    it. The trace's own span runs longer than the plain step (H100, `fast` at 1024: 3.42 ms against
    3.12), so its idle share overstates the step's; 0 where the kernels add up to more (noise)."""
    return max(0.0, 100 * (1 - busy_ms / step_ms))


def graph_node_gap_us(nodes: int = 200, replays: int = 10) -> dict:
    """The gap between two dependent kernels of a CUDA graph, with and without the tracer: a graph of
    ``nodes`` dependent one-element kernels, its replay timed with events and traced. Per node:
    ``plain`` = (replay time - traced kernel time) / nodes, ``traced`` = (traced span - traced
    kernel time) / nodes (which also spreads the gaps between the traced replays over the nodes). On
    an H100 about 0.26 us plain and a little more traced (bench/results/step.jsonl,
    graph_gap_plain_us and graph_gap_traced_us), so at 180 kernels a step the gaps themselves cost
    ~0.05 ms; the tracer widens them little, and the rest of the trace's longer span (0.3 ms a
    `fast` step) is not between kernels of one replay."""
    x = torch.zeros(1, device="cuda")

    def body():
        for _ in range(nodes):
            x.add_(1.0)

    graph = capture(body, 1)
    replay_ms = time_ms(graph.replay)["median_ms"]
    per = breakdown(traced_kernels(graph.replay, replays), replays)
    span_ms = per["busy_ms"] + per["idle_ms"]
    return {
        "nodes": nodes,
        "plain": (replay_ms - per["busy_ms"]) * 1e3 / nodes,
        "traced": (span_ms - per["busy_ms"]) * 1e3 / nodes,
        "kernel": per["busy_ms"] * 1e3 / nodes,
    }


def variant_config(preset: str | None, flags: str) -> Config:
    """The config the trainer would run for ``--preset PRESET FLAGS`` (split on blanks); ValueError,
    in one line, for a flag it refuses or a value it rejects."""
    if preset is None:
        raise ValueError("--variant needs --preset: each variant is that preset with its flags")
    said = io.StringIO()  # the parser's own one line, "fastcifar: error: ..."
    try:
        with contextlib.redirect_stderr(said):
            cfg, _ = parse_command_line(["--preset", preset, *flags.split()])
        validate(cfg)
    except SystemExit:
        raise ValueError(f"variant {flags!r}: {said.getvalue().strip().removeprefix('fastcifar: error: ')}") from None
    except ConfigError as exc:
        raise ValueError(f"variant {flags!r}: {exc}") from None
    return cfg


REMOVED = [f"{p}_ms" for p in PHASES] + ["idle_ms", "step_ms", "kernels_per_step"]


def add_removed(rows: list[dict]) -> None:
    """Each variant's row gets ``removed``: the preset's row (variant "", same batch, kernels,
    graphs) less its own, for each of REMOVED the two rows have (positive: the variant saved it)."""
    base = {(r["batch"], r["kernels"], r["graphs"]): r for r in rows if r.get("variant") == ""}
    for r in rows:
        b = base.get((r["batch"], r["kernels"], r["graphs"]))
        if r.get("variant") and b is not None:
            r["removed"] = {k: b[k] - r[k] for k in REMOVED if b.get(k) is not None and r.get(k) is not None}


def removed_table(rows: list[dict]) -> str:
    keys = ["variant", "batch", "kernels", "graphs", *REMOVED]
    flat = [{**r, **r["removed"]} for r in rows if "removed" in r]
    return markdown_table(flat, keys) if flat else "(no variant row has a preset row to compare with)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--batches",
        type=int,
        nargs="+",
        help="images per GPU per step (default 256 512); with --fake-world, global images per "
        "step split over the ranks (default: the preset's batch)",
    )
    parser.add_argument(
        "--preset",
        help="the network of this preset (e.g. fast: FastNet 64/256/256, GELU); "
        "default the ResNet-9 of the config's defaults",
    )
    parser.add_argument(
        "--kernels",
        nargs="+",
        choices=["torch", "triton", "auto"],
        help="default torch triton (with --fused-conv: triton, which it needs); auto: the trainer's default on CUDA",
    )
    parser.add_argument("--graphs", nargs="+", default=["off", "on"], choices=["off", "on"])
    parser.add_argument("--window", type=int, default=20, help="steps per timed window")
    parser.add_argument("--repeats", type=int, default=5, help="timed windows; the median is reported")
    parser.add_argument(
        "--fake-world",
        type=int,
        metavar="N",
        help="time rank 0's step of an N-rank run (per-rank batch = batch / N, gradient buckets "
        "issuing their all-reduces to a fake N-rank group, which completes them at once)",
    )
    parser.add_argument(
        "--fused-conv",
        action="store_true",
        help="the trainer's --fused-conv: convs that take their batchnorm statistics (Triton kernels)",
    )
    parser.add_argument(
        "--variant",
        dest="variants",
        action="append",
        default=[],
        metavar="FLAGS",
        help='with --preset, repeatable: also the preset with FLAGS, given after "=" (--variant="--tta-scope test": '
        "a value that starts with a dash), and what each removed from the preset's step",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run of the script's logic; writes nothing")
    args = parser.parse_args(argv)

    if args.kernels is None:
        args.kernels = ["triton"] if args.fused_conv else ["torch", "triton"]
    if args.fused_conv and "torch" in args.kernels:  # refused before anything is measured, as the trainer does
        print("bench_step: --fused-conv needs the Triton kernels: --kernels triton or auto, not torch", file=sys.stderr)
        return 2
    base = from_preset(args.preset) if args.preset else Config()
    try:  # every variant parsed before anything is measured, as the trainer refuses a bad flag
        configs = [("", base), *((flags, variant_config(args.preset, flags)) for flags in args.variants)]
    except ValueError as exc:
        print(f"bench_step: {exc}", file=sys.stderr)
        return 2
    world = args.fake_world or 1
    if args.batches is None:
        args.batches = [base.batch_size] if args.fake_world else [256, 512]
    if args.fake_world is not None and not 1 <= args.fake_world <= 1024:
        print(f"bench_step: --fake-world must lie in 1..1024 ranks, not {args.fake_world}", file=sys.stderr)
        return 2
    for batch in args.batches if args.fake_world else ():  # before anything is measured, as the trainer refuses it
        if batch < world or batch % world:
            print(
                f"bench_step: --batches {batch} does not divide over --fake-world {world} ranks "
                f"(the per-rank batch must be a whole number of images)",
                file=sys.stderr,
            )
            return 2
    if SMOKE:
        device, dtype = torch.device("cpu"), torch.float32
        smoke_batch = 2 * world if args.fake_world else 4
        args.batches, args.graphs, args.window, args.repeats = [smoke_batch], ["off"], 2, 1
        # the fused conv needs the Triton kernels: here Triton's interpreter (slow, tiny shapes)
        args.kernels = ["triton"] if args.fused_conv else ["torch"]
        if args.fused_conv:
            os.environ["FASTCIFAR_ALLOW_INTERPRETER"] = "1"
        widths = (8, 16, 32) if base.arch == "fastnet" else (8, 16, 32, 64)
    else:
        require_cuda("bench_step")
        device, dtype = torch.device("cuda"), torch.float16
        torch.backends.cudnn.benchmark = True
        widths = base.widths
    env = environment()
    copy_gbs = copy_bandwidth_gbs(smoke=SMOKE)
    tflops = matmul_tflops(smoke=SMOKE)
    print_header("Training step: eager vs CUDA graph, torch vs Triton kernels", env, copy_gbs)
    print(f"measured fp16 matmul rate: {tflops:.0f} TFLOP/s (the floor column divides the step's FLOPs by it)")
    gap = None if SMOKE else graph_node_gap_us()
    if gap:
        print(
            f"gap between dependent kernels of a CUDA graph ({gap['nodes']} one-element kernels of "
            f"{gap['kernel']:.2f} us): {gap['plain']:.2f} us timed plainly, {gap['traced']:.2f} us in the trace"
        )
    print()

    net = f"{base.arch} ({args.preset})" if args.preset else base.arch
    ctx = fake_group(args.fake_world, device) if args.fake_world else None  # a rank's step: buckets, collectives
    rows = []
    eager_origins = {}  # (batch, kernels) -> launched_by of the eager step, for its graphed row
    for (variant, vcfg), global_batch in itertools.product(configs, args.batches):
        batch = global_batch // world  # images per GPU per step
        for kernels in args.kernels:
            cfg = dataclasses.replace(
                vcfg,
                widths=widths if SMOKE else vcfg.widths,
                kernels=kernels,
                comm="bucketed",
                fused_conv=args.fused_conv or vcfg.fused_conv,
            )
            for graphs in args.graphs:
                model, step, images, labels, sync = build_step(cfg, batch, graphs == "on", device, dtype, ctx)
                flops = 3 * conv_flops_per_image(model, device, dtype) * batch
                model.train()
                ms = time_steps(step, images, labels, device, args.window, args.repeats)
                parts = profile_steps(step, images, labels)
                if parts and graphs == "off" and torch.cuda.is_available():
                    eager_origins[batch, kernels] = kernel_origins(functools.partial(step, images, labels))
                origins = eager_origins.get((batch, kernels), {})
                ranks = (
                    {}
                    if ctx is None
                    else {
                        "world_size": world,
                        "global_batch": global_batch,
                        "world_emulated": FAKE_WORLD,
                        "buckets": len(sync.buckets) if sync.buckets is not None else 0,
                    }
                )
                rows.append(
                    {
                        "net": net,
                        **({"variant": variant} if args.variants else {}),
                        "batch": batch,
                        **ranks,
                        "kernels": kernels,
                        "fused_conv": args.fused_conv,
                        "graphs": graphs,
                        "step_ms": ms,
                        "images_per_s": batch / ms * 1e3,
                        "floor_ms": flops / (tflops * 1e12) * 1e3,
                        "gpu_idle_pct": 100 * parts["idle_share"] if parts else None,
                        "idle_vs_step_pct": idle_against_step(parts["busy_ms"], ms) if parts else None,
                        **{k: v for k, v in parts.items() if k != "idle_share"},
                        **({"launched_by": origins} if parts and origins else {}),
                        **({"graph_gap_plain_us": gap["plain"], "graph_gap_traced_us": gap["traced"]} if gap else {}),
                    }
                )
                if sync is not None:
                    sync.remove()
                del model, step, sync
    if ctx is not None:
        import torch.distributed as dist

        dist.destroy_process_group()
    if args.variants:
        add_removed(rows)
    per_rank = ["world_size", "global_batch", "buckets"] if ctx is not None else []
    columns = [
        "net",
        *(["variant"] if args.variants else []),
        "batch",
        *per_rank,
        "kernels",
        "graphs",
        "step_ms",
        "images_per_s",
        "floor_ms",
        "gpu_idle_pct",
        "busy_ms",
        "idle_vs_step_pct",
        "kernels_per_step",
        "fused_conv",
    ]
    if ctx is not None:
        print(
            f"the step of rank 0 of {world} ranks: batch = images per rank (global_batch / world_size), "
            f"images_per_s per rank; {FAKE_WORLD}.\n"
        )
    print(markdown_table(rows, columns))
    parts = [f"{p}_ms" for p in PHASES] + ["idle_ms"]
    if any("idle_ms" in r for r in rows):
        print("\n### Where a step's time goes (ms per step, from the trace; data loading: bench_loader.py)\n")
        print(markdown_table([r for r in rows if "idle_ms" in r], ["net", "batch", "kernels", "graphs"] + parts))
        for r in rows:
            if r.get("top"):
                top = ", ".join(f"{name[:60]} {v:.3f}" for name, v in r["top"])
                print(f"- {r['batch']} {r['kernels']} graphs {r['graphs']}: top kernels {top}")
        for r in rows:  # what "other" is made of, kernel by kernel (the jsonl row lists every phase's)
            lines = phase_kernels(r, "other")
            if lines:
                print(
                    f"\n#### {r['net']}, {r['batch']} images, {r['kernels']} kernels, graphs {r['graphs']}: "
                    f'the {len(lines)} kernels of "other" ({r["other_ms"]:.3f} ms a step)\n'
                )
                print("| kernel | launched by (eager trace) | launches per step | ms per step |\n|---|---|---|---|")
                print("\n".join(lines))
    if args.variants:
        print("\n### What each variant removed from the preset's step (ms per step; negative: added)\n")
        print(removed_table(rows))
    if SMOKE:
        print("\n(smoke run on the CPU: timings meaningless, nothing written)")
    else:
        print(f"\nrows appended to {append_results('step', rows, env, copy_gbs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
