"""Files the trainer's commands read, written by the tests: a tiny model file, and a training
checkpoint's state as save_state writes it (the resume tests edit it, reseal it and hand it over)."""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path

import torch
from cli import SHORT, run_dirs
from conftest import CLASSES, batch_bytes, make_images
from safetensors import safe_open

from fastcifar.core.config import from_preset, training_settings
from fastcifar.core.options import parse_args
from fastcifar.models.files import save_model
from fastcifar.models.network import make_network
from fastcifar.ops.norm_act_pool import NormActPool
from fastcifar.run.state import STATE_FORMAT
from fastcifar.train import main as train_main

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


def train_with_checkpoint(root, tiny):
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


def read_tensors(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def flip_in_largest_zip_member(path: Path) -> None:
    """The same in a torch.save zip (checkpoint.pt): the largest tensor storage's first byte.
    torch.load does not check the members' CRCs, so it decodes the changed value."""
    with zipfile.ZipFile(path) as z:
        member = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(member.header_offset)
        local = f.read(30)
        start = member.header_offset + 30 + struct.unpack("<H", local[26:28])[0] + struct.unpack("<H", local[28:30])[0]
        f.seek(start)
        byte = f.read(1)[0]
        f.seek(start)
        f.write(bytes([byte ^ 1]))


def small_checkpoint_state():
    cfg = parse_args(RESUMED)
    state = training_state(cfg)
    state["model"] = {"w": torch.linspace(-1, 1, 2000)}  # 8,000 bytes: the largest storage (the RNG state: 5,056)
    return cfg, state
