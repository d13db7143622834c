"""One long-lived worker: ``python -m fastcifar.sweep.worker --store DIR --slot S --device D``, started
by ``fastcifar sweep`` once per slot (or by hand, or by a scheduler, on the same store). It takes runs
from the store's table one at a time and trains them back to back through ``fastcifar.train``
in this one process, so imports, Triton's and inductor's compiles and cuDNN's choices are paid by
its first run only (the table's ``first_of_worker`` keeps the first run's times apart). It keeps a
``run.engine.Reuse`` for its life: the data set is read once for all its runs (on the same data
settings), and a run whose settings differ from an earlier one's only in per-run fields (seeds,
subset, outputs) trains on that run's engine, its model, optimizer and captured steps, with no
build, warm-up or capture of its own.

With ``--share I/N`` it trains a fixed share of the runs and writes each as a result file instead
(``sweep.files``: a store on a shared filesystem, no database).

A run's failure of its own (its settings, its data: any exception out of the trainer) is recorded
with its reason and the worker goes on to the next. A store it cannot write (a full disk) ends the
worker with one line, the run pending again and its completed flag unset: nothing half-written is
counted as done. SIGINT or SIGTERM ends the worker within
seconds: the run it was training goes back to pending, not counted as an attempt. While its run
trains, a heartbeat thread renews the run's lease; a worker that dies (SIGKILL, a lost node) stops
renewing it, and another worker takes the run once the lease has run out.
"""

from __future__ import annotations

import argparse
import io
import shutil
import sqlite3
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fastcifar.core import signals
from fastcifar.core.atomic import write_atomic
from fastcifar.core.errors import ConfigError, first_line
from fastcifar.core.names import printable
from fastcifar.core.readfile import why
from fastcifar.sweep import files
from fastcifar.sweep.spec import Arm, Spec, check_masks
from fastcifar.sweep.store import LEASE_S, Result, Table, read_spec, worker_name

if TYPE_CHECKING:
    from fastcifar.run.engine import Reuse

RUNS_FOLDER = "runs"
WORK_FOLDER = "work"  # each run's mask file under policy "masks"
IDLE_POLL_S = 1.0  # no run to take, but others' are running: their worker may die and free them


class Heartbeat:
    """Renews the lease of run ``idx`` every quarter lease, from its own thread and connection."""

    def __init__(self, folder: Path, idx: int, worker: str, lease_s: float):
        self.stop_event = threading.Event()
        self.args = (folder, idx, worker, lease_s)
        self.thread = threading.Thread(target=self._run, name="fastcifar-sweep-heartbeat", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        folder, idx, worker, lease_s = self.args
        table = Table(folder)
        try:
            while not self.stop_event.wait(lease_s / 4):
                if not table.heartbeat(idx, worker, lease_s):
                    return  # no longer this worker's run
        except Exception:  # a locked or vanished table: the lease runs out and the run goes to another
            return
        finally:
            table.close()

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join()


def train_run(spec: Spec, arm: Arm, row, folder: Path, device: str, first: bool, reuse: Reuse | None = None) -> Result:
    """Train run ``row`` (its arm's settings, its rep's seed and subset) and return its rows.
    ``reuse``: the worker's, kept across its runs (``run.engine``)."""
    from fastcifar.api import train

    idx = row["idx"]
    out_dir = folder / RUNS_FOLDER / str(idx)
    shutil.rmtree(out_dir, ignore_errors=True)  # an earlier attempt's folder, from a worker that died
    mask_file = ""
    if spec.policy == "masks":
        mask = np.asarray(check_masks(spec.masks, spec.runs)[row["rep"]])
        mask_path = folder / WORK_FOLDER / f"mask-{idx}.npy"
        mask_path.parent.mkdir(exist_ok=True)
        blob = io.BytesIO()
        np.save(blob, mask, allow_pickle=False)
        write_atomic(mask_path, blob.getvalue())
        mask_file = str(mask_path)
    cfg = spec.config(arm, row["rep"], str(out_dir), device, mask_file)
    start = time.perf_counter()
    (run,) = train(cfg, reuse=reuse)
    wall = time.perf_counter() - start
    (run_dir,) = [p for p in out_dir.iterdir() if p.is_dir()]
    outputs = run.outputs
    return Result(
        mask=np.load(run_dir / "subset_mask.npy"),
        classes=len(run.metrics.classes),
        test_acc=run.test_acc,
        train_time=run.metrics.train_time,
        setup_time=run.metrics.setup_time,
        wall_time=wall,
        first=first,
        run_dir=str(run_dir.relative_to(folder)),
        test_margins=None if outputs is None else outputs.test_margins,
        test_logits=None if outputs is None else outputs.test_logits,
        train_margins=None if outputs is None else outputs.train_margins,
    )


def work(folder: Path, slot: int, device: str, lease_s: float) -> int:
    """Take and train runs until none is left; the count trained."""
    spec = read_spec(folder)
    arms = spec.arms
    table = Table(folder)
    name = worker_name(slot)
    trained = 0
    reuse = kept_between_runs()
    try:
        while True:
            row = table.claim(name, lease_s)
            if row is None:
                counts = table.counts()
                if not counts["running"]:
                    return trained
                time.sleep(IDLE_POLL_S)
                continue
            idx = row["idx"]
            beat = Heartbeat(folder, idx, name, lease_s)
            try:
                result = train_run(spec, arms[row["arm"]], row, folder, device, first=trained == 0, reuse=reuse)
                table.finish(idx, name, result, spec.keep)
            except signals.StopRun:
                table.release(idx, name)
                raise
            except (OSError, sqlite3.Error) as exc:  # the store's trouble (a full disk), not the run's
                table.release(idx, name, count_attempt=True)
                text = why(exc) if isinstance(exc, OSError) else str(exc)
                raise ConfigError(f"--store {folder}: cannot write run {idx}'s results: {text}") from None
            except Exception as exc:  # the run's own failure: recorded, and on to the next
                table.fail(idx, name, f"{type(exc).__name__}: {reason_of(exc)}")
            finally:
                beat.stop()
            trained += 1
    finally:
        table.close()


def work_share(folder: Path, index: int, count: int, slot: int, device: str) -> int:
    """The shared-filesystem mode (``sweep.files``): train share ``index`` of ``count``, each run
    without a result file, one file per run; the count trained."""
    spec = read_spec(folder)
    arms = spec.arms
    name = worker_name(slot)
    trained = 0
    reuse = kept_between_runs()
    for idx in files.share(spec, index, count):
        if files.result_file(folder, idx).exists() or files.failure_file(folder, idx).exists():
            continue
        row = files.row_of(spec, idx)
        started = time.time()
        try:
            result = train_run(spec, arms[row["arm"]], row, folder, device, first=trained == 0, reuse=reuse)
            result.started, result.ended = started, time.time()
        except signals.StopRun:
            raise
        except Exception as exc:  # the run's own failure: recorded, and on to the next
            files.save_failure(folder, idx, f"{type(exc).__name__}: {reason_of(exc)}", name)
        else:
            files.save_result(folder, idx, result, name)
        trained += 1
    return trained


def kept_between_runs() -> Reuse:
    """The worker's holder of what its runs share (torch's import with it, as training's)."""
    from fastcifar.run.engine import Reuse

    return Reuse()


def reason_of(exc: Exception) -> str:
    return printable(first_line(str(exc)) or type(exc).__name__)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastcifar.sweep.worker")
    parser.add_argument("--store", required=True)
    parser.add_argument("--slot", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lease-s", type=float, default=LEASE_S)
    parser.add_argument("--share", default="", help="I/N: the shared-filesystem mode's fixed share (sweep.files)")
    args = parser.parse_args(argv)
    previous = signals.install()
    try:
        if args.share:
            work_share(Path(args.store), *files.worker_share(args.share), args.slot, args.device)
        else:
            work(Path(args.store), args.slot, args.device, args.lease_s)
        return 0
    except ConfigError as exc:
        print(f"fastcifar: error: {printable(str(exc))}", file=sys.stderr)
        return 2
    except signals.StopRun as exc:
        return exc.exit_code
    finally:
        signals.restore(previous)


if __name__ == "__main__":
    sys.exit(main())
