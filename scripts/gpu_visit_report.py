"""Tables and checks over the trainer's summary.json files that a gpu_visit.sh stage left behind.

    python scripts/gpu_visit_report.py engines RUNS_DIR [--out FIGURES.md]
    python scripts/gpu_visit_report.py accuracy RUNS_DIR... [--out FIGURES.md]
    python scripts/gpu_visit_report.py race RUNS_DIR --airbench-log LOG [--bar PCT] [--out FIGURES.md]

``engines``: one row per engine combination (the folder name under RUNS_DIR: k-KERNELS-g-GRAPHS,
nccl-1rank, dali-g-GRAPHS), its per-epoch train loss, final test accuracy and train time; fails
(exit 1) when a run's loss did not fall from its first epoch to its last, or when the graphed and
eager runs of the same kernels end further apart than ``--tol`` (relative train loss; a sanity
bound over whole epochs, where fp16 and cuDNN's algorithm choice already make eager runs differ:
step-level equality is tests/unit/test_graphs_cuda.py's job). ``accuracy``: every run found under the
folders (several stages' chunks may be combined), with mean, std and min of the test accuracy.
``race``: each preset under RUNS_DIR and the public airbench94 script (its printed log) side by side:
accuracy mean/std/min, runs below the bar (``--bar``, else this call's ``resnet9`` mean), mean and max
time, and fastcifar's mean time over airbench94's. airbench94's clock also covers its whitening init
and final TTA evaluation; fastcifar's train time covers the init but not the final evaluation, so
the table gives fastcifar both ways ("+ eval": the last epoch's evaluation added).
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


def airbench_runs(log: Path) -> list[tuple[float, float]]:
    """(TTA test accuracy %, seconds) per run from airbench94's printed table: its final row of a run
    has "eval" in the epoch column, the TTA accuracy (a fraction) and the run's total seconds last."""
    runs = []
    for line in log.read_text(errors="replace").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[1] == "eval":
            runs.append((100.0 * float(cells[5]), float(cells[6])))
    return runs


def _row(name: str, accs: list[float], times: list[float], bar: float | None) -> str:
    std = statistics.stdev(accs) if len(accs) > 1 else 0.0
    below = "-" if bar is None else str(sum(a < bar for a in accs))
    return (f"| {name} | {len(accs)} | {statistics.fmean(accs):.2f} | {std:.2f} | {min(accs):.2f} | {below} | "
            f"{statistics.fmean(times):.3f} | {max(times):.3f} |")


def _with_eval(r: dict) -> float:
    """A run's train time plus its last epoch's evaluation: airbench94's clock covers both."""
    return r["train_time"] + (r["epochs"][-1]["test_time"] if r["epochs"] else 0.0)


def race(root: Path, airbench_log: Path, bar: float | None) -> tuple[list[str], list[str]]:
    presets: dict[str, list[dict]] = {}
    for results in load_runs(root).values():
        for r in results:
            presets.setdefault(r["_config"].get("preset", "?"), []).append(r)
    ab = airbench_runs(airbench_log) if airbench_log.is_file() else []
    problems = [] if ab else [f"no airbench94 runs in {airbench_log}"]
    source = "given"
    if bar is None and presets.get("resnet9"):
        bar, source = statistics.fmean(r["test_acc"] for r in presets["resnet9"]), "the resnet9 mean in this call"
    lines = ["bar: none (no --bar, no resnet9 runs)" if bar is None else f"bar: {bar:.2f}% ({source})", "",
             "| trainer | runs | acc mean % | std | min | below bar | time mean s | time max s |",
             "|---|---|---|---|---|---|---|---|"]
    for preset, results in sorted(presets.items()):
        accs = [r["test_acc"] for r in results]
        lines.append(_row(f"fastcifar {preset}", accs, [r["train_time"] for r in results], bar))
        lines.append(_row(f"fastcifar {preset} + eval", accs, [_with_eval(r) for r in results], bar))
    if ab:
        lines.append(_row("airbench94 (train + eval)", [a for a, _ in ab], [t for _, t in ab], bar))
    if len(ab) > 1:  # its first run pays cuDNN's autotuning, which fastcifar does in untimed warm-up
        lines.append(_row("airbench94 runs 2-N (1 = its warm-up)", [a for a, _ in ab[1:]], [t for _, t in ab[1:]], bar))
    contenders = {p: rs for p, rs in sorted(presets.items()) if p != "resnet9"}  # resnet9 sets the bar
    for preset, results in contenders.items():  # without airbench94 runs there is no ratio to print
        train = statistics.fmean(r["train_time"] for r in results)
        with_eval = statistics.fmean(_with_eval(r) for r in results)
        for what, runs in (("all runs", ab), ("runs 2-N", ab[1:])):
            if runs:
                ab_mean = statistics.fmean(t for _, t in runs)
                lines.append(f"\nratio of mean times, fastcifar {preset} / airbench94 {what}: {train / ab_mean:.3f} "
                             f"(train only), {with_eval / ab_mean:.3f} (+ eval, as airbench94 counts)")
    if not presets:
        problems.append(f"no summary.json under {root}")
    elif not contenders:
        problems.append(f"no contender under {root}: only the bar (resnet9) ran")
    return lines, problems


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("engines", "accuracy", "race"))
    p.add_argument("roots", nargs="+", type=Path)
    p.add_argument("--out", type=Path, help="also write the table here")
    p.add_argument("--tol", type=float, default=0.05, help="graphed vs eager final train loss, relative")
    p.add_argument("--airbench-log", type=Path, help="race: airbench94's printed output")
    p.add_argument("--bar", type=float, help="race: the accuracy bar in %% (default: this call's resnet9 mean)")
    args = p.parse_args(argv)
    if args.what == "engines":
        lines, problems = engines(args.roots[0], args.tol)
    elif args.what == "race":
        if args.airbench_log is None:
            p.error("race needs --airbench-log")
        lines, problems = race(args.roots[0], args.airbench_log, args.bar)
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
