"""Models per hour of ``fastcifar sweep`` beside ``--runs N`` in one process, and the per-run cost
beyond training, the first run of a worker apart from the later ones.

    python bench/bench_sweep.py --data data --runs 16                   # the CPU: 1 and 2 workers
    python bench/bench_sweep.py --device cuda --full --per-device 1,2,4 --data data --runs 32 --record
    python bench/bench_sweep.py --device cuda --full --epochs 2 --per-device 1,2,4 --data data --runs 32
    python bench/bench_sweep.py --smoke                                 # tiny, made-up data: nothing written

Each configuration trains the same ``--runs`` runs (seeds seed..seed+N-1, the same settings, test
margins kept, no model file): first ``python -m fastcifar.train --runs N`` (the baseline: one
process, one data read), then ``fastcifar sweep`` with K workers per device for each K of
``--per-device``, each into a new store. Every figure is wall time around the whole command, start-up
included, as a user waits for it. From the sweep's run table: each run's wall time in its worker
(data read, set-up, training, evaluation, outputs) less its training time, the first run of a worker
apart (imports and compiles are paid there), and each run's set-up before its clock (``setup_*``:
the first run builds, warms up and captures the engine that later runs take over, the baseline's
runs 2..N as the workers' later runs: fastcifar/run/engine.py).

On the CPU the K workers share the cores (each gets cores / K threads), the baseline takes them all.
Rows go to bench/results/sweep.jsonl only with ``--record``.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import RESULTS_DIR, environment, markdown_table  # noqa: E402

# the tiny CPU configuration: FastNet 16-32-32 on 5,000 images, one epoch
TINY = {"widths": "16,32,32", "subset": 5000, "epochs": 1, "batch_size": 500, "eval_batch_size": 1000}
SMOKE = {"widths": "16,32,32", "subset": 200, "epochs": 1, "batch_size": 50, "eval_batch_size": 100}


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="", help="CIFAR-10 (official batches); --smoke makes its own")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--preset", default="fast")
    p.add_argument("--runs", type=int, default=8, help="runs per configuration (default 8)")
    p.add_argument("--per-device", default="1,2", help="worker counts per device to measure (default 1,2)")
    p.add_argument("--full", action="store_true", help="the preset as it is, not the tiny configuration")
    p.add_argument("--epochs", type=float, help="the runs' epochs (a shorter run of the preset with --full)")
    p.add_argument("--label", default="", help="a name for the configuration in the rows (e.g. the call)")
    p.add_argument("--smoke", action="store_true", help="2 runs on tiny made-up data, nothing written")
    p.add_argument("--record", action="store_true", help="append the rows to bench/results/sweep.jsonl")
    args = p.parse_args(argv)
    args.per_device = [int(v) for v in args.per_device.split(",")]
    if args.smoke:
        args.runs, args.per_device = 2, [1]
    if not args.smoke and not args.data:
        p.error("--data is required (or --smoke)")
    return args


def settings_of(args) -> dict:
    base = {} if args.full else dict(SMOKE if args.smoke else TINY)
    if args.device == "cpu":
        base["loader"] = "torch"
    if args.epochs:
        base["epochs"] = int(args.epochs) if args.epochs.is_integer() else args.epochs
    return {"data": args.data, **base}


def flags(settings: dict) -> list[str]:
    return [a for k, v in settings.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def env() -> dict:
    e = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    for name in ("WORLD_SIZE", "RANK", "OMP_NUM_THREADS"):  # the sweep sets each CPU worker's threads
        e.pop(name, None)
    return e


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"bench_sweep: {' '.join(cmd[:6])} ... failed:\n{proc.stderr[-2000:]}")
    return wall


def baseline(args, settings: dict, out: Path) -> dict:
    cmd = [sys.executable, "-m", "fastcifar.train", "--preset", args.preset, "--device", args.device]
    cmd += [*flags(settings), "--runs", str(args.runs), "--save-outputs", "test", "--no-save-model", "--quiet"]
    wall = timed([*cmd, "--out-dir", str(out)])
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    results = json.loads((run_dir / "summary.json").read_text())["results"]
    train = statistics.fmean(r["train_time"] for r in results)
    later = [r["setup_time"] for r in results[1:]]  # on run 1's engine (fastcifar/run/engine.py)
    return {
        "mode": "--runs N",
        "workers": 1,
        "wall_s": wall,
        "train_s": train,
        "setup_first_s": results[0]["setup_time"],
        "setup_later_s": statistics.fmean(later) if later else None,
    }


def sweep(args, settings: dict, folder: Path, k: int) -> dict:
    spec = {"preset": args.preset, "seed": 0, "runs": args.runs, "keep": ["test_margins"], "settings": settings}
    for key in ("widths",):
        if key in spec["settings"]:
            spec["settings"][key] = [int(v) for v in str(spec["settings"][key]).split(",")]
    path = folder / "spec.json"
    path.write_text(json.dumps(spec))
    devices = "cpu" if args.device == "cpu" else "all"
    wall = timed([sys.executable, "-m", "fastcifar", "sweep", str(path), "--store", str(folder / "store")]
                 + ["--devices", devices, "--per-device", str(k)])  # fmt: skip
    with sqlite3.connect(folder / "store" / "runs.sqlite") as con:
        rows = con.execute(
            "SELECT first_of_worker, wall_time, train_time, setup_time FROM runs WHERE status='done'"
        ).fetchall()
    if len(rows) != args.runs:
        sys.exit(f"bench_sweep: the sweep finished {len(rows)} of {args.runs} runs")
    first = [w for f, w, _, _ in rows if f]
    later = [w for f, w, _, _ in rows if not f]
    return {
        "mode": "sweep",
        "workers": k,
        "wall_s": wall,
        "train_s": statistics.fmean(t for _, _, t, _ in rows),
        "first_run_s": statistics.fmean(first),
        "later_run_s": statistics.fmean(later) if later else None,
        "overhead_first_s": statistics.fmean(w - t for f, w, t, _ in rows if f),
        "overhead_later_s": statistics.fmean(w - t for f, w, t, _ in rows if not f) if later else None,
        "setup_first_s": statistics.fmean(s for f, _, _, s in rows if f),
        "setup_later_s": statistics.fmean(s for f, _, _, s in rows if not f) if later else None,
    }


def make_data(folder: Path) -> str:
    """Made-up CIFAR-format batches (tests/conftest.py's), for --smoke."""
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import write_official

    path, _ = write_official(folder / "data", per_batch=40, n_test=100)
    return str(path)


def main(argv=None) -> int:
    args = parse(argv)
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as tmp:
        tmp = Path(tmp)
        if args.smoke:
            args.data = make_data(tmp)
        settings = settings_of(args)
        (tmp / "base").mkdir()
        rows = [baseline(args, settings, tmp / "base")]
        for k in args.per_device:
            (tmp / f"k{k}").mkdir()
            rows.append(sweep(args, dict(settings), tmp / f"k{k}", k))
    for r in rows:
        r["runs"] = args.runs
        r["models_per_hour"] = args.runs / r["wall_s"] * 3600
        r["vs_runs_n"] = r["models_per_hour"] / rows[0]["models_per_hour"]
    columns = ["mode", "workers", "runs", "wall_s", "models_per_hour", "vs_runs_n", "train_s"]
    columns += ["first_run_s", "later_run_s", "overhead_first_s", "overhead_later_s", "setup_first_s", "setup_later_s"]
    env_row = environment()
    config = "full" if args.full else ("smoke" if args.smoke else "tiny")
    if args.epochs:
        config += f", {settings['epochs']} epochs"
    print(f"## fastcifar sweep beside --runs {args.runs}: preset {args.preset} ({config}), {args.device}\n")
    print(f"{env_row['device']} | torch {env_row['torch']} | {env_row['date']} | commit {env_row['commit']}\n")
    print(markdown_table(rows, columns))
    if args.smoke:
        print("\nsmoke run: figures meaningless, nothing written")
    elif args.record:
        for r in rows:
            r.update(preset=args.preset, config=config, settings=settings, label=args.label, cpus=os.cpu_count())
        path = RESULTS_DIR / "sweep.jsonl"
        with path.open("a") as f:
            for r in rows:
                f.write(json.dumps({**env_row, **r}) + "\n")
        print(f"\nappended to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
