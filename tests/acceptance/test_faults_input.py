"""Issue 48: bad input and hostile files end cleanly: one line on stderr, exit 2, nothing written.

Options out of range (items 1, 6), ``--kernels triton`` without a GPU (2), a tampered training
checkpoint (3), hostile model metadata and weights (7), official batches with labels that are not
integers in range (10).
"""

from __future__ import annotations

import dataclasses
import json
import pickle
from dataclasses import fields

import numpy as np
import pytest
import torch
from cli import SHORT, run_dirs
from conftest import one_line_error, write_official
from models import RESUMED, tiny_model_file, training_state

from fastcifar.core.config import CHOICES, RANGES, Config, ConfigError, from_preset, validate
from fastcifar.core.errors import DataError
from fastcifar.core.presets import PRESETS
from fastcifar.run.state import seal
from fastcifar.train import main as train_main


def _train_cli(argv, tmp_path, capfd):
    """The trainer's command line in this process: (exit code, its one stderr line); asserts that
    no run folder was made."""
    out = tmp_path / "runs"
    code = train_main([str(a) for a in ["--out-dir", out, *argv]])
    err = capfd.readouterr().err
    assert not run_dirs(out), "nothing may be written for a refused run"
    return code, (one_line_error(err) if code else err)


# --- items 1 and 6: every numeric option has a range, checked before any work ------------------

NOT_IN_TABLE = {"seed", "seed_init", "seed_order", "seed_aug", "seed_subset", "whiten_kernel", "tta"}
# the seeds: 0..2^63-1-runs, the streams also -1 (validate); the others: CHOICES


def test_every_numeric_field_has_a_range_in_one_table():
    numeric = {f.name for f in fields(Config) if f.type in ("int", "float")}
    assert set(RANGES) <= numeric
    assert numeric - set(RANGES) - set(CHOICES) <= NOT_IN_TABLE, numeric - set(RANGES) - set(CHOICES)
    for name, (low, high, brackets) in RANGES.items():
        assert brackets in ("[]", "[)", "(]", "()"), name
        assert low is not None and (high is None or low < high), name
    for name in ("epochs", "runs", "batch_size", "eval_batch_size"):  # they size memory or time
        assert RANGES[name][1] is not None, f"--{name} has no upper bound"
    for name in PRESETS:
        validate(from_preset(name))  # every preset lies within the ranges


@pytest.mark.parametrize(
    "args, message",
    [
        (["--momentum", "2"], "--momentum must lie in [0, 1), not 2.0"),
        (["--momentum", "1"], "--momentum must lie in [0, 1), not 1.0"),
        (["--target-acc", "150"], "--target-acc must lie in [0, 100], not 150.0"),
        (["--target-acc", "-1"], "--target-acc must lie in [0, 100], not -1.0"),
        (["--epochs", "1e9"], "--epochs must lie in (0, 1000], not 1000000000"),
        (["--runs", "100000"], "--runs must lie in 1..1000, not 100000"),
        (["--batch-size", "1000000"], "--batch-size must lie in 1..65536, not 1000000"),
        (["--eval-batch-size", "1000000"], "--eval-batch-size must lie in 1..65536, not 1000000"),
        (["--widths", "8,16,30000,64"], "--widths: each must lie in 1..4096 channels, not 30000"),
        (["--warmup-steps", "100000000"], "--warmup-steps must lie in 0..1000, not 100000000"),
        (["--lr", "-0.1"], "--lr must not be negative, not -0.1"),
    ],
)
def test_out_of_range_options_are_one_line_before_any_work(args, message, tmp_path, capfd):
    # --data names nothing: the refusal comes before any data is read
    code, line = _train_cli(["--data", tmp_path / "absent", *SHORT, *args], tmp_path, capfd)
    assert code == 2 and line.startswith("fastcifar: error: ") and message in line, line


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"epochs": "3"}, "--epochs must be a number, not '3'"),
        ({"batch_size": 2.5}, "--batch-size must be a whole number, not 2.5"),
        ({"momentum": True}, "--momentum must be a number, not True"),
        ({"widths": (8, "16", 32, 64)}, "--widths must be a list of whole numbers"),
        ({"nesterov": 1}, "--nesterov must be true or false, not 1"),
    ],
)
def test_api_config_of_wrong_types_is_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        validate(dataclasses.replace(from_preset("resnet9"), **overrides))


# --- item 2: --kernels triton without a GPU is Triton's interpreter: refused unless asked for ------


def test_triton_kernels_without_a_gpu_are_refused_unless_asked_for(tmp_path, capfd, monkeypatch):
    from fastcifar.models.blocks import resolve_kernels

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without a GPU, also on one with
    monkeypatch.delenv("FASTCIFAR_ALLOW_INTERPRETER", raising=False)
    folder, _ = write_official(tmp_path / "d")
    for device in (["--device", "cpu"], ["--device", "auto"]):
        code, line = _train_cli(["--data", folder, *SHORT, *device, "--kernels", "triton"], tmp_path, capfd)
        assert code == 2 and line.startswith(
            "fastcifar: error: --kernels triton without a GPU runs Triton's interpreter"
        ), line
        assert "--kernels torch" in line and "FASTCIFAR_ALLOW_INTERPRETER=1" in line
    assert resolve_kernels("auto", torch.device("cpu")) == "torch"  # the default is not affected
    monkeypatch.setenv("FASTCIFAR_ALLOW_INTERPRETER", "1")  # the tests' opt-in: the interpreter runs
    assert resolve_kernels("triton", torch.device("cpu")) == "triton"


# --- item 3: a tampered training checkpoint: every field checked against the run ----------------
# (tests/helpers/models.py: RESUMED's run and its checkpoint, training_state; each edit resealed)


def _set(state, field, value):
    if field.startswith("loader."):
        state["ranks"][0]["loader"][field.split(".")[1]] = value
    elif value is _DROP:
        del state[field]
    else:
        state[field] = value
    return state


_DROP = object()
_NAN_MODEL = {"w": torch.tensor([0.0, float("nan")])}


@pytest.mark.parametrize(
    "field, value, message",
    [
        (
            "epochs_done",
            99,
            "field epochs_done is 99, this run has 3 epochs: it must lie in 0..2 (nothing left to train)",
        ),
        ("epochs_done", 3, "field epochs_done is 3, this run has 3 epochs"),
        ("epochs_done", -1, "field epochs_done is -1"),
        ("epochs_done", 1.5, "field epochs_done is 1.5"),
        ("epochs_done", "2", "field epochs_done is '2'"),
        ("steps_per_epoch", 0, "field steps_per_epoch is 0"),
        ("schedule_step", 10**12, "field schedule_step is 1000000000000, 2 epochs of 4 steps end at step 8"),
        ("records", [], "field records holds 0 entries, expected one per epoch done (2)"),
        ("records", "x", "field records holds str entries"),
        ("world_size", "1", "field world_size is '1'"),
        ("ranks", [], "field ranks holds 0 entries, expected one per rank (1)"),
        ("loader.seed", 7, "field ranks entry 0: loader seed 7, this run's is 0"),
        ("loader.epoch", -5, "field ranks entry 0: loader epoch -5, expected 0..2"),
        ("config", 5, "field config is not the JSON of a config"),
        ("config", "{not json", "field config is not the JSON of a config"),
        ("model", _NAN_MODEL, "field model w holds NaN or infinite values"),
        ("optimizer", _DROP, "field optimizer is missing"),
    ],
)
def test_tampered_checkpoint_fields_are_refused_by_name(field, value, message, tmp_path):
    from fastcifar.core.options import parse_args
    from fastcifar.models.files import CheckpointError
    from fastcifar.run.state import _read_state

    cfg = parse_args(RESUMED)
    good = tmp_path / "good.pt"
    torch.save(seal(training_state(cfg)), good)
    assert _read_state(good, cfg, 1)["epochs_done"] == 2  # the untampered file passes
    bad = tmp_path / "checkpoint.pt"
    torch.save(seal(_set(training_state(cfg), field, value)), bad)  # edited, digest and all: the field checks
    with pytest.raises(CheckpointError) as err:
        _read_state(bad, cfg, 1)
    assert str(err.value) == f"--resume {bad}: {message}" or str(err.value).startswith(f"--resume {bad}: {message}")


@pytest.mark.parametrize("epochs_done", [99, -1])
def test_tampered_checkpoint_is_one_line_and_writes_nothing(epochs_done, tmp_path, capfd):
    from fastcifar.core.options import parse_args

    path = tmp_path / "checkpoint.pt"
    torch.save(seal(_set(training_state(parse_args(RESUMED)), "epochs_done", epochs_done)), path)
    folder, _ = write_official(tmp_path / "d")
    code, line = _train_cli(["--data", folder, *RESUMED, "--resume", path], tmp_path, capfd)
    assert code == 2 and line.startswith(f"fastcifar: error: --resume {path}: field epochs_done is {epochs_done}")


# --- item 7: hostile model metadata and weights: checked before anything is built ---------------


def _model_file(tmp_path, meta_changes=None, tensor_changes=None, name="m.safetensors"):
    """A legitimate model file of a tiny FastNet, then its metadata or tensors changed."""
    from safetensors import safe_open

    from fastcifar.models.files import write_safetensors

    path = tiny_model_file(
        tmp_path / "good.safetensors",
        [f"c{i}" for i in range(10)],
        mean=(125.0, 123.0, 114.0),
        std=(63.0, 62.0, 66.0),
    )
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    for key, change in (meta_changes or {}).items():
        meta[key] = change(meta[key]) if callable(change) else change
    for key, change in (tensor_changes or {}).items():
        tensors[key] = change(tensors[key])
    write_safetensors(tmp_path / name, tensors, meta)  # with a fresh digest: the checks behind it are tested
    return tmp_path / name


def _config_with(**changes):
    def change(text):
        return json.dumps({**json.loads(text), **changes})

    return change


def _nan_at_0(t):
    t = t.clone()
    t.view(-1)[0] = float("nan")
    return t


@pytest.mark.parametrize(
    "meta, tensors, message",
    [
        (
            {"std": "[0, 0, 0]"},
            None,
            "unusable metadata: std must be 3 finite numbers (one per channel), each positive",
        ),
        ({"std": '["a", "b", "c"]'}, None, "unusable metadata: std must be 3 finite numbers"),
        ({"std": "[1, 2]"}, None, "unusable metadata: std must be 3 finite numbers"),
        ({"std": "[1, NaN, 2]"}, None, "unusable metadata: std must be 3 finite numbers"),
        ({"mean": "[Infinity, 0, 0]"}, None, "unusable metadata: mean must be 3 finite numbers"),
        ({"mean": '"abc"'}, None, "unusable metadata: mean must be 3 finite numbers"),
        (
            {"config": _config_with(widths=[8, 30000, 16])},
            None,
            "unusable metadata: config --widths: each must lie in 1..4096 channels, not 30000",
        ),
        (
            {"config": _config_with(widths="wide")},
            None,
            "unusable metadata: config --widths must be a list of whole numbers",
        ),
        ({"config": _config_with(arch=5)}, None, "unusable metadata: config --arch must be a string, not 5"),
        (
            {"config": _config_with(whiten_kernel=9)},
            None,
            "unusable metadata: config --whiten-kernel must be one of 2, 3",
        ),
        ({"config": "[1, 2]"}, None, "unusable metadata (ValueError: config is a list, not a JSON object)"),
        ({"classes": "[]"}, None, "unusable metadata: classes must be 1..10000 names"),
        ({"classes": "[1, 2, 3]"}, None, "unusable metadata: classes must be 1..10000 names"),
        ({"test_acc": "nan"}, None, "unusable metadata: test_acc must lie in 0..100, not nan"),
        (None, {"fc.weight": _nan_at_0}, "fc.weight holds NaN or infinite values"),
        (None, {"whiten.weight": lambda t: torch.full_like(t, float("inf"))}, "whiten.weight holds NaN or infinite"),
    ],
)
def test_hostile_model_files_are_refused_before_building(meta, tensors, message, tmp_path, monkeypatch):
    from fastcifar.models import network
    from fastcifar.models.files import CheckpointError, load_model

    assert load_model(_model_file(tmp_path, name="plain.safetensors"))[1].classes[0] == "c0"  # untampered: loads
    path = _model_file(tmp_path, meta, tensors)
    if meta:  # metadata is refused before any network (and its weights) is allocated
        monkeypatch.setattr(network, "make_network", lambda *a, **k: pytest.fail("built a network"))
    with pytest.raises(CheckpointError) as err:
        load_model(path)
    assert str(err.value).startswith(f"{path}: {message}"), str(err.value)


@pytest.mark.parametrize("command", ["evaluate", "predict"])
@pytest.mark.parametrize(
    "meta, tensors",
    [
        ({"std": "[0, 0, 0]"}, None),
        ({"std": '"x"'}, None),
        ({"config": _config_with(widths=[8, 30000, 16])}, None),
        (None, {"fc.weight": _nan_at_0}),
    ],
)
def test_hostile_model_is_one_line_in_evaluate_and_predict(command, meta, tensors, tmp_path, capfd):
    from PIL import Image

    from fastcifar.evaluate import main as evaluate_main
    from fastcifar.predict import main as predict_main

    path = _model_file(tmp_path, meta, tensors)
    folder, _ = write_official(tmp_path / "d")
    image = tmp_path / "x.png"
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(image)
    before = sorted(p.name for p in tmp_path.iterdir())
    argv = [str(path), "--data", str(folder)] if command == "evaluate" else [str(path), str(image)]
    code = (evaluate_main if command == "evaluate" else predict_main)(argv)
    captured = capfd.readouterr()
    assert code == 2 and captured.out == ""
    line = one_line_error(captured.err)
    assert line.startswith(f"fastcifar: error: {path}: "), line
    assert sorted(p.name for p in tmp_path.iterdir()) == before


# --- item 10: official labels must be integers in range -----------------------------------------


def _batch_with_labels(images, labels) -> bytes:
    """batch_bytes with the labels as given (conftest's converts them to int)."""
    data = images.transpose(0, 3, 1, 2).reshape(len(images), -1)
    return pickle.dumps(
        {b"batch_label": b"tampered", b"labels": labels, b"data": data, b"filenames": [b"x.png"] * len(images)},
        protocol=2,
    )


@pytest.mark.parametrize(
    "make_labels, message",
    [
        (lambda y: [int(v) + 0.7 for v in y], "labels must be a list of integers, got float"),
        (lambda y: [str(int(v)) for v in y], "labels must be a list of integers, got str"),
        (lambda y: [bool(v % 2) for v in y], "labels must be a list of integers, got bool"),
        (lambda y: np.asarray(y, np.float64), "labels must be a list of integers, got ndarray of float64"),
        (lambda y: [10] + [int(v) for v in y[1:]], "labels outside 0..9 (one is 10; CIFAR-10 has 10 classes)"),
        (lambda y: [-1] + [int(v) for v in y[1:]], "labels outside 0..9 (one is -1;"),
    ],
)
def test_official_labels_that_are_not_integers_in_range_are_refused(make_labels, message, tmp_path, capfd):
    from fastcifar.data.official import read_batch_dir

    folder, arrays = write_official(tmp_path / "d")
    x, y = arrays["train"]
    (folder / "data_batch_1").write_bytes(_batch_with_labels(x[:40], make_labels(y[:40])))
    with pytest.raises(DataError) as err:
        read_batch_dir(folder)
    assert str(err.value).startswith(f"{folder}/data_batch_1: ") and message in str(err.value), str(err.value)
    code, line = _train_cli(["--data", folder, *SHORT, "--epochs", "1"], tmp_path, capfd)
    assert code == 2 and line.startswith(f"fastcifar: error: {folder}/data_batch_1: ") and message in line


def test_official_integer_labels_of_numpy_types_still_read(tmp_path):
    from fastcifar.data.official import read_batch_dir

    folder, arrays = write_official(tmp_path / "d")
    x, y = arrays["train"]
    (folder / "data_batch_1").write_bytes(_batch_with_labels(x[:40], [np.int64(v) for v in y[:40]]))
    (folder / "data_batch_2").write_bytes(_batch_with_labels(x[40:80], np.asarray(y[40:80], np.uint8)))
    data = read_batch_dir(folder)
    assert data.train_labels.dtype == np.int64 and np.array_equal(data.train_labels, y)


def test_epochs_times_steps_beyond_the_schedules_bound_is_one_line(tmp_path, capfd, monkeypatch):
    """The schedule holds one rate per step: a run of more than MAX_STEPS steps is refused once the
    data fixes the steps per epoch, before the run folder (a small bound here: tiny data)."""
    from fastcifar.core import config

    monkeypatch.setattr(config, "MAX_STEPS", 100)
    folder, _ = write_official(tmp_path / "d")  # 200 images: 200 steps per epoch at batch 1
    code, line = _train_cli(["--data", folder, *SHORT, "--batch-size", "1", "--epochs", "1000"], tmp_path, capfd)
    assert code == 2 and line == (
        "fastcifar: error: --epochs 1000 x 200 steps per epoch (--batch-size 1) is "
        "200000 steps, more than 100: fewer epochs or a larger batch"
    )


def test_model_metadata_of_the_boolean_tta_era_still_loads():
    from fastcifar.core.config import check_fields
    from fastcifar.models.files import config_from_dict

    cfg = config_from_dict({"tta": True, "widths": [64, 128, 256, 512]})
    assert cfg.tta == 1 and type(cfg.tta) is int and check_fields(cfg) is cfg
