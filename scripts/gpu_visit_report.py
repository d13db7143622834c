"""Tables and checks over the trainer's summary.json files that a gpu_visit.sh stage left behind.

    python scripts/gpu_visit_report.py engines RUNS_DIR [--out FIGURES.md]
    python scripts/gpu_visit_report.py accuracy RUNS_DIR... [--out FIGURES.md]
    python scripts/gpu_visit_report.py emulated RUNS_DIR... [--data PATH] [--jsonl FILE] [--call NAME]
                                       [--commit C] [--out FIGURES.md]

``engines``: one row per engine combination (the folder name under RUNS_DIR: k-KERNELS-g-GRAPHS,
nccl-1rank, dali-g-GRAPHS), its per-epoch train loss, final test accuracy and train time; fails
(exit 1) when a run's loss did not fall from its first epoch to its last, or when the graphed and
eager runs of the same kernels end further apart than ``--tol`` (relative train loss; a sanity
bound over whole epochs, where fp16 and cuDNN's algorithm choice already make eager runs differ:
step-level equality is tests/unit/test_graphs_cuda.py's job), and when the nccl-1rank run formed no
process group (its engine line names no comm: its buckets and collectives never ran). ``accuracy``: every run found under the
folders (several stages' chunks may be combined), with mean, std and min of the test accuracy.
``emulated``: the runs of ``--emulate-ranks N`` (issue 46: the N-GPU recipe's accuracy, measured on
one device), one set per preset and N: mean, std, min, runs below 94% and the one-sided p of "mean
> 94%" (scripts/race.py's figures), and one row per set appended to ``--jsonl``
(bench/results/multi_gpu.jsonl). The race's report is scripts/race.py.
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


def emulated(roots: list[Path], data: Path | None = None, call: str = "", commit: str = "",
             today: str | None = None) -> tuple[list[str], list[dict], list[str]]:
    """(table lines, jsonl rows, problems): one set per (preset, emulated ranks) found under the
    folders. The device, versions and data come from the runs' own summary.json (what ran them);
    the times are one device running every rank's share, not an N-GPU time."""
    import datetime as dt

    from race import BAR, data_name, summarize
    sets: dict[tuple[str, int], list[dict]] = {}
    docs: dict[tuple[str, int], dict] = {}
    for root in roots:
        for path in sorted(root.glob("**/summary.json")):
            doc = json.loads(path.read_text())
            config = doc.get("config", {})
            key = (config.get("preset", "?"), int(config.get("emulate_ranks", 1)))
            sets.setdefault(key, []).extend(doc.get("results", []))
            docs.setdefault(key, doc)
    lines = [f"emulated ranks (--emulate-ranks): accuracy on one device, bar {BAR:.1f}%", "",
             "| preset | ranks | per-rank batch | runs | acc mean ± std (min) | below bar | p | device |",
             "|---|---|---|---|---|---|---|---|"]
    rows, problems = [], []
    for (preset, ranks), results in sorted(sets.items()):
        if not results:
            problems.append(f"{preset} at {ranks} emulated ranks: no finished run")
            continue
        doc = docs[(preset, ranks)]
        versions = doc.get("versions", {})
        s = summarize([r["test_acc"] for r in results], [r["train_time"] for r in results], BAR)
        batch = doc.get("config", {}).get("batch_size", 0)
        row = {"call": call, "date": today or dt.date.today().isoformat(),
               "device": doc.get("device", {}).get("name"), "torch": versions.get("torch"),
               "triton": versions.get("triton"), "commit": commit or None,
               "data": data_name(data) if data else doc.get("data"), "preset": preset, "emulated": ranks > 1,
               "ranks": ranks, "per_rank_batch": batch // ranks, **s,
               "seeds": sorted(r["seed"] for r in results),
               "time": "one device running every rank's share of each step: not an N-GPU time"}
        rows.append(row)
        lines.append(f"| {preset} | {ranks} | {row['per_rank_batch']} | {s['runs']} | {s['acc_mean']:.2f} ± "
                     f"{s['acc_std']:.2f} ({s['acc_min']:.2f}) | {s['below_bar']} | "
                     f"{'-' if s['p_value'] is None else format(s['p_value'], '.2g')} | {row['device']} |")
        if s["runs"] < 10:
            lines.append(f"\nnote: {preset} at {ranks} ranks has {s['runs']} runs; issue 46 asks for at least 10")
    if not sets:
        problems.append(f"no summary.json under {', '.join(map(str, roots))}")
    return lines, rows, problems


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("engines", "accuracy", "emulated"))
    p.add_argument("roots", nargs="+", type=Path)
    p.add_argument("--out", type=Path, help="also write the table here")
    p.add_argument("--tol", type=float, default=0.05, help="graphed vs eager final train loss, relative")
    p.add_argument("--data", type=Path, help="emulated: the data set the runs read (names it in the rows)")
    p.add_argument("--jsonl", type=Path, help="emulated: append one row per set here")
    p.add_argument("--call", default="", help="emulated: names this call in the rows")
    p.add_argument("--commit", default="", help="emulated: the project's commit (the GPU machine's copy has no .git)")
    args = p.parse_args(argv)
    rows = []
    if args.what == "engines":
        lines, problems = engines(args.roots[0], args.tol)
    elif args.what == "accuracy":
        lines, problems = accuracy(args.roots)
    else:
        lines, rows, problems = emulated(args.roots, args.data, args.call, args.commit)
    text = "\n".join(lines + [f"\nPROBLEM: {m}" for m in problems]) + "\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)
    if args.jsonl and rows:
        with open(args.jsonl, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
