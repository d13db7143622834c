"""A study's store: one folder with the spec as run, the run table (SQLite) and the per-run arrays,
memory-mapped, in the layout data-attribution code reads (datamodels': one row per run).

    spec.json           the spec as run (runs per arm may grow; nothing else may change)
    runs.sqlite         the run table: index, arm, rep, seed, status (pending, running, done, failed),
                        worker, lease, attempts, start/end, accuracy, times, run folder, failure reason
    masks.npy           bool [runs, training images]: the images each run trained on
    test_margins.npy    float16 [runs, test images]   (keep "test_margins")
    test_logits.npy     float16 [runs, test images, classes]   (keep "test_logits")
    train_margins.npy   float16 [runs, training images]   (keep "train_margins")
    completed.npy       bool [runs]: row r of every array is whole; set last
    runs/<index>/       each run's own run folder (log, summary, model file)

Run r is rep r // arms of arm r % arms in the first block of runs: the arms' runs interleave, so a
study half done has every arm half done. Runs added later (more per arm) take the next indices.

The arrays are made when the first run finishes (its outputs give the image counts), each whole
under a temporary name and renamed; a store that grows is copied into larger ones the same way.
Every write of a run's rows happens inside the run table's write lock (BEGIN IMMEDIATE), after
the writer checked it still owns the run: rows first, flushed, then the completed flag, then the
table's "done". A reader (``open_store``) can map the arrays while others train and trust a row
whose completed flag is set.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fastcifar.core.atomic import write_atomic
from fastcifar.core.config import ConfigError
from fastcifar.core.readfile import why
from fastcifar.sweep.spec import Spec, differences, from_dict

SPEC_FILE = "spec.json"
TABLE_FILE = "runs.sqlite"
ARRAYS = ("masks", "test_margins", "test_logits", "train_margins", "completed")
# a run whose worker died is anybody's again after this many seconds without its heartbeat
LEASE_S = 60.0
# a run whose worker died this often is failed, not given out again: it is the run that kills them
MAX_ATTEMPTS = 3
# SQLite waits this long for another writer's lock before giving up (a run's rows take milliseconds)
LOCK_WAIT_S = 120.0

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    idx INTEGER PRIMARY KEY,    -- the row of every array
    arm INTEGER NOT NULL,       -- the arm's index (spec.arms order)
    arm_name TEXT NOT NULL,
    rep INTEGER NOT NULL,       -- run rep of its arm; its run seed is the spec's seed + rep
    seed INTEGER NOT NULL,
    status TEXT NOT NULL DEFAULT 'pending',   -- pending, running, done, failed
    worker TEXT,                -- host:pid:slot of the worker that has (or had) it
    lease_until REAL,           -- unix time; a running run past it is anybody's
    attempts INTEGER NOT NULL DEFAULT 0,
    started REAL,
    ended REAL,
    test_acc REAL,              -- %
    train_time REAL,            -- s, the trainer's clock
    setup_time REAL,            -- s, the trainer's set-up before the clock
    wall_time REAL,             -- s, the worker's whole call (data, set-up, training, outputs)
    first_of_worker INTEGER,    -- 1: the first run its worker trained (imports and compiles paid)
    run_dir TEXT,
    reason TEXT                 -- why it failed
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


def connect(folder: Path) -> sqlite3.Connection:
    """The run table, in autocommit mode (transactions are explicit: ``write_lock``)."""
    con = sqlite3.connect(str(folder / TABLE_FILE), timeout=LOCK_WAIT_S, isolation_level=None)
    con.row_factory = sqlite3.Row
    return con


@contextmanager
def write_lock(con: sqlite3.Connection):
    """One writer at a time across every process on the store: BEGIN IMMEDIATE takes SQLite's
    reserved lock at once, so a read-then-update (claiming a run) cannot interleave with another."""
    con.execute("BEGIN IMMEDIATE")
    try:
        yield con
    except BaseException:
        con.execute("ROLLBACK")
        raise
    con.execute("COMMIT")


def worker_name(slot: int, pid: int | None = None) -> str:
    """host:pid:slot, the run table's name of a worker process."""
    return f"{socket.gethostname()}:{os.getpid() if pid is None else pid}:{slot}"


def _add_runs(con, spec: Spec, first_rep: int) -> None:
    arms = spec.arms
    start = con.execute("SELECT COALESCE(MAX(idx) + 1, 0) FROM runs").fetchone()[0]
    rows = []
    for rep in range(first_rep, spec.runs):
        for arm in arms:
            rows.append((start + len(rows), arm.index, arm.name, rep, spec.seed + rep))
    con.executemany("INSERT INTO runs (idx, arm, arm_name, rep, seed) VALUES (?, ?, ?, ?, ?)", rows)


def prepare(folder: str, spec: Spec) -> Path:
    """Make the store for ``spec``, or check an existing one against it: the same spec continues,
    more runs per arm are added, anything else is refused in one line naming what differs."""
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"--store {folder}: cannot write there: {why(exc)}") from None
    try:
        con = connect(path)
        con.execute("PRAGMA journal_mode=WAL")  # readers (status, open_store) never wait on a writer
        con.executescript(SCHEMA)
        with write_lock(con):
            if (path / SPEC_FILE).exists():
                old = json.loads((path / SPEC_FILE).read_text())
                diff = differences(old, spec.as_dict())
                if diff:
                    raise ConfigError(
                        f"--store {folder} holds another study: its spec differs in {', '.join(diff)} "
                        "(only runs may grow; use a new --store)"
                    )
                if spec.runs < old["runs"]:
                    raise ConfigError(
                        f"--store {folder} has {old['runs']} runs per arm; a spec may add runs, not drop them "
                        f"(runs = {spec.runs})"
                    )
            # the table has the spec's runs (a store of result files, sweep.files, gets its table here)
            have = con.execute("SELECT COUNT(*) FROM runs").fetchone()[0] // len(spec.arms)
            if spec.runs > have:
                _add_runs(con, spec, have)
                _grow_arrays(path, con)
                write_atomic(path / SPEC_FILE, json.dumps(spec.as_dict(), indent=1))
        con.close()
    except sqlite3.Error as exc:
        raise ConfigError(f"--store {folder}: its run table {path / TABLE_FILE}: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"--store {folder}: {why(exc)}") from None
    return path


def read_spec(folder: Path) -> Spec:
    try:
        return from_dict(json.loads((folder / SPEC_FILE).read_text()))
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"{folder} is not a sweep store: its {SPEC_FILE}: {exc}") from None


def _meta(con) -> dict:
    return {r["key"]: json.loads(r["value"]) for r in con.execute("SELECT key, value FROM meta")}


def _shapes(runs: int, meta: dict, keep) -> dict:
    n_train, n_test, classes = meta["n_train"], meta["n_test"], meta["classes"]
    shapes = {"masks": ((runs, n_train), np.bool_), "completed": ((runs,), np.bool_)}
    if "test_margins" in keep:
        shapes["test_margins"] = ((runs, n_test), np.float16)
    if "test_logits" in keep:
        shapes["test_logits"] = ((runs, n_test, classes), np.float16)
    if "train_margins" in keep:
        shapes["train_margins"] = ((runs, n_train), np.float16)
    return shapes


def _make_array(path: Path, shape, dtype, old: np.ndarray | None = None) -> None:
    """``path`` whole, zero-filled (``old``'s rows copied in), under a temporary name, then renamed."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        arr = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=shape)
        if old is not None:
            arr[: len(old)] = old
        arr.flush()
        del arr
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _grow_arrays(path: Path, con) -> None:
    """Inside the write lock: the arrays with rows for every run of the table (copies of the old)."""
    meta = _meta(con)
    if "n_train" not in meta:
        return  # made at the first finished run
    runs = con.execute("SELECT COUNT(*) FROM runs").fetchone()[0]
    for name, (shape, dtype) in _shapes(runs, meta, read_spec(path).keep).items():
        old = np.load(path / f"{name}.npy", mmap_mode="r")
        if old.shape[0] < runs:
            _make_array(path / f"{name}.npy", shape, dtype, old)


@dataclass
class Result:
    """What a worker brings back for one run."""

    mask: np.ndarray  # bool [training images]
    classes: int
    test_acc: float
    train_time: float
    setup_time: float
    wall_time: float
    first: bool
    run_dir: str
    test_margins: np.ndarray | None = None
    test_logits: np.ndarray | None = None
    train_margins: np.ndarray | None = None
    started: float | None = None  # unix times of a result file's run (sweep.files); a claimed run has its own
    ended: float | None = None


class Table:
    """One process's handle on the run table, for the workers and the launcher."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.con = connect(folder)

    def close(self) -> None:
        self.con.close()

    def claim(self, worker: str, lease_s: float) -> sqlite3.Row | None:
        """The lowest pending run (or a running one whose lease ran out), now this worker's; None
        when there is none. A run whose workers died MAX_ATTEMPTS times is failed instead."""
        now = time.time()
        with write_lock(self.con):
            self.con.execute(
                "UPDATE runs SET status='failed', ended=?, reason=? "
                "WHERE status='running' AND lease_until < ? AND attempts >= ?",
                (now, f"its worker died {MAX_ATTEMPTS} times while training it", now, MAX_ATTEMPTS),
            )
            row = self.con.execute(
                "SELECT idx FROM runs WHERE status='pending' OR (status='running' AND lease_until < ?) "
                "ORDER BY idx LIMIT 1",
                (now,),
            ).fetchone()
            if row is None:
                return None
            self.con.execute(
                "UPDATE runs SET status='running', worker=?, lease_until=?, attempts=attempts+1, started=?, "
                "reason=NULL WHERE idx=?",
                (worker, now + lease_s, now, row["idx"]),
            )
            return self.con.execute("SELECT * FROM runs WHERE idx=?", (row["idx"],)).fetchone()

    def heartbeat(self, idx: int, worker: str, lease_s: float) -> bool:
        with write_lock(self.con):
            cur = self.con.execute(
                "UPDATE runs SET lease_until=? WHERE idx=? AND worker=? AND status='running'",
                (time.time() + lease_s, idx, worker),
            )
        return cur.rowcount == 1

    def release(self, idx: int, worker: str, count_attempt: bool = False) -> None:
        """The run is pending again (its worker was stopped): an interruption is not an attempt."""
        with write_lock(self.con):
            self.con.execute(
                "UPDATE runs SET status='pending', worker=NULL, lease_until=NULL, "
                f"attempts=attempts - {0 if count_attempt else 1} WHERE idx=? AND worker=? AND status='running'",
                (idx, worker),
            )

    def release_worker(self, worker: str) -> int:
        """Every run ``worker`` held goes back to pending (the launcher saw that worker die: the
        attempt counts)."""
        with write_lock(self.con):
            cur = self.con.execute(
                "UPDATE runs SET status='pending', worker=NULL, lease_until=NULL WHERE worker=? AND status='running'",
                (worker,),
            )
        return cur.rowcount

    def fail(self, idx: int, worker: str, reason: str) -> None:
        with write_lock(self.con):
            self.con.execute(
                "UPDATE runs SET status='failed', ended=?, reason=? WHERE idx=? AND worker=? AND status='running'",
                (time.time(), reason, idx, worker),
            )

    def finish(self, idx: int, worker: str, result: Result, keep) -> bool:
        """Write run ``idx``'s rows, then its completed flag, then mark it done, all under the write
        lock and only while this worker still owns it (False: its lease ran out and another took it;
        nothing is written). The first finished run makes the arrays."""
        with write_lock(self.con):
            row = self.con.execute("SELECT status, worker FROM runs WHERE idx=?", (idx,)).fetchone()
            if row is None or row["status"] != "running" or row["worker"] != worker:
                return False
            self._write(idx, result, keep)
        return True

    def merge(self, idx: int, result: Result | str, keep) -> bool:
        """A result file's run (``sweep.files``) into the table and arrays, unless it is there
        already: its rows and flag, or its failure's reason (``result`` a str)."""
        with write_lock(self.con):
            row = self.con.execute("SELECT status FROM runs WHERE idx=?", (idx,)).fetchone()
            if row is None or row["status"] in ("done", "failed"):
                return False
            if isinstance(result, str):
                self.con.execute("UPDATE runs SET status='failed', reason=? WHERE idx=?", (result, idx))
            else:
                self._write(idx, result, keep)
        return True

    def _write(self, idx: int, result: Result, keep) -> None:
        """Inside the write lock: the run's rows, flushed, its completed flag, then its row "done"."""
        meta = _meta(self.con)
        test = result.test_margins if result.test_margins is not None else result.test_logits
        n_test = 0 if test is None else len(test)
        if "n_train" not in meta:
            meta = {"n_train": len(result.mask), "n_test": n_test, "classes": result.classes}
            self.con.executemany(
                "INSERT INTO meta (key, value) VALUES (?, ?)", [(k, json.dumps(v)) for k, v in meta.items()]
            )
            runs = self.con.execute("SELECT COUNT(*) FROM runs").fetchone()[0]
            for name, (shape, dtype) in _shapes(runs, meta, keep).items():
                if not (self.folder / f"{name}.npy").exists():
                    _make_array(self.folder / f"{name}.npy", shape, dtype)
        if len(result.mask) != meta["n_train"] or (n_test and n_test != meta["n_test"]):
            raise ConfigError(
                f"its outputs cover {len(result.mask)} training and {n_test} test images, the store's "
                f"{meta['n_train']} and {meta['n_test']}: every run of a study must read the same data"
            )
        rows = {"masks": result.mask}
        for name in ("test_margins", "test_logits", "train_margins"):
            if name in keep:
                rows[name] = getattr(result, name)
        for name, values in rows.items():
            arr = np.load(self.folder / f"{name}.npy", mmap_mode="r+")
            arr[idx] = values
            arr.flush()
            del arr
        done = np.load(self.folder / "completed.npy", mmap_mode="r+")
        done[idx] = True  # last: a reader trusts the rows of a run whose flag is set
        done.flush()
        del done
        self.con.execute(
            "UPDATE runs SET status='done', started=COALESCE(?, started), ended=?, lease_until=NULL, test_acc=?, "
            "train_time=?, setup_time=?, wall_time=?, first_of_worker=?, run_dir=?, reason=NULL WHERE idx=?",
            (
                result.started,
                result.ended or time.time(),
                result.test_acc,
                result.train_time,
                result.setup_time,
                result.wall_time,
                int(result.first),
                result.run_dir,
                idx,
            ),
        )

    def counts(self) -> dict:
        out = {"pending": 0, "running": 0, "done": 0, "failed": 0}
        for r in self.con.execute("SELECT status, COUNT(*) AS n FROM runs GROUP BY status"):
            out[r["status"]] = r["n"]
        return out

    def rows(self) -> list[dict]:
        return table_rows(self.con)


def table_rows(con) -> list[dict]:
    return [dict(r) for r in con.execute("SELECT * FROM runs ORDER BY idx")]


@dataclass
class StoreView:
    """``open_store``: the spec, the run table (a list of dicts, one per run, by index) and the
    arrays, memory-mapped read-only (None: not kept, or no run finished yet)."""

    spec: Spec
    runs: list
    completed: np.ndarray | None
    masks: np.ndarray | None
    test_margins: np.ndarray | None
    test_logits: np.ndarray | None
    train_margins: np.ndarray | None

    @property
    def arms(self) -> list:
        return self.spec.arms


def open_store(folder: str) -> StoreView:
    """A store's spec, run table and arrays (read-only maps), readable while workers train: trust
    row r of an array where ``completed[r]`` is set."""
    path = Path(folder)
    if not (path / TABLE_FILE).is_file():
        raise ConfigError(f"{folder} is not a sweep store (no {TABLE_FILE})")
    spec = read_spec(path)
    con = connect(path)
    try:
        runs = table_rows(con)
    except sqlite3.Error as exc:
        raise ConfigError(f"{folder}: its run table: {exc}") from None
    finally:
        con.close()
    arrays = {
        name: np.load(path / f"{name}.npy", mmap_mode="r") if (path / f"{name}.npy").exists() else None
        for name in ARRAYS
    }
    return StoreView(spec, runs, **arrays)
