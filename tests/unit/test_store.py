"""A study's store (fastcifar/sweep/store.py): the run table's claims, leases and failures, the arrays
written row then flag, growth, a changed spec refused, open_store. No training here: the results
are made up (tests/acceptance/test_sweeps.py trains real runs into stores)."""

from __future__ import annotations

import json
import os
import sqlite3
import threading

import numpy as np
import pytest

import fastcifar
from fastcifar.core.config import ConfigError
from fastcifar.sweep import spec as specs
from fastcifar.sweep import store as stores
from fastcifar.sweep.store import MAX_ATTEMPTS, Result, Table

DOC = {
    "preset": "fast",
    "seed": 10,
    "runs": 3,
    "keep": ["test_margins", "test_logits", "train_margins"],
    "settings": {"data": "data", "widths": [16, 32, 32], "epochs": 1},
    "axes": {"lr": [0.2, 0.4]},
}
N_TRAIN, N_TEST, CLASSES = 40, 12, 10


def spec_of(**changes):
    return specs.parse({**DOC, **changes}, "spec.json", ".")


@pytest.fixture
def folder(tmp_path):
    return stores.prepare(str(tmp_path / "store"), spec_of())


def result(idx: int, n_train=N_TRAIN) -> Result:
    rng = np.random.default_rng(idx)
    return Result(
        mask=rng.random(n_train) < 0.5,
        classes=CLASSES,
        test_acc=50.0 + idx,
        train_time=1.0,
        setup_time=0.5,
        wall_time=2.0,
        first=idx == 0,
        run_dir=f"runs/{idx}/x",
        test_margins=rng.normal(size=N_TEST).astype(np.float32),
        test_logits=rng.normal(size=(N_TEST, CLASSES)).astype(np.float16),
        train_margins=rng.normal(size=n_train).astype(np.float32),
    )


def test_the_table_pairs_run_i_of_every_arm_on_one_seed_and_interleaves_the_arms(folder):
    rows = Table(folder).rows()
    assert [(r["idx"], r["arm"], r["rep"], r["seed"]) for r in rows] == [
        (0, 0, 0, 10), (1, 1, 0, 10), (2, 0, 1, 11), (3, 1, 1, 11), (4, 0, 2, 12), (5, 1, 2, 12),
    ]  # fmt: skip
    assert {r["status"] for r in rows} == {"pending"}
    assert rows[1]["arm_name"] == "lr=0.4"


def test_workers_claiming_at_once_take_every_run_once(folder):
    taken, lock = [], threading.Lock()

    def worker(slot):
        table = Table(folder)
        while (row := table.claim(f"w{slot}", 60)) is not None:
            with lock:
                taken.append(row["idx"])
        table.close()

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(taken) == list(range(6))
    assert {r["status"] for r in Table(folder).rows()} == {"running"}


def test_a_run_whose_lease_ran_out_is_anothers_and_a_run_that_kills_its_workers_fails(folder):
    table = Table(folder)
    first = table.claim("dead", lease_s=-1)  # its worker died: the lease is already over
    assert first["idx"] == 0 and first["attempts"] == 1
    again = table.claim("alive", lease_s=60)
    assert again["idx"] == 0 and again["worker"] == "alive" and again["attempts"] == 2
    assert not table.heartbeat(0, "dead", 60)  # the dead worker's heartbeat no longer holds it
    assert not table.finish(0, "dead", result(0), spec_of().keep)  # nor can it write the run's rows
    assert not (folder / "completed.npy").exists()
    for attempt in range(3, MAX_ATTEMPTS + 1):
        table.con.execute("UPDATE runs SET lease_until=0 WHERE idx=0")
        assert table.claim(f"w{attempt}", 60)["idx"] == 0
    table.con.execute("UPDATE runs SET lease_until=0 WHERE idx=0")
    assert table.claim("next", 60)["idx"] == 1  # not run 0 again: its workers died MAX_ATTEMPTS times
    row = table.rows()[0]
    assert row["status"] == "failed" and f"died {MAX_ATTEMPTS} times" in row["reason"]


def test_an_interrupted_run_is_pending_again_without_counting_an_attempt(folder):
    table = Table(folder)
    assert table.claim("w", 60)["idx"] == 0
    table.release(0, "w")
    row = table.rows()[0]
    assert (row["status"], row["worker"], row["attempts"]) == ("pending", None, 0)
    assert table.claim("w2", 60)["idx"] == 0
    assert table.release_worker("w2") == 1  # the launcher saw w2 die: the attempt counts
    assert (table.rows()[0]["status"], table.rows()[0]["attempts"]) == ("pending", 1)


def test_a_failed_run_keeps_its_reason_and_is_not_given_out_again(folder):
    table = Table(folder)
    table.claim("w", 60)
    table.fail(0, "w", "ConfigError: bad data")
    assert table.claim("w", 60)["idx"] == 1
    assert table.rows()[0]["reason"] == "ConfigError: bad data"
    assert table.counts() == {"pending": 4, "running": 1, "done": 0, "failed": 1}


def test_a_finished_runs_rows_then_its_flag_then_done(folder):
    table = Table(folder)
    for _ in range(2):
        table.claim("w", 60)
    assert table.finish(1, "w", result(1), spec_of().keep)
    view = fastcifar.open_store(str(folder))
    assert view.masks.shape == (6, N_TRAIN) and view.masks.dtype == np.bool_
    assert view.test_logits.shape == (6, N_TEST, CLASSES) and view.test_logits.dtype == np.float16
    assert view.test_margins.dtype == np.float16 and view.train_margins.shape == (6, N_TRAIN)
    assert view.completed.tolist() == [False, True, False, False, False, False]
    r = result(1)
    np.testing.assert_array_equal(view.masks[1], r.mask)
    np.testing.assert_array_equal(view.test_margins[1], r.test_margins.astype(np.float16))
    np.testing.assert_array_equal(view.test_logits[1], r.test_logits)
    np.testing.assert_array_equal(view.train_margins[1], r.train_margins.astype(np.float16))
    assert not view.masks[0].any() and not view.test_margins[0].any()  # unfinished: zeros, flag unset
    row = view.runs[1]
    assert (row["status"], row["test_acc"], row["run_dir"], row["first_of_worker"]) == ("done", 51.0, "runs/1/x", 0)
    assert view.runs[0]["status"] == "running"


def test_a_run_of_other_data_is_refused_and_writes_nothing(folder):
    table = Table(folder)
    table.claim("w", 60)
    table.claim("w", 60)
    assert table.finish(0, "w", result(0), spec_of().keep)
    with pytest.raises(ConfigError, match="every run of a study must read the same data"):
        table.finish(1, "w", result(1, n_train=N_TRAIN + 1), spec_of().keep)
    view = fastcifar.open_store(str(folder))
    assert view.completed.tolist()[:2] == [True, False] and view.runs[1]["status"] == "running"


def test_keep_decides_which_arrays_there_are(tmp_path):
    folder = stores.prepare(str(tmp_path / "s"), spec_of(keep=["test_margins"]))
    table = Table(folder)
    table.claim("w", 60)
    table.finish(0, "w", result(0), ("test_margins",))
    view = fastcifar.open_store(str(folder))
    assert view.test_logits is None and view.train_margins is None and view.test_margins.shape == (6, N_TEST)


def test_the_same_spec_continues_more_runs_grow_the_arrays_and_keep_the_rows(folder):
    table = Table(folder)
    table.claim("w", 60)
    table.finish(0, "w", result(0), spec_of().keep)
    assert stores.prepare(str(folder), spec_of()) == folder and len(table.rows()) == 6  # nothing added
    stores.prepare(str(folder), spec_of(runs=4))
    rows = table.rows()
    assert [(r["idx"], r["arm"], r["rep"], r["seed"], r["status"]) for r in rows[6:]] == [
        (6, 0, 3, 13, "pending"),
        (7, 1, 3, 13, "pending"),
    ]
    view = fastcifar.open_store(str(folder))
    assert view.spec.runs == 4 and view.test_logits.shape == (8, N_TEST, CLASSES) and view.completed.shape == (8,)
    np.testing.assert_array_equal(view.test_logits[0], result(0).test_logits)
    assert view.completed.tolist() == [True] + [False] * 7
    assert not list(folder.glob(".*.tmp"))


@pytest.mark.parametrize(
    "changes, says",
    [
        ({"settings": {**DOC["settings"], "epochs": 2}}, "differs in settings.epochs"),
        ({"axes": {"lr": [0.2, 0.5]}}, "differs in axes.lr"),
        ({"seed": 11}, "differs in seed"),
        ({"runs": 2}, "has 3 runs per arm; a spec may add runs, not drop them"),
    ],
)
def test_another_spec_on_a_store_is_refused_naming_what_differs(folder, changes, says):
    before = (folder / "spec.json").read_text()
    with pytest.raises(ConfigError, match=None) as err:
        stores.prepare(str(folder), spec_of(**changes))
    assert says in str(err.value) and "\n" not in str(err.value)
    assert (folder / "spec.json").read_text() == before and len(Table(folder).rows()) == 6


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_an_unwritable_store_is_one_line(tmp_path):
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match="cannot write there"):
            stores.prepare(str(tmp_path / "store"), spec_of())
    finally:
        tmp_path.chmod(0o700)


def test_a_store_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="cannot write there"):
        stores.prepare(str(tmp_path / "f"), spec_of())


def test_open_store_of_another_folder_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="is not a sweep store"):
        fastcifar.open_store(str(tmp_path))


def test_the_spec_as_run_is_in_the_store(folder):
    assert json.loads((folder / "spec.json").read_text()) == json.loads(json.dumps(spec_of().as_dict()))
    with sqlite3.connect(folder / "runs.sqlite") as con:
        assert con.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 6
