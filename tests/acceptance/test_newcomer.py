"""A newcomer's first day: --val-split, the target verdict of a toy run,
the CPU warning, the skip messages, the README's commands. --resume alone: tests/cli/test_resume.py."""

from __future__ import annotations

import json
import re

import forkserver
import numpy as np
import pytest
import torch
from cli import ROOT, TINY, run_dirs, run_train, torchrun
from conftest import make_images, one_line_error

from fastcifar.core.config import from_preset, full_recipe
from fastcifar.core.presets import DEFAULT_PRESET
from fastcifar.data import DataError
from fastcifar.data.dataset import Dataset, for_run
from fastcifar.run import report
from fastcifar.train import main as train_main


@pytest.fixture
def data(resume_data):
    """The data of ``uninterrupted`` (tests/conftest.py: one run, shared with the resume tests)."""
    return resume_data


# --- item 7: --val-split, --subset's test set, the target verdict ---------------------------------


def test_val_split_logs_and_summary_name_the_set(uninterrupted):
    out, summary = uninterrupted["stdout"], uninterrupted["summary"]
    assert re.search(r"^ run epoch .* val_acc ", out, re.M) and not re.search(r"^ run epoch .* test_acc ", out, re.M)
    assert "40 validation" in out and "evaluated once after the last epoch" in out
    assert summary["epoch_eval_set"] == "validation"
    result = summary["results"][0]
    assert "val_acc" in result and all("val_acc" in e and "test_acc" not in e for e in result["epochs"])
    assert result["val_acc"] == result["epochs"][-1]["val_acc"]
    assert f"run 1: test_acc {result['test_acc']:.2f}%" in out
    tsv = (uninterrupted["dir"] / "timing_log.tsv").read_text().splitlines()[0].split("\t")
    assert "val_acc" in tsv and "test_acc" not in tsv


@pytest.mark.slow  # over 2 s on 2 cores
def test_no_val_split_is_todays_log(data, tmp_path):
    out = tmp_path / "runs"
    proc = run_train(["--data", data, "--out-dir", out, *TINY, "--epochs", "1"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dirs(out)[0] / "summary.json").read_text())
    assert summary["epoch_eval_set"] == "test" and "val_acc" not in summary["results"][0]
    assert summary["results"][0]["test_acc"] == summary["results"][0]["epochs"][-1]["test_acc"]
    assert re.search(r"^ run epoch .* test_acc ", proc.stdout, re.M) and "evaluated once" not in proc.stdout
    assert "target 94.00% applies to the full preset on the full data" in proc.stdout
    assert "missed" not in proc.stdout


def _dataset(n_train=200, n_test=300):
    x, y = make_images(n_train, seed=1)
    tx, ty = make_images(n_test, seed=2)
    return Dataset(x, y, tx, ty, tuple(f"c{i}" for i in range(10)), "synthetic")


def test_hold_out_is_fixed_disjoint_and_before_sharding():
    ds = _dataset()
    rest, vx, vy = ds.hold_out(30)
    again = ds.hold_out(30)
    assert len(vy) == 30 and len(rest.train_labels) == 170
    assert np.array_equal(vx, again[1]) and np.array_equal(rest.train_images, again[0].train_images)
    seen = {img.tobytes() for img in rest.train_images}
    assert not any(img.tobytes() in seen for img in vx)
    assert rest.test_images is ds.test_images
    assert ds.hold_out(0)[0] is ds
    with pytest.raises(DataError, match="--val-split 200 leaves no training images"):
        ds.hold_out(200)


def test_subset_says_when_it_cuts_the_test_set():
    ds = _dataset()
    cut, _, _, notes = for_run(ds, 100, 0)
    assert len(cut.test_labels) == 150
    assert notes == [
        "--subset 100: the test set is cut to the same fraction, 150 of 300 images "
        "(its accuracy is noisier than the full set's)"
    ]
    assert for_run(ds, 0, 0)[3] == []


def test_the_target_verdict_only_for_a_full_recipe():
    full = from_preset(DEFAULT_PRESET)
    assert full_recipe(full) and full_recipe(from_preset("resnet9", epochs=30, lr=0.5))
    assert report.target_note(full, 93.0, 94.0) == "target 94.00%: missed"
    assert report.target_note(full, 94.5, 94.0) == "target 94.00%: reached"
    for toy in (
        from_preset(DEFAULT_PRESET, subset=5000),
        from_preset(DEFAULT_PRESET, epochs=2),
        from_preset(DEFAULT_PRESET, widths=(32, 64, 64)),
        from_preset(DEFAULT_PRESET, val_split=5000),
    ):
        assert not full_recipe(toy)
        assert report.target_note(toy, 10.0, 94.0) == "target 94.00% applies to the full preset on the full data"


def test_val_split_must_not_be_negative(capsys):
    assert train_main(["--val-split", "-1", "--data", "nowhere"]) == 2
    assert "--val-split must not be negative" in one_line_error(capsys.readouterr().err)


# --- item 4: the full preset on a CPU --------------------------------------------------------------


@pytest.mark.slow  # over 2 s on 2 cores
def test_cpu_warning_before_a_full_preset_on_the_cpu(tmp_path):
    assert "takes hours" in report.cpu_note(from_preset(DEFAULT_PRESET), torch.device("cpu"))
    assert report.cpu_note(from_preset(DEFAULT_PRESET, subset=5000), torch.device("cpu")) == ""
    assert report.cpu_note(from_preset(DEFAULT_PRESET), torch.device("cuda")) == ""
    # on the command line: the warning comes first, then (here) the data error, and no refusal of the CPU
    proc = run_train(["--device", "cpu", "--data", tmp_path / "none", "--out-dir", tmp_path / "runs"])
    assert proc.returncode == 2
    warnings = [line for line in proc.stdout.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "README" in warnings[0] and "CPU" in warnings[0]
    one_line_error(proc.stderr)


# --- item 9 and item 1: skip messages, the README -------------------------------------------------


def test_skip_reasons_name_no_path_outside_the_repository():
    """A skip reason built from a path (f"{SOME_PATH} ...") would print the machine's folders."""
    for path in (ROOT / "tests").rglob("*.py"):
        for m in re.finditer(r"reason=f?\"([^\"]*)\"", path.read_text()):
            text = m.group(1)
            assert not re.search(r"\{[A-Z_]*(PATH|TAR|JPEG|DIR|ROOT)[A-Z_]*\}", text), f"{path.name}: {text}"
            assert "/work" not in text and "/home" not in text, f"{path.name}: {text}"


def test_readme_runs_the_tests_with_python_m_pytest():
    readme = (ROOT / "README.md").read_text()
    assert "python -m pytest" in readme
    for link in re.findall(r"\]\(((?:docs|bench)/[^)#]+)\)", readme):
        assert (ROOT / link).exists(), f"README links to {link}, which is missing"


def test_busy_cpu_gets_advice_only_when_omp_num_threads_is_unset(monkeypatch):
    """A busy CPU gets a line advising OMP_NUM_THREADS=1; the thread count itself never changes
    (it can change a CPU run's sums, and runs must reproduce whatever the machine's load)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        monkeypatch.setattr("os.getloadavg", lambda: (3.0, 3.0, 3.0))
        assert report.cpu_threads_note(torch.device("cpu")) == ""
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert report.cpu_threads_note(torch.device("cuda")) == ""
        monkeypatch.setattr("os.getloadavg", lambda: (0.1, 0.1, 0.1))
        assert report.cpu_threads_note(torch.device("cpu")) == ""
        monkeypatch.setattr("os.getloadavg", lambda: (3.0, 3.0, 3.0))
        note = report.cpu_threads_note(torch.device("cpu"))
        assert note.startswith("note: load average 3.0 on 2 cores") and "OMP_NUM_THREADS=1" in note
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow  # over 2 s on 2 cores
def test_cpu_threads_bench_smoke_writes_nothing(data):
    import sys

    from cli import bench_results, env

    before = bench_results()
    proc = forkserver.run(
        [
            sys.executable,
            str(ROOT / "bench" / "bench_cpu_threads.py"),
            "--smoke",
            "--data",
            str(data),
            "--epochs",
            "1",
            "--threads",
            "1",
        ],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| omp_num_threads | torch_threads | epoch_s_mean |" in proc.stdout and "nothing written" in proc.stdout
    assert bench_results() == before


@pytest.mark.slow
def test_val_split_on_two_ranks_reports_the_test_set_figure(data, tmp_path, capsys):
    """gloo, 2 ranks: the same held-out images on both (taken before sharding), each rank evaluates
    its slice; the run's final test_acc is the whole test set's, as `evaluate` finds it again."""

    from fastcifar.evaluate import main as evaluate_main

    out = tmp_path / "runs"
    proc = run_train(
        ["--data", data, "--out-dir", out, *TINY, "--batch-size", "40", "--epochs", "1", "--val-split", "40"],
        launcher=torchrun(),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "160 train, 40 validation, 50 test images" in proc.stdout
    (run_dir,) = run_dirs(out)
    result = json.loads((run_dir / "summary.json").read_text())["results"][0]
    assert evaluate_main([str(run_dir / "model.safetensors"), "--data", str(data)]) == 0
    assert f"test_acc {result['test_acc']:.2f}%" in capsys.readouterr().out


def test_val_split_below_the_rank_count_is_refused():
    """Each rank evaluates every world_size-th held-out image: fewer than the ranks would leave a
    rank with none (its first evaluation batch would not exist)."""
    from fastcifar.core.config import ConfigError, from_preset, validate

    validate(from_preset("fast", val_split=2), world_size=2)
    with pytest.raises(ConfigError, match="--val-split must be 0 or at least the number of ranks \\(8\\), not 3"):
        validate(from_preset("fast", val_split=3), world_size=8)
