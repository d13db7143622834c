"""Running the trainer as users do: a process of its own (forked from one that has imported torch,
where that changes nothing: forkserver.py), on the CPU, with a short recipe."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import forkserver

ROOT = Path(__file__).resolve().parents[2]
# A recipe small enough for 2 CPU cores: narrow ResNet-9 (the seed preset), a few epochs, one
# untimed warm-up step.
SHORT = [
    "--preset",
    "resnet9",
    "--device",
    "cpu",
    "--widths",
    "8,16,32,64",
    "--batch-size",
    "100",
    "--epochs",
    "4",
    "--warmup-epochs",
    "1",
    "--warmup-steps",
    "1",
    "--eval-batch-size",
    "200",
]
# The `fast` preset (airbench94's recipe) made as small: narrow FastNet, whitening from 200 images.
FAST_SHORT = [
    "--preset",
    "fast",
    "--device",
    "cpu",
    "--widths",
    "16,32,32",
    "--batch-size",
    "100",
    "--epochs",
    "4",
    "--warmup-epochs",
    "1",
    "--warmup-steps",
    "1",
    "--eval-batch-size",
    "200",
    "--whiten-images",
    "200",
    "--whiten-bias-epochs",
    "2",
]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now: MASTER_PORT for ranks started by hand or a c10d rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*entry: str) -> list[str]:
    """torchrun of this interpreter's torch on one machine (--standalone: c10d on a free local port),
    starting two processes of `entry`: a script and its arguments, or by default the trainer. Each
    rank is forked from a process that has imported torch (forkserver.client), unless ``entry``
    starts with --no-python (the test's own rank command)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    if entry[:1] == ("--no-python",):
        return [*launcher, *entry]
    return [*launcher, "--no-python", *forkserver.client(), *(entry or ("-m", "fastcifar.train"))]


def as_a_shell_starts_it() -> None:
    """``preexec_fn`` of a command a test interrupts: SIGINT and SIGTERM at their defaults and
    unblocked in the child, as a terminal's shell starts it (a child inherits an ignored or blocked
    signal). Under pytest-xdist such a command was seen to finish through a SIGINT (exit 0) with no
    test found changing the worker's signal state: the cause is unknown, the child's start is fixed."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def env() -> dict:
    e = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    e.pop("WORLD_SIZE", None)
    e.pop("RANK", None)
    return e


forkserver.BASE_ENV.update(env())  # now, at collection: before any test has changed the environment


def env_without_interpreter(**changes: str) -> dict[str, str]:
    """This process's environment without TRITON_INTERPRET (tests/conftest.py sets it on a machine
    without a GPU), with ``changes``: for a subprocess whose Triton must not be the interpreter."""
    e = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    e.update(changes)
    return e


def bench_results() -> dict[str, bytes]:
    """Every file in bench/results/ with its content: a benchmark's CPU form must leave it as it
    was, and an appended row changes no file name."""
    results = ROOT / "bench" / "results"
    return {str(p.relative_to(results)): p.read_bytes() for p in sorted(results.rglob("*")) if p.is_file()}


def run_train(args, timeout=300, launcher=None, extra_env=None) -> subprocess.CompletedProcess:
    """``launcher`` (by default the trainer: python -m fastcifar.train) with ``args``, from the
    repository root, in env() with ``extra_env`` on top; its output captured."""
    cmd = (launcher or [sys.executable, "-m", "fastcifar.train"]) + [str(a) for a in args]
    e = {**env(), **(extra_env or {})}
    return forkserver.run(cmd, env=e, cwd=ROOT, timeout=timeout, capture_output=True, text=True)


def train_here(args, capsys) -> subprocess.CompletedProcess:
    """The trainer's ``main`` in this process, its exit status and output as ``run_train`` gives
    them: for a refusal, whose test is its line, its status and what it wrote, not the
    interpreter's start (about 4 s of CPU a subprocess, most of the suite's time)."""
    from fastcifar.train import main

    capsys.readouterr()
    argv = [str(a) for a in args]
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's refusals
        code = exc.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, out.out, out.err)


def run_dirs(out: Path) -> list[Path]:
    return sorted(p for p in out.iterdir() if p.is_dir()) if out.exists() else []


def summary_of(out: Path) -> dict:
    (run_dir,) = run_dirs(out)
    return json.loads((run_dir / "summary.json").read_text())


EPOCH_FIGURES = ("train_loss", "train_acc", "test_loss", "test_acc")


def epochs_of(summary: dict, figures=EPOCH_FIGURES) -> list[tuple]:
    """A summary.json's first run, epoch by epoch: one tuple of ``figures`` each (what two runs
    that must train alike compare)."""
    return [tuple(e[f] for f in figures) for e in summary["results"][0]["epochs"]]


# a tiny ResNet-9 on 200 training images: a few seconds on one thread
TINY = [
    "--preset",
    "resnet9",
    "--device",
    "cpu",
    "--widths",
    "8,16,32,64",
    "--batch-size",
    "50",
    "--epochs",
    "3",
    "--warmup-epochs",
    "1",
    "--warmup-steps",
    "1",
    "--eval-batch-size",
    "200",
    "--loader",
    "torch",
]


def run_script(code: str, *args, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = forkserver.run(
        [sys.executable, "-c", code, *map(str, args)],
        env=env(),
        cwd=ROOT,
        timeout=timeout,
        capture_output=True,
        text=True,
    )
    return proc, time.monotonic() - t0


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def start_log(out: Path):
    from fastcifar.core.config import Config
    from fastcifar.run.report import RunLog

    log = RunLog(Config(), str(out), enabled=True, stream=open(os.devnull, "w"))
    log.start(
        {
            "versions": {"fastcifar": None, "torch": "x"},
            "classes": [],
            "device": {"type": "cpu", "name": "cpu", "world_size": 1},
            "data": "test data",
        }
    )
    return log
