"""What a run leaves behind: fixed-width lines on stdout and in log.txt, timing_log.tsv, summary.json.

Only rank 0 makes a ``RunLog`` that writes; other ranks get one that does nothing, so the trainer
calls it unconditionally. summary.json is written to a temporary file and renamed, so a reader
never sees half of one.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import torch

TIMING_PROTOCOL = ("train time: summed per-epoch training time (on-device augmentation included), "
                   "device synchronized at each epoch's start and end; per-epoch evaluation and the "
                   "one-off warm-up steps before the clock starts are excluded. wall time: from "
                   "process start to the end of the run's last evaluation.")

EPOCH_HEADER = f"{'run':>4} {'epoch':>5} {'lr':>8} {'train_loss':>10} {'train_acc':>9} " \
               f"{'test_acc':>8} {'epoch_s':>8} {'train_s':>8}"
TSV_COLUMNS = ("run", "epoch", "lr", "train_time", "train_loss", "train_acc",
               "test_time", "test_loss", "test_acc", "total_train_time")


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
        "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "triton": version_of("triton"), "numpy": version_of("numpy"),
        "dali": version_of("nvidia-dali-cuda130"), "fastcifar": version_of("fastcifar"),
    }


def device_info(device: torch.device, world_size: int) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {"type": device.type, "name": name, "world_size": world_size,
            "cpu_threads": torch.get_num_threads(), "host": platform.node()}


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
    seed: int
    test_acc: float  # %, final epoch, with the recipe's evaluation (TTA if on)
    train_time: float  # s, see TIMING_PROTOCOL
    wall_time: float  # s since process start
    epochs: list[EpochRecord] = field(default_factory=list)
    classes: tuple = ()  # class names, in label order (the data's)
    model_path: str = ""  # where its model file was written ("" = not written)
    model: object = field(default=None, repr=False, compare=False)  # the trained network, in memory (not logged)


def record(r: RunResult) -> dict:
    """A run's metrics as plain data, without the in-memory model."""
    doc = dataclasses.asdict(dataclasses.replace(r, model=None))
    del doc["model"]
    return doc


def summarize(results: list[RunResult], target_acc: float) -> dict:
    accs = [r.test_acc for r in results]
    times = [r.train_time for r in results]
    return {
        "runs": len(results),
        "acc_mean": statistics.fmean(accs), "acc_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
        "acc_min": min(accs), "acc_median": statistics.median(accs), "acc_max": max(accs),
        "target_acc": target_acc, "reached": sum(a >= target_acc for a in accs),
        "train_time_mean": statistics.fmean(times), "train_time_max": max(times),
        "wall_time_max": max(r.wall_time for r in results),
    }


def summary_table(s: dict) -> str:
    return "\n".join([
        f"{'runs':>5} {'acc_mean':>8} {'acc_std':>7} {'acc_min':>7} {'acc_med':>7} {'reached':>9} "
        f"{'time_mean':>9} {'time_max':>8}",
        f"{s['runs']:>5} {s['acc_mean']:>8.2f} {s['acc_std']:>7.2f} {s['acc_min']:>7.2f} "
        f"{s['acc_median']:>7.2f} {str(s['reached']) + '/' + str(s['runs']):>9} "
        f"{s['train_time_mean']:>9.2f} {s['train_time_max']:>8.2f}",
        f"(accuracy in % of the test set; reached: runs at or above {s['target_acc']:.2f}%; times in s)",
    ])


def write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class RunLog:
    """Rank 0's record of one invocation. ``enabled=False`` makes every call a no-op."""

    def __init__(self, cfg, out_root: str, enabled: bool, stream=sys.stdout):
        self.cfg, self.enabled, self.stream = cfg, enabled, stream
        self.dir: Path | None = None
        self.meta: dict = {}
        self._epochs_logged = 0
        if not enabled:
            return
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        base = Path(out_root) / f"{stamp}-{cfg.preset}"
        self.dir, n = base, 1
        while self.dir.exists():  # two invocations in one second get two folders
            n += 1
            self.dir = base.with_name(f"{base.name}-{n}")
        self.dir.mkdir(parents=True)
        self._log = open(self.dir / "log.txt", "w")
        self._tsv = open(self.dir / "timing_log.tsv", "w")
        self._tsv.write("\t".join(TSV_COLUMNS) + "\n")

    def line(self, text: str = "") -> None:
        if not self.enabled:
            return
        print(text, file=self.stream, flush=True)
        self._log.write(text + "\n")
        self._log.flush()

    def start(self, meta: dict) -> None:
        self.meta = meta
        self.line(f"fastcifar {meta['versions']['fastcifar'] or ''} | preset {self.cfg.preset} | "
                  f"{meta['device']['type']} {meta['device']['name']} x{meta['device']['world_size']} | "
                  f"torch {meta['versions']['torch']}")
        self.line(f"data: {meta['data']}")
        self.line("config: " + json.dumps(dataclasses.asdict(self.cfg)))
        if self.dir:
            self.line(f"logs: {self.dir}")

    def epoch(self, r: EpochRecord) -> None:
        if not self.enabled:
            return
        if r.epoch == 1 or not self._epochs_logged:  # a resumed run starts past epoch 1
            self.line(EPOCH_HEADER)
        self._epochs_logged += 1
        self.line(f"{r.run:>4} {r.epoch:>5} {r.lr:>8.4f} {r.train_loss:>10.4f} {r.train_acc:>9.2f} "
                  f"{r.test_acc:>8.2f} {r.train_time:>8.2f} {r.total_train_time:>8.2f}")
        self._tsv.write("\t".join(f"{getattr(r, c):.6g}" if isinstance(getattr(r, c), float)
                                  else str(getattr(r, c)) for c in TSV_COLUMNS) + "\n")
        self._tsv.flush()

    def run_done(self, res: RunResult, target_acc: float) -> None:
        verdict = "reached" if res.test_acc >= target_acc else "missed"
        self.line(f"run {res.run}: test_acc {res.test_acc:.2f}% train {res.train_time:.2f} s "
                  f"wall {res.wall_time:.2f} s (target {target_acc:.2f}%: {verdict})")

    def finish(self, results: list[RunResult]) -> dict:
        summary = summarize(results, self.cfg.target_acc)
        if not self.enabled:
            return summary
        self.line(summary_table(summary))
        doc = {**self.meta, "config": dataclasses.asdict(self.cfg), "timing_protocol": TIMING_PROTOCOL,
               "summary": summary, "results": [record(r) for r in results],
               "date": datetime.datetime.now().isoformat(timespec="seconds")}
        write_atomic(self.dir / "summary.json", json.dumps(doc, indent=2) + "\n")
        self.line(f"summary: {self.dir / 'summary.json'}")
        self._log.close()
        self._tsv.close()
        return summary
