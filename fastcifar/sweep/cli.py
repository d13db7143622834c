"""``fastcifar sweep``: run a study, see where it stands, compare two arms.

    fastcifar sweep SPEC --store DIR [--devices all|0,1,...|cpu] [--per-device K]
    fastcifar sweep status DIR
    fastcifar sweep compare DIR ARM_A ARM_B

The first starts one worker process per slot (``sweep.worker``: K per device) and draws one
progress line for the study from the store's table until every run is done or failed. Run again, it
continues where the store stands. SIGINT or SIGTERM stops every worker within seconds (each puts
its run back to pending); a worker that dies on its own has its run put back at once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from fastcifar.cli import run_command
from fastcifar.core import signals
from fastcifar.core.config import ConfigError
from fastcifar.core.environment import slurm_array_task, threads_given, visible_gpu_names
from fastcifar.core.options import OneLineParser
from fastcifar.sweep import files, report
from fastcifar.sweep.spec import check_masks, read
from fastcifar.sweep.store import LEASE_S, TABLE_FILE, Table, open_store, prepare, worker_name

POLL_S = 0.5  # the launcher's look at its workers and the table
STOP_WAIT_S = 10.0  # SIGTERM, then this long before SIGKILL: a worker's stop takes about a second
LOG_FOLDER = "logs"
MAX_RESTARTS_PER_SLOT = 3  # a slot's worker that keeps dying is not restarted forever


def parse_devices(text: str) -> list[tuple[str, str | None]]:
    """``--devices``: [(device, CUDA_VISIBLE_DEVICES for the worker)]."""
    if text == "cpu":
        return [("cpu", None)]
    import torch

    count = torch.cuda.device_count()
    names = visible_gpu_names(count)  # what a worker's CUDA_VISIBLE_DEVICES names GPU i by
    if text == "all":
        return [("cuda", names[i]) for i in range(count)] or [("cpu", None)]
    try:
        ids = [int(v) for v in text.split(",")]
    except ValueError:
        raise ConfigError(f"--devices takes all, cpu or GPU numbers such as 0,1, not {text!r}") from None
    bad = [i for i in ids if not 0 <= i < count]
    if bad or len(set(ids)) != len(ids):
        raise ConfigError(f"--devices {text}: this machine has {count} GPUs (0..{count - 1}), each named once")
    return [("cuda", names[i]) for i in ids]


class Line:
    """The study's one progress line: a tqdm bar on a terminal, else a plain line when it changes."""

    def __init__(self, total: int, done_before: int):
        self.total, self.before, self.start = total, done_before, time.monotonic()
        self.last = None
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=done_before, desc="sweep", unit="model", file=sys.stderr)

    def show(self, counts: dict) -> None:
        finished = counts["done"] + counts["failed"]
        now = finished - self.before
        elapsed = time.monotonic() - self.start
        rate = now / elapsed * 3600 if elapsed > 0 and now > 0 else 0.0
        left = self.total - finished
        eta = f"{left / rate * 3600:.0f} s" if rate else "?"
        text = f"{counts['done']} done, {counts['failed']} failed of {self.total}; {rate:.0f} models/h; ETA {eta}"
        if self.bar is not None:
            self.bar.n = finished
            self.bar.set_postfix_str(f"{counts['failed']} failed, {rate:.0f}/h")
            return
        if text.split(";")[0] != (self.last or "").split(";")[0]:
            print(f"sweep: {text}", file=sys.stderr, flush=True)
            self.last = text

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _start(folder: Path, slot: int, device: str, visible: str | None, extra: list, threads: int | None, tag: str):
    env = dict(os.environ)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    if threads is not None and not threads_given():
        env["OMP_NUM_THREADS"] = str(threads)  # K CPU workers share the cores instead of each taking all
    log = open(folder / LOG_FOLDER / f"worker-{tag}{slot}.log", "ab")
    cmd = [sys.executable, "-m", "fastcifar.sweep.worker", "--store", str(folder), "--slot", str(slot)]
    cmd += ["--device", device, *extra]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    log.close()
    return proc


def _stop_all(procs: dict) -> None:
    for proc, _ in procs.values():
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + STOP_WAIT_S
    for proc, _ in procs.values():
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def training_images(spec) -> int:
    """The training images the spec's data holds, as read (the masks' length): read once here, so a
    masks file of the wrong length is one line before any worker starts, not a failure per run."""
    from fastcifar.data import DataError, load_dataset

    cfg = spec.config(spec.arms[0], 0, "runs", "cpu")
    try:
        return load_dataset(cfg.data, cfg.download, cfg.cache_dir or None, log=lambda text: None).n_read
    except DataError as exc:
        raise ConfigError(f"[settings] data: {exc}") from None


class TableMode:
    """One machine (or a local disk): workers claim runs from the SQLite table; a dead worker's run
    goes back at once."""

    def __init__(self, folder: Path, lease_s: float):
        self.table, self.lease_s = Table(folder), lease_s

    def counts(self) -> dict:
        return self.table.counts()

    def todo(self) -> int:
        c = self.table.counts()
        return c["pending"] + c["running"]

    def worker_args(self, slot: int, slots: int) -> list[str]:
        return ["--lease-s", str(self.lease_s)]

    def died(self, name: str) -> None:
        self.table.release_worker(name)

    def close(self) -> None:
        self.table.close()


class FilesMode:
    """A shared filesystem (``sweep.files``): this launch is worker ``index`` of ``count``; its K
    slots split its fixed share again (slot s: share index x K + s of count x K)."""

    def __init__(self, folder: Path, spec, index: int, count: int, slots: int):
        self.folder, self.spec, self.index, self.count, self.slots = folder, spec, index, count, slots
        self.mine = set(files.share(spec, index, count))

    def counts(self) -> dict:
        return files.counts(self.folder, self.spec)

    def todo(self) -> int:
        return len(self.mine - set(files.finished(self.folder, self.spec)))

    def worker_args(self, slot: int, slots: int) -> list[str]:
        return ["--share", f"{self.index * slots + slot}/{self.count * slots}"]

    def died(self, name: str) -> None:
        pass  # its share's runs have no file: the restarted worker trains them

    def close(self) -> None:
        pass


def worker_of(args) -> tuple[int, int] | None:
    """(I, N) of --worker I --workers N, else of a Slurm job array's task; None: one machine."""
    if (args.worker is None) != (args.workers is None):
        raise ConfigError("--worker I and --workers N go together")
    if args.workers is not None:
        if args.workers < 1 or not 0 <= args.worker < args.workers:
            raise ConfigError(f"--worker {args.worker} --workers {args.workers}: the index must lie in 0..N-1, N >= 1")
        return args.worker, args.workers
    try:
        return slurm_array_task()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def run_study(args) -> int:
    if args.per_device < 1:
        raise ConfigError(f"--per-device must be 1 or more, not {args.per_device}")
    if args.lease_s <= 0:
        raise ConfigError(f"--lease-s must be positive, not {args.lease_s}")
    share = worker_of(args)
    spec = read(args.spec)
    devices = parse_devices(args.devices)
    if spec.policy == "masks":
        check_masks(spec.masks, spec.runs, training_images(spec))
    slots = [d for d in devices for _ in range(args.per_device)]
    if share is None:
        folder = prepare(args.store, spec)
        if files.has_results(folder):  # a study begun as array tasks, finished here: their runs count
            files.merge(folder)
        mode = TableMode(folder, args.lease_s)
        slots = slots[: max(1, mode.todo())]  # more workers than runs: the rest would find nothing
    else:
        if (Path(args.store) / TABLE_FILE).exists() and not files.has_results(Path(args.store)):
            raise ConfigError(
                f"--store {args.store} was made by workers sharing its run table, which --worker/--workers and "
                "Slurm array tasks do not read: give them a store of their own"
            )
        folder = files.prepare_files(args.store, spec)
        mode = FilesMode(folder, spec, *share, len(slots))
    counts = mode.counts()
    total = sum(counts.values())
    todo = mode.todo()
    whose = "" if share is None else f" (worker {share[0]} of {share[1]})"
    if not todo and share is None:
        print(f"sweep: all {total} runs of {args.store} are done or failed ({counts['failed']} failed)")
        return 0 if not counts["failed"] else 1
    if not todo:
        print(
            f"sweep: worker {share[0]} of {share[1]}: each of its {len(mode.mine)} runs of {total} has its result file"
        )
        return 0
    (folder / LOG_FOLDER).mkdir(exist_ok=True)
    cpu_slots = sum(d == "cpu" for d, _ in slots)
    threads = max(1, (os.cpu_count() or 1) // cpu_slots) if cpu_slots else None
    print(
        f"sweep: {total} runs ({len(spec.arms)} arms x {spec.runs}), {todo} to go{whose}; {len(slots)} workers "
        f"({', '.join(sorted({d if v is None else f'cuda:{v}' for d, v in slots}))}); logs in {folder / LOG_FOLDER}",
        file=sys.stderr,
        flush=True,
    )
    line = Line(total, counts["done"] + counts["failed"])
    procs = {}
    restarts = 0
    tag = "" if share is None else f"w{share[0]}-"

    def start(slot):
        device, visible = slots[slot]
        extra = mode.worker_args(slot, len(slots))
        proc = _start(folder, slot, device, visible, extra, threads if device == "cpu" else None, tag)
        procs[slot] = (proc, worker_name(slot, proc.pid))

    try:
        for slot in range(len(slots)):
            start(slot)
        while procs:
            time.sleep(POLL_S)
            for slot, (proc, name) in list(procs.items()):
                code = proc.poll()
                if code is None:
                    continue
                del procs[slot]
                if code == 0:  # nothing left to take
                    continue
                if code == 2:  # it could not go on (a store it cannot write): its one line, here too
                    log = folder / LOG_FOLDER / f"worker-{tag}{slot}.log"
                    lines = [t for t in log.read_text(errors="replace").splitlines() if t.strip()]
                    print(f"sweep: worker {slot} stopped: {lines[-1] if lines else 'exit 2'}", file=sys.stderr)
                # died (SIGKILL, a crash): its run goes back now, not at its lease's end, and a new
                # worker takes the slot while there is work (a bounded number of times: a worker that
                # cannot start at all, exit 2, is not restarted)
                mode.died(name)
                if code != 2 and restarts < MAX_RESTARTS_PER_SLOT * len(slots) and mode.todo():
                    restarts += 1
                    start(slot)
            line.show(mode.counts())
    except signals.StopRun:
        _stop_all(procs)
        for _, name in procs.values():
            mode.died(name)
        raise
    finally:
        line.close()
    counts, todo = mode.counts(), mode.todo()
    mode.close()
    if share is None:
        print(
            f"sweep: {counts['done']} of {total} runs done, {counts['failed']} failed, {counts['pending']} pending"
            + (f" (fastcifar sweep status {args.store} says why)" if counts["failed"] else ""),
            file=sys.stderr,
        )
        return 0 if counts["done"] == total else 1
    print(
        f"sweep: worker {share[0]} of {share[1]}: its share finished, {todo} left; the study: {counts['done']} of "
        f"{total} done, {counts['failed']} failed (fastcifar sweep status {args.store} merges the result files)",
        file=sys.stderr,
    )
    return 0 if not todo else 1


def merge_files(store: str) -> None:
    """A shared-filesystem study's result files into its table and arrays (``sweep.files.merge``)."""
    if files.has_results(Path(store)):
        files.merge(store)


def _status(argv: list[str], prog: str) -> int:
    parser = OneLineParser(prog=prog, description="Where a study stands: per arm, runs done, failed, pending.")
    parser.add_argument("store")
    args = parser.parse_args(argv)

    def body():
        merge_files(args.store)
        view = open_store(args.store)
        print("\n".join(report.status_lines(view.spec, view.runs)))
        return 0

    return run_command(body)


def _compare(argv: list[str], prog: str) -> int:
    parser = OneLineParser(
        prog=prog, description="The paired difference of two arms' mean test accuracy over the runs both finished."
    )
    parser.add_argument("store")
    parser.add_argument("arm_a", help="an arm's name (as status prints it) or number")
    parser.add_argument("arm_b")
    args = parser.parse_args(argv)

    def body():
        merge_files(args.store)
        view = open_store(args.store)
        print(report.compare_line(view.spec, view.runs, args.arm_a, args.arm_b))
        return 0

    return run_command(body)


def main(argv: list[str] | None = None, prog: str = "python -m fastcifar.sweep") -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["status"]:
        return _status(argv[1:], f"{prog} status")
    if argv[:1] == ["compare"]:
        return _compare(argv[1:], f"{prog} compare")
    parser = OneLineParser(
        prog=prog,
        description=(
            "Train a study of many runs (a spec: docs/sweeps.md) into a store, one worker process per slot; "
            f"'{prog} status DIR' and '{prog} compare DIR A B' read a store."
        ),
    )
    parser.add_argument("spec", help="the study's spec, .toml or .json")
    parser.add_argument("--store", required=True, metavar="DIR", help="the store folder (made, or continued)")
    parser.add_argument(
        "--devices", default="all", metavar="LIST", help="all (every GPU, else the CPU) | cpu | GPU numbers: 0,1"
    )
    parser.add_argument(
        "--per-device", type=int, default=1, metavar="K", help="worker processes per device (default 1)"
    )
    parser.add_argument(
        "--worker",
        type=int,
        metavar="I",
        help="with --workers N: this launch is worker I (0..N-1) on a shared filesystem, a fixed share of the runs "
        "written as result files, no database (docs/sweeps.md); a Slurm array task reads its own",
    )
    parser.add_argument("--workers", type=int, metavar="N", help="the count of launches sharing the study (--worker)")
    parser.add_argument(
        "--lease-s",
        type=float,
        metavar="S",
        default=LEASE_S,
        help=f"seconds without a worker's heartbeat before its run is another's (default {LEASE_S:.0f})",
    )
    args = parser.parse_args(argv)
    return run_command(lambda: run_study(args))
