"""Files the trainer's commands read, written by the tests: a tiny model file, and a training
checkpoint's state as save_state writes it (the resume tests edit it, reseal it and hand it over)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from cli import SHORT
from conftest import CLASSES

from fastcifar.core.config import from_preset, training_settings
from fastcifar.models.files import save_model
from fastcifar.models.network import make_network
from fastcifar.ops.norm_act_pool import NormActPool
from fastcifar.run.state import STATE_FORMAT

# the widths of the tiny FastNet in tiny_model_file: a file of 50 KB, built in a moment
TINY_WIDTHS = (8, 16, 16)


def tiny_model_file(
    path: Path, classes=CLASSES, test_acc: float | None = 50.0, mean=(125.0,) * 3, std=(60.0,) * 3
) -> Path:
    """A model file of a tiny FastNet (the `fast` preset, TINY_WIDTHS, weights of seed 0) with its
    metadata, written by save_model as training writes it (class names are checked there)."""
    torch.manual_seed(0)
    cfg = from_preset("fast", widths=TINY_WIDTHS)
    return save_model(path, make_network(cfg, NormActPool, len(classes)), cfg, classes, test_acc, mean, std)


RESUMED = [*SHORT, "--epochs", "3"]  # resnet9, 3 epochs: a checkpoint after epoch 2 has one left


def training_state(cfg, epochs_done=2, steps=4) -> dict:
    """A training checkpoint as save_state writes it after ``epochs_done`` epochs of ``steps``
    steps (weights of a stand-in: the checks here come before any model is built); unsealed."""
    records = [
        {
            "run": 1,
            "epoch": e + 1,
            "lr": 0.1,
            "train_time": 1.0,
            "train_loss": 2.0,
            "train_acc": 20.0,
            "test_time": 0.5,
            "test_loss": 2.1,
            "test_acc": 19.0,
            "total_train_time": e + 1.0,
        }
        for e in range(epochs_done)
    ]
    rank = {
        "rng": {
            "torch": torch.get_rng_state(),
            "cuda": [],
            "numpy": (torch.zeros(624, dtype=torch.int64), 0, 0, 0.0),
            "python": None,
        },
        "hooks": {"lookahead": None},
        "loader": {"seed": cfg.seed, "epoch": epochs_done - 1},
    }
    return {
        "format": STATE_FORMAT,
        "config": json.dumps(training_settings(cfg), sort_keys=True),
        "world_size": 1,
        "epochs_done": epochs_done,
        "steps_per_epoch": steps,
        "model": {"w": torch.zeros(3)},
        "optimizer": {},
        "schedule_step": epochs_done * steps,
        "records": records,
        "ranks": [rank],
        "torch": str(torch.__version__),
    }


def tiny(arch="resnet9", seed=0):
    torch.manual_seed(seed)
    widths = (4, 8, 8, 8) if arch == "resnet9" else (8, 8, 8)
    cfg = from_preset("resnet9" if arch == "resnet9" else "fast", widths=widths)
    return cfg, make_network(cfg, NormActPool).to(memory_format=torch.channels_last)
