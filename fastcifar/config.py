"""One dataclass holds every setting of a run; presets fill it; the command line overrides fields.

Learning-rate rule: ``lr`` is the peak rate for the mean loss at 512 images of global batch, and
scales linearly with the global batch (``peak = lr * batch_size / 512``), so a preset keeps its
dynamics when the same global batch is split over more ranks. The trainer sums the loss over a
rank's batch (fp16 gradients stay well above underflow that way) and divides the rate by the
per-rank batch, which is the same update.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass, field, fields
from typing import Any


class ConfigError(Exception):
    """A setting that cannot work; the CLI prints it as one line and exits 2."""


@dataclass
class Config:
    # --- data ---
    data: str = "data"  # official archive/folder, or image folder / .tar.gz of train/ and test/
    download: bool = False  # fetch official CIFAR-10 into --data when absent (MD5-checked)
    cache_dir: str = ""  # decoded-image cache; "" = next to the data, else ~/.cache/fastcifar
    subset: int = 0  # training images to use, 0 = all; the test set is cut to the same fraction
    loader: str = "torch"  # torch: augmentation in plain torch ops on device-resident uint8
    # --- model ---
    arch: str = "resnet9"  # network, see fastcifar.model
    widths: tuple = (64, 128, 256, 512)  # channels of prep, layer1, layer2, layer3
    # --- recipe ---
    epochs: int = 24  # passes over the training set
    batch_size: int = 512  # images per step, global: split evenly over the ranks
    lr: float = 0.4  # peak, for the mean loss, per 512 images of global batch (linear scaling)
    warmup_epochs: float = 5.0  # linear from 0 to the peak, then linear to 0 at the last epoch
    momentum: float = 0.9  # SGD momentum
    nesterov: bool = True  # Nesterov momentum
    weight_decay: float = 5e-4  # per example scale: x per-rank batch on the summed loss
    label_smoothing: float = 0.2  # cross-entropy label smoothing
    crop_pad: int = 4  # random crop from this many pixels of padding per side
    pad_mode: str = "reflect"  # padding for the random crop: reflect | zero
    flip: bool = True  # random horizontal flip, p = 0.5
    cutout: int = 8  # side of the zeroed square, pixels; 0 = off
    tta: bool = True  # flip test-time augmentation: logits of image + mirrored image
    # --- engine ---
    device: str = "auto"  # auto (cuda when available) | cuda | cpu
    precision: str = "auto"  # auto (fp16 on cuda, fp32 on cpu) | fp16 | fp32
    comm: str = "bucketed"  # gradient averaging over ranks: bucketed (fastcifar.comm, overlapped) | ddp (stock)
    bucket_mb: float = 2.0  # MiB of gradients per all-reduce bucket (--comm bucketed), see fastcifar.comm
    eval_batch_size: int = 1000  # images per evaluation batch, per rank
    warmup_steps: int = 3  # untimed training steps before the clock starts; state restored after
    dist_timeout_s: float = 300.0  # a collective waiting longer than this fails the run
    # --- runs and reporting ---
    runs: int = 1  # independent runs in one process, seeds seed, seed+1, ...
    seed: int = 0  # seed of the first run
    target_acc: float = 94.0  # test accuracy (%) a run must reach to count as reached
    out_dir: str = "runs"  # each invocation writes its logs to a new folder in here
    preset: str = field(default="resnet9", metadata={"cli": False})  # the preset this started from


PRESETS: dict[str, dict[str, Any]] = {
    # The seed recipe: ResNet-9, 24 epochs at 512, Nesterov SGD, label smoothing 0.2, cutout 8.
    "resnet9": {},
}

CHOICES = {
    "loader": ("torch",),
    "arch": ("resnet9",),
    "pad_mode": ("reflect", "zero"),
    "device": ("auto", "cuda", "cpu"),
    "precision": ("auto", "fp16", "fp32"),
    "comm": ("bucketed", "ddp"),
}


def from_preset(name: str, **overrides) -> Config:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return dataclasses.replace(Config(), preset=name, **{**PRESETS[name], **overrides})


def validate(cfg: Config, world_size: int = 1) -> Config:
    """Reject settings that cannot work, with one sentence naming the field."""
    for name, allowed in CHOICES.items():
        if getattr(cfg, name) not in allowed:
            raise ConfigError(f"--{_flag(name)} must be one of {', '.join(allowed)}, not {getattr(cfg, name)!r}")
    positive = ("epochs", "batch_size", "eval_batch_size", "runs")
    for name in positive:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"--{_flag(name)} must be positive, not {getattr(cfg, name)}")
    if cfg.bucket_mb <= 0:
        raise ConfigError(f"--bucket-mb must be positive, not {cfg.bucket_mb}")
    if cfg.dist_timeout_s <= 0:
        raise ConfigError(f"--dist-timeout-s must be positive, not {cfg.dist_timeout_s}")
    for name in ("subset", "warmup_steps", "crop_pad", "cutout", "lr", "weight_decay", "momentum"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"--{_flag(name)} must not be negative, not {getattr(cfg, name)}")
    if not 0 <= cfg.warmup_epochs <= cfg.epochs:
        raise ConfigError(f"--warmup-epochs must lie in 0..{cfg.epochs} (the epochs), not {cfg.warmup_epochs}")
    if not 0 <= cfg.label_smoothing < 1:
        raise ConfigError(f"--label-smoothing must lie in [0, 1), not {cfg.label_smoothing}")
    if cfg.cutout > 32:
        raise ConfigError(f"--cutout must be at most 32 (the image side), not {cfg.cutout}")
    if len(cfg.widths) != 4 or min(cfg.widths) <= 0:
        raise ConfigError(f"--widths takes four positive channel counts, not {cfg.widths}")
    if cfg.batch_size % world_size:
        raise ConfigError(f"--batch-size {cfg.batch_size} does not divide over {world_size} ranks "
                          f"(the per-rank batch must be a whole number)")
    return cfg


# ---------------------------------------------------------------------------------------------
# Command line: --preset, then one flag per field, each defaulting to the preset's value.

def _flag(name: str) -> str:
    return name.replace("_", "-")


class _OneLineParser(argparse.ArgumentParser):
    """Errors as one line on stderr and exit 2 (argparse's own prints the usage first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parse_widths(text: str) -> tuple:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _comments() -> dict[str, str]:
    """Field name -> the comment after it in this file: --help shows the units written there."""
    import inspect
    import re
    out = {}
    for line in inspect.getsource(Config).splitlines():
        m = re.match(r"\s+(\w+): [^=]+=.*?#\s*(.*)$", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def build_parser(base: Config) -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="python -m fastcifar.train",
        description="Train ResNet-style networks on CIFAR-10, on one device or under torchrun. "
                    "Every field of the run's config has a flag; a preset sets their defaults.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--preset", default=base.preset, choices=list(PRESETS),
                        help="named recipe that sets the defaults below")
    help_of = _comments()
    for f in fields(Config):
        if not f.metadata.get("cli", True):
            continue
        default = getattr(base, f.name)
        kwargs: dict[str, Any] = {"default": default, "help": help_of.get(f.name, "").replace("%", "%%")}
        if isinstance(default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif isinstance(default, tuple):
            kwargs["type"] = _parse_widths
        else:
            kwargs["type"] = type(default)
        if f.name in CHOICES:
            kwargs["choices"] = CHOICES[f.name]
        parser.add_argument(f"--{_flag(f.name)}", dest=f.name, **kwargs)
    return parser


def parse_args(argv: list[str] | None = None) -> Config:
    argv = sys.argv[1:] if argv is None else list(argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", default="resnet9")
    known, _ = pre.parse_known_args(argv)
    if known.preset not in PRESETS:
        build_parser(Config()).error(f"unknown preset {known.preset!r}; choose from {', '.join(PRESETS)}")
    base = from_preset(known.preset)
    args = vars(build_parser(base).parse_args(argv))
    preset = args.pop("preset")
    return dataclasses.replace(base, preset=preset, **args)
