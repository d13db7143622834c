"""Compressed gradient communication: accuracy, bytes per step and a modelled step time per method.

    python bench/bench_compress.py -- --data data                      # ResNet-9, 24 epochs, 2 ranks
    python bench/bench_compress.py --nproc 8 --methods none,topk,qsgd --ratios 0.01,0.1 -- --data data
    python bench/bench_compress.py --smoke                             # tiny CPU run, writes nothing

For each method x scope x ratio it trains with ``torchrun --nproc_per_node N -m fastcifar.train
--preset resnet9`` (the seed's 24 epochs unless overridden after ``--``) and reads the run's
summary.json: test accuracy, train time, the bytes each rank sent per step, the dense bytes, the
compression ratio and the host time spent compressing per step (all measured in that run).

The time per step at interconnect bandwidths from 1 to 400 GB/s is a MODEL built on those
measured bytes and compress times, not a measurement: a ring all-reduce puts 2(n-1)/n of its
buffer on each rank's link, an all-gather (n-1) times each rank's payload (which method uses
which: fastcifar/compress/engine.py); modelled comm time = wire bytes / bandwidth, plus the
measured compress time (host time without the collectives; a run whose step was captured as a
CUDA graph measures none, and its row's note says so), against the dense all-reduce's wire
time. It ignores latency and overlap with backward, so it says where compression can pay, not
what a step will take.

``--smoke`` runs two methods for one epoch on a tiny synthetic data set on the CPU and writes
nothing; without it, rows go to bench/results/compress.jsonl and a table to compress.md, with the
device, versions and date (on the CPU the device column says so).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT)]
from common import RESULTS_DIR, environment, markdown_table, run_trainer

from fastcifar.parallel.compress import make

BANDWIDTHS_GBS = (1, 10, 25, 100, 400)


def wire_bytes(method: str, payload: float, n: int) -> float:
    """Bytes on each rank's link for one step's payload (per rank), ring algorithms. The collective
    is the compressor's ``kind`` (summable -> all-reduce, else all-gather), with the trainer's
    defaults (shared-coordinate RandomK); ``none`` is the plain all-reduce."""
    if method == "none" or make(method).kind == "sum":
        return 2 * (n - 1) / n * payload
    return (n - 1) * payload


def settings(methods, scopes, ratios):
    for method in methods:
        for scope in ["bucket"] if method == "none" else scopes:
            if method in ("topk", "randomk"):
                for r in ratios:
                    yield method, scope, ["--compress-ratio", str(r)], f"K={r:g}"
            else:
                yield method, scope, [], ""


def run_one(method, scope, extra, nproc, trainer_args, out: Path) -> dict:
    args = ["--preset", "resnet9", "--compress", method, "--compress-scope", scope, *extra, *trainer_args]
    run_dir = run_trainer(args, out, nproc, f"bench_compress ({method}/{scope})")
    return json.loads((run_dir / "summary.json").read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run, nothing written")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (torchrun --nproc_per_node)")
    parser.add_argument("--methods", default="none,fp16,topk,randomk,threshold,terngrad,qsgd,powersgd")
    parser.add_argument("--scopes", default="layer,bucket,model")
    parser.add_argument("--ratios", default="0.01,0.1")
    parser.add_argument("--model-ranks", type=int, default=8, help="ranks n in the modelled step time")
    parser.add_argument("trainer_args", nargs="*", help="after --: passed to every trainer run")
    args = parser.parse_args(argv)
    trainer_args = list(args.trainer_args)
    methods, scopes = args.methods.split(","), args.scopes.split(",")
    ratios = [float(r) for r in args.ratios.split(",")]
    tmp = tempfile.TemporaryDirectory()
    if args.smoke:
        sys.path.insert(0, str(ROOT / "tests"))
        from conftest import write_official

        data, _ = write_official(Path(tmp.name) / "data", per_batch=40, n_test=50)
        methods, scopes, ratios = ["none", "topk"], ["bucket"], [0.1]
        trainer_args = [
            "--data",
            str(data),
            "--device",
            "cpu",
            "--widths",
            "8,16,32,64",
            "--batch-size",
            "40",
            "--epochs",
            "1",
            "--warmup-steps",
            "1",
            "--eval-batch-size",
            "50",
            "--loader",
            "torch",
        ]

    rows = []
    for i, (method, scope, extra, param) in enumerate(settings(methods, scopes, ratios)):
        s = run_one(method, scope, extra, args.nproc, trainer_args, Path(tmp.name) / f"run{i}")
        comp = (s.get("compression") or [{}])[0]
        dense = comp.get("dense_bytes_per_step")
        row = {
            "method": method,
            "scope": scope,
            "param": param,
            "acc": s["summary"]["acc_mean"],
            "train_s": s["summary"]["train_time_mean"],
            "MiB_per_step": comp.get("bytes_per_step", dense),
            "dense": dense,
            "ratio": comp.get("ratio", 1.0),
            "compress_ms": comp.get("compress_ms_per_step", 0.0),
            "ranks": args.nproc,
            "device_run": f"{s['device']['type']} {s['device']['name']}",
        }
        rows.append(row)
    # --compress none logs no compression record: its bytes are the dense baseline the others report
    dense_bytes = next((r["dense"] for r in rows if r["dense"]), 0.0)
    n = args.model_ranks
    for r in rows:
        payload = dense_bytes if r["method"] == "none" else r["MiB_per_step"]
        del r["dense"]
        r["MiB_per_step"] = payload / 2**20
        if r["compress_ms"] is None:  # a captured step: graph replays run no Python, no host time to add
            r["note"] = "compress time not measured (CUDA graph replays): model_ms is the wire time alone"
        for bw in BANDWIDTHS_GBS:
            t = wire_bytes(r["method"], payload, n) / (bw * 1e9) * 1e3
            r[f"model_ms@{bw}GB/s"] = t if r["compress_ms"] is None else t + r["compress_ms"]
    columns = [
        "method",
        "scope",
        "param",
        "acc",
        "train_s",
        "MiB_per_step",
        "ratio",
        "compress_ms",
        *[f"model_ms@{bw}GB/s" for bw in BANDWIDTHS_GBS],
        *(["note"] if any("note" in r for r in rows) else []),
    ]
    env = environment()
    table = markdown_table(rows, columns)
    header = (
        f"{env['device']} | torch {env['torch']} | {env['date']} | commit {env['commit']} | "
        f"{args.nproc} ranks measured; step time modelled for {n} ranks (latency and overlap ignored)"
    )
    print(header + "\n\n" + table)
    if args.smoke:
        print("\nsmoke run: figures meaningless, nothing written")
        return 0
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    with (RESULTS_DIR / "compress.jsonl").open("a") as f:
        for r in rows:
            f.write(json.dumps({**env, "trainer_args": trainer_args, **r}) + "\n")
    with (RESULTS_DIR / "compress.md").open("a") as f:
        f.write(f"\n## bench_compress.py\n\n{header}\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
