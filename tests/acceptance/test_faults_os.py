"""Faults from the OS and the file system (issue 48, items 4, 5, 8, 9 and the minor list): each ends
with one line naming the path and the reason, exit 2 (3 for a lost peer), no traceback, no debris,
and nothing written before lost."""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import forkserver
import numpy as np
import pytest
from cli import ROOT, SHORT, dead_pid, env, run_dirs, start_log, train_here
from conftest import one_line_error, write_image_folder, write_official
from models import tiny_model_file
from PIL import Image

from fastcifar.core import atomic, signals
from fastcifar.data import DataError, load_dataset


def quiet(_msg):
    pass


def without_permission_override() -> list[str]:
    """A command prefix under which file permissions apply to root too (root ignores them): the
    capabilities that override them dropped with setpriv. The test is skipped when that is
    impossible (not root, no setpriv)."""
    if os.geteuid() != 0:
        pytest.skip("not root: the test changes modes that would then lock out the owner")
    caps = "-dac_override,-dac_read_search"
    prefix = ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}", "--"]
    try:
        subprocess.run([*prefix, sys.executable, "-c", "pass"], check=True, timeout=60, capture_output=True)
    except (OSError, subprocess.SubprocessError):
        pytest.skip("setpriv cannot drop the capabilities here")
    return prefix


# ---------------------------------------------------------------------------------------------
# Item 8: write_atomic leaves the old file or the new one, never a temporary

STEPS = ["open", "fsync", "chmod", "replace", "close", "mkstemp"]


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
        real(*args, **kwargs)  # the step happens; the signal lands just after it
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


def test_stale_temporaries_of_a_killed_writer_are_removed_and_live_ones_kept(tmp_path):
    old = time_ago = 3600
    here = atomic._host()
    dead = tmp_path / f".checkpoint.pt.{here}.{dead_pid()}-0123abcd.tmp"
    legacy = tmp_path / ".summary.json.k3j_h5g6.tmp"  # tempfile.mkstemp's name, before pids
    live = tmp_path / f".model.safetensors.{here}.{os.getppid()}-0123abcd.tmp"  # a live writer: kept
    elsewhere = tmp_path / f".checkpoint.pt.another-node.{dead_pid()}-0123abcd.tmp"  # young, another host: kept
    fresh_legacy = tmp_path / ".summary.json.abcdefgh.tmp"  # young: its writer may be running
    foreign = tmp_path / f".notes.txt.{here}.{dead_pid()}-0123abcd.tmp"  # not one of the run's files
    for p in (dead, legacy, live, fresh_legacy, foreign, elsewhere):
        p.write_bytes(b"")
    os.utime(legacy, (os.path.getmtime(legacy) - time_ago, os.path.getmtime(legacy) - old))
    removed = atomic.remove_stale(tmp_path, ("checkpoint.pt", "summary.json", "model*.safetensors"))
    assert sorted(removed) == sorted([dead, legacy])
    assert live.exists() and fresh_legacy.exists() and foreign.exists() and elsewhere.exists()


def test_write_atomic_clears_its_targets_stale_temporaries(tmp_path):
    stale = tmp_path / f".summary.json.{atomic._host()}.{dead_pid()}-0123abcd.tmp"
    stale.write_bytes(b"")
    atomic.write_atomic(tmp_path / "summary.json", "{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


# ---------------------------------------------------------------------------------------------
# Item 4: an image that is not 32x32, or a decompression bomb, is refused by its header


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header says ``width`` x ``height`` but whose pixel data is a few bytes: decoding
    it would fail, so a refusal naming its size shows the header was checked before any decode."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b"")
    )


def one_image(root: Path, split: str = "train") -> Path:
    return sorted((root / split).rglob("*.png"))[0]


@pytest.mark.parametrize(
    "size, message",
    [
        ((20000, 20000), "image too large to decode \\(Image size \\(400000000 pixels\\) exceeds limit"),  # PIL's error
        (
            (10000, 10000),
            "image too large to decode \\(Image size \\(100000000 pixels\\) exceeds limit",
        ),  # PIL's warning
        ((9000, 9000), "image is 9000x9000, too large to decode \\(at most 67108864 pixels\\)"),
        ((40, 30), "image is 40x30, expected 32x32"),
    ],
)
def test_an_image_of_another_size_is_refused_by_its_header(tmp_path, recwarn, size, message):
    root, _ = write_image_folder(tmp_path / "imgs", n_train=20, n_test=10)
    bad = one_image(root)
    bad.write_bytes(png_header(*size))
    with pytest.raises(DataError, match=f"{bad}: {message}"):
        load_dataset(root, cache_dir=tmp_path / "cache", log=quiet)
    assert not [w for w in recwarn if "DecompressionBomb" in type(w.message).__name__]


@pytest.mark.slow  # over 2 s on 2 cores
def test_train_refuses_a_decompression_bomb_in_one_line(tmp_path, capsys):
    root, _ = write_image_folder(tmp_path / "imgs", n_train=20, n_test=10)
    bad = one_image(root, "test")
    bad.write_bytes(png_header(20000, 20000))
    out = tmp_path / "runs"
    proc = train_here(["--data", root, "--out-dir", out, "--cache-dir", tmp_path / "cache", *SHORT], capsys)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = one_line_error(proc.stderr)
    assert line.startswith("fastcifar: error: ") and str(bad) in line and "too large to decode" in line, line
    assert not run_dirs(out)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    return tiny_model_file(tmp_path_factory.mktemp("model") / "model.safetensors")


def predict(args, capsys):
    from fastcifar.predict import main

    code = main([str(a) for a in args])
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return code, [line for line in out.err.splitlines() if line.strip()], out.out


def test_predict_refuses_a_decompression_bomb_by_its_header_and_classifies_the_rest(model_file, tmp_path, capsys):
    folder = tmp_path / "mine"
    folder.mkdir()
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(folder / "ok.png")
    (folder / "bomb.png").write_bytes(png_header(20000, 20000))
    code, err, out = predict([model_file, folder], capsys)
    assert code == 1
    assert len(err) == 1 and err[0].startswith(
        f"{folder / 'bomb.png'}: image too large to decode (Image size (400000000"
    )
    assert "ok.png: " in out


# ---------------------------------------------------------------------------------------------
# Item 5: every OS error is one line naming the path and the OS's reason


def test_an_unreadable_image_is_named_with_the_os_reason(tmp_path, monkeypatch):
    root, _ = write_image_folder(tmp_path / "imgs", n_train=20, n_test=10)
    bad = one_image(root)
    from fastcifar.core import readfile

    real = os.open

    def deny(path, *args, **kwargs):
        if str(path) == str(bad):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(readfile.os, "open", deny)
    with pytest.raises(DataError, match=f"{bad.name}: cannot read image: Permission denied$"):
        load_dataset(root, cache_dir=tmp_path / "cache", log=quiet)


def test_a_fifo_or_a_loop_among_the_images_is_named_not_waited_on_or_skipped(tmp_path):
    root, _ = write_image_folder(tmp_path / "imgs", n_train=20, n_test=10)
    bad = one_image(root)
    bad.unlink()
    os.mkfifo(bad)  # reading it would block for ever
    with pytest.raises(DataError, match=f"{bad.name}: cannot read image: a FIFO \\(named pipe\\), not a regular file"):
        load_dataset(root, cache_dir=tmp_path / "cache", log=quiet)
    bad.unlink()
    bad.symlink_to(bad.name)  # a loop
    with pytest.raises(DataError, match=f"{bad.name}: cannot read image: Too many levels of symbolic links"):
        load_dataset(root, cache_dir=tmp_path / "cache", log=quiet)


def test_an_unreadable_class_folder_is_named_not_called_a_class_mismatch(tmp_path, monkeypatch):
    root, _ = write_image_folder(tmp_path / "imgs", n_train=20, n_test=10)
    locked = root / "test" / "truck"
    real = os.scandir

    def deny(path="."):
        if str(path) == str(locked):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", deny)
    with pytest.raises(DataError, match=f"{locked}: cannot read folder: Permission denied$"):
        load_dataset(root, cache_dir=tmp_path / "cache", log=quiet)


@pytest.mark.parametrize("what", ["fifo", "dev-zero", "folder", "unreadable"])
def test_an_official_batch_that_is_not_a_readable_file_says_why(tmp_path, monkeypatch, what):
    folder, _ = write_official(tmp_path / "data")
    batch = folder / "data_batch_2"
    batch.unlink()
    expected = {
        "fifo": "a FIFO \\(named pipe\\), not a regular file",
        "dev-zero": "a character device, not a regular file",
        "folder": "a folder, not a regular file",
        "unreadable": "Permission denied",
    }[what]
    if what == "fifo":
        os.mkfifo(batch)
    elif what == "dev-zero":
        batch.symlink_to("/dev/zero")
    elif what == "folder":
        batch.mkdir()
    else:
        batch.write_bytes(b"x")
        from fastcifar.core import readfile

        real = os.open
        monkeypatch.setattr(
            readfile.os,
            "open",
            lambda p, *a, **k: (
                (_ for _ in ()).throw(PermissionError(errno.EACCES, "Permission denied", str(p)))
                if str(p) == str(batch)
                else real(p, *a, **k)
            ),
        )
    with pytest.raises(DataError, match=f"{batch}: cannot read CIFAR-10 batch file: {expected}$"):
        load_dataset(folder, log=quiet)


def test_a_batch_folder_not_named_as_released_with_a_fifo_batch_is_still_read_as_one(tmp_path):
    folder, _ = write_official(tmp_path / "data")
    plain = folder.rename(tmp_path / "mine")
    (plain / "data_batch_1").unlink()
    os.mkfifo(plain / "data_batch_1")
    with pytest.raises(DataError, match="data_batch_1: cannot read CIFAR-10 batch file: a FIFO"):
        load_dataset(plain, log=quiet)


def test_data_that_is_a_device_is_not_called_missing(tmp_path):
    with pytest.raises(DataError, match="^/dev/zero: a character device, not a data file or folder$"):
        load_dataset("/dev/zero", log=quiet)
    loop = tmp_path / "loop"
    loop.symlink_to(loop.name)
    with pytest.raises(DataError, match="loop: Too many levels of symbolic links$"):
        load_dataset(loop, log=quiet)


@pytest.mark.slow  # over 2 s on 2 cores
def test_train_with_an_unreadable_batch_enforced_is_one_line(tmp_path):
    """The real thing, without monkeypatching: permissions enforced, the batch is mode 000."""
    prefix = without_permission_override()
    folder, _ = write_official(tmp_path / "data")
    (folder / "data_batch_3").chmod(0)
    proc = forkserver.run(
        [
            *prefix,
            sys.executable,
            "-m",
            "fastcifar.train",
            "--data",
            str(folder),
            "--out-dir",
            str(tmp_path / "runs"),
            *SHORT,
        ],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = one_line_error(proc.stderr)
    assert line == f"fastcifar: error: {folder / 'data_batch_3'}: cannot read CIFAR-10 batch file: Permission denied"


def test_out_dir_inside_a_folder_it_may_not_enter_is_one_line(tmp_path, monkeypatch):
    from fastcifar.run import report

    locked = tmp_path / "locked"
    real = os.stat

    def stat_(path, *args, **kwargs):
        if str(path).startswith(str(locked) + "/"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    locked.mkdir()
    monkeypatch.setattr(report.os, "stat", stat_)
    with pytest.raises(report.OutputError, match=f"--out-dir {locked}/runs: {locked}/runs: Permission denied$"):
        report.check_out_dir(locked / "runs")


@pytest.mark.slow  # over 2 s on 2 cores
def test_out_dir_inside_a_folder_it_may_not_enter_enforced(tmp_path):
    prefix = without_permission_override()
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0)
    code = (
        "import sys\nfrom fastcifar.run import report\n"
        "try:\n    report.check_out_dir(sys.argv[1])\nexcept report.OutputError as e:\n    print(e)\n"
    )
    proc = forkserver.run(
        [*prefix, sys.executable, "-c", code, str(locked / "runs")],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    assert proc.stdout.strip() == f"--out-dir {locked}/runs: {locked}/runs: Permission denied"


@pytest.mark.parametrize("what", ["unreadable", "fifo", "loop"])
def test_a_model_file_that_cannot_be_read_says_why(model_file, tmp_path, monkeypatch, what):
    from fastcifar.models.files import CheckpointError, load_model

    bad = tmp_path / "model.safetensors"
    if what == "unreadable":
        bad.write_bytes(model_file.read_bytes())
        from fastcifar.core import readfile

        real = os.open
        monkeypatch.setattr(
            readfile.os,
            "open",
            lambda p, *a, **k: (
                (_ for _ in ()).throw(PermissionError(errno.EACCES, "Permission denied", str(p)))
                if str(p) == str(bad)
                else real(p, *a, **k)
            ),
        )
    elif what == "fifo":
        os.mkfifo(bad)
    else:
        bad.symlink_to(bad.name)
    expected = {
        "unreadable": "Permission denied",
        "fifo": "a FIFO \\(named pipe\\), not a regular file",
        "loop": "Too many levels of symbolic links",
    }[what]
    with pytest.raises(CheckpointError, match=f"{bad}: cannot read model file: {expected}$"):
        load_model(bad)


@pytest.mark.parametrize("what", ["loop", "fifo"])
def test_predict_reports_a_symlink_loop_or_fifo_in_a_folder_instead_of_skipping_it(model_file, tmp_path, capsys, what):
    """One line naming the file, the others classified, exit 1 (predict's "some could not be read")."""
    folder = tmp_path / "mine"
    folder.mkdir()
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(folder / "ok.png")
    bad = folder / "bad.png"
    if what == "loop":
        bad.symlink_to(bad.name)
    else:
        os.mkfifo(bad)  # read blindly, it would wait for a writer for ever
    code, err, out = predict([model_file, folder], capsys)
    reason = "Too many levels of symbolic links" if what == "loop" else "a FIFO (named pipe), not a regular file"
    assert code == 1 and err == [f"{bad}: cannot read: {reason}"]
    assert "ok.png: " in out


# ---------------------------------------------------------------------------------------------
# Minor: a full disk at start, a resumed run's clocks, DALI's own log line


def test_a_full_disk_at_start_leaves_no_run_folder(tmp_path, monkeypatch):
    from fastcifar.run import report

    real_open = open

    class Full:
        def __init__(self, f):
            self.f, self.name = f, f.name

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            pass

        def close(self):
            self.f.close()

    monkeypatch.setattr(report, "open", lambda *a, **k: Full(real_open(*a, **k)), raising=False)
    out = tmp_path / "runs"
    out.mkdir()
    with pytest.raises(report.OutputError, match="No space left on device"):
        start_log(out)
    assert list(out.iterdir()) == [] and not report._OPEN


def test_a_fresh_runs_line_is_unchanged(tmp_path):
    from fastcifar.run.report import EpochRecord, RunResult

    log = start_log(tmp_path / "runs")
    rec = EpochRecord(
        run=1,
        epoch=1,
        lr=0.1,
        train_time=2.0,
        train_loss=1.0,
        train_acc=50.0,
        test_time=0.1,
        test_loss=1.0,
        test_acc=60.0,
        total_train_time=2.0,
    )
    log.epoch(rec)
    log.run_done(RunResult(run=1, seed=0, test_acc=60.0, train_time=2.0, wall_time=9.0, epochs=[rec]), 50.0)
    log.stop("interrupted", "test")
    assert (
        "run 1: test_acc 60.00% train 2.00 s of training steps, wall 9.00 s since the process started, setup 0.00 s "
        "(target 50.00%: reached)" in (log.dir / "log.txt").read_text()
    )


@pytest.mark.slow  # over 2 s on 2 cores
def test_a_truncated_jpeg_gives_no_raw_dali_line(tmp_path):
    from fastcifar.data import dali as dl

    have, why = dl.dali_available()
    if not have:
        pytest.skip(f"DALI unavailable: {why}")
    root, _ = write_image_folder(tmp_path / "jpg", n_train=20, n_test=10, fmt="JPEG")
    bad = next((root / "train").rglob("*.jpeg"))
    bad.write_bytes(bad.read_bytes()[: len(bad.read_bytes()) // 2])
    code = (
        "import sys\nfrom fastcifar.data import DataError, load_dataset\nfrom fastcifar.data.dali import dali_decoder\n"
        "try:\n    load_dataset(sys.argv[1], cache_dir=sys.argv[2], log=lambda m: None, decode=dali_decoder('cpu'))\n"
        "except DataError as e:\n    print(e)\n"
    )
    proc = forkserver.run(
        [sys.executable, "-c", code, str(root), str(tmp_path / "cache")],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.startswith(f"{bad}: not a readable image"), proc.stdout


# ---------------------------------------------------------------------------------------------
# Item 9: a rank that ends itself for a stalled peer records why


@pytest.mark.slow  # over 2 s on 2 cores
def test_the_watchdog_records_the_cause_in_log_and_summary_before_it_ends_the_rank(tmp_path):
    """The main thread is blocked (here: asleep), so only the watchdog can end the rank; log.txt and
    summary.json must say why (status "failed"), not be left without a summary."""
    out = tmp_path / "runs"
    code = (
        "import sys, time, torch, os\n"
        "sys.path[:0] = ['tests', 'tests/helpers']\n"
        "from cli import start_log\n"
        "from fastcifar.parallel.distributed import DistContext, ProgressWatchdog\n"
        "from fastcifar.run import report\n"
        "log = start_log(sys.argv[1])\n"
        "ctx = DistContext(0, 2, 0, torch.device('cpu'), 'gloo')\n"
        "dog = ProgressWatchdog(1.0, ctx, enabled=True, on_stall=lambda why: report.stop_open_logs('failed', why))\n"
        "time.sleep(60)\n"
    )
    proc = forkserver.run(
        [sys.executable, "-c", code, str(out)], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 3, proc.stderr
    line = one_line_error(proc.stderr)
    assert line.startswith("fastcifar: error: [rank 0] lost contact with the other ranks"), line
    (run_dir,) = run_dirs(out)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "lost contact with the other ranks" in summary["stopped"]
    assert (run_dir / "log.txt").read_text().splitlines()[-1].startswith("stopped (failed): lost contact")


@pytest.mark.slow  # over 2 s on 2 cores
def test_the_watchdog_ends_the_rank_even_when_recording_hangs():
    code = (
        "import time, torch\n"
        "from fastcifar.parallel import distributed\n"
        "distributed.RECORD_TIMEOUT_S = 1.0\n"
        "ctx = distributed.DistContext(1, 2, 1, torch.device('cpu'), 'gloo')\n"
        "dog = distributed.ProgressWatchdog(1.0, ctx, enabled=True, on_stall=lambda why: time.sleep(120))\n"
        "time.sleep(60)\n"
    )
    proc = forkserver.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=50)
    assert proc.returncode == 3, proc.stderr


def test_a_sigterm_under_torchrun_is_not_recorded_as_a_bare_interruption(monkeypatch):
    from fastcifar.parallel.distributed import stop_reason

    exc = signals.Interrupted(signal.SIGTERM)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert stop_reason(exc) == "interrupted by SIGTERM"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert stop_reason(exc).startswith("interrupted by SIGTERM (from torchrun, which stops every rank when one")
    assert stop_reason(signals.Interrupted(signal.SIGINT)) == "interrupted by SIGINT"


def test_jpeg_size_reads_the_frame_header_and_the_dali_decoder_declines_other_sizes(tmp_path):
    import io

    from fastcifar.data import dali as dl

    for size in ((32, 32), (40, 30), (1, 2)):
        buf = io.BytesIO()
        Image.fromarray(np.zeros((size[1], size[0], 3), np.uint8)).save(buf, format="JPEG", quality=75)
        assert dl.jpeg_size(buf.getvalue()) == size
        buf = io.BytesIO()
        Image.fromarray(np.zeros((size[1], size[0], 3), np.uint8)).save(buf, format="JPEG", progressive=True)
        assert dl.jpeg_size(buf.getvalue()) == size
    assert dl.jpeg_size(b"\xff\xd8\xff") is None and dl.jpeg_size(b"\xff\xd8garbage") is None
    # a 20000x20000 frame header: declined by its header (PIL then refuses it by name), never decoded
    sof = b"\xff\xc0\x00\x11\x08" + (20000).to_bytes(2, "big") * 2 + b"\x03" + b"\x01\x22\x00\x02\x11\x01\x03\x11\x01"
    bomb = b"\xff\xd8" + sof + b"\xff\xd9"
    assert dl.jpeg_size(bomb) == (20000, 20000)
    assert dl.dali_decoder("cpu")([bomb], ["bomb.jpeg"]) is None


def test_a_release_archive_that_is_a_fifo_is_named_not_ignored(tmp_path):
    (tmp_path / "data").mkdir()
    os.mkfifo(tmp_path / "data" / "cifar-10-python.tar.gz")
    with pytest.raises(DataError, match="cifar-10-python.tar.gz: cannot read archive: a FIFO \\(named pipe\\)"):
        load_dataset(tmp_path / "data", log=quiet)


def test_dali_log_capture_forwards_other_lines_and_holds_dalis_own(capfd):
    """During a decode, fd 2 goes through a pipe: another line passes straight through (a crash's
    message is never left in a buffer), DALI's own record is dropped when the decode fails and
    written when it succeeds."""
    from fastcifar.data import dali as dl

    record = b"\x1b[31m[ERROR] [jpeg_parser] Invalid marker\x1b[0m\n"
    with pytest.raises(RuntimeError):
        with dl._dali_log_captured():
            os.write(2, b"a driver's message\n" + record)
            raise RuntimeError("decode failed")
    err = capfd.readouterr().err
    assert "a driver's message" in err and "jpeg_parser" not in err
    with dl._dali_log_captured():
        os.write(2, record)
    assert "jpeg_parser" in capfd.readouterr().err
