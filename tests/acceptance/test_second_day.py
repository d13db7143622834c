"""A newcomer's second day (issue 71): a library that cannot be imported ends no command in a
traceback; a run you can watch (its console lines); runs you can reuse (--config, TensorBoard)."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from broken_imports import broken_import_env
from cli import TINY, env, free_port, run_dirs, run_train
from conftest import one_line_error, write_official
from safetensors import safe_open

from fastcifar.core.config import CONFIG_FILE, config_file_text, from_preset, read_config_file
from fastcifar.core.options import parse_command_line
from fastcifar.run.report import EPOCH_HEADER


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder, _ = write_official(tmp_path_factory.mktemp("data"), per_batch=40, n_test=50)
    return folder


FASTCIFAR = [sys.executable, "-m", "fastcifar"]  # the command users type: run_train's launcher here


# --- a library that cannot be imported ---------------------------------------------------------


@pytest.fixture
def broken_torchvision(tmp_path):
    """The environment (its variables on top of env()) of a torchvision built for another torch: its
    import raises what that one raises (issue 71: a CPU install beside a torchvision of the wrong build)."""
    return broken_import_env("torchvision", tmp_path / "fake", "operator torchvision::nms does not exist")


@pytest.mark.slow
def test_a_torchvision_that_cannot_be_imported_ends_no_command(broken_torchvision, data, tmp_path):
    broken = broken_torchvision
    proc = subprocess.run(
        [sys.executable, "-c", "import torchvision"], env={**env(), **broken}, capture_output=True, text=True
    )
    assert "operator torchvision::nms does not exist" in proc.stderr, "the fake breaks the import"
    # --download with the network refused (a proxy on a closed port): the download's own one line, exit 2
    closed = f"http://127.0.0.1:{free_port()}"
    offline = dict(broken, https_proxy=closed, HTTPS_PROXY=closed, no_proxy="", NO_PROXY="")
    args = ["train", "--data", tmp_path / "dl", "--download", "--out-dir", tmp_path / "runs", *TINY]
    proc = run_train(args, launcher=FASTCIFAR, extra_env=offline)
    assert proc.returncode == 2, proc.stderr
    line = one_line_error(proc.stderr)
    assert line.startswith("fastcifar: error: download of https://") and "by hand" in line
    # no module of the package imports torchvision, and a run trains and evaluates without it
    args = ["train", "--data", data, "--out-dir", tmp_path / "runs", *TINY, "--epochs", "1"]
    proc = run_train(args, launcher=FASTCIFAR, extra_env=broken)
    assert proc.returncode == 0, proc.stderr
    (run_dir,) = run_dirs(tmp_path / "runs")
    proc = run_train(["evaluate", run_dir / "model.safetensors", "--data", data], launcher=FASTCIFAR, extra_env=broken)
    assert proc.returncode == 0, proc.stderr


# --- a run you can watch -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def first(data, tmp_path_factory):
    """One 3-epoch run with a checkpoint after every epoch: its console and its folder."""
    out = tmp_path_factory.mktemp("runs")
    proc = run_train(["train", "--data", data, "--out-dir", out, *TINY, "--checkpoint-every", "1"], launcher=FASTCIFAR)
    assert proc.returncode == 0, proc.stderr
    (run_dir,) = run_dirs(out)
    return proc.stdout.splitlines(), run_dir


@pytest.mark.slow
def test_the_console_gives_the_estimate_each_evaluation_the_checkpoints_and_the_total(first):
    lines, run_dir = first
    estimate = next(i for i, ln in enumerate(lines) if ln.startswith("run 1: about "))
    assert "3 epochs of 4 steps at " in lines[estimate] and "1 evaluation batch an epoch at" in lines[estimate]
    header = lines.index(EPOCH_HEADER)
    assert estimate < header and EPOCH_HEADER.split()[-1] == "eval_s"
    rows = [ln.split() for ln in lines if ln.startswith("   1 ") and len(ln.split()) == 9]
    with open(run_dir / "timing_log.tsv") as f:
        tsv = list(csv.DictReader(f, delimiter="\t"))
    assert [r[-1] for r in rows] == [f"{float(t['test_time']):.2f}" for t in tsv], "each epoch's evaluation time"
    checkpoints = [ln for ln in lines if ln.startswith("checkpoint: ")]
    assert checkpoints == [f"checkpoint: {run_dir / 'checkpoint.pt'} (after epoch {e})" for e in (1, 2)]
    assert [lines[lines.index(c) - 1].split()[:2] for c in checkpoints] == [["1", "1"], ["1", "2"]], "after its epoch"
    summary = json.loads((run_dir / "summary.json").read_text())
    (result,) = summary["results"]
    took = next(ln for ln in lines if ln.startswith("run 1: took "))
    assert lines.index(took) == next(i for i, ln in enumerate(lines) if ln.startswith("run 1: test_acc")) + 1
    assert took.startswith(
        f"run 1: took {result['run_time']:.1f} s in all, set-up to model file (setup {result['setup_time']:.1f} s"
    )
    assert f"estimated {result['estimated_time']:.1f} s)" in took
    spent = result["setup_time"] + sum(e["train_time"] + e["test_time"] for e in result["epochs"])
    assert result["run_time"] >= spent > 0, "the total holds the set-up, every epoch and every evaluation"


def test_evaluation_shows_a_bar_on_a_terminal():
    from fastcifar.data.loader import EvalSet
    from fastcifar.parallel.distributed import DistContext
    from fastcifar.run.graphs import EvalStep, StaticBatch
    from fastcifar.run.progress import Progress
    from fastcifar.run.step import evaluate

    class Tty(io.StringIO):
        def isatty(self):
            return True

    cpu = torch.device("cpu")
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 10))
    images, labels = np.zeros((50, 32, 32, 3), np.uint8), np.arange(50) % 10
    test_set = EvalSet(images, labels, 20, dtype=torch.float32, device=cpu)
    step = EvalStep(model, StaticBatch(20, torch.float32, cpu), 0, capture=False)
    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=cpu, backend=None)
    plain = evaluate(model, step, test_set, ctx)
    stream = Tty()
    assert evaluate(model, step, test_set, ctx, Progress(True, stream), "run 1 epoch 1 evaluation") == plain
    assert "run 1 epoch 1 evaluation:" in stream.getvalue() and "/3 [" in stream.getvalue(), "a bar of 3 batches"


# --- runs you can reuse ------------------------------------------------------------------------


@pytest.mark.slow
def test_config_repeats_the_run(first, tmp_path):
    """`train --config RUN/config.json` trains the same run again: the same accuracy, the same weights."""
    _, run_dir = first
    saved = json.loads((run_dir / CONFIG_FILE).read_text())
    assert saved["epochs"] == 3 and saved["checkpoint_every"] == 1 and saved["widths"] == [8, 16, 32, 64]
    proc = run_train(["train", "--config", run_dir / CONFIG_FILE, "--out-dir", tmp_path / "again"], launcher=FASTCIFAR)
    assert proc.returncode == 0, proc.stderr
    (again,) = run_dirs(tmp_path / "again")
    first_acc, again_acc = (
        json.loads((d / "summary.json").read_text())["results"][0]["test_acc"] for d in (run_dir, again)
    )
    assert again_acc == first_acc
    with (
        safe_open(str(run_dir / "model.safetensors"), "pt") as a,
        safe_open(str(again / "model.safetensors"), "pt") as b,
    ):
        assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())
    assert json.loads((again / CONFIG_FILE).read_text()) == {**saved, "out_dir": str(tmp_path / "again")}


def test_options_given_beside_config_override_it(tmp_path):
    path = tmp_path / CONFIG_FILE
    path.write_text(config_file_text(from_preset("resnet9", epochs=3, widths=(8, 16, 32, 64), seed=5)))
    saved = read_config_file(str(path))
    assert saved == from_preset("resnet9", epochs=3, widths=(8, 16, 32, 64), seed=5), "read back as written"
    cfg, given = parse_command_line(["--config", str(path), "--epochs", "6", "--lr", "0.2"])
    assert (cfg.epochs, cfg.lr) == (6, 0.2) and given == {"epochs": 6, "lr": 0.2}
    assert cfg.warmup_epochs == saved.warmup_epochs * 2, "the file's warm-up scaled with --epochs, as a preset's is"
    assert dataclasses.replace(cfg, epochs=3, lr=saved.lr, warmup_epochs=saved.warmup_epochs) == saved


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "No such file or directory"),
        ("{not json", "not a JSON file of settings"),
        ("[1, 2]", "not a JSON object of settings"),
        ('{"epochs": 3, "colour": "red"}', "unknown setting 'colour'"),
        ('{"epochs": "three"}', 'epochs must be float, not "three"'),
        ('{"quiet": 1}', "quiet must be bool, not 1"),
        ('{"widths": [8, "a"]}', "widths must be tuple"),
        ('{"preset": "fastest"}', "unknown preset 'fastest'"),
        ('{"epochs": 3}', "give --preset or --config, not both"),
    ],
)
def test_a_bad_config_file_is_one_line(content, message, tmp_path, capsys):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    argv = ["--config", str(path)] + (["--preset", "resnet9"] if message.startswith("give --preset") else [])
    with pytest.raises(SystemExit) as stop:
        parse_command_line(argv)
    assert stop.value.code == 2
    line = one_line_error(capsys.readouterr().err)
    assert line.startswith("fastcifar: error: ") and message in line, line


@pytest.mark.slow
def test_tensorboard_events_read_back(data, tmp_path):
    """--tensorboard: the epochs' scalars and the settings, read back with TensorBoard's own reader."""
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install 'fastcifar[tensorboard]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = ["train", "--data", data, "--out-dir", tmp_path, *TINY, "--epochs", "2", "--tensorboard"]
    proc = run_train(args, launcher=FASTCIFAR)
    assert proc.returncode == 0, proc.stderr
    (run_dir,) = run_dirs(tmp_path)
    (epochs,) = [r["epochs"] for r in json.loads((run_dir / "summary.json").read_text())["results"]]
    events = EventAccumulator(str(run_dir / "tensorboard" / "run1"), size_guidance={"tensors": 0}).Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    for tag, field in [("accuracy/test", "test_acc"), ("loss/train", "train_loss"), ("lr", "lr")]:
        assert scalars[tag] == [(e["epoch"], pytest.approx(e[field], rel=1e-6)) for e in epochs], tag
    assert [s for s, _ in scalars["time/step_s"]] == [1, 2] and all(v > 0 for _, v in scalars["rate/images_per_s"])
    assert {"accuracy/train", "loss/test", "time/epoch_train_s", "time/epoch_eval_s"} <= set(scalars)
    (settings,) = events.Tensors("settings/text_summary")
    assert '"tensorboard": true' in settings.tensor_proto.string_val[0].decode()
    said = f"tensorboard: events in {run_dir / 'tensorboard' / 'run1'} (tensorboard --logdir {tmp_path})"
    assert said in proc.stdout.splitlines(), "where the events went, on the console"


def test_tensorboard_without_the_package_is_one_line(data, tmp_path, monkeypatch, capsys):
    from fastcifar.train import main as train_main

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard fails as if not installed
    code = train_main(["--data", str(data), "--out-dir", str(tmp_path / "runs"), *TINY, "--tensorboard", "--quiet"])
    assert code == 2
    line = one_line_error(capsys.readouterr().err)
    assert line == (
        "fastcifar: error: --tensorboard needs the tensorboard package, which cannot be imported (not installed): "
        "pip install tensorboard (or pip install -e '.[tensorboard]' in the checkout), or leave out --tensorboard"
    )
    assert not (tmp_path / "runs").exists(), "nothing written"
