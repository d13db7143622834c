"""Model files and training checkpoints (fastcifar.checkpoint), resume, evaluate and predict."""

from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np
import pytest
import torch
from cli import run_dirs, run_train, torchrun
from conftest import CLASSES, batch_bytes, make_images, one_line_error
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
from fastcifar.run.state import seal
from fastcifar.train import main as train_main

# The `fast` preset (whitening, lookahead, frozen BN scales, bias freeze after epoch 2) made tiny.
# Noisy images (noise 150) keep the accuracy well below 100%, so "the same accuracy" means something;
# 300 test images in batches of 128 leave a partial last batch.
FAST_TINY = [
    "--preset",
    "fast",
    "--device",
    "cpu",
    "--widths",
    "16,32,32",
    "--batch-size",
    "100",
    "--epochs",
    "3",
    "--warmup-steps",
    "1",
    "--eval-batch-size",
    "128",
    "--whiten-images",
    "200",
    "--whiten-bias-epochs",
    "2",
    "--loader",
    "torch",
]


def write_noisy_official(root, n_train=1000, n_test=300):
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    x, y = make_images(n_train, seed=1, noise=150)
    tx, ty = make_images(n_test, seed=2, noise=150)
    per = n_train // 5
    for i in range(5):
        (folder / f"data_batch_{i + 1}").write_bytes(
            batch_bytes(x[i * per : (i + 1) * per], y[i * per : (i + 1) * per])
        )
    (folder / "test_batch").write_bytes(batch_bytes(tx, ty))
    return folder, (tx, ty)


# The default preset (fast-jitter: Muon on the filters, no lookahead, brightness/contrast jitter) made as small.
DEFAULT_TINY = FAST_TINY[2:]
assert FAST_TINY[:2] == ["--preset", "fast"]


def _train_with_checkpoint(root, tiny):
    """One uninterrupted 3-epoch run of ``tiny`` that also wrote a checkpoint after epoch 2."""
    data, test = write_noisy_official(root / "data")
    out = root / "runs"
    # in this process (no start-up cost); the resume test continues it in a fresh one, which runs
    # with OMP_NUM_THREADS=1 (tests/helpers/cli.py): one thread here too, since CPU convolutions round their
    # sums differently with another thread count (seen in CI: 1e-6 apart after resume with 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert train_main([str(a) for a in ["--data", data, "--out-dir", out, *tiny, "--checkpoint-every", "2"]]) == 0
    finally:
        torch.set_num_threads(threads)
    (run_dir,) = run_dirs(out)
    return {
        "data": data,
        "test": test,
        "dir": run_dir,
        "root": root,
        "tiny": tiny,
        "summary": json.loads((run_dir / "summary.json").read_text()),
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return _train_with_checkpoint(tmp_path_factory.mktemp("trained"), FAST_TINY)


@pytest.fixture(scope="module")
def trained_default(tmp_path_factory):
    return _train_with_checkpoint(tmp_path_factory.mktemp("trained_default"), DEFAULT_TINY)


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


# --- resume -------------------------------------------------------------------------------------


def _tensors(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


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
    full, resumed = _tensors(trained["dir"] / "model.safetensors"), _tensors(run_dir / "model.safetensors")
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


def test_checkpoint_state_is_complete(trained):
    state = torch.load(trained["dir"] / "checkpoint.pt", weights_only=True)
    assert state["epochs_done"] == 2 and state["schedule_step"] == 2 * state["steps_per_epoch"]
    (rank,) = state["ranks"]
    assert rank["loader"] == {"seed": 0, "epoch": 1}
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
    a, b = _tensors(dir_a / "model.safetensors"), _tensors(dir_b / "model.safetensors")
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
from fastcifar.core.config import parse_args
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
from fastcifar.core.config import parse_command_line
path, argv = sys.argv[1], sys.argv[2:]
ctx = distributed.setup("cpu", 60)
mine = path if ctx.rank == 0 else path + ".not-on-this-node"
cfg, given = parse_command_line(["--resume", mine, *argv])
cfg = state.resume_settings(cfg, given, ctx)
print(f"settings epochs={cfg.epochs:g} widths={tuple(cfg.widths)} whiten_bias_epochs={cfg.whiten_bias_epochs}")
distributed.teardown(ctx)
"""


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
def test_evaluate_reproduces_an_accuracy_recorded_with_a_tta_share(tmp_path):
    """--tta-share 0.3: the trainer gives the views to 30% of each padded evaluation batch's real
    rows (128 + 128 + 44 of 300 test images), evaluate to 30% of each unpadded batch: the same rows."""
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
    assert info.config.tta_share == 0.3 and info.config.tta == 2
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


def test_resume_accepts_other_display_and_path_settings_only():
    """--quiet, paths and logging may differ on resume; a training setting may not."""
    from fastcifar.core.config import from_preset
    from fastcifar.core.config import training_settings as _training_config

    base = from_preset("resnet9")
    assert _training_config(base) == _training_config(from_preset("resnet9", quiet=True, out_dir="x", data="y"))
    assert _training_config(base) != _training_config(from_preset("resnet9", lr=0.5))


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
