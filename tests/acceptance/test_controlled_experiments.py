"""A researcher's controlled experiments (docs/experiments.md): initial weights that only the init
seed decides, a leave-10-out pair of runs whose init, order and augmentation are shared, compute
held constant with --steps, and a bad subset mask refused in one line with nothing written."""

from __future__ import annotations

import json

import numpy as np
import pytest
from cli import SHORT, run_dirs, run_train
from conftest import one_line_error, write_official

import fastcifar
from fastcifar.core.config import from_preset
from fastcifar.core.streams import Streams
from fastcifar.train import main as train_main


class Built(Exception):
    """Raised right after the model is built: the test wants its initial weights, not a run."""


def initial_weights(monkeypatch, data, tmp_path, **settings) -> dict:
    """The weights the trainer builds a run's model with, under ``settings``."""
    import fastcifar.train as trainer  # the module, not the API function of that name

    build = trainer.build_model

    def spy(*args, **kwargs):
        model = build(*args, **kwargs)
        raise Built({k: v.clone() for k, v in model.state_dict().items()})

    monkeypatch.setattr(trainer, "build_model", spy)
    cfg = from_preset(
        "resnet9",
        data=str(data),
        out_dir=str(tmp_path / "runs"),
        device="cpu",
        widths=(8, 16, 32, 64),
        batch_size=50,
        epochs=1,
        quiet=True,
        save_model=False,
        **settings,
    )
    with pytest.raises(Built) as built:
        fastcifar.train(cfg)
    return built.value.args[0]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in a)


def test_the_init_seed_alone_decides_the_initial_weights(monkeypatch, tmp_path):
    data, _ = write_official(tmp_path / "d", per_batch=40, n_test=50)
    base = initial_weights(monkeypatch, data, tmp_path, seed_init=11)
    for others in (
        dict(seed=5, seed_init=11),
        dict(seed_init=11, seed_order=3, seed_aug=4),
        dict(seed_init=11, subset_fraction=0.5),
        dict(seed_init=11, subset=100),
    ):
        assert same(initial_weights(monkeypatch, data, tmp_path, **others), base), others
    assert not same(initial_weights(monkeypatch, data, tmp_path, seed_init=12), base)
    derived = initial_weights(monkeypatch, data, tmp_path, seed=3)
    assert same(initial_weights(monkeypatch, data, tmp_path, seed=3, seed_order=1, seed_aug=1), derived)
    assert same(initial_weights(monkeypatch, data, tmp_path, seed=9, seed_init=Streams.derived(3).init), derived)


@pytest.mark.slow
def test_a_leave_10_out_pair_shares_init_order_and_augmentation(learnable_data, tmp_path):
    """The README's pair: the full set and the set without 10 images, one --seed, the same number of
    steps; each run folder holds the mask it trained on, the streams and the schedule."""
    n = 1000
    left_out = np.arange(0, 100, 10)
    keep = np.ones(n, bool)
    keep[left_out] = False
    np.save(tmp_path / "without10.npy", keep)
    common = ["--data", learnable_data, *SHORT, "--seed", "7", "--steps", "30", "--quiet"]
    full = run_train([*common, "--out-dir", tmp_path / "full"])
    loo = run_train([*common, "--out-dir", tmp_path / "loo", "--subset-mask", tmp_path / "without10.npy"])
    assert full.returncode == 0 and loo.returncode == 0, full.stderr + loo.stderr
    docs = {}
    for name in ("full", "loo"):
        (run_dir,) = run_dirs(tmp_path / name)
        docs[name] = json.loads((run_dir / "summary.json").read_text())
        mask = np.load(run_dir / "subset_mask.npy", allow_pickle=False)
        assert mask.dtype == np.bool_ and (mask == (keep if name == "loo" else np.ones(n, bool))).all()
        assert "schedule: 30 steps = " in (run_dir / "log.txt").read_text()
    assert docs["full"]["results"][0]["streams"] == docs["loo"]["results"][0]["streams"] == Streams.derived(7).as_dict()
    assert docs["full"]["schedule"]["steps"] == docs["loo"]["schedule"]["steps"] == 30
    assert docs["full"]["schedule"]["steps_per_epoch"] == 10 and docs["loo"]["schedule"]["steps_per_epoch"] == 9
    assert docs["loo"]["schedule"]["epochs"] == pytest.approx(30 / 9) and docs["loo"]["schedule"]["given_in"] == "steps"
    assert sum(len(r["epochs"]) for r in docs["loo"]["results"]) == 4  # 3 whole epochs and a third of one


def test_a_bad_mask_ends_in_one_line_and_writes_nothing(tmp_path, capsys):
    """The trainer's main in this process (its exit status and stderr as the command's): the
    interpreter's start is not what these refusals test."""
    data, _ = write_official(tmp_path / "d", per_batch=40, n_test=50)
    out = tmp_path / "runs"
    np.save(tmp_path / "short.npy", np.ones(199, bool))
    np.save(tmp_path / "objects.npy", np.array([1, None], dtype=object), allow_pickle=True)

    def train(*args) -> tuple[int, str]:
        code = train_main([str(a) for a in ("--data", data, *SHORT, "--out-dir", out, *args)])
        return code, capsys.readouterr().err

    for mask, problem in (
        ("short.npy", "199 booleans, the training set has 200 images"),
        ("objects.npy", "holds Python objects (a pickle); save a bool or integer array"),
        ("absent.npy", "No such file or directory"),
    ):
        code, err = train("--subset-mask", tmp_path / mask)
        assert code == 2
        assert one_line_error(err) == f"fastcifar: error: --subset-mask {tmp_path / mask}: {problem}"
        assert run_dirs(out) == []
    code, err = train("--subset", "50", "--subset-fraction", "0.5")
    assert code == 2 and run_dirs(out) == []
    assert "--subset and --subset-fraction each choose the training subset" in one_line_error(err)
