"""Faults from the OS and the file system (issue 48, items 4, 5, 8, 9 and the minor list): each ends
with one line naming the path and the reason, exit 2 (3 for a lost peer), no traceback, no debris,
and nothing written before lost."""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import subprocess
import sys
import zlib
import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from cli import ROOT, SHORT, env, run_dirs, run_train
from conftest import one_line_error, write_image_folder, write_official

from fastcifar.core import atomic, signals
from fastcifar.data import DataError, load_dataset


def quiet(_msg):
    pass


def as_nobody():
    """A preexec_fn that drops root to nobody, so file permissions apply; None when impossible."""
    if os.geteuid() != 0:
        return None

    def drop():
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    return drop


def run_module(module: str, args, preexec=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=timeout, preexec_fn=preexec)


# ---------------------------------------------------------------------------------------------
# Item 8: write_atomic leaves the old file or the new one, never a temporary

STEPS = ["open", "fdopen", "fsync", "chmod", "replace", "close", "mkstemp"]


@pytest.mark.parametrize("step", STEPS)
def test_a_signal_at_any_step_of_write_atomic_leaves_no_temporary(tmp_path, monkeypatch, step):
    """The step runs, then a SIGTERM arrives (``signals.Interrupted``, as the handler raises it):
    the folder holds the previous file, whole, and nothing else."""
    import tempfile
    target = tmp_path / "summary.json"
    target.write_text("old")
    owner = tempfile if step == "mkstemp" else os
    real = getattr(owner, step)

    def then_signal(*args, **kwargs):
        out = real(*args, **kwargs)
        raise signals.Interrupted(signal.SIGTERM)
    monkeypatch.setattr(owner, step, then_signal)
    try:
        atomic.write_atomic(target, "new")
    except signals.Interrupted:
        pass
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
    assert target.read_text() in ("old", "new")


def test_write_atomic_fsyncs_the_file_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    calls = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append(("fsync", stat.S_ISDIR(os.fstat(fd).st_mode)))
        return real_fsync(fd)

    def replace(a, b):
        calls.append(("replace", None))
        return real_replace(a, b)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    atomic.write_atomic(tmp_path / "x.json", "{}")
    assert calls == [("fsync", False), ("replace", None), ("fsync", True)]


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temporaries_of_a_killed_writer_are_removed_and_live_ones_kept(tmp_path):
    old = time_ago = 3600
    dead = tmp_path / f".checkpoint.pt.{dead_pid()}-0123abcd.tmp"
    legacy = tmp_path / ".summary.json.k3j_h5g6.tmp"  # tempfile.mkstemp's name, before pids
    live = tmp_path / f".model.safetensors.{os.getppid()}-0123abcd.tmp"  # a live writer: kept
    fresh_legacy = tmp_path / ".summary.json.abcdefgh.tmp"  # young: its writer may be running
    foreign = tmp_path / f".notes.txt.{dead_pid()}-0123abcd.tmp"  # not one of the run's files
    for p in (dead, legacy, live, fresh_legacy, foreign):
        p.write_bytes(b"")
    os.utime(legacy, (os.path.getmtime(legacy) - time_ago, os.path.getmtime(legacy) - old))
    removed = atomic.remove_stale(tmp_path, ("checkpoint.pt", "summary.json", "model*.safetensors"))
    assert sorted(removed) == sorted([dead, legacy])
    assert live.exists() and fresh_legacy.exists() and foreign.exists()


def test_write_atomic_clears_its_targets_stale_temporaries(tmp_path):
    stale = tmp_path / f".summary.json.{dead_pid()}-0123abcd.tmp"
    stale.write_bytes(b"")
    atomic.write_atomic(tmp_path / "summary.json", "{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_resume_clears_the_stale_temporaries_beside_its_checkpoint(tmp_path):
    """A run killed mid-write (SIGKILL) leaves temporaries in its folder; the resume from its
    checkpoint removes them, also when the checkpoint itself then turns out unusable."""
    from fastcifar.core.config import Config
    from fastcifar.models.files import CheckpointError
    from fastcifar.run import state
    ckpt = tmp_path / "checkpoint.pt"
    ckpt.write_bytes(b"not a checkpoint")
    pid = dead_pid()
    stale = [tmp_path / f".{n}.{pid}-0123abcd.tmp" for n in ("checkpoint.pt", "summary.json", "model.safetensors")]
    for p in stale:
        p.write_bytes(b"")
    with pytest.raises(CheckpointError):
        state._read_state(ckpt, Config(), 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]
