"""`fastcifar train --resume`, every way a run continues from its checkpoint.pt: bit for bit the
uninterrupted run (the `fast` preset with lookahead, the default with Muon's momentum, two gloo
ranks, --resume alone taking the checkpoint's settings), a conflicting option refused in one line,
a bad, foreign or tampered checkpoint refused before anything is written, the stale temporaries
cleared, and the resumed run's log. The checkpoint file's own checks: tests/unit/test_state.py."""

from __future__ import annotations

import json
import os

import pytest
import torch
from cli import SHORT, dead_pid, run_dirs, run_train, start_log, torchrun
from conftest import one_line_error, write_official
from models import (
    FAST_TINY,
    RESUMED,
    flip_in_largest_zip_member,
    read_tensors,
    small_checkpoint_state,
    write_noisy_official,
)

from fastcifar.core import atomic
from fastcifar.models.files import CheckpointError
from fastcifar.run import state as run_state
from fastcifar.run.state import seal
from fastcifar.train import main as train_main


@pytest.mark.parametrize("which", ["trained", "trained_default"])
@pytest.mark.slow  # trains three runs (whole, interrupted, resumed)
def test_resume_is_bit_identical_to_the_uninterrupted_run(which, request, tmp_path):
    """`fast` (lookahead, SGD) and the default preset (Muon's momentum on the filters)."""
    trained = request.getfixturevalue(which)
    out = tmp_path / "runs"
    proc = run_train(
        ["--data", trained["data"], "--out-dir", out, *trained["tiny"], "--resume", trained["dir"] / "checkpoint.pt"]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "after epoch 2" in proc.stdout
    (run_dir,) = run_dirs(out)
    full, resumed = read_tensors(trained["dir"] / "model.safetensors"), read_tensors(run_dir / "model.safetensors")
    assert full.keys() == resumed.keys()
    for name in full:
        assert torch.equal(full[name], resumed[name]), f"{name} differs after resume"
    # the resumed run's records: epochs 1-2 from the checkpoint, epoch 3 trained again, same numbers
    a = trained["summary"]["results"][0]["epochs"]
    b = json.loads((run_dir / "summary.json").read_text())["results"][0]["epochs"]
    assert [r["epoch"] for r in b] == [1, 2, 3]
    for ra, rb in zip(a, b, strict=True):
        assert (ra["train_loss"], ra["test_loss"], ra["test_acc"]) == (
            rb["train_loss"],
            rb["test_loss"],
            rb["test_acc"],
        )


def _corrupt(path, tmp_path):
    bad = tmp_path / "corrupt.pt"
    bad.write_bytes(b"PK\x03\x04 not really a zip archive" * 20)
    return bad


def _truncated(path, tmp_path):
    bad = tmp_path / "truncated.pt"
    bad.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 3])
    return bad


class _RunsCode:
    def __reduce__(self):
        return (print, ("this ran while loading a checkpoint",))


def _hostile(path, tmp_path):  # a pickle that would call a function: weights_only refuses it
    bad = tmp_path / "hostile.pt"
    torch.save({"format": "fastcifar.state/1", "x": _RunsCode()}, bad)
    return bad


@pytest.mark.parametrize(
    "make,extra,message",
    [
        (_corrupt, [], "not a readable checkpoint"),
        (_truncated, [], "not a readable checkpoint"),
        (_hostile, [], "not a readable checkpoint"),
        (None, ["--seed", "1"], "written with --seed 0, this run has 1"),
        (None, ["--widths", "16,32,64"], "written with --widths"),
    ],
)
def test_bad_or_mismatched_checkpoints_give_one_line(trained, tmp_path, capsys, make, extra, message):
    path = trained["dir"] / "checkpoint.pt"
    if make is not None:
        path = make(path, tmp_path)
    out = tmp_path / "runs"
    argv = ["--data", trained["data"], "--out-dir", out, *FAST_TINY, *extra, "--resume", path]
    assert train_main([str(a) for a in argv]) == 2  # in process: the CLI's own error path, no start-up cost
    captured = capsys.readouterr()
    assert message in one_line_error(captured.err) and "this ran" not in captured.out
    assert run_dirs(out) == [], "refused before anything is written"


@pytest.mark.slow  # two gloo ranks train, stop at a checkpoint and resume
def test_two_ranks_checkpoint_and_resume(tmp_path, capsys):
    """gloo, 2 ranks: each rank resumes its own shard, RNGs and lookahead copy; the result is the
    uninterrupted 2-rank run's, bit for bit."""
    data, _ = write_noisy_official(tmp_path / "data", n_train=800, n_test=200)
    args = ["--data", data, *FAST_TINY, "--epochs", "2", "--whiten-bias-epochs", "1"]
    full = run_train([*args, "--out-dir", tmp_path / "a", "--checkpoint-every", "1"], launcher=torchrun(), timeout=600)
    assert full.returncode == 0, full.stderr[-3000:]
    (dir_a,) = run_dirs(tmp_path / "a")
    state = torch.load(dir_a / "checkpoint.pt", weights_only=True)
    assert state["world_size"] == 2 and len(state["ranks"]) == 2
    resumed = run_train(
        [*args, "--out-dir", tmp_path / "b", "--resume", dir_a / "checkpoint.pt"], launcher=torchrun(), timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (dir_b,) = run_dirs(tmp_path / "b")
    a, b = read_tensors(dir_a / "model.safetensors"), read_tensors(dir_b / "model.safetensors")
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs after a 2-rank resume"
    assert train_main([str(a) for a in [*args, "--out-dir", tmp_path / "c", "--resume", dir_a / "checkpoint.pt"]]) == 2
    assert "written by 2 ranks" in one_line_error(capsys.readouterr().err)
    # rank 0 alone reads the file and sends it on (ranks on other nodes may not see rank 0's
    # --out-dir): here rank 1 is handed a path that does not exist and still gets the state; a
    # refusal reaches every rank the same way, so none is left waiting
    script = tmp_path / "load_state_ranks.py"
    script.write_text(LOAD_STATE_RANKS)
    good = run_train(
        [dir_a / "checkpoint.pt", *args],
        launcher=torchrun(str(script)),
    )
    assert good.returncode == 0 and good.stdout.count("epochs_done 1") == 2, good.stdout + good.stderr[-3000:]
    bad = run_train(
        [dir_a / "checkpoint.pt", *args, "--label-smoothing", "0.1"],
        launcher=torchrun(str(script)),
    )
    assert bad.returncode == 0 and bad.stdout.count("refused: --resume") == 2, bad.stdout + bad.stderr[-3000:]
    assert "written with --label-smoothing 0.2" in bad.stdout
    # --resume alone: rank 0 reads the checkpoint's settings and sends them on; rank 1, which cannot
    # see the file, trains with them too (not with the command line's defaults)
    script.write_text(RESUME_SETTINGS_RANKS)
    alone = run_train(
        [dir_a / "checkpoint.pt", "--data", data],
        launcher=torchrun(str(script)),
    )
    want = f"settings epochs=2 widths={state_widths(dir_a)} whiten_bias_epochs=1"
    assert alone.returncode == 0 and alone.stdout.count(want) == 2, alone.stdout + alone.stderr[-3000:]


def state_widths(run_dir) -> tuple:
    import json as _json

    saved = _json.loads(torch.load(run_dir / "checkpoint.pt", weights_only=True)["config"])
    return tuple(saved["widths"])


LOAD_STATE_RANKS = """
import sys
from fastcifar.run import state as checkpoint
from fastcifar.parallel import distributed
from fastcifar.core.options import parse_args
path, argv = sys.argv[1], sys.argv[2:]
ctx = distributed.setup("cpu", 60)
mine = path if ctx.rank == 0 else path + ".not-on-this-node"
try:
    state = checkpoint.load_state(mine, parse_args(argv), ctx)
    print(f"epochs_done {state['epochs_done']}")  # one write each: the two ranks share one pipe
except checkpoint.CheckpointError as exc:
    print(f"refused: {exc}")  # print("refused:", exc) wrote in pieces, and rank 1's came between
distributed.teardown(ctx)
"""


RESUME_SETTINGS_RANKS = """
import sys
from fastcifar.run import state
from fastcifar.parallel import distributed
from fastcifar.core.options import parse_command_line
path, argv = sys.argv[1], sys.argv[2:]
ctx = distributed.setup("cpu", 60)
mine = path if ctx.rank == 0 else path + ".not-on-this-node"
cfg, given = parse_command_line(["--resume", mine, *argv])
cfg = state.resume_settings(cfg, given, ctx)
print(f"settings epochs={cfg.epochs:g} widths={tuple(cfg.widths)} whiten_bias_epochs={cfg.whiten_bias_epochs}")
distributed.teardown(ctx)
"""


@pytest.mark.slow  # over 2 s on 2 cores
def test_a_checkpoint_of_other_precision_is_refused_by_name(trained, tmp_path, capsys):
    """--precision auto is fp32 on a CPU and fp16 on a GPU: the same flags, other weights. The
    refusal names the precision, not an optimizer state that does not fit."""
    state = torch.load(trained["dir"] / "checkpoint.pt", weights_only=True)
    state["model"] = {k: v.half() if v.is_floating_point() else v for k, v in state["model"].items()}
    other = tmp_path / "fp16.pt"
    torch.save(seal(state), other)  # digest and all: the precision is what is refused
    argv = ["--data", trained["data"], "--out-dir", tmp_path / "runs", *FAST_TINY, "--resume", other]
    assert train_main([str(a) for a in argv]) == 2
    assert "written with torch.float16 weights" in one_line_error(capsys.readouterr().err)


@pytest.mark.slow  # trains a run twice
def test_resume_alone_finishes_as_the_uninterrupted_run(resume_data, uninterrupted, tmp_path):
    out = tmp_path / "runs"
    proc = run_train(["--data", resume_data, "--out-dir", out, "--resume", uninterrupted["dir"] / "checkpoint.pt"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "after epoch 2" in proc.stdout and "preset resnet9" in proc.stdout
    (run_dir,) = run_dirs(out)
    full, resumed = (
        read_tensors(uninterrupted["dir"] / "model.safetensors"),
        read_tensors(run_dir / "model.safetensors"),
    )
    assert full.keys() == resumed.keys()
    for name in full:
        assert torch.equal(full[name], resumed[name]), f"{name} differs after resume"
    a, b = uninterrupted["summary"], json.loads((run_dir / "summary.json").read_text())
    assert b["config"]["widths"] == [8, 16, 32, 64] and b["config"]["val_split"] == 40
    for ra, rb in zip(a["results"][0]["epochs"], b["results"][0]["epochs"], strict=True):
        assert (ra["train_loss"], ra["val_loss"], ra["val_acc"]) == (rb["train_loss"], rb["val_loss"], rb["val_acc"])
    assert a["results"][0]["test_acc"] == b["results"][0]["test_acc"]


@pytest.mark.parametrize(
    "extra,flag,values",
    [
        (["--lr", "0.5"], "--lr", ("0.4", "0.5")),
        (["--widths", "8,16,32,32"], "--widths", ("8,16,32,64", "8,16,32,32")),
        (["--preset", "fast"], "--preset", ("resnet9", "fast")),
    ],
)
def test_a_conflicting_option_on_resume_is_refused_in_one_line(
    resume_data, uninterrupted, tmp_path, capsys, extra, flag, values
):
    out = tmp_path / "runs"
    argv = ["--data", resume_data, "--out-dir", out, "--resume", uninterrupted["dir"] / "checkpoint.pt", *extra]
    assert train_main([str(a) for a in argv]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert line.startswith("fastcifar: error:") and flag in line and all(v in line for v in values), line
    assert run_dirs(out) == []


def test_resume_from_a_fifo_is_refused_at_once_not_waited_on(tmp_path):
    """issue 70: ``--resume`` on a FIFO hung for ever in the settings' read (before the check)."""
    fifo = tmp_path / "checkpoint.pt"
    os.mkfifo(fifo)
    out = tmp_path / "runs"
    proc = run_train(["--data", tmp_path, *SHORT, "--out-dir", out, "--resume", fifo], timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert one_line_error(proc.stderr) == (
        f"fastcifar: error: --resume {fifo}: cannot read checkpoint: a FIFO (named pipe), not a regular file"
    )
    assert not run_dirs(out)


@pytest.mark.slow
def test_a_real_checkpoint_with_a_flipped_byte_is_refused_on_resume_in_one_line(tmp_path):
    """End to end: a run's checkpoint.pt with a byte flipped in its largest tensor: the resume is
    one line, exit 2, nothing written; the untouched checkpoint resumes."""
    from fastcifar.train import main as train_main

    data, _ = write_official(tmp_path / "data")
    args = ["--data", data, *SHORT, "--epochs", "2", "--quiet"]
    assert train_main([*map(str, args), "--out-dir", str(tmp_path / "a"), "--checkpoint-every", "1"]) == 0
    (run_dir,) = run_dirs(tmp_path / "a")
    ckpt = tmp_path / "copy.pt"
    ckpt.write_bytes((run_dir / "checkpoint.pt").read_bytes())
    flip_in_largest_zip_member(ckpt)
    proc = run_train([*args, "--out-dir", tmp_path / "b", "--resume", ckpt], timeout=120)
    assert proc.returncode == 2
    assert "its contents do not match the digest" in one_line_error(proc.stderr)
    assert not run_dirs(tmp_path / "b")
    assert (
        train_main([*map(str, args), "--out-dir", str(tmp_path / "c"), "--resume", str(run_dir / "checkpoint.pt")]) == 0
    )


def test_a_checkpoints_unusable_setting_is_named_as_the_checkpoints_not_a_flag(tmp_path, capfd):
    from fastcifar.train import main as train_main

    cfg, state = small_checkpoint_state()
    config = json.loads(state["config"])
    config["momentum"] = 5  # never typed by the user
    state["config"] = json.dumps(config, sort_keys=True)
    ckpt = tmp_path / "checkpoint.pt"
    torch.save(run_state.seal(state), ckpt)
    data, _ = write_official(tmp_path / "data")
    out = tmp_path / "runs"
    code = train_main([*map(str, ["--data", data, *RESUMED, "--out-dir", out, "--resume", ckpt])])
    line = one_line_error(capfd.readouterr().err)
    assert code == 2 and line.startswith(
        f"fastcifar: error: --resume {ckpt}: field config holds an unusable setting (from the checkpoint, "
        f"not this command line): momentum must lie in"
    ), line
    assert not run_dirs(out)


@pytest.mark.parametrize("preset", ["../../escaped", "evil\npreset"])
def test_a_checkpoints_preset_that_is_no_preset_is_refused_and_stays_one_line(preset, tmp_path, capfd):
    """A checkpoint edited (and resealed) to carry a preset name that would name the run folder
    outside --out-dir, or break the error line."""
    from fastcifar.train import main as train_main

    _, state = small_checkpoint_state()
    config = json.loads(state["config"])
    config["preset"] = preset
    state["config"] = json.dumps(config, sort_keys=True)
    ckpt = tmp_path / "checkpoint.pt"
    torch.save(run_state.seal(state), ckpt)
    out = tmp_path / "deep" / "runs"
    assert RESUMED[:2] == ["--preset", "resnet9"]  # left out: the checkpoint's preset is taken, not compared
    code = train_main([*map(str, ["--data", tmp_path, *RESUMED[2:], "--out-dir", out, "--resume", ckpt])])
    line = one_line_error(capfd.readouterr().err)
    assert code == 2 and f"field config holds preset {preset!r}".replace("\n", "\\n") in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


def test_resume_clears_the_stale_temporaries_beside_its_checkpoint(tmp_path):
    """A run killed mid-write (SIGKILL) leaves temporaries in its folder; the resume from its
    checkpoint removes them, also when the checkpoint itself then turns out unusable."""
    from fastcifar.core.config import Config
    from fastcifar.run import state

    ckpt = tmp_path / "checkpoint.pt"
    ckpt.write_bytes(b"not a checkpoint")
    pid = dead_pid()
    stale = [
        tmp_path / f".{n}.{atomic._host()}.{pid}-0123abcd.tmp"
        for n in ("checkpoint.pt", "summary.json", "model.safetensors")
    ]
    for p in stale:
        p.write_bytes(b"")
    with pytest.raises(CheckpointError):
        state._read_state(ckpt, Config(), 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


def test_a_resumed_runs_line_says_what_each_clock_counts(tmp_path):
    from fastcifar.run.report import TIMING_PROTOCOL, EpochRecord, RunResult

    log = start_log(tmp_path / "runs")
    records = [
        EpochRecord(
            run=1,
            epoch=e,
            lr=0.1,
            train_time=5.0,
            train_loss=1.0,
            train_acc=50.0,
            test_time=0.1,
            test_loss=1.0,
            test_acc=60.0,
            total_train_time=5.0 * e,
        )
        for e in range(1, 6)
    ]
    for r in records[3:]:  # epochs 4 and 5 trained in this process, 1-3 came from the checkpoint
        log.epoch(r)
    log.run_done(RunResult(run=1, seed=0, test_acc=60.0, train_time=25.0, wall_time=12.0, epochs=records), 94.0)
    log.finish([RunResult(run=1, seed=0, test_acc=60.0, train_time=25.0, wall_time=12.0, epochs=records)])
    line = next(ln for ln in (log.dir / "log.txt").read_text().splitlines() if ln.startswith("run 1:"))
    assert line == (
        "run 1: test_acc 60.00% train 25.00 s of training steps over 5 epochs (15.00 s in the 3 before the resume, "
        "10.00 s in this process), wall 12.00 s since the process started, setup 0.00 s (target 94.00%: missed)"
    )
    assert "resumed run" in TIMING_PROTOCOL


def test_a_resume_from_a_fifo_or_a_folder_says_what_it_is(tmp_path):
    from fastcifar.core.config import Config
    from fastcifar.run import state

    fifo = tmp_path / "checkpoint.pt"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match="cannot read checkpoint: a FIFO \\(named pipe\\), not a regular file$"):
        state._read_state(fifo, Config(), 1)
    with pytest.raises(
        CheckpointError,
        match="cannot read checkpoint: a folder, not a regular file \\(did you mean .*checkpoint.pt\\?\\)$",
    ):
        state._read_state(tmp_path, Config(), 1)
