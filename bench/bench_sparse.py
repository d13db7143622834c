"""Sparse training: accuracy and checkpoint bytes per mask, and accuracy and bytes for local SGD.

    python bench/bench_sparse.py --size cpu --data ../shared/data/cifar10-jpeg.tar.gz   # CI-sized, CPU
    python bench/bench_sparse.py --size full --data data                                # GPU(s), seed recipe
    python bench/bench_sparse.py --smoke                                                # checks the script

Each row is one run of the trainer (a subprocess; local SGD rows under torchrun on 2 ranks, or on
every GPU when there are several). Table 1: K x {fisher, random} x {mask fixed, recomputed every
epoch}, with a dense run for reference: final test accuracy, train time, the mean sparse-diff size
per epoch next to the dense model file. Table 2: local SGD at a few H, dense and with a shared
Fisher mask: accuracy, bytes each rank sends per merge, merges, and the bytes per rank of the
whole run next to dense data parallel's (a gradient all-reduce every step). Rows are appended to
``bench/results/sparse.jsonl`` with device, versions, date and commit; ``--smoke`` (tiny synthetic
data, one epoch, two rows per table) writes nothing.

Sizes: ``cpu`` is ResNet-9 at widths 8/16/32/64 on 2,000 training images for 4 epochs (the
accuracies rank settings on a toy problem, nothing more); ``full`` is the seed recipe (`resnet9`,
24 epochs) on the whole set.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from common import RESULTS_DIR, environment, markdown_table, run_trainer

SIZES = {
    "smoke": [
        "--preset",
        "resnet9",
        "--device",
        "cpu",
        "--widths",
        "8,16,32,64",
        "--batch-size",
        "100",
        "--epochs",
        "1",
        "--warmup-steps",
        "1",
        "--eval-batch-size",
        "200",
        "--mask-samples",
        "100",
        "--loader",
        "torch",
    ],
    "cpu": [
        "--preset",
        "resnet9",
        "--device",
        "cpu",
        "--widths",
        "8,16,32,64",
        "--batch-size",
        "100",
        "--subset",
        "2000",
        "--epochs",
        "4",
        "--warmup-steps",
        "1",
        "--eval-batch-size",
        "500",
        "--mask-samples",
        "256",
        "--loader",
        "torch",
    ],
    "full": ["--preset", "resnet9"],
}


def run(args: list[str], out: Path, ranks: int) -> dict:
    run_dir = run_trainer(args, out, ranks, "bench_sparse")
    summary = json.loads((run_dir / "summary.json").read_text())
    sparse_file = run_dir / "sparse-run1.json"
    sparse = json.loads(sparse_file.read_text()) if sparse_file.exists() else {}
    return {"summary": summary, "sparse": sparse}


def mask_rows(base: list[str], fractions, every_epoch: bool, workdir: Path, kinds) -> list[dict]:
    rows = []
    settings = [("none", 0.0, 0)] + [
        (k, f, e) for f in fractions for k in kinds for e in ([0, 1] if every_epoch else [0])
    ]
    for i, (kind, frac, every) in enumerate(settings):
        args = [*base]
        if kind != "none":
            args += [
                "--sparse-mask",
                kind,
                "--sparse-fraction",
                str(frac),
                "--mask-every",
                str(every),
                "--sparse-checkpoints",
            ]
        r = run(args, workdir / f"mask{i}", 1)
        result, diffs = r["summary"]["results"][0], r["sparse"].get("diffs", [])
        rows.append(
            {
                "table": "masks",
                "mask": kind,
                "K": frac if kind != "none" else None,
                "mask_every": every if kind != "none" else None,
                "trained_params": r["sparse"]["masks"][0]["count"] if kind != "none" else None,
                "test_acc": result["test_acc"],
                "train_s": round(result["train_time"], 2),
                "diff_bytes_mean": round(sum(d["bytes"] for d in diffs) / len(diffs)) if diffs else None,
                "dense_file_bytes": diffs[0]["dense_bytes"] if diffs else None,
            }
        )
        print(f"  {kind} K={frac} every={every}: {result['test_acc']:.2f}%", file=sys.stderr, flush=True)
    return rows


def local_rows(base: list[str], hs, fraction: float, ranks: int, workdir: Path) -> list[dict]:
    rows = []
    r = run(base, workdir / "dp", ranks)
    dp = r["summary"]
    steps = dp["steps_per_epoch"] * dp["config"]["epochs"]
    rows.append(
        {
            "table": "local_sgd",
            "mode": "data parallel",
            "H": None,
            "ranks": ranks,
            "test_acc": dp["results"][0]["test_acc"],
            "merges": steps,
            "bytes_per_merge": None,
            "run_bytes_per_rank": None,
        }
    )
    for h in hs:
        for kind in ("none", "fisher"):
            args = [*base, "--local-steps", str(h)]
            if kind != "none":
                args += ["--sparse-mask", kind, "--sparse-fraction", str(fraction)]
            r = run(args, workdir / f"local{h}{kind}", ranks)
            lsgd = r["sparse"]["local_sgd"]
            rows.append(
                {
                    "table": "local_sgd",
                    "mode": "dense local SGD" if kind == "none" else f"fisher K={fraction}",
                    "H": h,
                    "ranks": ranks,
                    "test_acc": r["summary"]["results"][0]["test_acc"],
                    "merges": lsgd["merges"],
                    "bytes_per_merge": lsgd["per_merge"],
                    "run_bytes_per_rank": lsgd["merges"] * lsgd["per_merge"],
                    "dp_run_bytes_per_rank": steps * lsgd["dense_allreduce"],
                }
            )
            print(f"  local SGD H={h} {kind}: {rows[-1]['test_acc']:.2f}%", file=sys.stderr, flush=True)
    return rows


def synthetic_data(folder: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import write_official

    return write_official(folder, per_batch=200, n_test=400)[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=("cpu", "full"), default="cpu")
    p.add_argument("--data", default="", help="the data set (--smoke writes a synthetic one)")
    p.add_argument("--fractions", default="0.005,0.02,0.1", help="K values, comma-separated")
    p.add_argument("--local-steps", default="1,4,16", help="H values for local SGD, comma-separated")
    p.add_argument("--local-fraction", type=float, default=0.02, help="K of the sparse local SGD rows")
    p.add_argument(
        "--tables",
        choices=("both", "masks", "local"),
        default="both",
        help="which table to measure (e.g. table 2 again after a change to local SGD alone)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny synthetic run of every code path; writes nothing")
    args = p.parse_args(argv)
    size = "smoke" if args.smoke else args.size
    fractions = [0.05] if args.smoke else [float(v) for v in args.fractions.split(",")]
    hs = [2] if args.smoke else [int(v) for v in args.local_steps.split(",")]
    env = environment()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = str(synthetic_data(work / "data")) if args.smoke else args.data
        if not data:
            p.error("--data is required (or --smoke)")
        base = ["--data", data, *SIZES[size]]
        ranks = 2
        if size == "full":
            import torch

            ranks = torch.cuda.device_count()
        rows, lrows = [], []
        if args.tables != "local":
            rows = mask_rows(base, fractions, not args.smoke, work, ("fisher",) if args.smoke else ("fisher", "random"))
        if ranks >= 2 and args.tables != "masks":
            lrows = local_rows(base, hs, args.local_fraction, ranks, work)
    print(f"## sparse training ({size})\n")
    print(f"{env['device']} | torch {env['torch']} | {env['date']} | commit {env['commit']}\n")
    if rows:
        print(
            markdown_table(
                rows,
                [
                    "mask",
                    "K",
                    "mask_every",
                    "trained_params",
                    "test_acc",
                    "train_s",
                    "diff_bytes_mean",
                    "dense_file_bytes",
                ],
            )
        )
        print()
    if lrows:
        print(
            markdown_table(
                lrows,
                [
                    "mode",
                    "H",
                    "ranks",
                    "test_acc",
                    "merges",
                    "bytes_per_merge",
                    "run_bytes_per_rank",
                    "dp_run_bytes_per_rank",
                ],
            )
        )
    elif args.tables != "masks":
        print("local SGD: skipped, it needs at least 2 devices (this machine has 1 GPU)")
    if args.smoke:
        print("\nsmoke run: figures meaningless, nothing written")
        return 0
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    with (RESULTS_DIR / "sparse.jsonl").open("a") as f:
        for r in rows + lrows:
            f.write(json.dumps({**env, "size": size, "data": data, **r}) + "\n")
    print(f"\nappended {len(rows) + len(lrows)} rows to {RESULTS_DIR / 'sparse.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
