"""The whole training step: eager vs CUDA graph, torch vs Triton kernels, 256 and 512 images per GPU.

For each combination: median step time (CUDA events over a window of replays, repeated), images/s,
the floor that the convolutions' FLOPs set at the device's measured fp16 matmul rate, and the GPU's
idle share of the step: 1 - (union of kernel intervals) / (first kernel start to last kernel end),
read from a torch.profiler trace of a few steps. Launch gaps show up as idle time; a graphed step
should leave the GPU idle for less than 5% of it.

    python bench/bench_step.py                      # on a GPU: the full table, rows to bench/results/step.jsonl
    python bench/bench_step.py --smoke              # the script's logic on the CPU, tiny, nothing written

The step is the trainer's own (``fastcifar.train.make_step`` inside ``fastcifar.graphs.TrainStep``),
on a fixed random batch: loader time is not in these figures (bench_loader.py measures it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (append_results, copy_bandwidth_gbs, environment, markdown_table,  # noqa: E402
                          matmul_tflops, print_header, require_cuda, smoke_mode)

SMOKE = smoke_mode()

import torch  # noqa: E402

from fastcifar.config import Config  # noqa: E402
from fastcifar.graphs import DeviceSchedule, StaticBatch, TrainStep  # noqa: E402
from fastcifar.optim import NesterovSGD  # noqa: E402
from fastcifar.train import build_model, make_step  # noqa: E402


def conv_flops_per_image(model: torch.nn.Module, device, dtype) -> float:
    """Forward FLOPs of the convolutions and the linear layer for one 32x32 image (2 per MAC);
    backward is counted as twice the forward (input and weight gradients)."""
    total = 0.0

    def hook(module, inputs, output):
        nonlocal total
        if isinstance(module, torch.nn.Conv2d):
            k = module.kernel_size[0] * module.kernel_size[1]
            total += 2.0 * module.in_channels * module.out_channels * k * output.shape[2] * output.shape[3] \
                / module.groups
        elif isinstance(module, torch.nn.Linear):
            total += 2.0 * module.in_features * module.out_features
    handles = [m.register_forward_hook(hook) for m in model.modules()
               if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    with torch.no_grad():
        model.eval()
        model(torch.zeros(1, 3, 32, 32, device=device, dtype=dtype).contiguous(memory_format=torch.channels_last))
    for h in handles:
        h.remove()
    return total


def build_step(cfg: Config, batch: int, graphs: bool, device, dtype):
    torch.manual_seed(0)
    model = build_model(cfg, device, dtype)
    opt = NesterovSGD(model.parameters(), lr=0.0, momentum=0.9, weight_decay=5e-4 * batch)
    schedule = DeviceSchedule([0.4 / batch] * 10_000, device)
    step = TrainStep(make_step(model, opt, schedule, 0.2), StaticBatch(batch, dtype, device), capture=graphs)
    g = torch.Generator(device=device).manual_seed(0)
    images = torch.randn(batch, 3, 32, 32, device=device, generator=g).to(dtype).contiguous(
        memory_format=torch.channels_last)
    labels = torch.randint(0, 10, (batch,), device=device, generator=g)
    step.batch.load(images, labels)
    model.train()
    step.warm_up_and_capture(3)
    return model, step, images, labels


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


def idle_share(step, images, labels, steps: int = 10) -> float | None:
    """GPU idle share over ``steps`` steps from a torch.profiler trace (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(images, labels)
        torch.cuda.synchronize()
    intervals = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start)
    if not intervals:
        return None
    busy, cur_start, cur_end = 0.0, *intervals[0]
    for s, e in intervals[1:]:
        if s > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    busy += cur_end - cur_start
    span = max(e for _, e in intervals) - intervals[0][0]
    return 1.0 - busy / span


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 512], help="images per GPU per step")
    parser.add_argument("--kernels", nargs="+", default=["torch", "triton"], choices=["torch", "triton"])
    parser.add_argument("--graphs", nargs="+", default=["off", "on"], choices=["off", "on"])
    parser.add_argument("--window", type=int, default=20, help="steps per timed window")
    parser.add_argument("--repeats", type=int, default=5, help="timed windows; the median is reported")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run of the script's logic; writes nothing")
    args = parser.parse_args()

    if SMOKE:
        device, dtype = torch.device("cpu"), torch.float32
        args.batches, args.kernels, args.graphs, args.window, args.repeats = [4], ["torch"], ["off"], 2, 1
        widths = (8, 16, 32, 64)
    else:
        require_cuda("bench_step")
        device, dtype = torch.device("cuda"), torch.float16
        torch.backends.cudnn.benchmark = True
        widths = Config().widths
    env = environment()
    copy_gbs = copy_bandwidth_gbs(smoke=SMOKE)
    tflops = matmul_tflops(smoke=SMOKE)
    print_header("Training step: eager vs CUDA graph, torch vs Triton kernels", env, copy_gbs)
    print(f"measured fp16 matmul rate: {tflops:.0f} TFLOP/s (the floor column divides the step's FLOPs by it)\n")

    rows = []
    for batch in args.batches:
        for kernels in args.kernels:
            cfg = Config(widths=widths, kernels=kernels)
            for graphs in args.graphs:
                model, step, images, labels = build_step(cfg, batch, graphs == "on", device, dtype)
                flops = 3 * conv_flops_per_image(model, device, dtype) * batch
                model.train()
                ms = time_steps(step, images, labels, device, args.window, args.repeats)
                idle = idle_share(step, images, labels)
                rows.append({"batch": batch, "kernels": kernels, "graphs": graphs, "step_ms": ms,
                             "images_per_s": batch / ms * 1e3, "floor_ms": flops / (tflops * 1e12) * 1e3,
                             "gpu_idle_pct": None if idle is None else 100 * idle})
                del model, step
    columns = ["batch", "kernels", "graphs", "step_ms", "images_per_s", "floor_ms", "gpu_idle_pct"]
    print(markdown_table(rows, columns))
    if SMOKE:
        print("\n(smoke run on the CPU: timings meaningless, nothing written)")
    else:
        print(f"\nrows appended to {append_results('step', rows, env, copy_gbs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
