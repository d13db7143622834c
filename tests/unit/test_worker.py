"""One sweep worker (fastcifar/sweep/worker.py), in this process: it takes the store's runs one by one,
records a run's own failure with its reason and goes on, puts an interrupted run back, and writes a
trained run's rows as the trainer's own files hold them."""

from __future__ import annotations

import signal

import numpy as np
import pytest
from conftest import write_official

import fastcifar
import fastcifar.api
import fastcifar.train as trainer
from fastcifar.core import signals
from fastcifar.core.config import ConfigError
from fastcifar.sweep import spec as specs
from fastcifar.sweep import store as stores
from fastcifar.sweep import worker
from fastcifar.sweep.store import Table

# no TTA: its six views of every test image were 60% of these runs' CPU time, and the rows do not need them
TINY = {"widths": [16, 32, 32], "epochs": 1, "batch_size": 50, "warmup_steps": 1, "loader": "torch", "tta": 0}


def make_store(tmp_path, data="data", runs=2, **doc):
    spec = specs.parse(
        {"preset": "fast", "seed": 4, "runs": runs, "settings": {"data": str(data), **TINY}, **doc}, "spec.json", "."
    )
    return stores.prepare(str(tmp_path / "store"), spec)


def test_a_runs_own_failure_is_recorded_and_the_worker_goes_on(tmp_path, monkeypatch):
    folder = make_store(tmp_path, runs=3)
    seen = []

    def failing(cfg, reuse=None):
        seen.append(cfg.seed)
        raise ConfigError(f"--data {cfg.data}: no such file or folder\nmore")

    monkeypatch.setattr(fastcifar.api, "train", failing)
    assert worker.work(folder, 0, "cpu", 60) == 3
    assert seen == [4, 5, 6]  # each run once, in order, with its own seed
    rows = Table(folder).rows()
    assert {r["status"] for r in rows} == {"failed"}
    assert rows[0]["reason"] == "ConfigError: --data data: no such file or folder"
    assert worker.work(folder, 1, "cpu", 60) == 0  # not retried


def test_an_interrupted_run_goes_back_to_pending(tmp_path, monkeypatch):
    folder = make_store(tmp_path)

    def interrupted(cfg, reuse=None):
        raise signals.Interrupted(signal.SIGTERM)

    monkeypatch.setattr(fastcifar.api, "train", interrupted)
    with pytest.raises(signals.Interrupted):
        worker.work(folder, 0, "cpu", 60)
    rows = Table(folder).rows()
    assert [(r["status"], r["attempts"], r["worker"]) for r in rows] == [("pending", 0, None)] * 2


def test_a_worker_waits_for_anothers_run_and_takes_it_when_its_lease_runs_out(tmp_path, monkeypatch):
    folder = make_store(tmp_path, runs=1)
    Table(folder).claim("gone", lease_s=0.5)  # a worker that will never finish it
    taken = []

    def failing(cfg, reuse=None):
        taken.append(cfg.seed)
        raise ConfigError("stop")

    monkeypatch.setattr(fastcifar.api, "train", failing)
    monkeypatch.setattr(worker, "IDLE_POLL_S", 0.1)
    assert worker.work(folder, 0, "cpu", 60) == 1 and taken == [4]
    assert Table(folder).rows()[0]["attempts"] == 2


@pytest.mark.slow  # trains three tiny runs on the CPU (about 15 s on 2 cores)
def test_a_trained_runs_rows_are_its_run_folders_outputs(tmp_path, monkeypatch):
    data, arrays = write_official(tmp_path / "data", per_batch=40, n_test=50)
    labels = arrays["test"][1]
    folder = make_store(
        tmp_path,
        data=data,
        keep=["test_margins", "test_logits", "train_margins"],
        subset={"policy": "fraction", "fraction": 0.5},
    )
    calls = []
    for name in ("load_dataset", "make_step"):  # the data read, the engine built: once each
        real = getattr(trainer, name)
        monkeypatch.setattr(trainer, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
    assert worker.work(folder, 0, "cpu", 60) == 2
    assert calls == ["load_dataset", "make_step"]  # the second run: the worker's data and engine
    view = fastcifar.open_store(str(folder))
    assert view.completed.tolist() == [True, True]
    assert [r["first_of_worker"] for r in view.runs] == [1, 0]
    for r in view.runs:
        run_dir = folder / r["run_dir"]
        assert r["status"] == "done" and run_dir.parent == folder / "runs" / str(r["idx"])
        out = run_dir / "outputs"
        np.testing.assert_array_equal(view.masks[r["idx"]], np.load(run_dir / "subset_mask.npy"))
        assert view.masks[r["idx"]].sum() == 100  # half of 200, each run its own draw
        np.testing.assert_array_equal(view.test_logits[r["idx"]], np.load(out / "test_logits.npy"))
        margins = np.load(out / "test_margins.npy").astype(np.float16)
        np.testing.assert_array_equal(view.test_margins[r["idx"]], margins)
        np.testing.assert_array_equal(
            view.train_margins[r["idx"]], np.load(out / "train_margins.npy").astype(np.float16)
        )
        correct = view.test_logits[r["idx"]].argmax(1) == labels  # the files' argmax is the counted prediction
        assert r["test_acc"] == pytest.approx(100 * correct.mean())
    assert not np.array_equal(view.masks[0], view.masks[1])
    # the second run, on the first one's engine, equals the same run trained alone, bit for bit
    spec = stores.read_spec(folder)
    (alone,) = fastcifar.train(spec.config(spec.arms[0], 1, str(tmp_path / "alone"), "cpu"))
    np.testing.assert_array_equal(view.test_logits[1], alone.outputs.test_logits)
    np.testing.assert_array_equal(view.train_margins[1], alone.outputs.train_margins.astype(np.float16))
    assert view.runs[1]["test_acc"] == alone.test_acc


def test_a_store_that_cannot_be_written_stops_the_worker_and_counts_nothing_half_written(tmp_path, monkeypatch):
    folder = make_store(tmp_path, runs=2)
    made = stores.Result(np.ones(30, bool), 10, 50.0, 1.0, 0.5, 2.0, True, "runs/0/x")
    made.test_margins = np.zeros(8, np.float32)
    monkeypatch.setattr(worker, "train_run", lambda *args, **kwargs: made)
    real = np.load

    def full_disk(path, *args, **kwargs):
        if kwargs.get("mmap_mode") == "r+" and str(path).endswith("completed.npy"):
            raise OSError(28, "No space left on device")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(stores.np, "load", full_disk)
    with pytest.raises(ConfigError) as err:
        worker.work(folder, 0, "cpu", 60)
    assert str(err.value) == f"--store {folder}: cannot write run 0's results: No space left on device"
    rows = Table(folder).rows()
    assert [r["status"] for r in rows] == ["pending", "pending"] and rows[0]["attempts"] == 1
    monkeypatch.setattr(stores.np, "load", real)
    assert not fastcifar.open_store(str(folder)).completed.any()  # the rows went in, the flag did not
