"""The 8-GPU model of the default preset's gradient all-reduce: bytes, time on the wire, what stays
exposed after overlap with backward, the predicted step and run, per machine (issue 73 item 1).

    python bench/model_allreduce.py            # writes bench/results/allreduce_model_8gpu.md
    python bench/model_allreduce.py --print    # prints it, writes nothing

No GPU is used and nothing is timed: the inputs are the measured rows named in the output
(bench/results/step.jsonl, bench/results/official.jsonl), the bucket plans as
``fastcifar.parallel.comm.plan_buckets`` makes them for the preset's network (built on the CPU in
the GPU's layout: fp16 weights, fp32 batchnorm), and the bandwidth and latency assumptions in
``MACHINES``, each with its source. Every figure in the output says whether it is measured or
modelled.

The model, per step: backward takes ``BACKWARD_SHARE`` of the step's compute (the step less the
optimizer's kernels); each parameter's gradient is ready when backward has done the conv FLOPs
behind it (backward walks the layers in reverse, a conv's wgrad and dgrad costing 2x its forward);
the buckets go out in launch order, one at a time on the comm stream, each taking
``alpha + 2(n-1)/n x bytes / busbw`` (a ring all-reduce: nccl-tests' bus-bandwidth convention), and
can start when their last gradient is ready and the previous bucket is done. What runs past the end
of backward is exposed: the step grows by it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
OUT = RESULTS / "allreduce_model_8gpu.md"

PRESET = "fast-jitter"
# The measured per-rank step: rank 0 of a fake 8-rank group (no data moves), 250 images, graphs
# and buckets on, the default preset's network (fast-muon9's: fast-jitter changes epochs and
# augmentation only). Found by these fields in step.jsonl.
STEP_ROW = {"date": "2026-11-26T19:17:54+00:00", "batch": 250, "world_size": 8}
# One H100 training the whole 2000-image batch (no group): the other end of the per-rank line.
ONE_GPU_ROW = {"date": "2026-11-26T16:41:39+00:00", "batch": 2000, "graphs": "on", "kernels": "auto"}
# The default preset's official runs beside it: its train clock per run.
RUN_ROW = {
    "call": "visit 12c (2026-11-26, H100)",
    "trainer": "fastcifar:fast-muon9 --epochs 8.5 --brightness 0.14 --contrast 0.13",
}
BACKWARD_SHARE = 2 / 3  # of forward + backward: a conv's backward is two convs of its forward's size


@dataclass(frozen=True)
class Machine:
    name: str
    ranks: int
    busbw_gbs: float  # all-reduce bus bandwidth, GB/s (nccl-tests' convention)
    alpha_us: float  # per-collective latency
    link: str  # where busbw and alpha come from
    step_rule: str  # how its per-rank step is had from the measured one
    flops_ratio: float = 1.0  # H100 SXM's dense fp16 tensor peak / this GPU's
    bytes_ratio: float = 1.0  # H100 SXM's memory bandwidth / this GPU's


H100_SXM = "H100 SXM: 989 TFLOP/s dense fp16, 3.35 TB/s (NVIDIA's H100 datasheet)"
MACHINES = [
    Machine(
        "8x H100 SXM, NVLink 4 (NVSwitch)",
        8,
        400.0,
        20.0,
        "busbw 400 GB/s: nccl-tests all_reduce on DGX H100 is quoted at 350-480 GB/s for large "
        "messages (NVLink 4: 900 GB/s per GPU, both directions); alpha 20 us: NCCL's LL protocol on one "
        "NVSwitch node, 10-30 us as commonly quoted",
        "measured (the row above)",
    ),
    Machine(
        "8x V100 SXM2, NVLink 2 (DGX-1, the design's machine)",
        8,
        130.0,
        25.0,
        "busbw 130 GB/s: nccl-tests on DGX-1 V100 is quoted at 130-150 GB/s for large messages "
        "(NVLink 2: 300 GB/s per GPU); alpha 25 us, as above for the older hybrid cube mesh",
        "modelled: the H100 row's conv kernels x 989/125 (dense fp16 tensor peaks, NVIDIA datasheets), "
        "its other kernels x 3.35/0.90 (HBM bandwidth), its untraced remainder as is",
        989 / 125,
        3.35 / 0.90,
    ),
    Machine(
        "8x H100 PCIe (Gen5 x16, no NVLink bridges)",
        8,
        25.0,
        30.0,
        "busbw 25 GB/s: PCIe Gen5 x16 is 64 GB/s per direction nominal; through PCIe switches and the "
        "host bridge nccl-tests all_reduce reaches well under half of it (Gen4 machines are quoted at "
        "10-20 GB/s); alpha 30 us",
        "modelled: the H100 SXM row's conv kernels x 989/756, other kernels x 3.35/2.0 (H100 PCIe "
        "datasheet: 756 TFLOP/s, 2.0 TB/s), remainder as is",
        989 / 756,
        3.35 / 2.0,
    ),
    Machine(
        "2 nodes x 8 H100 SXM, 100 Gb/s per node",
        16,
        0.9 * 100 / 8,
        40.0,
        "busbw 11.25 GB/s: the ring's two node crossings share one 100 Gb/s NIC a node (12.5 GB/s "
        "line rate), at 90% (nccl-tests over InfiniBand reaches 90-95% of line rate for large "
        "messages); alpha 40 us: an NVLink node plus two network hops",
        "modelled: 125 images a rank, on the line through the two measured H100 steps (1.70 ms at 250 "
        "on a fake 8-rank group, 5.70 ms at 2000 on one GPU)",
    ),
    Machine(
        "2 nodes x 8 H100 SXM, 400 Gb/s per node",
        16,
        0.9 * 400 / 8,
        40.0,
        "busbw 45 GB/s: as above, one 400 Gb/s NIC a node (50 GB/s line rate) at 90%; alpha 40 us",
        "modelled: 125 images a rank, as above",
    ),
]


def find_row(path: Path, match: dict) -> tuple[int, dict]:
    """The one jsonl row whose fields equal ``match``, with its line number (1-based)."""
    found = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        row = json.loads(line)
        if all(row.get(k) == v for k, v in match.items()):
            found.append((number, row))
    if len(found) != 1:
        raise SystemExit(f"model_allreduce: {len(found)} rows of {path.name} match {match}; expected one")
    return found[0]


def ring_ms(nbytes: float, ranks: int, busbw_gbs: float, alpha_us: float) -> float:
    """One all-reduce of ``nbytes``: alpha + 2(n-1)/n x bytes / busbw, in ms."""
    return alpha_us / 1e3 + 2 * (ranks - 1) / ranks * nbytes / (busbw_gbs * 1e9) * 1e3


def exposed_ms(buckets: list[tuple[float, float]], backward_ms: float, ranks: int, m: Machine) -> float:
    """``buckets``: (bytes, share of backward done when its last gradient is ready), launch order.
    One at a time on the comm stream; what ends after backward is exposed."""
    end = 0.0
    for nbytes, ready in buckets:
        end = max(end, ready * backward_ms) + ring_ms(nbytes, ranks, m.busbw_gbs, m.alpha_us)
    return max(0.0, end - backward_ms)


def plan_from_start(params, cap: int):
    """The plan filled from the start of backward (plan_buckets' former order, docs/history.md), so
    the remainder (the first layers) forms the last bucket. Sizes and members only."""
    from fastcifar.parallel.comm import ALIGN_BYTES, _span

    open_by_dtype, closed = {}, []
    for position, p in enumerate(reversed([p for p in params if p.requires_grad])):
        nbytes = math.ceil(_span(p) * p.element_size() / ALIGN_BYTES) * ALIGN_BYTES
        current = open_by_dtype.get(p.dtype)
        if current and current[1] + nbytes > cap:
            closed.append((current[2], current[0], current[1]))
            current = None
        if current is None:
            current = open_by_dtype[p.dtype] = [[], 0, position]
        current[0].append(p)
        current[1] += nbytes
        current[2] = position
    closed += [(last, members, size) for members, size, last in open_by_dtype.values()]
    return [(members, size) for _, members, size in sorted(closed, key=lambda c: c[0])]


def network():
    """The preset's network in the GPU's layout (fp16 weights, fp32 batchnorm) and, for each of its
    parameters, the share of backward done when its gradient is ready: backward walks the conv and
    linear layers in reverse at 2x their forward FLOPs (the frozen whitening conv computes nothing);
    a layer's weight is ready after its own backward, the batchnorm shift that follows it in forward
    before it; the whitening bias at the very end."""
    import torch

    from fastcifar.core.config import from_preset
    from fastcifar.models.network import build_model

    cfg = from_preset(PRESET)
    torch.manual_seed(0)
    shapes = build_model(cfg, torch.device("cpu"), torch.float32)  # fp32 on the CPU, for the FLOPs
    layers = [(n, m) for n, m in shapes.named_modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    flops = {}

    def counter(name):
        def hook(module, inputs, output):
            if isinstance(module, torch.nn.Conv2d):
                k = module.kernel_size[0] * module.kernel_size[1]
                flops[name] = 2.0 * module.in_channels * module.out_channels * k * output.shape[2] * output.shape[3]
            else:
                flops[name] = 2.0 * module.in_features * module.out_features
            flops[name] *= 0.0 if name == "whiten" else 2.0  # backward: wgrad + dgrad

        return hook

    handles = [m.register_forward_hook(counter(n)) for n, m in layers]
    with torch.no_grad():
        shapes.eval()(torch.zeros(1, 3, 32, 32).contiguous(memory_format=torch.channels_last))
    for h in handles:
        h.remove()
    total, done, ready = sum(flops.values()), 0.0, {}
    for name, _ in reversed(layers):
        block = name.rsplit(".", 1)[0] if name.endswith(".conv") else name
        ready[f"{block}.norm.bias"] = done / total
        done += flops[name]
        ready[f"{name}.weight"] = done / total
    model = build_model(cfg, torch.device("cpu"), torch.float16)
    return cfg, model, {p: ready.get(n, 1.0) for n, p in model.named_parameters()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--print", action="store_true", help="print the table, write nothing")
    args = p.parse_args(argv)
    text = build()
    if args.print:
        print(text)
        return 0
    from fastcifar.core.atomic import write_atomic

    write_atomic(OUT, text.encode())
    print(f"model_allreduce: wrote {OUT.relative_to(ROOT)}")
    return 0


def versions(row: dict) -> str:
    """What a measured row ran: torch, Triton, the driver or CUDA where the row has it, and the commit."""
    system = f"driver {row['driver']}" if "driver" in row else f"CUDA {row['cuda']}"
    return f"torch {row['torch']}, Triton {row['triton']}, {system}, commit {row['commit']}"


def build() -> str:
    from fastcifar.parallel.comm import plan_buckets
    from fastcifar.run.schedule import epoch_lengths

    cfg, model, ready = network()
    names = {p: n for n, p in model.named_parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in trainable)
    cap = int(cfg.bucket_mb * 2**20)

    def described(plan):  # (bytes, share of backward done when complete, member names) per bucket
        return [(nbytes, max(ready[p] for p in members), [names[p] for p in members]) for members, nbytes in plan]

    def made(params):
        return [(b.params, b.numel * b.params[0].element_size()) for b in plan_buckets(params, cap)]

    after, before = described(made(trainable)), described(plan_from_start(trainable, cap))
    after_frozen = described(made([p for p in trainable if p is not model.whiten.bias]))
    grad_bytes = sum(s for s, _, _ in after)
    filters = [p for p in trainable if p.dim() == 4]
    muon_bytes = sum(p.numel() for p in filters) * 2  # the sharded update buffer: bfloat16 on CUDA

    step_line, step = find_row(RESULTS / "step.jsonl", STEP_ROW)
    one_line, one = find_row(RESULTS / "step.jsonl", ONE_GPU_ROW)
    run_line, run = find_row(RESULTS / "official.jsonl", RUN_ROW)
    kernels = step["per_kernel"]
    ns_ms = sum(k[3] for k in kernels if "BFloat16" in k[0] or k[0].startswith("nvjet"))
    opt_ms = step["optimizer_ms"] + ns_ms
    convs, rest = step["convs_ms"], step["bn_act_pool_ms"] + step["other_ms"] + step["optimizer_ms"]
    per_image = (one["step_ms"] - step["step_ms"]) / (one["batch"] - step["batch"])
    steps = sum(epoch_lengths(cfg.epochs, 50_000 // cfg.batch_size))
    in_run = run["train_clock_mean_s"] / (steps * one["step_ms"] / 1e3)  # the run's clock per bench step
    freeze_steps = sum(epoch_lengths(cfg.epochs, 50_000 // cfg.batch_size)[: cfg.whiten_bias_epochs])

    def machine_step(m: Machine) -> float:
        """The per-rank step without communication: the measured one, its conv kernels scaled by
        ``flops_ratio`` and the rest by ``bytes_ratio``; 16 ranks: 125 images on the measured line."""
        if m.ranks == 16:
            return step["step_ms"] + per_image * (cfg.batch_size // 16 - step["batch"])
        return step["step_ms"] + convs * (m.flops_ratio - 1) + rest * (m.bytes_ratio - 1)

    lines = [
        "# The default preset's gradient all-reduce on 8 and 16 GPUs: a model from measured parts",
        "",
        "Generated by `python bench/model_allreduce.py` on a machine without a GPU (2-core CPU): no",
        "figure here was measured on several GPUs. Each says where it comes from: **measured** (device,",
        "date, row) or **modelled** (from what). Rerun the script after a new measurement; replace the",
        "model with `bench/bench_allreduce.py --backend nccl --nproc 8 --preset fast-jitter --batch 250`",
        "when 8 GPUs are available.",
        "",
        "## Inputs",
        "",
        f"- The network: `{PRESET}` (FastNet {cfg.widths}), {n_params:,} trainable parameters: "
        f"{sum(p.numel() for p in trainable if p.element_size() == 2) * 2 / 1e6:.2f} MB of fp16 gradients and "
        f"{sum(p.numel() for p in trainable if p.element_size() == 4) * 4 / 1e3:.1f} KB of fp32 (batchnorm "
        f"shifts); {grad_bytes / 1e6:.2f} MB in the buckets with 128-byte alignment (`plan_buckets`, "
        f"--bucket-mb {cfg.bucket_mb:g}). {steps} steps a run ({cfg.epochs:g} epochs of {50_000 // cfg.batch_size}), "
        f"the whitening bias frozen after {freeze_steps}.",
        f"- The per-rank step, **measured**: {step['step_ms']:.3f} ms, {step['device']}, {step['date'][:10]}, "
        f"{versions(step)}, bench/results/step.jsonl line {step_line}: rank 0 of a fake "
        f"{step['world_size']}-rank group (collectives complete at once, no data moves), {step['batch']} images, "
        f"graphs on, {step['buckets']} buckets (the plan before issue 73). Its traced kernels: convs {convs:.3f} ms, "
        f"other {rest:.3f} ms, of which the optimizer {step['optimizer_ms']:.3f} ms and Muon's "
        f"Newton-Schulz (bfloat16 and nvjet GEMM kernels) {ns_ms:.3f} ms.",
        f"- One H100 over the whole batch, **measured**: {one['step_ms']:.3f} ms at {one['batch']} images "
        f"({one['date'][:10]}, {versions(one)}, step.jsonl line {one_line}); with the row above, "
        f"{per_image * 1e3:.2f} us per image, the line the 16-rank step is read from.",
        f"- One default run on one H100, **measured**: train clock {run['train_clock_mean_s']:.3f} s mean over "
        f"{run['runs']} runs (bench/results/official.jsonl line {run_line}, {run['call']}, {versions(run)}), "
        f"{in_run:.3f} x {steps} bench steps: a run is {in_run:.3f} x its steps' bench time. Predicted runs "
        "below apply the same factor to the predicted step (whitening init and epoch ends not modelled apart).",
        f"- Backward, **modelled**: {BACKWARD_SHARE:.2f} of the step less the optimizer and Newton-Schulz "
        f"({opt_ms:.3f} ms, run after the all-reduce); gradients ready by conv FLOPs done (module docstring).",
        "",
        "## Bucket plans (launch order; bytes, share of backward done when the bucket is complete)",
        "",
        "| plan | buckets |",
        "|---|---|",
    ]

    def show(plan):
        return "; ".join(
            f"{s / 1e6:.3f} MB at {r:.2f} ({', '.join(n.replace('.conv.weight', '') for n in ns)})" for s, r, ns in plan
        )

    lines += [
        f"| before issue 73 (filled from the start) | {show(before)} |",
        f"| after (filled from the end) | {show(after)} |",
        f"| after, whitening bias frozen | {show(after_frozen)} |",
        "",
        "Before the change, once the bias froze its bucket could only be launched from `finish()`, after",
        "backward; it was the last bucket either way, so the exposure below is the same in both phases.",
        "",
        "## Machines and what they assume",
        "",
    ]
    for m in MACHINES:
        lines.append(f"- **{m.name}**: {m.link}. Step: {m.step_rule}.")
    lines += [
        f"- `--muon-shard`: each rank orthogonalizes every n-th filter and one all-reduce of the "
        f"{muon_bytes / 1e6:.2f} MB bfloat16 update buffer shares them, after backward and the gradient "
        "all-reduce (exposed whole). Newton-Schulz on the slowest rank falls to its largest filter's share "
        "of the FLOPs (one 256x2304 of the default's six filters: 31%), an optimistic bound: at these sizes "
        "the kernels are partly latency-bound.",
        "",
        "## Per machine (all **modelled** except the H100 step's input)",
        "",
        "| machine | ranks | images a rank | bytes on the wire a GPU a step | time on the wire | exposed before | "
        "exposed after (% of step) | predicted step after | run (s) after | `--muon-shard`: + bytes, step, run |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in MACHINES:
        base = machine_step(m)
        compute = base - opt_ms * (m.bytes_ratio if m.ranks == 8 else 1.0)
        backward = BACKWARD_SHARE * compute
        wire_bytes = 2 * (m.ranks - 1) / m.ranks * grad_bytes
        wire = sum(ring_ms(s, m.ranks, m.busbw_gbs, m.alpha_us) for s, _, _ in after)
        exp = {}
        for label, plan_on, plan_off in (("before", before, before), ("after", after, after_frozen)):
            on = exposed_ms([(s, r) for s, r, _ in plan_on], backward, m.ranks, m)
            off = exposed_ms([(s, r) for s, r, _ in plan_off], backward, m.ranks, m)
            exp[label] = (freeze_steps * on + (steps - freeze_steps) * off) / steps  # the run's mean
        predicted = base + exp["after"]
        ns_here = ns_ms * (m.bytes_ratio if m.ranks == 8 else 1.0)
        shard = predicted - ns_here * (1 - 0.306) + ring_ms(muon_bytes, m.ranks, m.busbw_gbs, m.alpha_us)
        lines.append(
            f"| {m.name} | {m.ranks} | {cfg.batch_size // m.ranks} | {wire_bytes / 1e6:.2f} MB | {wire:.3f} ms "
            f"({len(after)} collectives) | {exp['before']:.3f} ms | {exp['after']:.3f} ms "
            f"({100 * exp['after'] / predicted:.1f}%) | {predicted:.3f} ms (compute {base:.3f}) | "
            f"{in_run * steps * predicted / 1e3:.3f} | {2 * (m.ranks - 1) / m.ranks * muon_bytes / 1e6:.2f} MB, "
            f"{shard:.3f} ms, {in_run * steps * shard / 1e3:.3f} s |"
        )
    lines += [
        "",
        "Exposed: the run's mean per step (the first epochs with the whitening bias in its bucket, the rest",
        "without). Left out: NCCL's kernels taking SMs from backward while they overlap it, the host's",
        "bucket hooks (captured: replayed by the graph), and the division of each bucket after its sum",
        "(a read and write of 3.95 MB at HBM speed: about 2 us on the H100). Runs are the time of the",
        "default's steps only: whether its recipe, with batchnorm over 250 (or 125) images a rank, still",
        "reaches 94% is the emulated-ranks measurement's to say (issue 46, docs/distributed.md).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
