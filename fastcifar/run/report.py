"""What a run leaves behind: fixed-width lines on stdout and in log.txt, timing_log.tsv, summary.json.

Only rank 0 makes a ``RunLog`` that writes; other ranks get one that does nothing, so the trainer
calls it unconditionally. The run folder is made only at ``start``, once the data and config have
been read and checked, so bad input leaves no folder behind; lines logged before it are kept and
written first. Every line and every TSV row is flushed as it is written, so a killed run leaves
its header and every finished epoch. summary.json is strict JSON (a non-finite number is written
as null), written to a temporary file and renamed, so a reader never sees half of one; a run that
stops early (diverged, interrupted, failed) still gets one, with ``status`` saying why.
A folder or file that cannot be written (a bad --out-dir, a full disk) is an ``OutputError``:
one line, exit 2, like any bad input.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import os
import platform
import re
import stat
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import torch

from fastcifar.core import environment, gpu
from fastcifar.core.atomic import write_atomic
from fastcifar.core.config import CONFIG_FILE, ConfigError, config_file_text, training_settings
from fastcifar.core.stats import p_above

TIMING_PROTOCOL = (
    "train time: summed per-epoch training time (on-device augmentation included), "
    "device synchronized at each epoch's start and end; per-epoch evaluation and the "
    "one-off warm-up steps before the clock starts are excluded. wall time: from "
    "process start to the end of the run's last evaluation. A resumed run's train time "
    "also counts the epochs trained before its checkpoint (their times as recorded "
    "there), its wall time this process only, so train time can exceed wall time; "
    "the run's line in log.txt then gives the train time before the resume and in "
    "this process apart."
)

EPOCH_HEADER = (
    f"{'run':>4} {'epoch':>5} {'lr':>8} {'train_loss':>10} {'train_acc':>9} "
    f"{'test_acc':>8} {'epoch_s':>8} {'train_s':>8} {'eval_s':>7}"
)  # eval_s last: a reader of the first eight columns by position reads what it read before
TSV_COLUMNS = (
    "run",
    "epoch",
    "lr",
    "train_time",
    "train_loss",
    "train_acc",
    "test_time",
    "test_loss",
    "test_acc",
    "total_train_time",
)
# --val-split: each epoch's evaluation is on held-out training images, so its columns and fields
# say "val" (an EpochRecord's test_* hold whichever set the epochs were evaluated on)
VAL_NAMES = {"test_time": "val_time", "test_loss": "val_loss", "test_acc": "val_acc"}


def epoch_names(cfg) -> dict:
    """EpochRecord field -> the name the log, timing_log.tsv and summary.json give it."""
    return VAL_NAMES if getattr(cfg, "val_split", 0) else {}


def target_note(cfg, acc: float, target_acc: float) -> str:
    """The run line's verdict: reached or missed for a full recipe, else why the bar does not apply."""
    from fastcifar.core.config import full_recipe

    if not full_recipe(cfg):
        return f"target {target_acc:.2f}% applies to the full preset on the full data"
    return f"target {target_acc:.2f}%: {'reached' if acc >= target_acc else 'missed'}"


def lr_note(cfg) -> str:
    """What the epoch lines' lr column is, with the run's numbers (config.py's learning-rate rule)."""
    muon = f"; Muon's filter step: --muon-lr {cfg.muon_lr:g} on the same schedule" if cfg.optimizer == "muon" else ""
    return (
        f"lr: the base learning rate at the epoch's last step, for the mean loss over the global batch of "
        f"{cfg.batch_size}; its peak is --lr {cfg.lr:g} x {cfg.batch_size}/512 = "
        f"{cfg.lr * cfg.batch_size / 512:.4f}{muon}"
    )


def cpu_note(cfg, device: torch.device) -> str:
    """A full recipe on the CPU: a warning before it starts (hours, with TTA's 6 views each epoch)."""
    from fastcifar.core.config import full_recipe

    if device.type != "cpu" or not full_recipe(cfg):
        return ""
    return (
        f"warning: the full {cfg.preset} preset on a CPU takes hours; for a short CPU run see the README's "
        f"CPU example (--subset 2000 --epochs 4 --widths 16,32,32 --batch-size 128)"
    )


def emulated_note(cfg) -> str:
    """--emulate-ranks N: one line saying the ranks are emulated and what is the same as N real ranks
    (the recipe), and what is not (the numbers: the sums run in another order). On 2 ranks of a small
    CPU run, emulated ended at 47.75% and torchrun's gloo ranks at 46.00%, weights up to 1.15 apart:
    a last-bit difference in one step's sums grows over the steps, and a small network at a high
    learning rate grows it fastest."""
    n = cfg.emulate_ranks
    if n <= 1:
        return ""
    return (
        f"emulated ranks: {n} ranks in this one process, each with its own shard, augmentation draws and "
        f"batchnorm statistics over {cfg.batch_size // n} images, gradients averaged: the recipe of {n} real "
        f"ranks, up to the order of floating-point sums, so not their exact numbers; time is one device's"
    )


def cpu_threads_note(device: torch.device) -> str:
    """On the CPU with OMP_NUM_THREADS unset while other work keeps the cores busy (the 1-minute
    load average): a line advising OMP_NUM_THREADS=1; else nothing. torch's default (a thread per
    core) contends with that work: on 2 shared cores the README's CPU example ran about ten times
    slower an epoch than with one thread, while on an idle machine the default was faster
    (bench/results/cpu_threads.jsonl). Advice only: the thread count can change a CPU run's
    floating-point sums, so the trainer never changes it behind the user's back."""
    if device.type != "cpu" or environment.threads_given():
        return ""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return ""
    threads = torch.get_num_threads()
    cores = environment.usable_cores()
    if threads <= 1 or cores - math.ceil(load - 0.25) >= threads:
        return ""
    return (
        f"note: load average {load:.1f} on {cores} cores: other work is running, and torch uses {threads} "
        f"threads; OMP_NUM_THREADS=1 is usually much faster on a shared machine (README, CPU runs)"
    )


def estimate(set_up: float, lengths: list[int], step_s: float, eval_batches: int, eval_s: float) -> float:
    """Seconds a run will take in all: ``set_up`` spent (data, model, warm-up, compilation and graph
    capture), then each epoch's steps at ``step_s`` and the run's ``eval_batches`` evaluation batches
    (every epoch's, and the test set's after --val-split) at ``eval_s`` (each timed after the
    warm-up: run.step.timed, timed_eval)."""
    return set_up + sum(lengths) * step_s + eval_batches * eval_s


def about(seconds: float) -> str:
    """A duration as an estimate is worth saying: 1.6 s, 25 s, 12 min."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    return f"{seconds:.0f} s" if seconds < 600 else f"{seconds / 60:.0f} min"


def estimate_line(
    run: int, total: float, lengths: list[int], step_s: float, eval_batches: int, eval_s: float, final_batches: int = 0
) -> str:
    """The run's first line: its whole time, from its set-up to its model file, as its ``took`` line
    counts it; what it is made of, and what it leaves out."""
    epochs = f"{len(lengths)} epochs of {lengths[0]} steps" if len(set(lengths)) == 1 else f"{sum(lengths)} steps"
    final = f" and {final_batches} for the test set at the end" if final_batches else ""
    # under 200 characters, as every line a run prints (its 'took' line counts the same span)
    return (
        f"run {run}: about {about(total)} in all (set-up to model file): {epochs} at {step_s:.3g} s, "
        f"{eval_batches} evaluation batch{'es' if eval_batches != 1 else ''} an epoch{final} at {eval_s:.3g} s; "
        f"not counted: the loader's per-epoch work, a busy machine"
    )


def process_start_time() -> float:
    """Unix time at which this process started (Linux /proc), else the time of this import."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORT_TIME


_IMPORT_TIME = time.time()


def versions() -> dict:
    def version_of(dist_name: str) -> str | None:
        try:
            return metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            return None

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "triton": version_of("triton"),
        "numpy": version_of("numpy"),
        "dali": next((version_of(name) for name, _ in gpu.dali_builds()), None),  # the cuda130 or cuda120 build
        "fastcifar": version_of("fastcifar"),
    }


def _git(*args: str) -> str:
    """A git command in the package's checkout ("" outside one, or without git)."""
    try:
        out = subprocess.run(
            ["git", *args], cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def gpu_identity(device: torch.device) -> tuple[str | None, str | None]:
    """The GPU's name and driver version (nvidia-smi; without it the driver stays unknown)."""
    if device.type != "cuda":
        return None, None
    index = device.index if device.index is not None else torch.cuda.current_device()
    name = torch.cuda.get_device_name(index)
    try:  # by UUID: nvidia-smi orders GPUs by bus id and ignores CUDA_VISIBLE_DEVICES, CUDA does neither
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        gpu_id = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
        out = subprocess.run(
            ["nvidia-smi", f"--id={gpu_id}", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        return name, out.stdout.strip().splitlines()[0].strip() or None
    except (OSError, subprocess.SubprocessError, IndexError, AttributeError, RuntimeError):
        return name, None


def provenance(cfg, device: torch.device) -> dict:
    """What a result was measured with beyond the versions: the commit (with whether tracked files
    differed from it), a hash of the settings that shape training (paths and logging left out:
    run.state's rule for a resume), and the GPU's name and driver."""
    commit = _git("rev-parse", "HEAD") or None
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no")) if commit else None
    settings = json.dumps(training_settings(cfg), sort_keys=True, default=str)
    gpu, driver = gpu_identity(device)
    return {
        "commit": commit,
        "dirty": dirty,
        "config_hash": hashlib.sha256(settings.encode()).hexdigest()[:16],
        "gpu": gpu,
        "driver": driver,
    }


def device_info(device: torch.device, world_size: int) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    info = {
        "type": device.type,
        "name": name,
        "world_size": world_size,
        "cpu_threads": torch.get_num_threads(),
        "host": platform.node(),
    }
    if device.type == "cuda":  # what the dtype policy and the kernels' tiles follow (core.gpu)
        info["capability"] = "{}.{}".format(*gpu.capability(device))
    return info


@dataclass
class EpochRecord:
    run: int
    epoch: int
    lr: float
    train_time: float
    train_loss: float
    train_acc: float
    test_time: float
    test_loss: float
    test_acc: float
    total_train_time: float


@dataclass
class RunResult:
    run: int
    seed: int  # the run seed: --seed + run - 1
    test_acc: (
        float  # %, final epoch, with the recipe's evaluation (TTA if on); --val-split: the test set once, at the end
    )
    train_time: float  # s, see TIMING_PROTOCOL
    wall_time: float  # s since process start
    # s before the run's clock starts: model build, warm-up steps (cuDNN's search, Triton's compiles),
    # graph capture, the initial state's restore (and a resumed run's checkpoint); on an earlier run's
    # kept engine only its initial state built and copied in (run.engine); off the train clock, but
    # a user waits for it
    setup_time: float = 0.0
    epochs: list[EpochRecord] = field(default_factory=list)
    classes: tuple = ()  # class names, in label order (the data's)
    model_path: str = ""  # where its model file was written ("" = not written)
    val_acc: float | None = None  # --val-split: the last epoch's accuracy on the held-out images
    # s, what a user waits for: from the run's set-up to its end (evaluations, checkpoints, model file
    # included), and its estimate before the first epoch (``estimate``); 0: not measured
    run_time: float = 0.0
    estimated_time: float = 0.0
    streams: dict = field(default_factory=dict)  # the run's seed per stream (core.streams.Streams)
    model: object = field(default=None, repr=False, compare=False)  # the trained network, in memory (not logged)
    # --save-outputs: the files written, name -> path in the run folder (summary.json), and the arrays
    # themselves in memory (run.outputs.PerExample, not logged)
    output_files: dict = field(default_factory=dict)
    outputs: object = field(default=None, repr=False, compare=False)


def record(r: RunResult, names: dict | None = None) -> dict:
    """A run's metrics as plain data, without the in-memory model or the class names (summary.json
    holds those once, as "classes": every run of an invocation trains on the same data).
    ``names``: epoch fields renamed (``epoch_names``); no val_acc without --val-split."""
    doc = dataclasses.asdict(dataclasses.replace(r, model=None, outputs=None))
    del doc["model"], doc["classes"], doc["outputs"]
    if doc["val_acc"] is None:
        del doc["val_acc"]
    if not doc["output_files"]:  # no --save-outputs
        del doc["output_files"]
    doc["epochs"] = [rename(e, names) for e in doc["epochs"]]
    return doc


def rename(epoch: dict, names: dict | None) -> dict:
    return {(names or {}).get(k, k): v for k, v in epoch.items()}


HEADER_CLASSES = 3  # class names on the header's data line: CIFAR-100's 100 would fill the terminal


def class_names(classes, most: int = HEADER_CLASSES) -> str:
    """``classes`` as "a, b, c, ..." with at most ``most`` names."""
    names = list(classes)
    return ", ".join(names[:most]) + (", ..." if len(names) > most else "")


def summarize(results: list[RunResult], target_acc: float) -> dict:
    accs = [r.test_acc for r in results]
    times = [r.train_time for r in results]
    return {
        "runs": len(results),
        "acc_mean": statistics.fmean(accs),
        "acc_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
        "acc_min": min(accs),
        "acc_median": statistics.median(accs),
        "acc_max": max(accs),
        "target_acc": target_acc,
        "reached": sum(a >= target_acc for a in accs),
        "p_above_target": p_above(accs, target_acc),  # one-sided t-test of "mean > target" (None for 1 run)
        "train_time_mean": statistics.fmean(times),
        "train_time_max": max(times),
        "wall_time_max": max(r.wall_time for r in results),
        # the first run's set-up is the one a user waits for (compiles, cuDNN's search); later runs
        # in the process find them done
        "setup_time_first": results[0].setup_time,
        "setup_time_mean": statistics.fmean(r.setup_time for r in results),
    }


def summary_table(s: dict) -> str:
    p = "-" if s["p_above_target"] is None else f"{s['p_above_target']:.2g}"
    return "\n".join(
        [
            f"{'runs':>5} {'acc_mean':>8} {'acc_std':>7} {'acc_min':>7} {'acc_med':>7} {'reached':>9} {'p':>8} "
            f"{'time_mean':>9} {'time_max':>8}",
            f"{s['runs']:>5} {s['acc_mean']:>8.2f} {s['acc_std']:>7.2f} {s['acc_min']:>7.2f} "
            f"{s['acc_median']:>7.2f} {str(s['reached']) + '/' + str(s['runs']):>9} {p:>8} "
            f"{s['train_time_mean']:>9.2f} {s['train_time_max']:>8.2f}",
            f"(accuracy in % of the test set; reached: runs at or above {s['target_acc']:.2f}%; p: one-sided "
            f"t-test of a mean above it; times in s)",
        ]
    )


class OutputError(ConfigError):
    """The run's folder or one of its files cannot be written: printed as one line, exit 2."""


def _why(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def check_out_dir(root: str | Path) -> None:
    """Refuse an --out-dir that cannot hold run folders, before anything is read or written:
    a file, a path under a file, or a folder (or its nearest existing parent) that is not
    writable. Nothing is created here; ``RunLog.start`` makes the folder."""
    path = Path(root).expanduser().absolute()
    probe = path
    while True:
        try:
            mode = os.stat(probe).st_mode
            break
        except (FileNotFoundError, NotADirectoryError):  # not there yet, or under a file: look above
            if probe.parent == probe:
                raise OutputError(f"--out-dir {root}: no existing folder above it") from None
            probe = probe.parent
        except OSError as exc:  # e.g. inside a folder it may not enter: the OS's reason
            raise OutputError(f"--out-dir {root}: {probe}: {_why(exc)}") from None
    if not stat.S_ISDIR(mode):
        raise OutputError(f"--out-dir {root}: {probe} is not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise OutputError(f"--out-dir {root}: {probe} is not writable")


def _finite(value):
    """``value`` with every non-finite float replaced by None: strict JSON has no NaN or Infinity."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def to_json(doc: dict) -> str:
    return json.dumps(_finite(doc), indent=2, allow_nan=False) + "\n"


_OPEN: list[RunLog] = []  # started, unfinished logs: stop_open_logs closes them on any early exit


def stop_open_logs(status: str, reason: str) -> None:
    """Record why the run ended early in every open log (log.txt and summary.json) and close it.
    Best effort: this runs on the way out, after an error that may itself be a full disk."""
    for log in list(_OPEN):
        log.stop(status, reason)


class RunLog:
    """Rank 0's record of one invocation. ``enabled=False`` makes every call a no-op, but for
    ``follow``: another rank that knows rank 0's run folder leaves a summary.json there when it
    stops early and rank 0 has written none (rank 0 was killed)."""

    def __init__(self, cfg, out_root: str, enabled: bool, stream=None):
        # sys.stdout as it is now, not as it was at import: a caller (pytest's capture) may have replaced it since
        self.cfg, self.enabled, self.stream = cfg, enabled, sys.stdout if stream is None else stream
        self.out_root = out_root
        self.dir: Path | None = None
        self.meta: dict = {}
        self._pending: list[str] = []  # lines logged before the folder exists
        self._log = self._tsv = None
        self._results: list[RunResult] = []
        self._epochs: list[EpochRecord] = []  # the current run's, for a summary of a stopped run
        self._epochs_logged = 0  # a resumed run's first logged epoch is past 1: it gets the header
        self.names = epoch_names(cfg)  # --val-split: val_* columns and fields
        self.rank0_dir: Path | None = None  # another rank's: rank 0's run folder (``follow``)
        self.rank = 0
        if enabled:
            check_out_dir(out_root)

    def _write(self, f, text: str) -> None:
        try:
            f.write(text)
            f.flush()
        except OSError as exc:
            raise OutputError(f"cannot write {getattr(f, 'name', 'a log file')}: {_why(exc)}") from None

    def line(self, text: str = "", terminal: bool = True) -> None:
        """Print ``text`` (unless ``terminal`` is False) and append it to log.txt."""
        if not self.enabled:
            return
        if terminal:
            print(text, file=self.stream, flush=True)
        if self._log is None:
            self._pending.append(text)
        else:
            self._write(self._log, text + "\n")

    def _make_dir(self) -> None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        # the preset's name as a file name: a checkpoint's or the API's could hold "/" or "..", or a newline
        label = re.sub(r"[^A-Za-z0-9_.-]", "_", str(self.cfg.preset)).strip(".") or "run"
        base = Path(self.out_root) / f"{stamp}-{label}"
        self.dir, n = base, 1
        while self.dir.exists():  # two invocations in one second get two folders
            n += 1
            self.dir = base.with_name(f"{base.name}-{n}")
        try:
            self.dir.mkdir(parents=True)
            self._log = open(self.dir / "log.txt", "w")
            self._tsv = open(self.dir / "timing_log.tsv", "w")
        except OSError as exc:
            raise OutputError(f"--out-dir {self.out_root}: cannot create {self.dir}: {_why(exc)}") from None
        _OPEN.append(self)
        self._write(
            self._tsv, "\t".join(self.names.get(c, c) for c in TSV_COLUMNS) + "\n"
        )  # flushed: even a SIGKILL leaves the header
        for text in self._pending:
            self._write(self._log, text + "\n")
        self._pending = []

    def start(self, meta: dict) -> None:
        """Make the run folder (data and config are valid by now) and write the header: one line
        each for the build, the engine actually chosen, and the data (the class count and a few
        names); the full config and class list go to log.txt and summary.json only."""
        self.meta = meta
        if not self.enabled:
            return
        try:
            self._make_dir()
            self._header(meta)
            # the settings, for `train --config` to repeat the run: written whole (atomic) before the first epoch
            try:
                write_atomic(self.dir / CONFIG_FILE, config_file_text(self.cfg))
            except OSError as exc:
                raise OutputError(f"cannot write {self.dir / CONFIG_FILE}: {_why(exc)}") from None
        except (OutputError, OSError):  # e.g. a full disk: no run folder of empty logs left behind
            self._discard()
            raise

    def _discard(self) -> None:
        """Remove what a failed ``start`` created: its open files, their files and the folder."""
        self._close()
        if self.dir is not None:
            for name in ("log.txt", "timing_log.tsv", CONFIG_FILE):
                try:
                    (self.dir / name).unlink()
                except OSError:
                    pass
            try:
                self.dir.rmdir()  # only if empty: never anything this run did not write
            except OSError:
                pass
        self._log = self._tsv = self.dir = None

    def follow(self, rank0_dir: str, rank: int) -> None:
        """Another rank (``rank``) learns rank 0's run folder: when it stops early (``stop``: its lost
        contact, torchrun's SIGTERM) and the folder has no summary.json, it writes one, so a
        killed rank 0 still leaves a summary with the status and the reason. Never over rank 0's:
        rank 0 replaces a survivor's, a survivor never replaces one (``write_atomic`` without replace)."""
        if self.enabled or not rank0_dir:
            return
        self.rank0_dir, self.rank = Path(rank0_dir), rank
        _OPEN.append(self)

    def _survivor_summary(self, status: str, reason: str) -> None:
        doc = self._summary_doc(
            [],
            None,
            status,
            stopped=reason,
            written_by=f"rank {self.rank}: rank 0 left no summary (it was gone); its log.txt has its last epochs",
        )
        try:
            if self.rank0_dir.is_dir() and not (self.rank0_dir / "summary.json").exists():
                write_atomic(self.rank0_dir / "summary.json", to_json(doc), replace=False)
        except OSError:  # rank 0 or another survivor wrote it meanwhile, or the folder is not reachable
            pass

    def _header(self, meta: dict) -> None:
        dev = meta["device"]
        name = "" if dev["name"] in ("", dev["type"]) else f" {dev['name']}"
        if dev.get("capability"):
            name += f" (compute capability {dev['capability']})"
        self.line(
            f"fastcifar {meta['versions']['fastcifar'] or '(source)'} | preset {self.cfg.preset} | "
            f"{dev['type']}{name} x{dev['world_size']} | torch {meta['versions']['torch']}"
        )
        prov = meta.get("provenance")
        if prov:
            commit = (prov["commit"] or "unknown")[:12] + (" (dirty)" if prov["dirty"] else "")
            gpu = f" | gpu {prov['gpu']}, driver {prov['driver'] or 'unknown'}" if prov["gpu"] else ""
            self.line(f"commit {commit} | config {prov['config_hash']}{gpu}", terminal=False)
        engine = meta.get("engine")
        if engine:
            self.line("engine: " + ", ".join(f"{k} {v}" for k, v in engine.items()))
        classes = meta.get("classes") or []
        self.line(f"data: {meta['data']}" + (f" ({class_names(classes)})" if classes else ""))
        if len(classes) > HEADER_CLASSES:
            self.line(f"classes: {class_names(classes, len(classes))}", terminal=False)
        self.line("config: " + json.dumps(dataclasses.asdict(self.cfg)), terminal=False)
        self.line(f"logs: {self.dir}")

    def epoch(self, r: EpochRecord) -> None:
        if not self.enabled:
            return
        self._epochs.append(r)
        # the TSV row first: whoever sees the printed line (and stops the run) finds it on disk
        self._write(
            self._tsv,
            "\t".join(
                f"{getattr(r, c):.6g}" if isinstance(getattr(r, c), float) else str(getattr(r, c)) for c in TSV_COLUMNS
            )
            + "\n",
        )
        if r.epoch == 1 or not self._epochs_logged:  # a resumed run starts past epoch 1
            if not self._epochs_logged:
                self.line(lr_note(self.cfg))
            self.line(EPOCH_HEADER.replace("test_acc", f"{self.names.get('test_acc', 'test_acc'):>8}"))
        self._epochs_logged += 1
        self.line(
            f"{r.run:>4} {r.epoch:>5} {r.lr:>8.4f} {r.train_loss:>10.4f} {r.train_acc:>9.2f} "
            f"{r.test_acc:>8.2f} {r.train_time:>8.2f} {r.total_train_time:>8.2f} {r.test_time:>7.2f}"
        )

    def run_done(self, res: RunResult, target_acc: float) -> None:
        self._results.append(res)
        here, self._epochs = self._epochs, []  # the epochs this process trained (and logged)
        # which clock counts what, in the lines themselves: train is the epochs' training steps (the
        # figure's clock), wall the process since it started (imports, data and evaluations included),
        # and the took line this run from its set-up to its model file
        train = f"train {res.train_time:.2f} s of training steps"
        wall = f"wall {res.wall_time:.2f} s since the process started"
        resumed = len(res.epochs) - len(here)
        if resumed > 0:  # see TIMING_PROTOCOL: the train clock spans the checkpoint, the wall clock does not
            mine = sum(r.train_time for r in here)
            train += (
                f" over {len(res.epochs)} epochs ({res.train_time - mine:.2f} s in the {resumed} before "
                f"the resume, {mine:.2f} s in this process)"
            )
        self.line(
            f"run {res.run}: test_acc {res.test_acc:.2f}% {train}, {wall}, setup {res.setup_time:.2f} s "
            f"({target_note(self.cfg, res.test_acc, target_acc)})"
        )
        if res.run_time:
            evaluation = sum(r.test_time for r in here)
            self.line(
                f"run {res.run}: took {res.run_time:.1f} s in all, set-up to model file (setup "
                f"{res.setup_time:.1f} s, training {sum(r.train_time for r in here):.1f} s, evaluation "
                f"{evaluation:.1f} s; estimated {res.estimated_time:.1f} s)"
            )

    def _summary_doc(self, results: list[RunResult], summary: dict | None, status: str, **extra) -> dict:
        return {
            **self.meta,
            "status": status,
            **extra,
            "config": dataclasses.asdict(self.cfg),
            "timing_protocol": TIMING_PROTOCOL,
            "summary": summary,
            "epoch_eval_set": "validation" if self.names else "test",
            "results": [record(r, self.names) for r in results],
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
        }

    def _write_summary(self, doc: dict) -> None:
        try:
            write_atomic(self.dir / "summary.json", to_json(doc))
        except OSError as exc:
            raise OutputError(f"cannot write {self.dir / 'summary.json'}: {_why(exc)}") from None

    def _close(self) -> None:
        for f in (self._log, self._tsv):
            if f is None:  # a start that failed before opening it
                continue
            try:
                f.close()
            except OSError:
                pass
        if self in _OPEN:
            _OPEN.remove(self)

    def finish(self, results: list[RunResult]) -> dict:
        summary = summarize(results, self.cfg.target_acc)
        if not self.enabled:
            self._close()  # a follower: the run finished, nothing to stand in for
            return summary
        self.line(summary_table(summary))
        self._write_summary(self._summary_doc(results, summary, "finished"))
        self.line(f"summary: {self.dir / 'summary.json'}")
        self._close()
        return summary

    def stop(self, status: str, reason: str) -> None:
        """End a started log early: the reason as the last line of log.txt, and a summary.json
        with ``status`` (e.g. "diverged", "interrupted", "failed"), the finished runs and the
        epochs of the unfinished one. Never raises: the caller is already on its way out. Another
        rank that follows rank 0's folder writes its own summary there, if rank 0 left none."""
        if not self.enabled and self in _OPEN:
            self._survivor_summary(status, reason)
            self._close()
            return
        if not self.enabled or self._log is None or self not in _OPEN:
            return
        try:
            self._log.write(f"stopped ({status}): {reason}\n")
            self._log.flush()
            summary = summarize(self._results, self.cfg.target_acc) if self._results else None
            partial = [rename(dataclasses.asdict(r), self.names) for r in self._epochs]
            self._write_summary(
                self._summary_doc(self._results, summary, status, stopped=reason, unfinished_run_epochs=partial)
            )
        except (OSError, OutputError):
            pass
        finally:
            self._close()
