"""A study of many runs, as a user runs it (``fastcifar sweep`` in its own process, workers in theirs)
and as it goes wrong: a worker killed in mid-run, two launches on one store, SIGTERM, more workers
than runs. Every test here trains several tiny runs on the CPU, so every one is slow."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import forkserver
import numpy as np
import pytest
from cli import ROOT, env
from conftest import write_official

import fastcifar
from fastcifar.sweep.store import ARRAYS, Table

TINY = {
    "widths": [16, 32, 32],
    "epochs": 1,
    "batch_size": 50,
    "warmup_steps": 1,
    "loader": "torch",
    "eval_batch_size": 100,
    "deterministic": True,
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder, _ = write_official(tmp_path_factory.mktemp("sweepdata") / "data", per_batch=60, n_test=100)
    return folder


def spec_file(folder, data, runs=2, **doc):
    path = folder / "spec.json"
    body = {
        "preset": "fast",
        "seed": 3,
        "runs": runs,
        "keep": ["test_margins", "test_logits", "train_margins"],
        "settings": {"data": str(data), **TINY},
        "axes": {"label_smoothing": [0.0, 0.2]},
        "subset": {"policy": "fraction", "fraction": 0.5},
        **doc,
    }
    path.write_text(json.dumps(body))
    return path


def sweep(*args) -> list[str]:
    return [sys.executable, "-m", "fastcifar", "sweep", *map(str, args)]


def launch(*args) -> subprocess.Popen:
    return subprocess.Popen(
        sweep(*args), cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def launch_logged(log, *args, extra_env=None):
    """A launch whose stderr goes to the file ``log``, forked from the test's server where it can be
    (tests/helpers/forkserver.py; the killing and SIGTERM tests launch real interpreters instead)."""
    with open(log, "w") as err:
        return forkserver.popen(sweep(*args), cwd=ROOT, env={**env(), **(extra_env or {})}, stderr=err)


def run_folders(store) -> dict[int, int]:
    return {int(p.name): len([q for q in p.iterdir() if q.is_dir()]) for p in (store / "runs").iterdir()}


def rows_now(store) -> list[dict]:
    """The store's rows as a poll sees them: none before the launcher has written its table (the
    database file exists a moment before its table does: seen once in a CI-like run, 2026-12-07)."""
    if not (store / "runs.sqlite").exists():
        return []
    try:
        return Table(store).rows()
    except sqlite3.OperationalError as e:
        if "no such table" not in str(e):
            raise
        return []


def wait_for(predicate, timeout=120.0, step=0.2):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError("timed out waiting")


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory):
    """The study run through once, 2 workers: the store every faulted study must equal."""
    folder = tmp_path_factory.mktemp("plain")
    spec = spec_file(folder, data)
    proc = forkserver.run(
        sweep(spec, "--store", folder / "store", "--devices", "cpu", "--per-device", "2"),
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return folder / "store", proc


def assert_same_store(a, b):
    va, vb = fastcifar.open_store(str(a)), fastcifar.open_store(str(b))
    for name in ARRAYS:
        np.testing.assert_array_equal(getattr(va, name), getattr(vb, name), err_msg=name)
    assert [r["test_acc"] for r in va.runs] == [r["test_acc"] for r in vb.runs]


@pytest.mark.slow  # trains 4 tiny runs in 2 worker processes
def test_a_study_from_spec_to_store(uninterrupted):
    store, proc = uninterrupted
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("sweep: 4 runs (2 arms x 2), 4 to go; 2 workers (cpu)")
    assert lines[-1] == "sweep: 4 of 4 runs done, 0 failed, 0 pending"
    assert any(line.startswith("sweep: 4 done, 0 failed of 4;") and "models/h" in line for line in lines)
    view = fastcifar.open_store(str(store))
    assert view.completed.all() and [r["attempts"] for r in view.runs] == [1] * 4
    assert [r["seed"] for r in view.runs] == [3, 3, 4, 4]  # run i of each arm on one seed
    np.testing.assert_array_equal(view.masks[0], view.masks[1])  # ... and so one subset
    assert not np.array_equal(view.masks[0], view.masks[2]) and (view.masks.sum(1) == 150).all()
    assert sorted(r["first_of_worker"] for r in view.runs) == [0, 0, 1, 1]  # 2 workers, 2 runs each
    assert run_folders(store) == {0: 1, 1: 1, 2: 1, 3: 1}
    status = forkserver.run(sweep("status", store), cwd=ROOT, env=env(), capture_output=True, text=True)
    assert status.returncode == 0 and status.stdout.startswith("4/4 done, 0 failed")


@pytest.mark.slow  # trains 5 tiny runs, one of them killed with SIGKILL in mid-run
def test_a_worker_killed_in_mid_run_leaves_the_store_an_uninterrupted_study_makes(data, tmp_path, uninterrupted):
    store = tmp_path / "store"
    proc = launch(spec_file(tmp_path, data), "--store", store, "--devices", "cpu", "--per-device", "2")

    def a_run_under_way():
        rows = [r for r in rows_now(store) if r["status"] == "running" and time.time() - r["started"] > 1.0]
        return rows[0] if rows else None

    row = wait_for(a_run_under_way)
    os.kill(int(row["worker"].split(":")[1]), signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    view = fastcifar.open_store(str(store))
    assert all(r["status"] == "done" for r in view.runs)
    assert [r["attempts"] for r in view.runs] == [2 if r["idx"] == row["idx"] else 1 for r in view.runs]
    assert run_folders(store) == {0: 1, 1: 1, 2: 1, 3: 1}  # the killed attempt's folder is gone
    assert_same_store(store, uninterrupted[0])


@pytest.mark.slow  # two launches of 2 workers each train 4 tiny runs
def test_two_launches_on_one_store_cooperate(data, tmp_path, uninterrupted):
    spec = spec_file(tmp_path, data)
    logs = [tmp_path / f"launch-{i}.err" for i in range(2)]
    procs = [launch_logged(log, spec, "--store", tmp_path / "store", "--devices", "cpu") for log in logs]
    for proc, log in zip(procs, logs, strict=True):
        assert proc.wait(timeout=300) == 0, log.read_text()
    view = fastcifar.open_store(str(tmp_path / "store"))
    assert [(r["status"], r["attempts"]) for r in view.runs] == [("done", 1)] * 4  # each once
    assert run_folders(tmp_path / "store") == {0: 1, 1: 1, 2: 1, 3: 1}
    assert_same_store(tmp_path / "store", uninterrupted[0])


@pytest.mark.slow  # trains tiny runs until SIGTERM, then the rest
def test_sigterm_stops_every_worker_and_the_same_command_finishes_the_study(data, tmp_path, uninterrupted):
    store = tmp_path / "store"
    args = (spec_file(tmp_path, data), "--store", store, "--devices", "cpu", "--per-device", "2")
    proc = launch(*args)

    def both_training():
        running = [r for r in rows_now(store) if r["status"] == "running"]
        return {int(r["worker"].split(":")[1]) for r in running} if len(running) == 2 else None

    workers = wait_for(both_training)
    proc.send_signal(signal.SIGTERM)
    start = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - start < 15
    assert proc.returncode == 143 and err.strip().splitlines()[-1] == "fastcifar: interrupted by SIGTERM"
    for pid in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    view = fastcifar.open_store(str(store))
    assert "running" not in {r["status"] for r in view.runs}
    done = [r["idx"] for r in view.runs if r["status"] == "done"]
    assert view.completed is None or np.flatnonzero(view.completed).tolist() == done
    again = forkserver.run(sweep(*args), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "sweep: 4 runs (2 arms x 2), " in again.stderr
    assert_same_store(store, uninterrupted[0])


@pytest.mark.slow  # trains one tiny run
def test_more_workers_than_runs_and_masks_from_a_file(data, tmp_path):
    masks = np.zeros((3, 300), bool)
    masks[0, ::3] = True
    np.save(tmp_path / "m.npy", masks)
    spec = spec_file(tmp_path, data, runs=1, axes={}, subset={"policy": "masks", "masks": "m.npy"})
    store = tmp_path / "store"
    proc = forkserver.run(
        sweep(spec, "--store", store, "--devices", "cpu", "--per-device", "3"),
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "1 to go; 1 workers (cpu)" in proc.stderr
    view = fastcifar.open_store(str(store))
    np.testing.assert_array_equal(view.masks[0], masks[0])
    assert view.runs[0]["status"] == "done"


@pytest.mark.slow  # four array tasks train 4 tiny runs at once
def test_four_slurm_array_tasks_on_one_folder_cooperate_without_a_database(data, tmp_path, uninterrupted):
    spec = spec_file(tmp_path, data)
    store = tmp_path / "store"
    procs, logs = [], [tmp_path / f"task-{task + 1}.err" for task in range(4)]
    for task, log in enumerate(logs):
        array = {"SLURM_ARRAY_TASK_ID": str(task + 1), "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "1"}
        procs.append(launch_logged(log, spec, "--store", store, "--devices", "cpu", extra_env=array))
    for proc, log in zip(procs, logs, strict=True):
        assert proc.wait(timeout=300) == 0, log.read_text()
        assert "its share finished, 0 left" in log.read_text()
    assert not (store / "runs.sqlite").exists()  # no database while training
    assert sorted(p.name for p in (store / "results").iterdir()) == [f"run-{i}.npz" for i in range(4)]
    status = forkserver.run(sweep("status", store), cwd=ROOT, env=env(), capture_output=True, text=True)
    assert status.returncode == 0 and status.stdout.startswith("4/4 done, 0 failed"), status.stderr
    assert_same_store(store, uninterrupted[0])  # each task trained its own run: the study as one machine's
    again = forkserver.run(
        sweep(spec, "--store", store, "--devices", "cpu", "--worker", "2", "--workers", "4"),
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
    )
    assert again.returncode == 0 and "each of its 1 runs of 4 has its result file" in again.stdout
