"""A user's first hour (issue 12): every bad input ends in one line, long work can be stopped
cleanly, a run that diverges says so, and the loader does not change the result.

The table of bad inputs runs ``fastcifar.train.main`` in this process (each case stops before
training, so a subprocess per case would mostly time torch's import); the cases that need a
real process (signals, a file-size limit, a killed run, the divergence exit) use a subprocess.
"""

from __future__ import annotations

import inspect
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from cli import ROOT, SHORT, env, epochs_of, run_dirs, run_train
from conftest import one_line_error, write_image_folder, write_official

from fastcifar import train
from fastcifar.core import signals
from fastcifar.data import dali as dali_loader
from fastcifar.data import load_dataset
from fastcifar.data.dali import DaliLoader, dali_available
from fastcifar.data.folder import save_cache
from fastcifar.data.loader import TorchLoader
from fastcifar.ops.augment import AugmentSpec
from fastcifar.parallel import sync
from fastcifar.run.guard import Diverged, LossGuard
from fastcifar.run.progress import Progress
from fastcifar.run.report import TSV_COLUMNS, to_json

needs_dali = pytest.mark.skipif(not dali_available()[0], reason="DALI does not import here")
TINY = [*SHORT, "--epochs", "1", "--loader", "torch"]


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    """200 official-format training images (one batch of 40 per file), 50 test images."""
    folder, _ = write_official(tmp_path_factory.mktemp("first_hour") / "data")
    return folder


def _tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []


def _read_only_dir(tmp: Path) -> str:
    d = tmp / "ro"
    d.mkdir()
    d.chmod(0o555)
    return str(d / "runs")


def _file(tmp: Path) -> str:
    (tmp / "a_file").write_text("x")
    return str(tmp / "a_file")


# (case id, extra arguments (may name {tmp}/{data}), setup, stderr must contain)
BAD_INPUTS = [
    ("out-dir is a file", ["--out-dir", "{file}"], None, "is not a folder"),
    ("out-dir under a file", ["--out-dir", "{file}/runs"], None, "is not a folder"),
    ("out-dir cannot be created (/proc)", ["--out-dir", "/proc/fastcifar-test/runs"], None, "cannot create"),
    ("out-dir cannot be created (/sys)", ["--out-dir", "/sys/fastcifar-test"], None, "--out-dir /sys/fastcifar-test"),
    pytest.param(
        "out-dir read-only",
        ["--out-dir", "{ro}"],
        None,
        "is not writable",
        marks=pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0555 folder"),
    ),
    ("crop-pad 40 (torch loader)", ["--crop-pad", "40"], None, "--crop-pad must be at most 31"),
    ("crop-pad 40 (dali loader)", ["--crop-pad", "40", "--loader", "dali"], None, "--crop-pad must be at most 31"),
    ("crop-pad 33 zero padding", ["--crop-pad", "33", "--pad-mode", "zero"], None, "--crop-pad must be at most 32"),
    ("seed -1", ["--seed", "-1"], None, "--seed must lie in 0..2^63-1"),
    ("seed above 2^63", ["--seed", str(2**63 + 5)], None, "--seed must lie in 0..2^63-1"),
    ("seed + runs past 2^63", ["--seed", str(2**63 - 2), "--runs", "2"], None, "--seed must lie in"),
    ("lr nan", ["--lr", "nan"], None, "--lr must be a finite number, not nan"),
    ("momentum inf", ["--momentum", "inf"], None, "--momentum must be a finite number"),
    ("muon with lr 0", ["--optimizer", "muon", "--lr", "0"], None, "--optimizer muon needs a positive --lr"),
    ("subset larger than the data", ["--subset", "5000"], None, "--subset 5000 is larger than the training set"),
    ("batch larger than the data", ["--batch-size", "1000"], None, "larger than the training set"),
    ("missing data", ["--data", "{tmp}/missing"], None, "no such file or folder"),
    ("corrupt data", ["--data", "{tmp}/corrupt"], "corrupt", "not a readable CIFAR-10 batch"),
    ("loader dali without DALI", ["--loader", "dali"], "no_dali", "--loader dali: NVIDIA DALI cannot be imported"),
]


@pytest.mark.parametrize("case, args, setup, message", BAD_INPUTS, ids=[getattr(c, "values", c)[0] for c in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(
    case, args, setup, message, small_data, tmp_path, capsys, monkeypatch
):
    if case.startswith("crop-pad 40 (dali") and not dali_available()[0]:
        pytest.skip("DALI does not import here")
    out = tmp_path / "runs"
    names = {"tmp": tmp_path, "data": small_data}
    if "{file}" in " ".join(args):
        names["file"] = _file(tmp_path)
    if "{ro}" in args:
        names["ro"] = _read_only_dir(tmp_path)
    if setup == "corrupt":
        corrupt = tmp_path / "corrupt" / "cifar-10-batches-py"
        corrupt.parent.mkdir()
        write_official(tmp_path / "corrupt_src")
        (tmp_path / "corrupt_src" / "cifar-10-batches-py").rename(corrupt)
        (corrupt / "test_batch").write_bytes(b"\x80\x02garbage")
    if setup == "no_dali":  # what dali_available reports where DALI is not installed
        monkeypatch.setattr(dali_loader, "dali_available", lambda: (False, "ImportError: No module named 'nvidia'"))
    argv = ["--data", str(small_data), "--out-dir", str(out), *TINY, *[a.format(**names) for a in args]]
    before = {p: _tree(p) for p in (tmp_path, small_data.parent)}
    code = train.main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    line = one_line_error(err)
    assert line.startswith("fastcifar: error: ") and message in line, line
    assert {p: _tree(p) for p in before} == before, "a refused run must write nothing"


@pytest.mark.parametrize("teardown", ["returns", "raises"])
def test_main_gives_the_caller_its_signal_handlers_back(small_data, tmp_path, capsys, monkeypatch, teardown):
    """``main`` routes SIGINT/SIGTERM to ``Interrupted`` while it runs and puts the caller's
    handlers back when it returns, so Ctrl-C still reaches pytest (or a notebook) afterwards; also
    when the distributed teardown raises (a Ctrl-C during a slow NCCL teardown)."""

    def mine(signum, frame):
        pass

    def stuck(ctx):
        raise signals.Interrupted(signal.SIGINT)  # a Ctrl-C during the teardown

    saved = {s: signal.getsignal(s) for s in signals.HANDLED}
    try:
        for s in signals.HANDLED:
            signal.signal(s, mine)
        argv = ["--data", str(small_data), "--out-dir", str(tmp_path / "runs"), *TINY, "--lr", "nan"]
        if teardown == "raises":
            monkeypatch.setattr(train.distributed, "teardown", stuck)
            with pytest.raises(signals.Interrupted):
                train.main(argv)
        else:
            assert train.main(argv) == 2, capsys.readouterr().err
        assert {s: signal.getsignal(s) for s in signals.HANDLED} == {s: mine for s in signals.HANDLED}
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.slow
def test_exploding_lr_stops_with_one_line_exit_4_and_strict_json(small_data, tmp_path):
    out = tmp_path / "runs"
    proc = run_train(
        ["--data", small_data, "--out-dir", out, *SHORT, "--epochs", "3", "--loader", "torch", "--lr", "1e6"]
    )
    assert proc.returncode == 4, proc.stderr
    line = one_line_error(proc.stderr)
    assert line.startswith("fastcifar: training diverged: the training loss is") and "run 1, epoch 1" in line
    (run_dir,) = run_dirs(out)
    doc = _strict((run_dir / "summary.json").read_text())  # NaN written as null, never as a bare NaN
    assert doc["status"] == "diverged" and doc["results"] == [] and doc["summary"] is None
    (epoch,) = doc["unfinished_run_epochs"]
    assert epoch["epoch"] == 1 and (epoch["train_loss"] is None or epoch["train_loss"] > 23)
    assert "stopped (diverged)" in (run_dir / "log.txt").read_text().splitlines()[-1]


def test_guard_and_json_units():
    guard = LossGuard(10)
    guard.check(2.3, 1, 1)
    for bad in (float("nan"), float("inf"), 24.0):
        with pytest.raises(Diverged, match="training diverged"):
            guard.check(bad, 1, 2)
    assert _strict(to_json({"a": float("nan"), "b": [1.0, float("-inf")], "c": {"d": 2.5}})) == {
        "a": None,
        "b": [1.0, None],
        "c": {"d": 2.5},
    }


def _popen(args, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "fastcifar.train", *map(str, args)],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def _wait_for(proc: subprocess.Popen, needle: str, timeout: float = 120) -> list[str]:
    seen, end = [], time.monotonic() + timeout
    for text in proc.stdout:
        seen.append(text)
        if needle in text or time.monotonic() > end:
            break
    assert any(needle in t for t in seen), f"never printed {needle!r}:\n{''.join(seen)}"
    return seen


@pytest.mark.slow
def test_sigint_during_training_is_one_line_and_keeps_finished_epochs(small_data, tmp_path):
    sig, code = signal.SIGINT, 130
    out = tmp_path / "runs"
    proc = _popen(["--data", small_data, "--out-dir", out, *SHORT, "--epochs", "50", "--loader", "torch"])
    _wait_for(proc, "   1     2 ")  # two epochs done
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code
    assert one_line_error(err) == f"fastcifar: interrupted by {signal.Signals(sig).name}"
    (run_dir,) = run_dirs(out)
    rows = (run_dir / "timing_log.tsv").read_text().splitlines()
    assert rows[0].split("\t") == list(TSV_COLUMNS) and len(rows) >= 3
    doc = _strict((run_dir / "summary.json").read_text())
    assert doc["status"] == "interrupted" and len(doc["unfinished_run_epochs"]) == len(rows) - 1
    assert not [p for p in run_dir.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.slow
def test_sigterm_while_decoding_is_one_line_and_leaves_no_temporary_file(tmp_path):
    folder, _ = write_image_folder(tmp_path / "imgs", n_train=400, n_test=100)
    out = tmp_path / "runs"
    proc = _popen(["--data", folder, "--out-dir", out, *SHORT, "--loader", "torch", "--epochs", "50"])
    _wait_for(proc, "decoding")  # PIL decoding, then the cache write: either may take the signal
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143
    assert one_line_error(err) == "fastcifar: interrupted by SIGTERM"
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


def test_sigterm_while_the_cache_is_written_leaves_no_tmp(tmp_path, monkeypatch):
    """A real SIGTERM delivered in the middle of np.savez: the handler's exception unwinds
    save_cache, whose finally removes the temporary file (the default action killed the process
    with the .tmp left beside the data)."""
    folder, _ = write_image_folder(tmp_path / "imgs", n_train=20, n_test=10)
    ds = load_dataset(folder, cache_dir=tmp_path / "elsewhere", log=lambda _: None)
    target = tmp_path / "cache" / "x.npz"
    real_savez = np.savez

    def savez_then_signal(f, **arrays):
        f.write(b"PK partial")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)  # the handler runs at the next bytecode boundary, well within this
        real_savez(f, **arrays)

    monkeypatch.setattr(np, "savez", savez_then_signal)
    previous = signals.install()
    try:
        with pytest.raises(signals.Interrupted) as info:
            save_cache(target, ds)
    finally:
        signals.restore(previous)  # pytest's own SIGINT/SIGTERM handling back
    assert info.value.exit_code == 143
    assert list(target.parent.iterdir()) == []


@pytest.mark.slow
def test_sigkill_leaves_the_tsv_header_and_finished_epochs(small_data, tmp_path):
    out = tmp_path / "runs"
    proc = _popen(["--data", small_data, "--out-dir", out, *SHORT, "--epochs", "50", "--loader", "torch"])
    _wait_for(proc, "   1     1 ")
    proc.kill()
    proc.communicate(timeout=60)
    (run_dir,) = run_dirs(out)
    rows = (run_dir / "timing_log.tsv").read_text().splitlines()
    assert rows[0].split("\t") == list(TSV_COLUMNS) and len(rows) >= 2 and rows[1].startswith("1\t1\t")


@pytest.mark.slow
@pytest.mark.parametrize("limit, what, epochs", [(1024, "log.txt", 1), (6144, "summary.json", 3)])
def test_full_disk_is_one_line(limit, what, epochs, small_data, tmp_path):
    """RLIMIT_FSIZE makes writes past ``limit`` bytes fail (EFBIG; Python ignores SIGXFSZ), as a
    full disk does: at 1 KiB the config line of log.txt fails, at 6 KiB summary.json (larger; log.txt,
    ~4.4 KiB with the line that explains the lr column and the streams' settings, stays under it)."""

    def limit_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    out = tmp_path / "runs"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fastcifar.train",
            "--data",
            str(small_data),
            "--out-dir",
            str(out),
            *SHORT,
            "--epochs",
            str(epochs),
            "--loader",
            "torch",
            "--no-save-model",
        ],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit_files,
    )
    assert proc.returncode == 2
    line = one_line_error(proc.stderr)
    assert line.startswith("fastcifar: error: cannot write ") and line.endswith(f"{what}: File too large"), line
    if what == "log.txt":  # the header could not be written: no run folder of half-written logs (issue 48)
        assert run_dirs(out) == []
        return
    (run_dir,) = run_dirs(out)
    assert not [p for p in run_dir.iterdir() if p.name.endswith(".tmp")]


class _Tty:
    def __init__(self, tty: bool):
        self.tty, self.text = tty, []

    def isatty(self):
        return self.tty

    def write(self, s):
        self.text.append(s)

    def flush(self):
        pass


def test_progress_only_on_a_terminal_on_rank_0_and_not_quiet(monkeypatch):
    items = list(range(7))
    for enabled, tty, shown in [(True, True, True), (True, False, False), (False, True, False)]:
        stream = _Tty(tty)
        bars = Progress(enabled, stream)
        wrapped = bars.steps(items, len(items), "epoch 1/2")
        assert (wrapped is items) != shown
        assert list(wrapped) == items
        assert ("epoch 1/2" in "".join(stream.text)) == shown
    # for_rank draws on stderr, which is no terminal under pytest: make it one, or nothing here could fail
    monkeypatch.setattr(sys, "stderr", _Tty(True))
    assert Progress.for_rank(True, quiet=False).enabled
    assert not Progress.for_rank(True, quiet=True).enabled and not Progress.for_rank(False, quiet=False).enabled


@needs_dali
@pytest.mark.parametrize("flip_mode, pad_mode, cutout", [("random", "reflect", 8), ("alternate", "zero", 0)])
def test_torch_and_dali_loaders_give_the_same_batches(flip_mode, pad_mode, cutout):
    """Same (seed, rank, epoch): the same order, the same augmentation, the same bits (CIFAR
    statistics, fp32), so a run does not depend on which loader `auto` found."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (90, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, 90)
    shard = np.sort(rng.permutation(90)[:45])
    kw = dict(
        augment=AugmentSpec(crop_pad=4, pad_mode=pad_mode, cutout=cutout, flip=True, flip_mode=flip_mode),
        dtype=torch.float32,
        device=torch.device("cpu"),
        rank=1,
    )
    loaders = [TorchLoader(images, labels, shard, 10, 4, **kw), DaliLoader(images, labels, shard, 10, 4, **kw)]
    for seed, epoch in [(0, 0), (0, 1), (7, 3)]:
        batches = []
        for loader in loaders:
            loader.set_epoch(seed, epoch)
            batches.append([(x.clone(), y.clone()) for x, y in loader])
        for step, ((xt, yt), (xd, yd)) in enumerate(zip(*batches, strict=True)):
            assert torch.equal(yt, yd), f"seed {seed} epoch {epoch} step {step}: different images"
            assert torch.equal(xt, xd), f"seed {seed} epoch {epoch} step {step}: max diff {(xt - xd).abs().max()}"


@pytest.mark.slow
@needs_dali
def test_a_short_run_gives_the_same_metrics_with_either_loader(small_data, tmp_path):
    """Also: the header names the engine actually chosen, once, and the data counts once; the
    full config goes to log.txt and summary.json, not the terminal."""
    runs = {}
    for loader in ("torch", "dali"):
        proc = run_train(
            [
                "--data",
                small_data,
                "--out-dir",
                tmp_path / loader,
                *SHORT,
                "--epochs",
                "2",
                "--loader",
                loader,
                "--subset",
                "200",
            ]
        )
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        assert lines[0].startswith("fastcifar ") and "cpu cpu" not in lines[0] and "| cpu" in lines[0]
        assert lines[1] == f"engine: loader {loader}, kernels torch, precision fp32, cuda graphs off"
        assert lines[2].startswith("data: ") and lines[2].count("200 train") == 1, lines[2]
        assert not any(ln.startswith("config: ") for ln in lines) and max(map(len, lines)) < 200
        (run_dir,) = run_dirs(tmp_path / loader)
        assert any(ln.startswith("config: {") for ln in (run_dir / "log.txt").read_text().splitlines())
        doc = _strict((run_dir / "summary.json").read_text())
        assert doc["engine"]["loader"] == loader and doc["status"] == "finished"
        runs[loader] = epochs_of(doc)
    assert runs["torch"] == runs["dali"]


def test_ddp_is_built_without_the_deprecated_argument():
    """--comm ddp printed torch's broadcast_buffers FutureWarning on every rank: where torch has
    forward_sync_buffers (2.13+), the trainer passes it and never the deprecated name."""
    accepted = inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters
    assert set(sync._DDP_OWN_BUFFERS) <= set(accepted) and not any(sync._DDP_OWN_BUFFERS.values())
    if "forward_sync_buffers" in accepted:
        assert "broadcast_buffers" not in sync._DDP_OWN_BUFFERS


def test_chunked_decoder_under_a_bar_gives_the_same_arrays(tmp_path, monkeypatch):
    """The decode bar decodes in chunks: the decoder's chunks, PIL for those it declines."""
    import io

    from PIL import Image

    from fastcifar.data.folder import decode_with_pil
    from fastcifar.run import progress as progress_mod

    images = np.random.default_rng(0).integers(0, 256, (7, 32, 32, 3), dtype=np.uint8)
    raws = []
    for img in images:
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="PNG")
        raws.append(buf.getvalue())
    wheres = [f"img{i}.png" for i in range(7)]
    calls = []

    def every_other(chunk, names):  # takes chunks 0 and 2, declines chunk 1 (PIL decodes it)
        calls.append(names[0])
        return None if names[0] == "img3.png" else decode_with_pil(chunk, names)

    monkeypatch.setattr(progress_mod, "DECODE_CHUNK", 3)
    stream = _Tty(True)
    out = progress_mod.chunked_decoder(every_other, Progress(True, stream))(raws, wheres)
    assert np.array_equal(out, images) and calls == ["img0.png", "img3.png", "img6.png"]
    assert "decoding" in "".join(stream.text)
    # the cache key names the wrapped decoder: under a bar (rank 0) as without one (the other ranks)
    from fastcifar.data.folder import decoder_name

    every_other.name = "dali-cuda"
    assert decoder_name(progress_mod.chunked_decoder(every_other, Progress(True, stream))) == "dali-cuda"
    assert decoder_name(progress_mod.chunked_decoder(None, Progress(True, stream))) == "pil"
