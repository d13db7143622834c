"""CPU threads: the README's CPU example timed with OMP_NUM_THREADS at 1, 2 and torch's default.

    python bench/bench_cpu_threads.py --data data          # official CIFAR-10; appends to results/cpu_threads.jsonl
    python bench/bench_cpu_threads.py --smoke --data DIR   # one short run per setting, nothing written

Each setting is one trainer run in a fresh process (threads are fixed at start-up): the README's
CPU example (default preset, --subset 2000 --widths 16,32,32 --batch-size 128) for --epochs
epochs. The figure is the trainer's own train clock per epoch (evaluation excluded) and the run's
wall time. The machine's load average is recorded beside it: on a machine shared with other work
the default (one thread per core) contends with it, which is the effect this measures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, environment, markdown_table

ROOT = Path(__file__).resolve().parents[1]
CPU_EXAMPLE = ["--device", "cpu", "--subset", "2000", "--widths", "16,32,32", "--batch-size", "128"]


def run(setting: str, data: str, epochs: str, smoke: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    env.pop("OMP_NUM_THREADS", None)
    if setting != "default":
        env["OMP_NUM_THREADS"] = setting
    extra = ["--subset", "200", "--batch-size", "50", "--widths", "8,16,16", "--whiten-images", "50"] if smoke else []
    with tempfile.TemporaryDirectory() as out:
        args = [
            sys.executable,
            "-m",
            "fastcifar.train",
            *CPU_EXAMPLE,
            *extra,
            "--data",
            data,
            "--epochs",
            epochs,
            "--out-dir",
            out,
            "--no-save-model",
            "--quiet",
        ]
        load = os.getloadavg()[0]
        proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"bench_cpu_threads: the run with OMP_NUM_THREADS={setting} failed:\n{proc.stderr[-2000:]}")
        (run_dir,) = [p for p in Path(out).iterdir() if p.is_dir()]
        doc = json.loads((run_dir / "summary.json").read_text())
    result = doc["results"][0]
    epoch_s = [e["train_time"] for e in result["epochs"]]
    return {
        "omp_num_threads": setting,
        "torch_threads": doc["device"]["cpu_threads"],
        "epochs": len(epoch_s),
        "epoch_s_mean": sum(epoch_s) / len(epoch_s),
        "epoch_s_max": max(epoch_s),
        "train_s": result["train_time"],
        "run_wall_s": result["wall_time"],
        "load_avg_1m": round(load, 2),
        "test_acc": result["test_acc"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="data", help="official CIFAR-10 (folder or archive)")
    p.add_argument("--epochs", default="2")
    p.add_argument("--threads", default="1,2,default", help="comma-separated OMP_NUM_THREADS settings")
    p.add_argument("--smoke", action="store_true", help="a tiny run per setting, nothing written")
    args = p.parse_args(argv)
    env = environment()
    rows = [run(s, args.data, args.epochs, args.smoke) for s in args.threads.split(",")]
    print(f"## CPU threads: the README's CPU example, {args.epochs} epochs\n")
    print(f"{env['device']} | {os.cpu_count()} CPUs | torch {env['torch']} | {env['date']} | commit {env['commit']}\n")
    print(
        markdown_table(
            rows,
            [
                "omp_num_threads",
                "torch_threads",
                "epoch_s_mean",
                "epoch_s_max",
                "train_s",
                "run_wall_s",
                "load_avg_1m",
                "test_acc",
            ],
        )
    )
    if args.smoke:
        print("\nsmoke run: figures meaningless, nothing written")
    else:
        path = RESULTS_DIR / "cpu_threads.jsonl"
        with path.open("a") as f:
            for r in rows:
                f.write(json.dumps({**env, "cpus": os.cpu_count(), "data": args.data, **r}) + "\n")
        print(f"\nappended to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
