"""The shared-filesystem mode: ``--worker I --workers N`` (or a Slurm job array's task), for a store on
NFS, Lustre or GPFS, where SQLite's locks cannot be trusted. No database and no locks while
training: worker I of N owns the runs whose index is I modulo N (a fixed share, decided by the
numbers alone), and each finished run is one file, written under a temporary name and renamed
(atomic on every POSIX filesystem and on these), so a file that exists is whole:

    results/run-<index>.npz          the run's mask, kept outputs and its record (accuracy, times)
    results/run-<index>.failed.json  a run that failed for its own reasons, with the reason

A task started again (Slurm's requeue, or the same command) skips its runs with a file. A task that
dies leaves its share's rest undone until it runs again: no other task takes over a fixed share.
``fastcifar sweep status DIR`` merges the files into the run table and the arrays (one process,
on one machine: the only SQLite writer), after which ``open_store`` reads them as any store's.

Run index r is rep r // arms of arm r % arms, as in the run table.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np

from fastcifar.core.atomic import write_atomic
from fastcifar.core.config import ConfigError
from fastcifar.core.readfile import why
from fastcifar.sweep.spec import Spec, differences
from fastcifar.sweep.store import SPEC_FILE, Result, Table, prepare, read_spec

RESULTS = "results"
ARRAY_NAMES = ("mask", "test_margins", "test_logits", "train_margins")


def result_file(folder: Path, idx: int) -> Path:
    return folder / RESULTS / f"run-{idx}.npz"


def failure_file(folder: Path, idx: int) -> Path:
    return folder / RESULTS / f"run-{idx}.failed.json"


def total_runs(spec: Spec) -> int:
    return spec.runs * len(spec.arms)


def row_of(spec: Spec, idx: int) -> dict:
    """Run ``idx``'s place: its arm, rep and seed (as the run table numbers them)."""
    arms = len(spec.arms)
    return {"idx": idx, "arm": idx % arms, "rep": idx // arms, "seed": spec.seed + idx // arms}


def share(spec: Spec, index: int, count: int) -> list[int]:
    """Worker ``index`` of ``count``: its fixed share of the run indices."""
    return list(range(index, total_runs(spec), count))


def prepare_files(folder: str, spec: Spec) -> Path:
    """The store folder for this spec without a database: spec.json made by whichever task comes
    first (linked into place: never over another's), checked by the others."""
    path = Path(folder)
    text = json.dumps(spec.as_dict(), indent=1)
    try:
        (path / RESULTS).mkdir(parents=True, exist_ok=True)
        try:
            write_atomic(path / SPEC_FILE, text, replace=False)
            return path
        except FileExistsError:
            old = json.loads((path / SPEC_FILE).read_text())
    except OSError as exc:
        raise ConfigError(f"--store {folder}: cannot write there: {why(exc)}") from None
    diff = differences(old, spec.as_dict())
    if diff:
        raise ConfigError(
            f"--store {folder} holds another study: its spec differs in {', '.join(diff)} "
            "(only runs may grow; use a new --store)"
        )
    if spec.runs < old["runs"]:
        raise ConfigError(
            f"--store {folder} has {old['runs']} runs per arm; a spec may add runs, not drop them (runs = {spec.runs})"
        )
    if spec.runs > old["runs"]:
        write_atomic(path / SPEC_FILE, text)
    return path


def save_result(folder: Path, idx: int, result: Result, worker: str) -> Path:
    """Run ``idx``'s result as one file, whole or not at all."""
    names = ("classes", "test_acc", "train_time", "setup_time", "wall_time", "started", "ended")
    record = {k: getattr(result, k) for k in names}
    record.update(first=result.first, run_dir=result.run_dir, worker=worker)
    arrays = {"mask": np.asarray(result.mask, bool), "record": np.array(json.dumps(record))}
    for name in ARRAY_NAMES[1:]:
        if getattr(result, name) is not None:
            arrays[name] = np.asarray(getattr(result, name))
    blob = io.BytesIO()
    np.savez(blob, **arrays)
    return write_atomic(result_file(folder, idx), blob.getvalue())


def save_failure(folder: Path, idx: int, reason: str, worker: str) -> Path:
    return write_atomic(failure_file(folder, idx), json.dumps({"reason": reason, "worker": worker}))


def load_result(path: Path) -> Result:
    with np.load(path, allow_pickle=False) as f:
        record = json.loads(str(f["record"]))
        arrays = {name: f[name] if name in f.files else None for name in ARRAY_NAMES}
    return Result(
        mask=arrays.pop("mask"),
        classes=record["classes"],
        test_acc=record["test_acc"],
        train_time=record["train_time"],
        setup_time=record["setup_time"],
        wall_time=record["wall_time"],
        first=record["first"],
        run_dir=record["run_dir"],
        started=record.get("started"),
        ended=record.get("ended"),
        **arrays,
    )


def finished(folder: Path, spec: Spec) -> dict[int, str]:
    """Each run with a file: index -> "done" or "failed" (one listing of results/, not a look per
    run: the launchers poll it twice a second, on a network filesystem)."""
    out = {}
    total = total_runs(spec)
    for name in os.listdir(folder / RESULTS):
        stem, _, kind = name.partition(".")
        if not stem.startswith("run-") or not stem[4:].isdigit() or int(stem[4:]) >= total:
            continue
        if kind == "npz":
            out[int(stem[4:])] = "done"
        elif kind == "failed.json":
            out.setdefault(int(stem[4:]), "failed")
    return out


def counts(folder: Path, spec: Spec) -> dict:
    ends = list(finished(folder, spec).values())
    done, failed = ends.count("done"), ends.count("failed")
    return {"done": done, "failed": failed, "running": 0, "pending": total_runs(spec) - done - failed}


def has_results(folder: Path) -> bool:
    return (folder / RESULTS).is_dir()


def merge(folder: str | Path) -> int:
    """The result files into the run table and the arrays (made here when there are none yet);
    the count merged now. Runs merged before are left as they are."""
    path = Path(folder)
    spec = read_spec(path)
    prepare(str(path), spec)
    table = Table(path)
    merged = 0
    try:
        for idx, end in sorted(finished(path, spec).items()):
            if end == "done":
                try:
                    result = load_result(result_file(path, idx))
                except (OSError, ValueError, KeyError) as exc:
                    raise ConfigError(f"{result_file(path, idx)}: cannot read it: {exc}") from None
            else:
                result = json.loads(failure_file(path, idx).read_text())["reason"]
            merged += table.merge(idx, result, spec.keep)
    finally:
        table.close()
    return merged


def worker_share(value: str) -> tuple[int, int]:
    """``I/N`` -> (I, N), 0 <= I < N."""
    try:
        index, count = (int(v) for v in value.split("/"))
    except ValueError:
        raise ConfigError(f"a share is I/N, not {value!r}") from None
    if not 0 <= index < count:
        raise ConfigError(f"worker {index} of {count}: the index must lie in 0..{count - 1}")
    return index, count
