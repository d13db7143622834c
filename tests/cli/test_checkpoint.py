"""Model files and training checkpoints (fastcifar.checkpoint), evaluate and predict. Resuming from a
checkpoint: tests/cli/test_resume.py."""

from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np
import pytest
import torch
from cli import run_dirs
from conftest import CLASSES, one_line_error
from models import FAST_TINY, write_noisy_official
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file

from fastcifar.core import atomic
from fastcifar.core.config import from_preset
from fastcifar.evaluate import evaluate
from fastcifar.evaluate import main as evaluate_main
from fastcifar.models.files import CheckpointError, load_model, save_model, write_safetensors
from fastcifar.models.network import make_network
from fastcifar.ops.norm_act_pool import NormActPool
from fastcifar.predict import main as predict_main
from fastcifar.train import main as train_main


def tiny_fastnet(num_classes=11):
    torch.manual_seed(0)
    cfg = from_preset("fast", widths=(8, 16, 16))
    model = make_network(cfg, NormActPool, num_classes)
    with torch.no_grad():  # buffers away from their init, so a load that skipped them would show
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.add_(torch.rand_like(t))
    return cfg, model


# --- the model file ---------------------------------------------------------------------------


def test_model_file_round_trip(tmp_path):
    cfg, model = tiny_fastnet(num_classes=11)
    classes = [f"c{i}" for i in range(11)]
    path = save_model(tmp_path / "m.safetensors", model, cfg, classes, 71.25, (1.0, 2.0, 3.0), (4.0, 5.0, 6.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"], "no temporary file left"
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        assert set(f.keys()) == set(model.state_dict())
    assert meta["format"] == "fastcifar.model/1" and json.loads(meta["classes"]) == classes
    assert json.loads(meta["config"])["widths"] == [8, 16, 16] and float(meta["test_acc"]) == 71.25
    assert json.loads(meta["mean"]) == [1.0, 2.0, 3.0] and json.loads(meta["std"]) == [4.0, 5.0, 6.0]

    loaded, info = load_model(path)  # from the file alone: arch, widths and class count from metadata
    assert info.config == cfg and info.classes == tuple(classes) and info.test_acc == 71.25
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    base = save_model(tmp_path / "base.safetensors", model, cfg, classes, None, (1.0,) * 3, (4.0,) * 3)
    assert load_model(base)[1].test_acc is None  # a file written before any evaluation (a sparse-diff base)
    x = torch.randn(4, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    model.eval().to(memory_format=torch.channels_last)  # as loaded: same layout, same conv algorithm
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    assert loaded(x).shape == (4, 11)


def test_failed_write_keeps_the_previous_file(tmp_path, monkeypatch):
    cfg, model = tiny_fastnet()
    path = save_model(tmp_path / "m.safetensors", model, cfg, CLASSES + ("x",), 50.0, (0,) * 3, (1,) * 3)
    before = path.read_bytes()

    def half_then_full(tmp, blob):  # what a full disk does mid-write
        with open(tmp, "wb") as f:
            f.write(blob[:100])
        raise OSError(27, "File too large")

    monkeypatch.setattr(atomic, "_write_file", half_then_full)
    with pytest.raises(CheckpointError, match="cannot write .*m.safetensors: File too large"):
        save_model(path, model, cfg, CLASSES + ("x",), 60.0, (0,) * 3, (1,) * 3)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]


def _bad_model_file(kind, tmp_path):
    cfg, model = tiny_fastnet()
    good = save_model(tmp_path / "good.safetensors", model, cfg, CLASSES + ("x",), 50.0, (0,) * 3, (1,) * 3)
    bad = tmp_path / f"{kind}.safetensors"
    if kind == "corrupt":
        bad.write_bytes(b"\x00garbage, not a safetensors header" * 10)
    elif kind == "truncated":
        bad.write_bytes(good.read_bytes()[: len(good.read_bytes()) // 2])
    elif kind == "foreign":  # a valid safetensors file, not ours
        save_file({"w": torch.zeros(3)}, str(bad), metadata={"format": "pt"})
    elif kind == "mismatched":  # our metadata, weights of another width
        _, other = tiny_fastnet()
        tensors = {k: v.contiguous() for k, v in other.state_dict().items()}
        tensors["fc.weight"] = torch.zeros(11, 99)
        with safe_open(str(good), framework="pt") as f:
            write_safetensors(bad, tensors, f.metadata())  # digest and all: the shapes are what is refused
    return bad


@pytest.mark.parametrize(
    "kind,message",
    [
        ("corrupt", "not a readable model file"),
        ("truncated", "not a readable model file"),
        ("foreign", "not a fastcifar model file"),
        ("mismatched", r"fc.weight has shape \(11, 99\)"),
    ],
)
def test_bad_model_files_are_refused(kind, message, tmp_path):
    with pytest.raises(CheckpointError, match=message):
        load_model(_bad_model_file(kind, tmp_path))


@pytest.mark.parametrize("main", [evaluate_main, predict_main])
def test_cli_refuses_a_truncated_model_in_one_line(main, tmp_path, capsys):
    bad = _bad_model_file("truncated", tmp_path)
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(tmp_path / "x.png")
    assert main([str(bad), "--data" if main is evaluate_main else str(tmp_path / "x.png"), str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert "not a readable model file" in one_line_error(captured.err) and captured.out == ""


# --- the training checkpoint ----------------------------------------------------------------------


def test_checkpoint_state_is_complete(trained):
    state = torch.load(trained["dir"] / "checkpoint.pt", weights_only=True)
    assert state["epochs_done"] == 2 and state["schedule_step"] == 2 * state["steps_per_epoch"]
    (rank,) = state["ranks"]
    assert rank["loader"]["seed"] == 0 and rank["loader"]["epoch"] == 1  # and the streams it resumes with
    assert rank["loader"]["streams"]["run"] == 0 and set(rank["loader"]["streams"]) == {
        "run",
        "init",
        "order",
        "aug",
        "subset",
    }
    assert rank["hooks"]["lookahead"]["steps"] == 2 * state["steps_per_epoch"]
    assert set(rank["rng"]) == {"torch", "cuda", "numpy", "python"}
    assert state["optimizer"]["lr_scales"]["whiten_bias"] == 1.0  # frozen only from epoch 3 (index 2)
    assert len(state["records"]) == 2


def test_default_presets_checkpoint_holds_muons_momentum(trained_default):
    state = torch.load(trained_default["dir"] / "checkpoint.pt", weights_only=True)
    filters = [t for name, t in state["model"].items() if t.dim() == 4 and not name.startswith("whiten")]
    buffers = state["optimizer"]["muon"]["buffers"]
    assert [b.shape for b in buffers] == [f.shape for f in filters]  # one per trained conv filter
    assert all(b.abs().sum() > 0 for b in buffers), "two epochs of momentum, not the zeroed start"


# --- evaluate and predict -----------------------------------------------------------------------


@pytest.mark.slow  # over 2 s on 2 cores
def test_evaluate_reproduces_the_recorded_accuracy(trained, capsys):
    model_file = trained["dir"] / "model.safetensors"
    recorded = trained["summary"]["results"][0]["test_acc"]
    assert 30 < recorded < 100, "the noisy data should leave room for mistakes"
    _, info = load_model(model_file)
    assert info.test_acc == recorded
    result = evaluate(str(model_file), str(trained["data"]))
    assert result.accuracy == pytest.approx(recorded, abs=1e-9) and result.count == 300 and result.tta == 2
    counts = np.array([result.per_class_count[c] for c in CLASSES])
    accs = np.array([result.per_class[c] for c in CLASSES])
    assert counts.sum() == 300 and (accs * counts).sum() / 300 == pytest.approx(recorded)

    assert evaluate_main([str(model_file), "--data", str(trained["data"])]) == 0
    out = capsys.readouterr().out
    assert f"test_acc {recorded:.2f}% (TTA 2, 300 images)" in out
    assert sum(line.strip().split()[0] in CLASSES for line in out.splitlines()) == 10
    assert evaluate(str(model_file), str(trained["data"]), tta=0).tta == 0


@pytest.mark.slow  # trains, then evaluates with TTA
@pytest.mark.parametrize("scope", ["batch", "test"])
def test_evaluate_reproduces_an_accuracy_recorded_with_a_tta_share(tmp_path, scope):
    """--tta-share 0.3: the trainer gives the views to 30% of each padded evaluation batch's real
    rows (128 + 128 + 44 of 300 test images), evaluate to 30% of each unpadded batch: the same rows;
    with --tta-scope test both to the least sure 90 of all 300 (the trainer's two captured passes,
    evaluate's eager ones)."""
    data, _ = write_noisy_official(tmp_path / "data")
    out = tmp_path / "runs"
    assert (
        train_main(
            [
                str(a)
                for a in [
                    "--data",
                    data,
                    "--out-dir",
                    out,
                    *FAST_TINY,
                    "--epochs",
                    "1",
                    "--tta-share",
                    "0.3",
                    "--tta-scope",
                    scope,
                    "--quiet",
                ]
            ]
        )
        == 0
    )
    (run_dir,) = run_dirs(out)
    (result,) = json.loads((run_dir / "summary.json").read_text())["results"]
    recorded = result["test_acc"]
    net, info = load_model(run_dir / "model.safetensors")
    assert info.config.tta_share == 0.3 and info.config.tta == 2 and info.config.tta_scope == scope
    mine = evaluate((net, info), str(data))
    assert mine.accuracy == pytest.approx(recorded, abs=1e-9)
    # the loss moves with every row's logits: a row given the views that should not have been shows here
    assert mine.loss == pytest.approx(result["epochs"][-1]["test_loss"], rel=1e-5)
    everyone = dataclasses.replace(info, config=dataclasses.replace(info.config, tta_share=1.0))
    assert evaluate((net, everyone), str(data)).accuracy != pytest.approx(recorded, abs=1e-9)  # the share mattered


@pytest.mark.slow  # over 2 s on 2 cores
def test_predict_folder_with_a_corrupt_file(trained, tmp_path, capsys):
    model_file = trained["dir"] / "model.safetensors"
    images, labels = trained["test"]
    folder = tmp_path / "mine"
    (folder / "sub").mkdir(parents=True)
    for i in range(6):  # lossless PNGs of test images: their top class must be evaluate's prediction
        Image.fromarray(images[i]).save(folder / f"{i}.png")
    Image.fromarray(images[6]).save(folder / "sub" / "6.jpg", quality=95)
    Image.fromarray(images[7]).resize((64, 48)).save(folder / "big.png")
    (folder / "broken.png").write_bytes(b"\x89PNG but then nothing")

    assert predict_main([str(model_file), str(folder), "--json", "--top", "3"]) == 1  # one unreadable, others run
    proc = capsys.readouterr()
    err = [line for line in proc.err.splitlines() if line.strip()]
    assert len(err) == 2 and any("broken.png: not a readable image" in e for e in err)
    assert any("big.png: resized from 64x48 to 32x32" in e for e in err)
    preds = {p["path"].split("/")[-1]: p for p in json.loads(proc.out)["predictions"]}
    assert set(preds) == {"0.png", "1.png", "2.png", "3.png", "4.png", "5.png", "6.jpg", "big.png", "broken.png"}
    assert preds["broken.png"]["error"] and preds["broken.png"]["top"] == []
    assert preds["big.png"]["resized_from"] == [64, 48]
    expected = evaluate(str(model_file), str(trained["data"])).predictions
    for i in range(6):
        top = preds[f"{i}.png"]["top"]
        probs = [t["probability"] for t in top]
        assert len(top) == 3 and probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1 + 1e-6
        assert top[0]["class"] == CLASSES[expected[i]], f"image {i}"

    assert predict_main([str(model_file), str(folder / "0.png")]) == 0
    assert capsys.readouterr().out.startswith(f"{folder / '0.png'}: {CLASSES[expected[0]]} ")


@pytest.mark.slow  # over 2 s on 2 cores
def test_full_disk_at_the_model_file_is_one_line(learnable_data, tmp_path):
    """RLIMIT_FSIZE fails writes past 16 KiB (EFBIG), as a full disk would: the logs fit, the
    model file (~100 KiB) does not; one line, exit 2, no temporary file left."""
    import resource
    import subprocess

    from cli import ROOT, SHORT, env

    def limit_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384))

    out = tmp_path / "runs"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fastcifar.train",
            "--data",
            str(learnable_data),
            "--out-dir",
            str(out),
            *SHORT,
            "--epochs",
            "1",
            "--loader",
            "torch",
        ],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit_files,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = one_line_error(proc.stderr)
    assert line.startswith("fastcifar: error: cannot write ") and line.endswith("model.safetensors: File too large")
    (run_dir,) = run_dirs(out)
    assert not [p for p in run_dir.iterdir() if p.name.endswith(".tmp") or p.name.startswith(".model")]
