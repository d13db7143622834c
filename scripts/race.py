"""The official-data race: fastcifar beside the public CIFAR-10 speedrun scripts, on one GPU, the
same images, in one call (scripts/gpu_visit.sh race runs it).

    python scripts/race.py prepare SCRIPTS_DIR WORK_DIR --images DIR [--runs N]
    python scripts/race.py variants PRESET -- [FLAGS ...]
    python scripts/race.py levers CANDIDATE [--base PRESET]
    python scripts/race.py report WORK_DIR --fastcifar RUNS_DIR --data PATH [--bar 94]
                                  [--jsonl bench/results/official.jsonl] [--call NAME] [--commit C] [--out MD]

``prepare``: each public script found in SCRIPTS_DIR (an ignored folder: none of their code is the
project's) is checked against the commit the race names (its sha256), copied into WORK_DIR/NAME/
with only the edits the race allows (its run count; the hiverge script's 6e9-cycle sleep between
runs) and a ``cifar10`` link to DIR, where scripts/export_tensors.py wrote ``train.pt`` and
``test.pt`` (the public loaders read those and would otherwise download). A script missing from
SCRIPTS_DIR is skipped with a line; one that differs from the named commit, or whose edits no longer
match exactly once, is refused (exit 2).

``variants PRESET -- [FLAGS ...]``: refuses (exit 2, one line) a variant the screen stage of
scripts/gpu_visit.sh cannot race (``check_variants``), before any run.

``levers CANDIDATE``: the flags of each field where preset CANDIDATE differs from --base (the
default preset), one line each, in field order: each line is one lever alone, the base preset with
that one field changed (gpu_visit.sh's levers stage times each, then all of them together). Exit 2,
one line, when CANDIDATE is not a preset or does not differ from the base.

``report``: every trainer's runs (fastcifar from its summary.json files, each public script from the
log its run printed, WORK_DIR/NAME.log; a cut-off log gives the runs it finished), the statistics
the record scripts are judged by (mean, std, min, runs below the bar, one-sided t-test p-value of
"mean > bar"), each on its own clock, fastcifar's time counted the way each public script counts
(``COUNTED_AS``) and its ratio to each. Prints a table, appends it to --out, and appends one JSON
row per trainer to --jsonl. Exit 1 when fastcifar has no runs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import hashlib
import io
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout, uninstalled

from fastcifar.core.config import ConfigError, from_preset, validate
from fastcifar.core.options import parse_command_line, recipe_flags
from fastcifar.core.presets import DEFAULT_PRESET, PRESETS
from fastcifar.core.stats import p_above

BAR = 94.0  # % official test accuracy, the record scripts' bar


@dataclass(frozen=True)
class Peer:
    """A public script as the race runs it."""

    name: str  # its log is NAME.log; its row's trainer is NAME@COMMIT
    file: str  # the file name in SCRIPTS_DIR
    origin: str  # repository and path it was copied from
    commit: str
    sha256: str  # of the file at that commit: anything else is not the script the row names
    run_count: tuple[str, str]  # (text in the script, the same with {runs} for the race's count)
    other_edits: tuple[tuple[str, str], ...]  # (text, replacement) besides the run count
    clock: str  # what its printed time counts


PEERS = (
    # the current record (its README: 94.02% in 1.98 s on one A100, PR #6); hiverge's own mirror
    # here stops at 5cd49b1 (2.015 s), the fork ljbuturovic/cifar10-speedrun holds 06c6072
    Peer(
        "hiverge",
        "cifar10_speedrun.py",
        "hiverge/cifar10-speedrun:cifar10_speedrun.py",
        "06c60727547042c847d919c5848e807e8119d582",
        "6c5a096876586909412ab78ad359712c16dfd39d67faf8a8c8dfb922c73664f9",
        ("for run in range(200):", "for run in range({runs}):"),
        # about 3.5 s of idle GPU before each run (6e9 cycles at 1.7-1.98 GHz): 25 runs would spend
        # 90 s of a 9-minute call asleep; the sleep is outside its clock
        (("torch.cuda._sleep(int(6000000000))", "pass"),),
        "whitening init through the TTA evaluation (one CUDA-event span); its compile warm-up run off the clock",
    ),
    Peer(
        "airbench94_muon",
        "airbench94_muon.py",
        "KellerJordan/cifar10-airbench:airbench94_muon.py",
        "f1c599c4af24aca803e3e65a6a7e52a502e09d0e",
        "704e29251a5207d8aed8a35adf13f772ff386b90a712aaddc2a28854385b536e",
        ("[main(run, model) for run in range(200)]", "[main(run, model) for run in range({runs})]"),
        (),
        "whitening init, the training epochs and the TTA evaluation; per-epoch evaluations and its "
        "compile warm-up run off the clock",
    ),
    Peer(
        "airbench94",
        "airbench94.py",
        "KellerJordan/cifar10-airbench:legacy/airbench94.py",
        "f1c599c4af24aca803e3e65a6a7e52a502e09d0e",
        "0b155e0ff0e696bc01ae136654ddae88a24cd053cd2b4313d44548c29ed6c91d",
        ("[main(run) for run in range(25)]", "[main(run) for run in range({runs})]"),
        (),
        "whitening init, the training epochs and the TTA evaluation; per-epoch evaluations off the "
        "clock; no warm-up run (its first run pays cuDNN's autotuning)",
    ),
)
PEER_NAMES = tuple(p.name for p in PEERS)


class RaceError(Exception):
    """A one-line reason the race cannot prepare or report."""


# --- statistics -------------------------------------------------------------------------------


def summarize(accs: list[float], times: list[float], bar: float = BAR) -> dict:
    """The figures the race reports for one trainer: accuracy in %, times in s."""
    return {
        "runs": len(accs),
        "acc_mean": statistics.fmean(accs),
        "acc_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
        "acc_min": min(accs),
        "below_bar": sum(a < bar for a in accs),
        "p_value": p_above(accs, bar),
        "time_mean_s": statistics.fmean(times),
        "time_max_s": max(times),
    }


# --- the runs ---------------------------------------------------------------------------------


def parse_peer_log(text: str) -> list[tuple[float, float]]:
    """(TTA test accuracy %, seconds) per run, in order, from a public script's printed table.

    All three print rows "| run | epoch | ... | tta_val_acc | <time> |" under a header naming the
    columns; a run's last row has "eval" in the epoch column, its TTA accuracy (a fraction) and the
    run's clocked seconds. The run column is filled on a run's first row only (hiverge: on its one
    row), so the run a row belongs to is the last one named; the compile warm-up run ("warmup") is
    left out. A half-printed last row (a cut-off run) is skipped."""
    runs, columns, current = [], None, None
    for line in text.splitlines():  # hiverge's progress line ends in "\r": splitlines splits there too
        line = line.strip()
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if "epoch" in cells and "tta_val_acc" in cells:
            columns = {name: i for i, name in enumerate(cells)}
            time_col = next(i for name, i in columns.items() if name.endswith("time_seconds"))
            continue
        if columns is None or len(cells) != len(columns):
            continue
        if cells[columns["run"]]:
            current = cells[columns["run"]]
        if cells[columns["epoch"]] != "eval" or current == "warmup":
            continue
        try:
            runs.append((100.0 * float(cells[columns["tta_val_acc"]]), float(cells[time_col])))
        except ValueError:
            continue
    return runs


def fastcifar_runs(root: Path) -> dict[str, list[dict]]:
    """{contender: [result dicts]} from every summary.json under ``root``. A contender is a preset
    and the flags that made its recipe differ from the preset's ("fast-muon320 --epochs 7",
    "fast-muon320 --fused-conv"): gpu_visit.sh's conv and screen stages race variants of one preset."""
    found: dict[str, list[dict]] = {}
    for path in sorted(root.glob("**/summary.json")):
        doc = json.loads(path.read_text())
        config = doc.get("config", {})
        preset = config.get("preset", "?")
        name = " ".join([preset, *(recipe_flags(config) if preset in PRESETS else [])])
        for result in doc.get("results", []):
            found.setdefault(name, []).append(result)
    return found


FASTCIFAR_CLOCK = (
    "train clock: per-epoch training summed, whitening init on it, per-epoch evaluations, "
    "warm-up and graph capture off it (run.report.TIMING_PROTOCOL)"
)


def with_final_evaluation(result: dict) -> float:
    """A fastcifar run's train clock plus its last epoch's evaluation (TTA, the whole test set):
    from the whitening init through the TTA evaluation, the span every public script here clocks.
    The evaluation's span also holds the host-side loss sum (a few microseconds), so it errs long."""
    return result["train_time"] + (result["epochs"][-1]["test_time"] if result["epochs"] else 0.0)


# How each public script counts, applied to a fastcifar run. All three clock the whitening init,
# the training steps and the final TTA evaluation, and none its warm-up/compile or per-epoch
# evaluations: the same span, named per script so a script that counts otherwise gets its own.
COUNTED_AS = {name: with_final_evaluation for name in PEER_NAMES}
COUNTED_CLOCK = (
    "whitening init through the final TTA evaluation; per-epoch evaluations, warm-up and capture off the clock"
)


# --- variants ---------------------------------------------------------------------------------

STAGE_SETS = ("seed", "runs", "data", "out_dir")  # gpu_visit.sh's contender() gives every run these


def check_variants(preset: str, variants: list[str]) -> None:
    """Each variant (flags added to ``preset``, split on blanks as bash's ``read -ra`` splits them
    for the run) parses and validates, sets nothing the stage sets, and changes the recipe, each its
    own way: the report pools a contender's runs by its recipe's name (``fastcifar_runs``), so a
    variant that is the preset, or another variant, would mix two sets. RaceError on the first that
    does not."""
    seen: dict[str, str] = {}
    for flags in variants:
        words = flags.split()
        said = io.StringIO()  # the parser's own one line, "fastcifar: error: ..."
        try:
            with contextlib.redirect_stderr(said):
                cfg, given = parse_command_line(["--preset", preset, *words])
                validate(cfg)
        except SystemExit:
            raise RaceError(
                f"variant {flags!r} refused: {said.getvalue().strip().removeprefix('fastcifar: error: ')}"
            ) from None
        except ConfigError as exc:
            raise RaceError(f"variant {flags!r} refused: {exc}") from None
        own = [k for k in given if k in STAGE_SETS]
        own += ["preset"] * any(w == "--preset" or w.startswith("--preset=") for w in words)
        if own:
            raise RaceError(f"variant {flags!r} refused: the stage sets --{own[0].replace('_', '-')} itself")
        name = " ".join(recipe_flags(dataclasses.asdict(cfg)))
        if not name:
            raise RaceError(
                f"variant {flags!r} refused: it trains the {preset} recipe itself: its runs would join the default's"
            )
        if name in seen:
            raise RaceError(f"variant {flags!r} refused: it trains the same recipe as {seen[name]!r}")
        seen[name] = flags


def lever_variants(candidate: str, base: str = DEFAULT_PRESET) -> list[str]:
    """Each field where preset ``candidate`` differs from preset ``base``, as the flags that make
    ``base`` take that field's value alone (``recipe_flags`` over the base: a candidate's epochs
    keep the base's warm-up fraction, as on the command line), in field order. Read from
    ``fastcifar.core.presets`` at each call, so a field added to the candidate is a lever at once.
    RaceError when either is not a preset, or they train the same recipe."""
    for name in (candidate, base):
        if name not in PRESETS:
            raise RaceError(f"no preset {name!r} (presets: {', '.join(PRESETS)})")
    flags = recipe_flags({**dataclasses.asdict(from_preset(candidate)), "preset": base})
    if not flags:
        raise RaceError(f"preset {candidate!r} trains the {base} recipe itself: no lever to time")
    return flags


# --- prepare ----------------------------------------------------------------------------------


def edited(peer: Peer, source: str, runs: int) -> str:
    """The script with the race's edits; each must match exactly once."""
    text = source
    for old, new in (peer.run_count, *peer.other_edits):
        count = text.count(old)
        if count != 1:
            raise RaceError(f"{peer.file}: expected {old!r} once, found it {count} times")
        text = text.replace(old, new.format(runs=runs))
    return text


def prepare(scripts: Path, work: Path, images: Path, runs: int, log=print) -> list[str]:
    """Copy and edit every public script present; return the names prepared."""
    for name in ("train.pt", "test.pt"):
        if not (images / name).is_file():
            raise RaceError(f"{images}: no {name} (scripts/export_tensors.py writes it)")
    ready = []
    for peer in PEERS:
        src = scripts / peer.file
        if not src.is_file():
            log(f"{peer.name}: no {src}, not raced (a copy of {peer.origin} at {peer.commit[:7]})")
            continue
        raw = src.read_bytes()
        digest = hashlib.sha256(raw).hexdigest()
        if digest != peer.sha256:
            raise RaceError(f"{src}: sha256 {digest[:12]}... is not {peer.origin} at {peer.commit[:7]}")
        folder = work / peer.name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / peer.file).write_text(edited(peer, raw.decode(), runs))
        link = folder / "cifar10"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(images.resolve(), target_is_directory=True)
        ready.append(peer.name)
        log(f"{peer.name}: {folder / peer.file} ({peer.origin}@{peer.commit[:7]}, {runs} runs)")
    return ready


# --- report -----------------------------------------------------------------------------------


def data_name(path: Path) -> str:
    """ "cifar10-official" for the official CIFAR-10 release (its lossless batch files), else what it is."""
    from fastcifar.data.official import CIFAR10, set_of_folder

    if path.is_dir() and set_of_folder(path) == CIFAR10:
        return "cifar10-official"
    return f"other:{path.name}"


def environment() -> dict:
    """The machine the figures come from: GPU name and driver, torch and triton versions."""
    import torch

    from fastcifar.run.report import gpu_identity, versions

    device, driver = gpu_identity(torch.device("cuda")) if torch.cuda.is_available() else ("cpu", None)
    v = versions()
    return {"device": device, "driver": driver, "torch": v["torch"], "triton": v["triton"]}


def _fmt_p(p: float | None) -> str:
    return "-" if p is None else f"{p:.2g}"


def report(
    work: Path,
    fastcifar: Path,
    data: Path,
    bar: float = BAR,
    call: str = "",
    commit: str = "",
    env: dict | None = None,
    today: str | None = None,
) -> tuple[list[str], list[dict], list[str]]:
    """(table lines, jsonl rows, problems) for one call's race."""
    env = env or environment()
    base = {
        "call": call,
        "date": today or dt.date.today().isoformat(),
        **env,
        "commit": commit or None,
        "data": data_name(data),
    }
    rows, problems = [], []
    peers = {}
    for peer in PEERS:
        log = work / f"{peer.name}.log"
        runs = parse_peer_log(log.read_text(errors="replace")) if log.is_file() else []
        if runs:
            peers[peer.name] = runs
        elif log.is_file():
            problems.append(f"{peer.name}: no finished run in {log}")
    contenders = fastcifar_runs(fastcifar)
    if not contenders:
        problems.append(f"no fastcifar summary.json under {fastcifar}")
    lines = [
        f"official-data race, bar {bar:.1f}%, data {base['data']}, {env['device']} (driver {env['driver']}), "
        f"torch {env['torch']}, triton {env['triton']}",
        "",
        "| trainer | runs | acc mean ± std (min) | below bar | p | time mean (max) s | clock |",
        "|---|---|---|---|---|---|---|",
    ]

    def add(trainer: str, accs: list[float], times: list[float], clock: str, **extra) -> dict:
        s = summarize(accs, times, bar)
        rows.append({**base, "trainer": trainer, **s, "clock": clock, **extra})
        lines.append(
            f"| {trainer} | {s['runs']} | {s['acc_mean']:.2f} ± {s['acc_std']:.2f} ({s['acc_min']:.2f}) | "
            f"{s['below_bar']} | {_fmt_p(s['p_value'])} | {s['time_mean_s']:.3f} ({s['time_max_s']:.3f}) | "
            f"{clock.split(';')[0]} |"
        )
        return s

    peer_means = {name: statistics.fmean(t for _, t in runs) for name, runs in peers.items()}
    mine = {}  # {contender: {peer: fastcifar's mean time counted as that peer counts}}
    plain = {}  # {preset: its summary}, for the variants of it raced beside it
    variants = []
    # sorted, a preset comes before its variants ("fast-muon320" < "fast-muon320 --epochs 7")
    for contender, results in sorted(contenders.items()):
        accs = [r["test_acc"] for r in results]
        own = [r["train_time"] for r in results]
        times = [with_final_evaluation(r) for r in results]
        mine[contender] = {peer: statistics.fmean(COUNTED_AS[peer](r) for r in results) for peer in peers}
        # set-up before the clock (older summaries lack it): the first run's is the one a
        # user waits for (Triton's compiles, cuDNN's search), the later ones' find them done
        setup = [r["setup_time"] for r in sorted(results, key=lambda r: r["run"]) if "setup_time" in r]
        preset = contender.split(" ")[0]
        against = {}
        if contender != preset and preset in plain:  # a variant: what it gains and costs beside its preset
            ref = plain[preset]
            against = {
                "variant_of": f"fastcifar:{preset}",
                "time_ratio_to_preset": statistics.fmean(times) / ref["time_mean_s"],
                "acc_diff_to_preset": statistics.fmean(accs) - ref["acc_mean"],
            }
            variants.append((contender, against))
        s = add(
            f"fastcifar:{contender}",
            accs,
            times,
            COUNTED_CLOCK,
            train_clock_mean_s=statistics.fmean(own),
            train_clock_max_s=max(own),
            train_clock=FASTCIFAR_CLOCK,
            setup_first_s=setup[0] if setup else None,
            setup_mean_s=statistics.fmean(setup) if setup else None,
            **against,
        )
        if contender == preset:
            plain[preset] = s
    for peer in PEERS:
        if peer.name not in peers:
            continue
        accs, times = zip(*peers[peer.name], strict=True)
        ratios = {f"ratio_fastcifar_{p}": m[peer.name] / peer_means[peer.name] for p, m in mine.items()}
        add(f"{peer.name}@{peer.commit[:7]}", list(accs), list(times), peer.clock, **ratios)
    for contender, means in mine.items():
        for name, mean in means.items():
            lines.append(
                f"\nfastcifar:{contender} / {name}: {mean:.3f} / {peer_means[name]:.3f} s = "
                f"**{mean / peer_means[name]:.3f}** (counted as {name} counts)"
            )
    for contender, against in variants:
        lines.append(
            f"\nfastcifar:{contender} beside {against['variant_of']}: time x{against['time_ratio_to_preset']:.3f}, "
            f"accuracy {against['acc_diff_to_preset']:+.2f} points"
        )
    lines.append(
        f"\nclocks: fastcifar {COUNTED_CLOCK} (own train clock in the jsonl's train_clock_mean_s); "
        + "; ".join(f"{p.name}: {p.clock}" for p in PEERS if p.name in peers)
    )
    return lines, rows, problems


def write_report(lines: list[str], problems: list[str], rows: list[dict], out: Path | None, jsonl: Path | None) -> None:
    """Print the table and its problems, append them to ``out`` and the rows to ``jsonl`` (also
    scripts/gpu_visit_report.py's way of filing its reports)."""
    text = "\n".join(lines + [f"\nPROBLEM: {m}" for m in problems]) + "\n"
    print(text)
    if out:
        with open(out, "a") as f:
            f.write(text)
    if jsonl and rows:
        with open(jsonl, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    sub = p.add_subparsers(dest="what", required=True)
    prep = sub.add_parser("prepare", help="copy the public scripts with the race's edits")
    prep.add_argument("scripts", type=Path, help="the folder holding the public scripts' copies")
    prep.add_argument("work", type=Path, help="where each gets a folder of its own")
    prep.add_argument("--images", type=Path, required=True, help="the folder with train.pt and test.pt")
    prep.add_argument("--runs", type=int, default=25)
    var = sub.add_parser("variants", help="refuse, in one line, a variant of PRESET the screen stage cannot race")
    var.add_argument("preset")
    var.add_argument("variants", nargs="*", help="each variant's flags, one argument each, after --")
    lev = sub.add_parser("levers", help="the flags of each field where CANDIDATE differs from the base preset")
    lev.add_argument("candidate")
    lev.add_argument("--base", default=DEFAULT_PRESET, help="the preset each lever is added to (the default)")
    rep = sub.add_parser("report", help="the race's table and jsonl rows")
    rep.add_argument("work", type=Path, help="the folder holding each public script's NAME.log")
    rep.add_argument("--fastcifar", type=Path, required=True, help="the fastcifar runs' out-dirs, under one folder")
    rep.add_argument("--data", type=Path, required=True, help="the data set every trainer read")
    rep.add_argument("--bar", type=float, default=BAR)
    rep.add_argument("--jsonl", type=Path, help="append one row per trainer here")
    rep.add_argument("--call", default="", help="names this call in the rows")
    rep.add_argument("--commit", default="", help="the project's commit (the GPU machine's copy has no .git)")
    rep.add_argument("--out", type=Path, help="also append the table here")
    args = p.parse_args(argv)
    try:
        if args.what == "prepare":
            if args.runs < 1:
                raise RaceError(f"--runs {args.runs}: at least 1")
            prepare(args.scripts, args.work, args.images, args.runs)
            return 0
        if args.what == "variants":
            check_variants(args.preset, args.variants)
            return 0
        if args.what == "levers":
            print("\n".join(lever_variants(args.candidate, args.base)))
            return 0
        lines, rows, problems = report(args.work, args.fastcifar, args.data, args.bar, args.call, args.commit)
    except (RaceError, OSError) as exc:
        print(f"race: {exc}", file=sys.stderr)
        return 2
    write_report(lines, problems, rows, args.out, args.jsonl)
    return 1 if not any(r["trainer"].startswith("fastcifar:") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
