"""Step time of a data-parallel preset's network (ResNet-9 unless --preset) with stock DDP vs
fastcifar.parallel.comm's buckets, and the exposed communication: a config's step time minus the
same step with its communication skipped.

    python bench/bench_allreduce.py --widths 16,32,64,128              # gloo, 2 CPU ranks, CI-sized (~1 min)
    python bench/bench_allreduce.py --backend nccl --nproc 8 --batch 256 \\
        --bucket-mb 0.5,1,2,4,8,25 --steps 30                         # the 8-GPU seed recipe's shapes
    python bench/bench_allreduce.py --backend nccl --nproc 8 --preset fast-jitter --batch 250 \\
        --bucket-mb 0.5,1,2,4,25 --steps 30                           # the default preset on 8 GPUs

Started without torchrun's environment it launches itself under torchrun (``--nproc`` ranks).
Each rank times every step (device synchronized at its end); a config's figure is the slowest rank's
median, with the 20th and 80th percentiles. Configs are measured in interleaved rounds so that a
load change on a shared machine hits all of them alike. "skipped" runs the same code with the
collectives left out: DDP under ``no_sync()``, the buckets with ``communicate = False``; "none"
is the bare model with no DDP wrapper and no hooks. Prints a markdown table and appends one JSON
line per config to bench/results/allreduce.jsonl, and the table to bench/results/allreduce.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo", help="gloo: CPU ranks; nccl: one GPU each")
    p.add_argument("--nproc", type=int, default=2, help="ranks on this machine")
    p.add_argument("--preset", default="resnet9", help="the preset whose network is timed (fastcifar.PRESETS)")
    p.add_argument("--widths", default="", help="channels, comma-separated; empty: the preset's own")
    p.add_argument("--batch", type=int, default=8, help="images per rank per step (small: the CPU ranks share 2 cores)")
    p.add_argument("--bucket-mb", default="0.05,0.25,0.5,1,25", help="bucket caps to try, MiB, comma-separated")
    p.add_argument("--steps", type=int, default=10, help="timed steps per config per round")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds over all configs")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per config before the first round")
    p.add_argument("--no-save", action="store_true", help="print only, append nothing to bench/results")
    return p.parse_args(argv)


def launch(args, argv) -> int:
    """Refuse what cannot run, then start ``--nproc`` ranks of this script under torchrun."""
    import torch

    if args.backend == "nccl" and not torch.cuda.is_available():
        print(
            "bench_allreduce: --backend nccl needs CUDA GPUs and PyTorch sees none; use --backend gloo on the CPU",
            file=sys.stderr,
        )
        return 2
    if args.backend == "nccl" and torch.cuda.device_count() < args.nproc:
        print(
            f"bench_allreduce: --nproc {args.nproc} NCCL ranks need {args.nproc} GPUs, this machine has "
            f"{torch.cuda.device_count()}",
            file=sys.stderr,
        )
        return 2
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(args.nproc),
        str(Path(__file__).resolve()),
        *argv,
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if args.backend == "gloo":
        env["OMP_NUM_THREADS"] = "1"  # one compute thread per rank: the ranks share the machine's cores
    return subprocess.run(cmd, env=env).returncode


def quantiles(samples: list[float]) -> dict:
    s = sorted(samples)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return {"median_ms": statistics.median(s), "p20_ms": pick(0.2), "p80_ms": pick(0.8)}


def run_rank(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from fastcifar.core.config import ConfigError, from_preset
    from fastcifar.models.network import build_model
    from fastcifar.parallel import distributed
    from fastcifar.parallel.comm import GradBuckets
    from fastcifar.run.optim import NesterovSGD
    from fastcifar.run.report import versions

    # The trainer passes broadcast_buffers=False too; torch 2.14 warns that the name is deprecated.
    warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated")
    ctx = distributed.setup("cuda" if args.backend == "nccl" else "cpu", timeout_s=300.0)
    device = ctx.device
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    try:
        widths = {"widths": tuple(int(w) for w in args.widths.split(","))} if args.widths else {}
        cfg = from_preset(args.preset, **widths)
    except (ConfigError, ValueError) as exc:
        print(f"bench_allreduce: error: {exc}", file=sys.stderr)
        sys.exit(2)
    args.widths, args.arch = ",".join(str(w) for w in cfg.widths), cfg.arch  # what the report names
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    g = torch.Generator().manual_seed(100 + ctx.rank)  # each rank its own batch, as in training
    images = (
        torch.randn(args.batch, 3, 32, 32, generator=g).to(device, dtype).contiguous(memory_format=torch.channels_last)
    )
    labels = torch.randint(0, 10, (args.batch,), generator=g).to(device)

    def make(kind, mb=None):
        torch.manual_seed(0)
        model = build_model(cfg, device, dtype)
        net, buckets = model, None
        if kind == "ddp":
            net = DistributedDataParallel(
                model, device_ids=[device] if device.type == "cuda" else None, broadcast_buffers=False
            )
        elif kind == "bucketed":
            buckets = GradBuckets(model.parameters(), bucket_mb=mb)
        opt = NesterovSGD(model.parameters(), lr=0.0, momentum=0.9, weight_decay=5e-4 * args.batch)
        return {
            "kind": kind,
            "mb": mb,
            "model": model,
            "net": net,
            "buckets": buckets,
            "opt": opt,
            "samples": {"comm": [], "skipped": []},
        }

    def step(c, skip: bool):
        if c["buckets"] is not None:
            c["buckets"].communicate = not skip
        ctx_mgr = c["net"].no_sync() if (skip and c["kind"] == "ddp") else contextlib.nullcontext()
        with ctx_mgr:
            loss = F.cross_entropy(c["net"](images).float(), labels, reduction="sum")
            loss.backward()
        if c["buckets"] is not None:
            c["buckets"].finish()
        c["opt"].step()
        c["opt"].zero_grad()

    def timed(c, skip: bool) -> float:
        t0 = time.perf_counter()
        step(c, skip)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) * 1e3

    mbs = [float(v) for v in args.bucket_mb.split(",")]
    configs = [make("none"), make("ddp")] + [make("bucketed", mb) for mb in mbs]
    for c in configs:
        for skip in (False, True):
            for _ in range(args.warmup):
                step(c, skip)
    for _ in range(args.rounds):
        for c in configs:
            for skip in (True,) if c["kind"] == "none" else (False, True):
                key = "skipped" if skip else "comm"
                dist.barrier()  # every rank starts the config together: no skew carried between configs
                c["samples"][key] += [timed(c, skip) for _ in range(args.steps)]

    grad_bytes = sum(p.numel() * p.element_size() for p in configs[0]["model"].parameters() if p.requires_grad)
    rows = []
    for c in configs:
        row = {
            "config": c["kind"] if c["kind"] != "bucketed" else f"bucketed {c['mb']:g} MiB",
            "buckets": len(c["buckets"]) if c["buckets"] is not None else None,
        }
        for key in ("comm", "skipped"):
            if c["samples"][key]:
                q = quantiles(c["samples"][key])
                worst = torch.tensor([q["median_ms"]], dtype=torch.float64, device=device)
                dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the slowest rank sets the step
                row[key] = {**q, "median_ms": worst.item()}
        rows.append(row)
    if ctx.rank == 0:
        report(args, ctx, device, rows, grad_bytes, versions())
    distributed.teardown(ctx)


def report(args, ctx, device, rows, grad_bytes, vers) -> None:
    import torch

    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, shared)"
    )
    env = {
        "device": name,
        "backend": args.backend,
        "world_size": ctx.world_size,
        "torch": vers["torch"],
        "cuda": vers["cuda"],
        "python": vers["python"],
        "host": platform.node(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "preset": args.preset,
        "widths": args.widths,
        "batch_per_rank": args.batch,
        "grad_mb": round(grad_bytes / 2**20, 3),
        "steps": args.steps * args.rounds,
    }
    lines = [
        f"### {ctx.world_size} x {name}, {args.backend}; torch {vers['torch']}, {env['date']}",
        "",
        f"{args.preset} ({args.arch}) widths {args.widths}, {args.batch} images per rank, "
        f"{grad_bytes / 2**20:.2f} MiB of gradients; {args.steps * args.rounds} timed steps per config "
        "(slowest rank's median, p20-p80).",
        "",
        "| config | buckets | step ms | p20-p80 | comm skipped ms | exposed comm ms | exposed % of step |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        comm, skipped = r.get("comm"), r["skipped"]
        exposed = comm["median_ms"] - skipped["median_ms"] if comm else None
        shown = comm or skipped
        lines.append(
            "| {} | {} | {:.1f} | {:.1f}-{:.1f} | {:.1f} | {} | {} |".format(
                r["config"],
                r["buckets"] if r["buckets"] is not None else "",
                shown["median_ms"],
                shown["p20_ms"],
                shown["p80_ms"],
                skipped["median_ms"],
                f"{exposed:.1f}" if comm else "",
                f"{100 * exposed / comm['median_ms']:.0f}%" if comm else "",
            )
        )
    table = "\n".join(lines)
    print(table)
    if args.no_save:
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    with (RESULTS / "allreduce.jsonl").open("a") as f:
        for r in rows:
            f.write(json.dumps({**env, **r}) + "\n")
    with (RESULTS / "allreduce.md").open("a") as f:
        f.write(table + "\n\n")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from fastcifar.core.presets import PRESETS

    if args.preset not in PRESETS:  # refused here, before torchrun starts a rank to refuse it
        print(
            f"bench_allreduce: error: unknown preset {args.preset!r}; choose from {', '.join(PRESETS)}", file=sys.stderr
        )
        return 2
    if "RANK" not in os.environ:
        return launch(args, argv)
    run_rank(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
