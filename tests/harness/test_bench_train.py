"""bench/bench_train.py end to end on the CPU: two tiny presets side by side, rows, table, plot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import forkserver
import pytest
from broken_imports import break_import
from cli import ROOT, env
from script_modules import load_script

pytestmark = pytest.mark.slow  # trains presets end to end through the benchmark

TINY = [
    "--device",
    "cpu",
    "--batch-size",
    "100",
    "--epochs",
    "2",
    "--warmup-epochs",
    "0.5",
    "--warmup-steps",
    "1",
    "--eval-batch-size",
    "200",
    "--target-acc",
    "50",
    "--tta",  # none: the fast preset's six views of every test image each epoch are not what is tested
    "0",
]


def test_two_presets_side_by_side(learnable_data, tmp_path):
    results = tmp_path / "results" / "train.jsonl"
    cmd = [
        sys.executable,
        "bench/bench_train.py",
        "--preset",
        "fast",
        "--compare",
        "resnet9",
        "--runs",
        "2",
        "--results",
        results,
        "--out-dir",
        tmp_path / "runs",
        "--plot",
        tmp_path / "plot.png",
        "--args-for",
        "fast=--widths 16,32,32 --whiten-images 200",
        "--args-for",
        "resnet9=--widths 8,16,32,64",
        "--",
        "--data",
        learnable_data,
        *TINY,
    ]
    proc = forkserver.run([str(c) for c in cmd], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr

    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["preset"] for r in rows] == ["fast", "resnet9"]
    assert rows[0]["bench"] == rows[1]["bench"]  # one invocation, one id
    for row in rows:
        assert row["device"]["type"] == "cpu" and row["versions"]["torch"] and row["date"] and row["data"]
        assert row["warmup_runs"] == 1 and "train time" in row["timing_protocol"]
        assert [r["seed"] for r in row["runs"]] == [0, 1], "the warm-up run is not among the measured runs"
        assert all(len(r["epoch_test_acc"]) == 2 and r["train_time"] > 0 for r in row["runs"])
        s = row["summary"]
        assert s["runs"] == 2 and s["below_target"] + s["reached"] == 2 and s["train_time_min"] > 0
        assert s["bar"] == pytest.approx(rows[1]["summary"]["acc_mean"])  # resnet9's mean is the bar
    assert rows[0]["config"]["arch"] == "fastnet" and rows[1]["config"]["arch"] == "resnet9"
    assert rows[0]["config"]["widths"] == [16, 32, 32]

    out = proc.stdout
    assert "| preset | runs | acc mean ± std |" in out and "| fast | 2 |" in out and "| resnet9 | 2 |" in out
    last = out.strip().splitlines()[-1]
    assert last == f"plot: {tmp_path / 'plot.png'}" or last.startswith("plot skipped: matplotlib")
    if last.startswith("plot: "):
        assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_the_plot_is_a_notice(monkeypatch, tmp_path):
    bench = load_script("bench/bench_train.py")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    note = bench.plot([{"runs": []}], tmp_path / "p.png", 94.0)
    assert note.startswith("plot skipped: matplotlib is not installed") and not (tmp_path / "p.png").exists()


def test_a_broken_matplotlib_is_a_notice_too(monkeypatch, tmp_path):
    """Installed and failing to import (as a build for another numpy does): the same notice, the reason in it."""
    bench = load_script("bench/bench_train.py")
    break_import("matplotlib", tmp_path / "fake", "module compiled against another ABI", monkeypatch)
    note = bench.plot([{"runs": []}], tmp_path / "p.png", 94.0)
    assert note.startswith("plot skipped: matplotlib cannot be imported (RuntimeError: module compiled against")
    assert "\n" not in note and not (tmp_path / "p.png").exists()


def test_bad_arguments(tmp_path):
    proc = forkserver.run(
        [sys.executable, "bench/bench_train.py", "--args-for", "apple8=--no-tta", "--", "--data", str(tmp_path)],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "not among the presets" in proc.stderr


def test_rows_go_to_the_users_folder_and_the_record_only_when_asked(monkeypatch, tmp_path):
    """A user's rows go to train.jsonl in their --out-dir (runs/bench by default), never into the
    checkout's bench/results/ unless --record asks; --smoke writes nothing and takes neither."""
    bench = load_script("bench/bench_train.py")
    seen = []
    monkeypatch.setattr(bench, "measure", lambda args, passthrough, smoke=False: seen.append(args.results) or 0)
    assert bench.main(["--out-dir", str(tmp_path), "--", "--data", "d"]) == 0
    assert bench.main(["--", "--data", "d"]) == 0
    assert bench.main(["--record", "--", "--data", "d"]) == 0
    assert seen == [str(tmp_path / "train.jsonl"), str(Path("runs/bench/train.jsonl")), str(bench.RECORD)]
    assert bench.RECORD == ROOT / "bench" / "results" / "train.jsonl"
    for argv in (["--record", "--results", "x.jsonl"], ["--smoke", "--record"], ["--smoke", "--results", "x"]):
        with pytest.raises(SystemExit) as exit_:
            bench.main(argv)
        assert exit_.value.code == 2, argv
