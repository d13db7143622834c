"""torch.profiler over a few training steps after warm-up: a Chrome trace and the top kernels.

    python scripts/profile_torch.py --skip 20 --steps 10 -- --data data          # the default preset
    python scripts/profile_torch.py --out prof/ -- --data data --preset resnet9 --nvtx

Runs the trainer (``fastcifar.train.train``, every flag after ``--`` is the trainer's), lets
``--skip`` timed steps pass (after the trainer's own untimed warm-up steps), records one profiler
warm-up step and then ``--steps`` steps, writes ``trace.json`` (open it in chrome://tracing or
https://ui.perfetto.dev) and prints the ``--top`` operations by self device time: the CUDA kernels
on a GPU; on the CPU (no device), the ops by self CPU time. The run is stopped once the window
is recorded. Works where nsys cannot report (containers without its permissions, CPU only); under
torchrun each rank writes ``trace-rank<N>.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastcifar.core.config import ConfigError, validate
from fastcifar.core.options import parse_args
from fastcifar.data import DataError
from fastcifar.parallel import distributed
from fastcifar.run import profiling
from fastcifar.train import train


class WindowRecorded(Exception):
    """Raised from the step callback once the profiler has its window: ends the run early."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    ours, trainer_flags = argv[:split], argv[split + 1 :]
    p = argparse.ArgumentParser(
        prog="scripts/profile_torch.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--skip", type=int, default=10, help="timed steps before the profiler's warm-up step")
    p.add_argument("--steps", type=int, default=5, help="steps recorded")
    p.add_argument("--top", type=int, default=20, help="rows of the table")
    p.add_argument("--out", default="runs/profile", help="folder for trace.json and the trainer's logs")
    args = p.parse_args(ours)
    if args.skip < 0 or args.steps <= 0:
        p.error("--skip must not be negative and --steps must be positive")

    out = Path(args.out)
    cfg = parse_args([*trainer_flags, "--runs", "1", "--out-dir", str(out / "logs")])
    ctx = None
    try:
        ctx = distributed.setup(cfg.device, cfg.dist_timeout_s, settings=cfg)
        validate(cfg, ctx.world_size)
        out.mkdir(parents=True, exist_ok=True)
        trace = out / (f"trace-rank{ctx.rank}.json" if ctx.distributed else "trace.json")
        on_device = ctx.device.type == "cuda"
        activities = [torch.profiler.ProfilerActivity.CPU]
        if on_device:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        window = args.skip + 1 + args.steps  # boundaries until the trace is ready
        boundaries = 0
        with torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=args.skip, warmup=1, active=args.steps, repeat=1),
            on_trace_ready=lambda prof: prof.export_chrome_trace(str(trace)),
        ) as prof:

            def step_boundary() -> None:
                nonlocal boundaries
                prof.step()
                boundaries += 1
                if boundaries >= window:
                    raise WindowRecorded

            profiling.on_step(step_boundary)
            try:
                train(cfg, ctx)
            except WindowRecorded:
                pass
            finally:
                profiling.remove_step_callback(step_boundary)
        if boundaries < window:
            raise ConfigError(
                f"the run ended after {boundaries} timed steps; the window needs {window} "
                f"(--skip {args.skip} + 1 + --steps {args.steps}): add epochs or lower --skip"
            )
    except (ConfigError, DataError) as exc:
        print(f"profile_torch: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if ctx is not None:
            distributed.teardown(ctx)

    sort_by = "self_device_time_total" if on_device else "self_cpu_time_total"
    what = "CUDA kernels and ops by self device time" if on_device else "ops by self CPU time (no device)"
    print(
        f"\nprofile of {args.steps} steps after {args.skip} timed steps, preset {cfg.preset}, "
        f"{ctx.device.type}: top {args.top} {what}"
    )
    print(prof.key_averages().table(sort_by=sort_by, row_limit=args.top))
    print(f"trace: {trace}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
