"""Tables and checks over the trainer's summary.json files that a gpu_visit.sh stage left behind.

    python scripts/gpu_visit_report.py engines RUNS_DIR [--out FIGURES.md]
    python scripts/gpu_visit_report.py accuracy RUNS_DIR... [--out FIGURES.md]

``engines``: one row per engine combination (the folder name under RUNS_DIR: k-KERNELS-g-GRAPHS,
nccl-1rank, dali-g-GRAPHS), its per-epoch train loss, final test accuracy and train time; fails
(exit 1) when a run's loss did not fall from its first epoch to its last, or when the graphed and
eager runs of the same kernels end further apart than ``--tol`` (relative train loss; a sanity
bound over whole epochs, where fp16 and cuDNN's algorithm choice already make eager runs differ:
step-level equality is tests/unit/test_graphs_cuda.py's job), and when the nccl-1rank run formed no
process group (its engine line names no comm: its buckets and collectives never ran). ``accuracy``: every run found under the
folders (several stages' chunks may be combined), with mean, std and min of the test accuracy.
The race's report is scripts/race.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def load_runs(root: Path) -> dict[str, list[dict]]:
    """{combination name: [result dicts]} from root/NAME/**/summary.json."""
    found: dict[str, list[dict]] = {}
    for path in sorted(root.glob("*/**/summary.json")):
        name = path.relative_to(root).parts[0]
        doc = json.loads(path.read_text())
        for result in doc.get("results", []):
            result["_config"] = doc.get("config", {})
            result["_engine"] = doc.get("engine", {})
            found.setdefault(name, []).append(result)
    return found


def engines(root: Path, tol: float) -> tuple[list[str], list[str]]:
    runs = load_runs(root)
    lines = ["| combination | train loss by epoch | test acc % | train s | loss fell |", "|---|---|---|---|---|"]
    problems = []
    final = {}
    for name, results in runs.items():
        r = results[0]
        losses = [e["train_loss"] for e in r["epochs"]]
        fell = len(losses) >= 2 and losses[-1] < losses[0]
        final[name] = losses[-1] if losses else float("nan")
        lines.append(f"| {name} | {' > '.join(f'{v:.4f}' for v in losses)} | {r['test_acc']:.2f} | "
                     f"{r['train_time']:.2f} | {'yes' if fell else 'NO'} |")
        if not fell:
            problems.append(f"{name}: train loss did not fall over its epochs: {losses}")
        if name == "nccl-1rank" and "comm" not in r["_engine"]:
            problems.append(f"{name}: the run formed no process group (--dist-group always missing?): "
                            f"no bucket or collective ran")
    for kernels in ("auto", "triton", "torch"):
        on, off = final.get(f"k-{kernels}-g-on"), final.get(f"k-{kernels}-g-off")
        if on is None or off is None:
            continue
        gap = abs(on - off) / abs(off)
        lines.append(f"\ngraphed vs eager, kernels {kernels}: final train loss {on:.4f} vs {off:.4f} "
                     f"({100 * gap:.2f}% apart, bound {100 * tol:.0f}%)")
        if not gap <= tol:
            problems.append(f"kernels {kernels}: graphed {on:.4f} vs eager {off:.4f} train loss, {100 * gap:.1f}% apart")
    if not runs:
        problems.append(f"no summary.json under {root}")
    return lines, problems


def accuracy(roots: list[Path]) -> tuple[list[str], list[str]]:
    rows = []
    for root in roots:
        for name, results in load_runs(root).items():
            for r in results:
                rows.append((r["_config"].get("preset", "?"), r["seed"], r["test_acc"], r["train_time"], name))
    lines = ["| preset | seed | test acc % | train s |", "|---|---|---|---|"]
    lines += [f"| {p} | {s} | {a:.2f} | {t:.2f} |" for p, s, a, t, _ in sorted(rows)]
    for preset in sorted({r[0] for r in rows}):
        accs = [r[2] for r in rows if r[0] == preset]
        times = [r[3] for r in rows if r[0] == preset]
        std = statistics.stdev(accs) if len(accs) > 1 else 0.0
        lines.append(f"\n{preset}: {len(accs)} runs, test acc mean {statistics.fmean(accs):.2f} ± {std:.2f} "
                     f"(min {min(accs):.2f}), train time mean {statistics.fmean(times):.2f} s")
    return lines, ([] if rows else ["no runs found"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("engines", "accuracy"))
    p.add_argument("roots", nargs="+", type=Path)
    p.add_argument("--out", type=Path, help="also write the table here")
    p.add_argument("--tol", type=float, default=0.05, help="graphed vs eager final train loss, relative")
    args = p.parse_args(argv)
    if args.what == "engines":
        lines, problems = engines(args.roots[0], args.tol)
    else:
        lines, problems = accuracy(args.roots)
    text = "\n".join(lines + [f"\nPROBLEM: {m}" for m in problems]) + "\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
