"""The trainer end to end on the CPU: it learns, reports, and turns bad input into one line."""

from __future__ import annotations

import csv
import dataclasses

import pytest
import torch
from cli import FAST_SHORT, SHORT, run_dirs, run_train, summary_of, train_here
from conftest import one_line_error, write_official

from fastcifar.core.config import Config, from_preset
from fastcifar.core.options import build_parser, parse_args
from fastcifar.core.presets import DEFAULT_PRESET
from fastcifar.core.stats import p_above
from fastcifar.data.dali import dali_available
from fastcifar.run.report import EPOCH_HEADER, TSV_COLUMNS

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "loader",
    ["torch", pytest.param("dali", marks=pytest.mark.skipif(not dali_available()[0], reason="DALI is not installed"))],
)
def test_short_cpu_run_learns_and_reports(learnable_data, tmp_path, loader):
    out = tmp_path / "runs"
    proc = run_train(["--data", learnable_data, "--out-dir", out, *SHORT, "--loader", loader])
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == "" or "Traceback" not in proc.stderr

    summary = summary_of(out)
    acc = summary["summary"]["acc_mean"]
    assert acc > 60.0, f"a 4-epoch run on learnable data reached only {acc:.1f}% (guessing: 10%)"
    assert summary["config"]["epochs"] == 4 and summary["device"]["type"] == "cpu"
    assert summary["engine"]["loader"] == loader and summary["engine"]["kernels"] == "torch"
    assert "loader" not in summary and "kernels" not in summary  # once, under "engine"
    assert summary["versions"]["torch"] and "timing_protocol" in summary
    (result,) = summary["results"]
    assert len(result["epochs"]) == 4 and result["train_time"] > 0 and result["wall_time"] > result["train_time"]
    # the warm-up before the clock: timed, and neither in the train clock nor more than the wall clock
    assert 0 < result["setup_time"] < result["wall_time"] - result["train_time"]

    # stdout: the header, one fixed-width line per epoch, a final line
    lines = proc.stdout.splitlines()
    assert EPOCH_HEADER in lines
    epoch_lines = [ln for ln in lines if ln.startswith("   1 ") and len(ln.split()) == 9]
    assert [int(ln.split()[1]) for ln in epoch_lines] == [1, 2, 3, 4]
    assert any(ln.startswith("run 1: test_acc") for ln in lines)

    (run_dir,) = run_dirs(out)
    with open(run_dir / "timing_log.tsv") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    assert tuple(rows[0]) == TSV_COLUMNS and len(rows) == 4
    assert float(rows[-1]["test_acc"]) == pytest.approx(acc, abs=0.01)
    assert float(rows[-1]["total_train_time"]) == pytest.approx(result["train_time"], rel=1e-4)
    assert (run_dir / "log.txt").read_text().count("\n") >= 6


def test_a_jittered_run_learns_and_records_its_jitter(learnable_data, tmp_path):
    """--brightness/--contrast reach the loader (the DALI loader here: auto on the CPU) and the record:
    the same seed without them trains on other images, so its first epoch's loss differs."""
    losses = {}
    for name, jitter in (("plain", []), ("jittered", ["--brightness", "0.2", "--contrast", "0.2"])):
        out = tmp_path / name
        proc = run_train(["--data", learnable_data, "--out-dir", out, *SHORT, "--epochs", "2", *jitter])
        assert proc.returncode == 0, proc.stderr
        summary = summary_of(out)
        losses[name] = summary["results"][0]["epochs"][0]["train_loss"]
    assert (summary["config"]["brightness"], summary["config"]["contrast"]) == (0.2, 0.2)
    assert summary["summary"]["acc_mean"] > 50.0, summary["summary"]
    assert losses["plain"] != losses["jittered"], losses


def test_default_fast_preset_learns_on_the_cpu(learnable_data, tmp_path):
    out = tmp_path / "runs"
    proc = run_train(
        ["--data", learnable_data, "--out-dir", out, *FAST_SHORT, "--epochs", "2", "--warmup-epochs", "0.5"]
    )
    assert proc.returncode == 0, proc.stderr
    summary = summary_of(out)
    cfg = summary["config"]
    assert (cfg["preset"], cfg["arch"], cfg["flip_mode"], cfg["tta"], cfg["lookahead_steps"]) == (
        "fast",
        "fastnet",
        "alternate",
        2,
        5,
    )
    acc = summary["summary"]["acc_mean"]
    assert acc > 60.0, f"a 2-epoch fast run on learnable data reached only {acc:.1f}% (guessing: 10%)"
    (result,) = summary["results"]
    assert len(result["epochs"]) == 2 and result["epochs"][0]["lr"] > 0


def test_several_runs_give_a_summary_table(learnable_data, tmp_path):
    out = tmp_path / "runs"
    proc = run_train(
        ["--data", learnable_data, "--out-dir", out, *SHORT, "--epochs", "1", "--runs", "2", "--target-acc", "0"]
    )
    assert proc.returncode == 0, proc.stderr
    s = summary_of(out)
    assert s["summary"]["runs"] == 2 and s["summary"]["reached"] == 2
    assert [r["seed"] for r in s["results"]] == [0, 1]
    assert (
        s["results"][0]["test_acc"] != s["results"][1]["test_acc"]
        or s["results"][0]["epochs"][0]["train_loss"] != s["results"][1]["epochs"][0]["train_loss"]
    )
    assert "acc_mean" in proc.stdout and "2/2" in proc.stdout
    accs = [r["test_acc"] for r in s["results"]]  # the t-test of "mean > --target-acc 0" over 2 runs: 1 degree
    # of freedom, so how far below 0.5 depends on the two runs' spread
    assert s["summary"]["p_above_target"] == pytest.approx(p_above(accs, 0.0)) and s["summary"]["p_above_target"] < 0.5


def test_help_lists_every_field():
    """Every field but the preset has a flag in --help; the test harness's switches have flags that
    --help leaves out."""
    text = build_parser(Config()).format_help()
    for f in dataclasses.fields(Config):
        if f.name != "preset":
            flag = f"--{f.name.replace('_', '-')}"
            assert (flag in text) is (f.metadata["group"] != "testing"), f.name
    assert "--preset" in text and "per 512 images" in text  # the units from the config's comments


def test_warmup_scales_with_epochs_unless_given():
    assert parse_args(["--preset", "resnet9", "--epochs", "12"]).warmup_epochs == pytest.approx(2.5)
    assert parse_args(["--preset", "resnet9", "--epochs", "12", "--warmup-epochs", "1"]).warmup_epochs == 1.0
    assert parse_args(["--preset", "resnet9"]).warmup_epochs == 5.0
    # the user's value survives a changed --epochs in either spelling, on the default preset too
    assert parse_args(["--epochs", "5", "--warmup-epochs", "1"]).warmup_epochs == 1.0
    assert parse_args(["--epochs", "5", "--warmup-epochs=1"]).warmup_epochs == 1.0


def test_abbreviated_flags_are_refused(capsys):
    """argparse took --warmup-epo for --warmup-epochs, and the rescaling, looking for the full
    name, then replaced the user's 1 with the preset's share of 5 epochs (1.15)."""
    with pytest.raises(SystemExit) as stop:
        parse_args(["--epochs", "5", "--warmup-epo", "1"])
    assert stop.value.code == 2
    assert "unrecognized arguments: --warmup-epo 1" in one_line_error(capsys.readouterr().err)


def test_overrides_and_presets():
    cfg = parse_args(["--preset", "resnet9", "--epochs", "3", "--no-tta", "--widths", "8,16,32,64", "--lr", "0.2"])
    assert (cfg.epochs, cfg.tta, cfg.widths, cfg.lr, cfg.preset) == (3, False, (8, 16, 32, 64), 0.2, "resnet9")
    assert parse_args(["--epochs", "3"]).preset == DEFAULT_PRESET == "fast-jitter"  # the default preset
    seed = from_preset("resnet9")
    assert (
        seed.epochs,
        seed.batch_size,
        seed.lr,
        seed.momentum,
        seed.nesterov,
        seed.weight_decay,
        seed.label_smoothing,
        seed.crop_pad,
        seed.cutout,
        seed.warmup_epochs,
        seed.tta,
    ) == (24, 512, 0.4, 0.9, True, 5e-4, 0.2, 4, 8, 5.0, True)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--epochs", "x"], "invalid epoch count"),
        (["--epochs", "0"], "--epochs must lie in (0, 1000], not 0"),
        (["--preset", "nope"], "unknown preset"),
        (["--pad-mode", "wrap"], "invalid choice"),
        (["--warmup-epochs", "30"], "--warmup-epochs must lie in"),
        (["--warmup-epo", "1"], "unrecognized arguments: --warmup-epo"),  # no abbreviations
        (["--widths", "8,16"], "--widths takes three positive channel counts for --arch fastnet"),
        (["--preset", "resnet9", "--widths", "8,16"], "--widths takes four"),
        (["--fused-conv", "--compile"], "--fused-conv runs the Triton conv + normalize kernels in eager mode"),
        (
            ["--fused-conv", "--emulate-ranks", "2"],
            "does not combine with --compile, --emulate-ranks or --kernels torch",
        ),
        (
            ["--fused-conv", "--device", "cpu"],
            "--fused-conv needs the Triton kernels; --kernels auto runs the torch ones on cpu",
        ),
        pytest.param(
            ["--device", "cuda"],
            "no CUDA GPU",
            marks=pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU"),
        ),
    ],
)
def test_bad_arguments_are_one_line(args, message, tmp_path, capsys):
    proc = train_here(["--data", tmp_path, "--out-dir", tmp_path / "runs", *args], capsys)
    assert proc.returncode == 2
    assert message in one_line_error(proc.stderr)
    assert not run_dirs(tmp_path / "runs"), "nothing may be written for a refused run"


def test_triton_on_the_cpu_of_a_gpu_machine_is_one_line(tmp_path, monkeypatch, capfd):
    """Triton interprets CPU tensors only in a process without a GPU: where there is one (emulated),
    ``--device cpu --kernels triton`` is refused before anything is written, not at the first launch."""
    from fastcifar.train import main as train_main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    argv = ["--data", tmp_path, "--out-dir", tmp_path / "runs", *SHORT, "--device", "cpu", "--kernels", "triton"]
    assert train_main([str(a) for a in argv]) == 2
    assert "--kernels triton on the CPU" in one_line_error(capfd.readouterr().err)
    assert not run_dirs(tmp_path / "runs")


def test_bad_data_is_one_line(tmp_path, capsys):
    folder, _ = write_official(tmp_path / "d")
    (folder / "test_batch").write_bytes(b"\x80\x02garbage")
    proc = train_here(["--data", folder, "--out-dir", tmp_path / "runs", *SHORT], capsys)
    assert proc.returncode == 2
    assert "not a readable CIFAR-10 batch" in one_line_error(proc.stderr)
    proc = train_here(["--data", tmp_path / "missing", "--out-dir", tmp_path / "runs", *SHORT], capsys)
    assert proc.returncode == 2
    assert "no such file or folder" in one_line_error(proc.stderr)


def test_batch_larger_than_the_data(tmp_path, capsys):
    folder, _ = write_official(tmp_path / "d", per_batch=10)
    proc = train_here(["--data", folder, "--out-dir", tmp_path / "runs", *SHORT, "--batch-size", "100"], capsys)
    assert proc.returncode == 2
    assert "larger than the training set" in one_line_error(proc.stderr)


def test_each_epoch_after_the_first_was_drawn_while_the_one_before_ran(learnable_data, tmp_path, monkeypatch):
    """The trainer prepares epoch e+1's draws once epoch e's steps are queued (loader.EpochAhead: on a
    GPU the host then draws while the device computes), and iterating epoch e+1 takes them."""
    import fastcifar
    import fastcifar.train as fastcifar_train  # the module, not the API function of that name
    from fastcifar.data.loader import EpochAhead, TorchLoader

    taken = []
    take = EpochAhead.take

    def spy(self, streams, epoch):
        taken.append((streams.run, epoch, self.key == (streams, epoch)))
        return take(self, streams, epoch)

    monkeypatch.setattr(EpochAhead, "take", spy)
    events = []  # the order of the clock's synchronizes and of the prepares
    sync, prepare = fastcifar_train.synchronize, TorchLoader.prepare
    monkeypatch.setattr(fastcifar_train, "synchronize", lambda device: (events.append("sync"), sync(device)))
    monkeypatch.setattr(TorchLoader, "prepare", lambda self, s, e: (events.append(e), prepare(self, s, e)))
    cfg = from_preset(
        "resnet9",
        data=str(learnable_data),
        out_dir=str(tmp_path / "runs"),
        device="cpu",
        widths=(8, 16, 32, 64),
        batch_size=100,
        epochs=3,
        warmup_epochs=1,
        warmup_steps=1,
        eval_batch_size=200,
        seed=4,
        loader="torch",
        quiet=True,
    )
    fastcifar.train(cfg)
    timed = [t for t in taken if t[1] < 10**6]  # not the warm-up's batch (an epoch index training never uses)
    assert timed == [(4, 0, False), (4, 1, True), (4, 2, True)]
    # each epoch runs between two synchronizes (its clock): the next one's draws inside it, not after
    assert events == ["sync", 1, "sync", "sync", 2, "sync", "sync", "sync"]
