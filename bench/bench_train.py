"""Time to accuracy: N runs of a preset in one process, after an untimed warm-up run, side by side
with other presets.

    python bench/bench_train.py --runs 25 --compare fast resnet9 -- --data data   # the default preset first
    torchrun --nproc_per_node 8 bench/bench_train.py --preset apple8 --runs 25 -- --data data
    python bench/bench_train.py --smoke          # two tiny presets on the CPU, made-up data: nothing written

Everything after ``--`` is passed to every preset's trainer command line (``--data``, ``--device``,
any field); ``--args-for "PRESET=FLAGS"`` adds flags for one preset only. Each preset runs as
``fastcifar.train.train`` does, in the order given: one warm-up run that is neither timed nor
reported (cuDNN's algorithm search, the allocator and the GPU clocks settle), then ``--runs``
measured runs with seeds seed, seed+1, ...; the trainer writes its usual logs under ``--out-dir``.

Rank 0 then prints a markdown table (accuracy mean, std, min, runs below the bar; train time mean,
std, median, min, max; the first measured run's wall time, which includes loading and the warm-up
run), appends one row per preset to ``--results`` (JSON lines: date, device, versions, data,
config, the summary, every run's per-epoch test accuracy and train time; by default
``train.jsonl`` in ``--out-dir``, the user's own folder; ``--record`` appends to the project's
record, ``bench/results/train.jsonl``, instead), and draws ``--plot``:
accuracy against train time per run, and test accuracy per epoch against train time. The plot
needs matplotlib (``pip install 'fastcifar[plot]'``); without it the data is still written and one
line says the plot was skipped.

The bar: ``--target-acc`` (94.0 by default, official CIFAR-10). On other data (the shared JPEG
copy) the bar is the `resnet9` preset's mean on that data: with ``--bar-preset resnet9`` (the
default whenever resnet9 is among the presets) each preset's table row also counts its runs
below that mean.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastcifar.core import optional
from fastcifar.core.config import Config, ConfigError, validate
from fastcifar.core.options import parse_args
from fastcifar.core.presets import DEFAULT_PRESET, PRESETS
from fastcifar.data import DataError
from fastcifar.parallel import distributed
from fastcifar.run.report import TIMING_PROTOCOL, RunResult, summarize
from fastcifar.train import train


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" in argv:
        split = argv.index("--")
        argv, passthrough = argv[:split], argv[split + 1 :]
    else:
        passthrough = []
    p = argparse.ArgumentParser(
        prog="bench/bench_train.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--preset", default=DEFAULT_PRESET, choices=list(PRESETS), help="the preset under test")
    p.add_argument("--compare", nargs="*", default=[], choices=list(PRESETS), help="presets to run beside it")
    p.add_argument("--runs", type=int, default=25, help="measured runs per preset")
    p.add_argument("--warmup-runs", type=int, default=1, help="untimed, unreported runs before them")
    p.add_argument(
        "--args-for",
        action="append",
        default=[],
        metavar="PRESET=FLAGS",
        help="trainer flags for one preset only, e.g. 'resnet9=--widths 8,16,32,64'",
    )
    p.add_argument(
        "--bar-preset", default=None, help="count runs below this preset's mean (default: resnet9 when it runs)"
    )
    p.add_argument(
        "--results", default=None, help="JSON lines file the rows are appended to (default: train.jsonl in --out-dir)"
    )
    p.add_argument(
        "--record", action="store_true", help=f"append the rows to the project's record, {RECORD.relative_to(ROOT)}"
    )
    p.add_argument("--plot", default=None, help="PNG path (default: beside --results, named by date)")
    p.add_argument("--out-dir", default="runs/bench", help="where the trainer's own logs and the rows go")
    p.add_argument("--smoke", action="store_true", help="two tiny presets on the CPU, made-up data; nothing written")
    args = p.parse_args(argv)
    if args.runs <= 0 or args.warmup_runs < 0:
        p.error("--runs must be positive and --warmup-runs not negative")
    if args.record and args.results is not None:
        p.error("--record appends to the project's record; --results names another file: give one")
    if args.smoke and (args.record or args.results is not None or args.plot is not None):
        p.error("--smoke writes nothing: leave out --record, --results and --plot")
    return args, passthrough


RECORD = ROOT / "bench" / "results" / "train.jsonl"
# --smoke: the whole script on made-up data, two narrowed presets of a few steps, on the CPU
SMOKE_ARGS = ["--device", "cpu", "--batch-size", "100", "--epochs", "1", "--warmup-steps", "1"]
SMOKE_ARGS += ["--eval-batch-size", "100", "--target-acc", "50", "--loader", "torch"]
SMOKE_PRESETS = {"fast": ["--widths", "8,16,16", "--whiten-images", "100"], "resnet9": ["--widths", "8,8,8,8"]}


def run_stats(results: list[RunResult], target: float, bar: float | None) -> dict:
    s = summarize(results, target)
    times = [r.train_time for r in results]
    s.update(
        below_target=s["runs"] - s["reached"],
        train_time_std=statistics.stdev(times) if len(times) > 1 else 0.0,
        train_time_median=statistics.median(times),
        train_time_min=min(times),
        wall_time_first=results[0].wall_time,
    )
    if bar is not None:
        s.update(bar=bar, below_bar=sum(r.test_acc < bar for r in results))
    return s


def table(rows: list[dict]) -> str:
    lines = [
        "| preset | runs | acc mean ± std | acc min | below target | below bar | "
        "train s mean ± std | median | min | max | wall s (1st run) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        s = row["summary"]
        bar = f"{s['below_bar']} (< {s['bar']:.2f})" if "bar" in s else "-"
        lines.append(
            f"| {row['preset']} | {s['runs']} | {s['acc_mean']:.2f} ± {s['acc_std']:.2f} | {s['acc_min']:.2f} | "
            f"{s['below_target']} (< {s['target_acc']:.2f}) | {bar} | "
            f"{s['train_time_mean']:.3f} ± {s['train_time_std']:.3f} | {s['train_time_median']:.3f} | "
            f"{s['train_time_min']:.3f} | {s['train_time_max']:.3f} | {s['wall_time_first']:.1f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, target: float) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install 'fastcifar[plot]'); the data is in the rows"
    except Exception as exc:  # installed and broken (a RuntimeError or OSError of its build): a notice too
        return (
            f"plot skipped: matplotlib cannot be imported ({optional.reason(exc)}; "
            "pip install --force-reinstall matplotlib); the data is in the rows"
        )
    fig, (ax_runs, ax_epochs) = plt.subplots(1, 2, figsize=(12, 4.5))
    for k, row in enumerate(rows):
        colour = f"C{k}"
        runs = row["runs"]
        ax_runs.scatter(
            [r["train_time"] for r in runs],
            [r["test_acc"] for r in runs],
            color=colour,
            s=18,
            label=f"{row['preset']} (n={len(runs)})",
        )
        for n, r in enumerate(runs):
            ax_epochs.plot(
                r["epoch_train_time"],
                r["epoch_test_acc"],
                color=colour,
                alpha=0.35,
                lw=1,
                label=row["preset"] if n == 0 else None,
            )
    for ax in (ax_runs, ax_epochs):
        ax.axhline(target, color="grey", ls="--", lw=1, label=f"target {target:.2f}%")
        ax.set_xlabel("train time (s, summed epochs)")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    ax_runs.set_ylabel("final test accuracy (%)")
    ax_runs.set_title("accuracy vs train time, per run")
    ax_epochs.set_ylabel("test accuracy (%) after each epoch")
    ax_epochs.set_title("test accuracy per epoch")
    device = rows[0]["device"]
    fig.suptitle(
        f"{device['name']} x{device['world_size']} | torch {rows[0]['versions']['torch']} | {rows[0]['date']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"


def bench_row(
    cfg: Config, results: list[RunResult], summary_doc: dict, stamp: str, warmup_runs: int, bar: float | None
) -> dict:
    return {
        "bench": stamp,
        "date": summary_doc["date"],
        "preset": cfg.preset,
        "device": summary_doc["device"],
        "versions": summary_doc["versions"],
        "data": summary_doc["data"],
        "config": dataclasses.asdict(cfg),
        "warmup_runs": warmup_runs,
        "timing_protocol": TIMING_PROTOCOL,
        "summary": run_stats(results, cfg.target_acc, bar),
        "runs": [
            {
                "run": r.run,
                "seed": r.seed,
                "test_acc": r.test_acc,
                "train_time": r.train_time,
                "wall_time": r.wall_time,
                "epoch_test_acc": [e.test_acc for e in r.epochs],
                "epoch_train_time": [e.total_train_time for e in r.epochs],
            }
            for r in results
        ],
    }


def main(argv: list[str] | None = None) -> int:
    args, passthrough = parse(sys.argv[1:] if argv is None else list(argv))
    if args.smoke:
        with tempfile.TemporaryDirectory() as tmp:
            sys.path.insert(0, str(ROOT / "tests"))
            from conftest import write_official

            data, _ = write_official(Path(tmp) / "data", per_batch=40, n_test=100)
            args.preset, args.compare, args.runs, args.warmup_runs = "fast", ["resnet9"], 2, 1
            args.args_for = [f"{name}={shlex.join(flags)}" for name, flags in SMOKE_PRESETS.items()]
            args.out_dir, args.results = tmp, str(Path(tmp) / "train.jsonl")
            code = measure(args, ["--data", str(data), *SMOKE_ARGS], smoke=True)
        print("\nsmoke run: figures meaningless, nothing written")
        return code
    if args.results is None:
        args.results = str(RECORD if args.record else Path(args.out_dir) / "train.jsonl")
    return measure(args, passthrough)


def measure(args: argparse.Namespace, passthrough: list[str], smoke: bool = False) -> int:
    presets = list(dict.fromkeys([args.preset, *args.compare]))
    extra = {}
    for spec in args.args_for:
        name, _, flags = spec.partition("=")
        if name not in presets:
            print(f"bench_train: error: --args-for {name}: not among the presets {presets}", file=sys.stderr)
            return 2
        extra.setdefault(name, []).extend(shlex.split(flags))
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_root = Path(args.out_dir) / stamp
    cfgs = [
        parse_args(
            ["--preset", p, *passthrough, *extra.get(p, []), "--runs", str(args.runs), "--out-dir", str(out_root / p)]
        )
        for p in presets
    ]
    ctx = None
    try:
        ctx = distributed.setup(cfgs[0].device, cfgs[0].dist_timeout_s, settings=cfgs[0])
        for cfg in cfgs:
            validate(cfg, ctx.world_size)
        measured = []
        for cfg in cfgs:
            results = train(cfg, ctx, warmup_runs=args.warmup_runs)
            measured.append((cfg, results))
    except (ConfigError, DataError) as exc:
        print(f"bench_train: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if ctx is not None:
            distributed.teardown(ctx)
    if not ctx.is_main:
        return 0

    bar_preset = args.bar_preset or ("resnet9" if "resnet9" in presets else None)
    means = {cfg.preset: statistics.fmean(r.test_acc for r in res) for cfg, res in measured}
    bar = means.get(bar_preset)
    rows = []
    for cfg, results in measured:
        (run_dir,) = sorted(p for p in (out_root / cfg.preset).iterdir() if p.is_dir())
        doc = json.loads((run_dir / "summary.json").read_text())
        rows.append(bench_row(cfg, results, doc, stamp, args.warmup_runs, bar))

    results_path = Path(args.results)
    results_path.parent.mkdir(parents=True, exist_ok=True)
    with open(results_path, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    device = rows[0]["device"]
    print(
        f"\n{device['type']} {device['name']} x{device['world_size']} | torch {rows[0]['versions']['torch']} | "
        f"{rows[0]['date']} | {rows[0]['data']}"
    )
    print(
        f"{args.warmup_runs} untimed warm-up run(s) per preset before the measured ones; "
        f"bar: {bar_preset + ' mean' if bar is not None else 'none'}\n"
    )
    print(table(rows))
    if not smoke:  # its rows and logs are in a temporary folder, removed
        print(f"\nrows: {results_path}")
        plot_path = Path(args.plot) if args.plot else results_path.with_name(f"train-{stamp}.png")
        print(plot(rows, plot_path, cfgs[0].target_acc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
