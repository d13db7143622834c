"""One dataclass holds every setting of a run; presets fill it; the command line overrides fields.

Learning-rate rule: ``lr`` is the peak rate for the mean loss at 512 images of global batch, and
scales linearly with the global batch (``peak = lr * batch_size / 512``), so a preset keeps its
dynamics when the same global batch is split over more ranks. The trainer sums the loss over a
rank's batch (fp16 gradients stay well above underflow that way) and divides the rate by the
per-rank batch, which is the same update.

The field defaults are the seed recipe (preset ``resnet9``, kept exactly for comparison); a preset
lists only the fields it changes. The command line starts from ``DEFAULT_PRESET`` (``fast-jitter``).
Fields marked "fastnet:" only act with ``--arch fastnet``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import numbers
import sys
from dataclasses import dataclass, field, fields
from typing import Any

from fastcifar.core.errors import ConfigError


# Each field and its comment stay on one line: the comment is the field's --help (_field_notes reads it).
# fmt: off
@dataclass
class Config:
    # --- data ---
    data: str = "data"  # official archive/folder, or image folder / .tar.gz of train/ and test/
    download: bool = False  # fetch official CIFAR-10 into --data when absent (MD5-checked)
    download_set: str = "cifar10"  # which official set --download fetches: cifar10 | cifar100 (fine labels)
    cache_dir: str = ""  # decoded-image cache; "" = next to the data, else ~/.cache/fastcifar
    subset: int = 0  # training images to use, 0 = all; the test set is cut to the same fraction
    val_split: int = 0  # training images held out (fixed, seeded) for the per-epoch evaluation; the test set is then evaluated once, at the end; 0 = evaluate on the test set every epoch
    loader: str = "auto"  # dali | torch (plain torch ops on device-resident uint8) | auto: torch on CUDA, dali on the CPU (the faster measured: fastcifar.data.dali.AUTO_LOADER)
    # --- model ---
    arch: str = "resnet9"  # network: resnet9 (fastcifar.models.resnet9) | fastnet (fastcifar.models.fastnet) | alexnet (fastcifar.models.alexnet)
    widths: tuple = (64, 128, 256, 512)  # channels (each 1..4096): resnet9 prep,layer1,layer2,layer3; fastnet its 3 blocks; alexnet its 5 convs
    whiten_kernel: int = 2  # fastnet: side of the patches its first conv whitens (2*3*side^2 channels)
    whiten_eps: float = 5e-4  # fastnet: added to each patch eigenvalue before the 1/sqrt scaling (damps smaller ones)
    activation: str = "gelu"  # fastnet: after the whitening conv and every batchnorm: gelu | silu | relu | celu
    whiten_images: int = 5000  # fastnet: training images whose patches set the first conv, on the clock; 0 = random init
    whiten_frozen: bool = True  # fastnet: the whitening conv's weights are not trained
    whiten_bias_epochs: int = 3  # fastnet: epochs the whitening conv's bias trains before it is frozen
    bn_momentum: float = 0.1  # weight of each batch in batchnorm's running statistics (torch convention)
    bn_scale_frozen: bool = False  # batchnorm scales stay 1 (not trained); the shifts train
    # --- recipe ---
    epochs: float = 24  # passes over the training set, in (0, 1000]; a fraction cuts the last one short (9.9: ceil(9.9 x steps) steps)
    batch_size: int = 512  # images per step (1..65536), global: split evenly over the ranks
    lr: float = 0.4  # peak rate for the mean loss, per 512 images of global batch: the run peaks at lr x batch-size / 512 (the log's lr column)
    warmup_epochs: float = 5.0  # from lr-start x peak up to the peak, then to lr-end x peak; scales with --epochs unless given
    lr_start: float = 0.0  # rate at the first step, as a fraction of the peak
    lr_end: float = 0.0  # rate at the last step, as a fraction of the peak
    bias_lr_scale: float = 1.0  # batchnorm shifts: rate x this, weight decay / this (same decay per step)
    momentum: float = 0.9  # SGD momentum, in [0, 1)
    nesterov: bool = True  # Nesterov momentum
    weight_decay: float = 5e-4  # per example (the step multiplies it by the per-rank batch, as it sums the loss: docs/presets.md, learning-rate rule)
    label_smoothing: float = 0.2  # cross-entropy label smoothing
    lookahead_steps: int = 0  # every this many steps slow weights move toward the trained ones and replace them; 0 = off
    lookahead_decay: float = 0.7738  # slow weights' share at the last sync (0.95^5), ramping up from 0 as progress^3
    crop_pad: int = 4  # random crop from this many pixels of padding per side
    pad_mode: str = "reflect"  # padding for the random crop: reflect | zero
    flip: bool = True  # horizontal flip, half of the images per epoch
    flip_mode: str = "random"  # random: a coin per image per epoch | alternate: a coin per image, mirrored every other epoch
    cutout: int = 8  # side of the zeroed square, pixels; 0 = off
    brightness: float = 0.0  # jitter: each training image, normalized, plus a uniform draw in [-B, B] (units of each channel's std); 0 = off
    contrast: float = 0.0  # jitter: then times a uniform draw in [1 - C, 1 + C], one per image; 0 = off
    tta: int = 1  # test-time augmentation: 0 none | 1 mean logits of image and mirror | 2 also 1-px shifts (6 views)
    tta_share: float = 1.0  # share of each evaluation batch (per rank) given the TTA views, least confident first (the plain view's top probability); the rest count the plain view
    # --- recipe, issue 14: airbench94 parity, its former departures, orthogonalized momentum ---
    bn_eps: float = 1e-5  # added to the batch variance in batchnorm (torch: 1e-5; airbench: 1e-12)
    whiten_centred: bool = False  # fastnet: whiten with the patches' covariance (centred), not their second moment
    lr_at: str = "end"  # step i's rate: end (at progress (i+1)/steps of its epoch) | start (at i of ceil(epochs x steps), warm-up floored to whole steps: airbench)
    lookahead_start_epoch: int = 0  # lookahead's slow copy taken at the first sync step of this epoch; 0 = at the start
    lookahead_epoch_end: str = "fold"  # at epoch ends: fold (the run's last sync folds in the steps since the one before) | reset (every epoch end from the start epoch: weights <- slow copy, airbench)
    optimizer: str = "sgd"  # sgd (Nesterov SGD on everything) | muon (conv filters: orthogonalized momentum, fastcifar.run.optim.Muon; the rest: Nesterov SGD)
    muon_lr: float = 0.24  # muon: a filter's step at the peak, x its orthogonalized update (weights renormalized to sqrt(out channels))
    muon_momentum: float = 0.6  # muon: Nesterov momentum of the filters
    muon_ns_steps: int = 3  # muon: Newton-Schulz iterations per orthogonalization
    muon_shard: bool = False  # muon, several ranks: each orthogonalizes every world-th filter, one all-reduce shares them
    head_lr_scale: float = 1.0  # the linear head: rate x this, weight decay / this (same decay per step)
    logit_scale: float = 0.0  # fastnet: logits x this; 0 = 1/9 (airbench94)
    head_unit_init: bool = False  # fastnet: head weights rescaled to standard deviation 1 at init (fast-muon)
    # --- sparse training (fastcifar.run.sparse) ---
    sparse_mask: str = "none"  # which parameters train: none (all) | fisher (top Fisher scores) | random (same count)
    sparse_fraction: float = 0.02  # K: fraction of the trainable parameters in the mask (classifier/BN shifts on top)
    mask_samples: int = 1024  # N: training images whose per-sample gradients score the parameters (split over ranks)
    mask_score: str = "squared"  # Fisher score per sample: squared grad at the true label | abs | expected (over the model's labels)
    mask_every: int = 0  # recompute the mask every this many epochs; 0 = one mask for the whole run
    mask_bn_shifts: bool = True  # batchnorm shifts always train (else they compete for the mask like the rest)
    sparse_update: str = "full"  # full: mask gradient, weight decay and momentum | grad: the gradient only
    sparse_checkpoints: bool = False  # write a base model file and a sparse diff per epoch (run dir, sparse/)
    local_steps: int = 0  # H: local SGD, ranks merge weights every H steps instead of all-reducing gradients; 0 = off
    merge: str = "mean"  # local SGD: combine the ranks' changes by mean | sum
    mask_layout: str = "shared"  # local SGD masks: shared (one mask) | disjoint (top W*K dealt round-robin over ranks)
    local_momentum: str = "keep"  # local SGD: momentum after a merge: keep | reset (zeroed)
    # --- engine ---
    device: str = "auto"  # auto (cuda when available) | cuda | cpu
    kernels: str = "auto"  # triton (fused BN+act+pool, augmentation) | torch (reference) | auto: triton on CUDA
    precision: str = "auto"  # auto (fp16 on cuda, fp32 on cpu) | fp16 | fp32
    comm: str = "bucketed"  # gradient averaging over ranks: bucketed (fastcifar.parallel.comm, overlapped) | ddp (stock)
    bucket_mb: float = 2.0  # MiB of gradients per all-reduce bucket (--comm bucketed), see fastcifar.parallel.comm
    cuda_graphs: str = "auto"  # capture the train step and eval batch as CUDA graphs: auto (on for CUDA) | on | off
    eval_batch_size: int = 1000  # images per evaluation batch, per rank (1..65536); with --tta-share < 1 it decides which images share the views
    warmup_steps: int = 3  # untimed training steps before the clock starts (0..1000); state restored after
    dist_timeout_s: float = 300.0  # a collective waiting longer than this fails the run
    dist_group: str = "auto"  # process group: auto (only with several ranks) | always (also for one rank: its gradient buckets, comm stream and captured collectives run, as on several)
    emulate_ranks: int = 1  # one process trains what N ranks train (each rank's shard and draws, batchnorm statistics per rank over batch/N, gradients averaged): the N-GPU recipe's accuracy on one device (fastcifar.data.loader.EmulatedRanks); 1 = off
    compile: bool = False  # run the model through torch.compile, Triton kernels as custom ops (fastcifar.models.compiled)
    fused_conv: bool = False  # the blocks' convs as Triton implicit GEMMs that take the batchnorm statistics (and a pool-first block's 2x2 pool) in their epilogue (fastcifar.kernels.conv_stats); needs the Triton kernels; slower than cuDNN so far (bench/results/visits/visit-11.md)
    # --- compressed gradient communication (fastcifar.parallel.compress; several ranks, --comm bucketed) ---
    compress: str = "none"  # none (plain all-reduce) | fp16 | bf16 | topk | randomk | threshold | terngrad | qsgd | powersgd
    compress_ratio: float = 0.01  # topk/randomk: fraction K of each chunk's coordinates sent, 0 < K <= 1
    compress_threshold: float = 1e-3  # threshold: send |g_i| >= V (units of the summed-loss gradient)
    qsgd_levels: int = 127  # qsgd: quantization levels s (int8 on the wire up to 127)
    powersgd_rank: int = 4  # powersgd: rank r of the P Q^T approximation
    compress_scope: str = "bucket"  # what one compressor call sees: layer (each parameter) | bucket | model (one vector per dtype)
    error_feedback: bool = True  # add what compression dropped to the next step's gradient
    compress_warmup_steps: int = 0  # steps averaged uncompressed before compression starts
    compress_transport: str = "sparse"  # sparse: payloads only (all-reduce or all-gather) | dense: the seed's zero-filled all-reduce
    randomk_unbiased: bool = False  # randomk: values x d/k (unbiased; pair with --no-error-feedback) | off: the seed's unscaled
    terngrad_clip: bool = False  # terngrad: clip to +-2.5 standard deviations before ternarizing
    nvtx: bool = False  # NVTX ranges around data, forward, backward, optimizer (for nsys); off: no CUDA calls
    profile_steps: str = ""  # A:B: cudaProfilerStart after A timed steps of run 1, Stop after B (nsys capture range)
    # --- runs and reporting ---
    runs: int = 1  # independent runs in one process (1..1000), seeds seed, seed+1, ...
    seed: int = 0  # seed of the first run
    target_acc: float = 94.0  # test accuracy (%, 0..100) a run must reach to count as reached
    out_dir: str = "runs"  # each invocation writes its logs to a new folder in here
    quiet: bool = False  # no progress bars (they show only on rank 0 and only when stderr is a terminal)
    tensorboard: bool = False  # TensorBoard event files in the run folder's tensorboard/ (per epoch: loss, accuracy, rates, step time; the settings); needs pip install tensorboard
    # --- checkpoints (fastcifar.checkpoint) ---
    save_model: bool = True  # write the final, evaluated weights to the run folder (model.safetensors), off the clock
    checkpoint_every: int = 0  # epochs between training-state checkpoints (run folder's checkpoint.pt); 0 = none
    resume: str = ""  # training-state checkpoint (checkpoint.pt) to continue from, with its settings (options given must agree); "" = start fresh
    preset: str = field(default="resnet9", metadata={"cli": False})  # the preset this started from
# fmt: on


PRESETS: dict[str, dict[str, Any]] = {
    # The seed recipe: ResNet-9, 24 epochs at 512, Nesterov SGD, label smoothing 0.2, cutout 8.
    "resnet9": {},
    # The 8-GPU seed recipe: ResNet-9 at 256 images per GPU, 2048 global. Only the batch is known
    # (from the issue); every other setting is the seed recipe's, and lr 0.4 per 512 scales
    # linearly to a peak of 1.6 for the mean loss at 2048 (docs/presets.md, "Learning-rate rule").
    "apple8": {"batch_size": 2048},
    # The CIFAR AlexNet of the compressed-communication system (issue 15), on the seed recipe.
    "alexnet": {"arch": "alexnet", "widths": (64, 192, 384, 256, 256)},
    # airbench94 (Jordan, 2024: 94.01% mean over 1,000 runs on one A100) transcribed fact by fact
    # into this trainer's conventions (the default until 2026-11-23); tests/unit/test_recipe_parity.py
    # holds a few of its steps to a plain-PyTorch transcription of the published recipe. Not yet
    # measured on official CIFAR-10 (bench/results/official.jsonl has no row for it).
    # Conversions:
    #   lr 11.5 per 1024 in airbench's decoupled form is 11.5 / (1024 x (1 + 1/(1 - 0.85))) =
    #      1.4648e-3 per image of summed loss = 0.75 per 512 for the mean loss;
    #   weight decay 0.0153 decoupled: 0.0153 x 1024 / 7850.7 per step on the summed loss
    #      = lr x (0.0153 / 11.5) x 1024, so 1.3304e-3 per example here;
    #   9.9 epochs: ceil(9.9 x 48) = 476 steps at 1024, the tenth epoch cut at 44 of 48;
    #   schedule 0.2 -> 1 at step int(0.23 x 476) -> 0.07 at step 476, step i at i (lr_at start);
    #   batchnorm momentum 0.6 in airbench's (1 - torch) convention = 0.4 here, eps 1e-12;
    #   whitening from the uncentred second moment of the first 5000 images' 2x2 patches;
    #   lookahead from epoch 3 (slow copy at its first 5th step), every 5 steps at
    #      0.95^5 x (step / 476)^3, and the weights reset to the slow copy at every epoch end.
    "fast": {
        "arch": "fastnet",
        "widths": (64, 256, 256),
        "whiten_kernel": 2,
        "whiten_images": 5000,
        "whiten_frozen": True,
        "whiten_bias_epochs": 3,
        "bn_momentum": 0.4,
        "bn_scale_frozen": True,
        "epochs": 9.9,
        "batch_size": 1024,
        "lr": 11.5 * 512 / (1024 * (1 + 1 / (1 - 0.85))),
        "warmup_epochs": 0.23 * 9.9,
        "lr_start": 0.2,
        "lr_end": 0.07,
        "bias_lr_scale": 64.0,
        "momentum": 0.85,
        "nesterov": True,
        "weight_decay": 0.0153 / 11.5,
        "label_smoothing": 0.2,
        "lookahead_steps": 5,
        "lookahead_decay": 0.95**5,
        "crop_pad": 2,
        "pad_mode": "reflect",
        "flip": True,
        "flip_mode": "alternate",
        "cutout": 0,
        "tta": 2,
        "bn_eps": 1e-12,
        "whiten_centred": False,
        "lr_at": "start",
        "lookahead_start_epoch": 3,
        "lookahead_epoch_end": "reset",
    },
}
# `fast` as it was before issue 14: its former departures from airbench94, each a field, kept
# side by side for the GPU to measure (bench/bench_train.py --preset fast --compare fast-departures).
PRESETS["fast-departures"] = {
    **PRESETS["fast"],
    "epochs": 10,
    "warmup_epochs": 2.3,
    "lr": 0.75,
    "weight_decay": 1.33e-3,
    "lookahead_decay": 0.7738,
    "bn_eps": 1e-5,
    "whiten_centred": True,
    "lr_at": "end",
    "lookahead_start_epoch": 0,
    "lookahead_epoch_end": "fold",
}
# The next lever (airbench94_muon, Jordan: 94.01% in 2.59 s on one A100, per its authors):
# orthogonalized momentum on the conv filters, Nesterov SGD on the biases and the head, batch
# 2000, 8 epochs, the rate falling linearly from the peak to 0, no lookahead. Their per-group
# rates (summed loss): biases 0.053, head 0.67, filters 0.24 (Muon); decay 2e-6 x 2000 per step
# x the schedule. Here: lr 0.053 x 512 = 27.136 per 512 (= 0.053 per image of summed loss at
# 2000 on any rank count), head x 12.64, weight decay 0.004 / 0.053 / 2000 = 3.774e-5 per
# example. Logits / 256 from a unit-std head. Two departures: their whitening bias's rate falls
# to 0 over its 3 epochs (here it follows the global schedule until frozen at epoch 3), and it
# starts from torch's default conv-bias init (here from 0, as in airbench94).
PRESETS["fast-muon"] = {
    **PRESETS["fast"],
    "epochs": 8,
    "batch_size": 2000,
    "lr": 0.053 * 512,
    "warmup_epochs": 0.0,
    "lr_start": 1.0,
    "lr_end": 0.0,
    "bias_lr_scale": 1.0,
    "head_lr_scale": 0.67 / 0.053,
    "weight_decay": 2e-6 * 2000 / 0.053 / 2000,
    "lookahead_steps": 0,
    "optimizer": "muon",
    "muon_lr": 0.24,
    "muon_momentum": 0.6,
    "muon_ns_steps": 3,
    "logit_scale": 1 / 256,
    "head_unit_init": True,
}
# The default until visit 10: `fast-muon` with its two wide blocks at 320 channels, chosen on the
# JPEG copy as the best mean within 1.5 s on one H100 (bench/results/visits/visit-6.md 6a-6b,
# visit-7.md 7b); logits stay / 256, as measured there. On official CIFAR-10 it held 94% with
# about 0.26 points to spare (bench/results/official.jsonl, rows "fastcifar:fast-muon320").
PRESETS["fast-muon320"] = {**PRESETS["fast-muon"], "widths": (64, 320, 320)}
# The default until visit 12: `fast-muon` (64/256/256) for 9 epochs, the fastest of the variants of fast-muon320
# screened on official CIFAR-10 whose 10-run mean kept the margin set before the call (>= 94.12%,
# so that 25 runs would clear 94% with p < 0.05), then confirmed over 25 beside airbench94_muon
# (bench/results/official.jsonl, calls "visit 10" and "visit 10b"; bench/results/visits/visit-10.md).
# 256 channels at 8 epochs were faster still but kept too little margin (94.06%).
PRESETS["fast-muon9"] = {**PRESETS["fast-muon"], "epochs": 9}
# The default: `fast-muon9` with the record script's brightness/contrast jitter (its ranges, 0.1399
# and 0.1308, rounded) and half an epoch less (213 steps). The jitter alone added about 0.07 point
# at no cost in time; at 8.5 epochs it kept the margin over 10 runs and held the bar over 25 beside
# the former default in one call, at x0.956 its time (bench/results/official.jsonl, calls "visit 12b"
# and "visit 12c"; bench/results/visits/visit-12.md). At 8 epochs it fell short (93.95%, "visit 12").
PRESETS["fast-jitter"] = {**PRESETS["fast-muon9"], "epochs": 8.5, "brightness": 0.14, "contrast": 0.13}
DEFAULT_PRESET = "fast-jitter"  # what `python -m fastcifar.train` runs


def parse_window(spec: str) -> tuple[int, int] | None:
    """'A:B' -> (A, B) with 0 <= A < B; '' -> None. ValueError otherwise."""
    if not spec:
        return None
    try:
        start, stop = (int(v) for v in spec.split(":"))
    except ValueError:
        raise ValueError(f"expected A:B (two step counts), got {spec!r}") from None
    if not 0 <= start < stop:
        raise ValueError(f"expected 0 <= A < B, got {spec!r}")
    return start, stop


# Fields that leave the training trajectory alone: where things are, what is logged. A resumed run
# may change them (run.state refuses a checkpoint written under any other difference), and a run's
# config hash (run.report.provenance) leaves them out.
TRAJECTORY_FREE_FIELDS = (
    "data",
    "download",
    "download_set",
    "cache_dir",
    "out_dir",
    "resume",
    "checkpoint_every",
    "save_model",
    "nvtx",
    "profile_steps",
    "dist_timeout_s",
    "target_acc",
    "eval_batch_size",
    "quiet",
    "tensorboard",
)


def training_settings(cfg: Config) -> dict:
    """The fields that shape the training trajectory, as plain data."""
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in TRAJECTORY_FREE_FIELDS}


CHOICES = {
    "loader": ("auto", "dali", "torch"),
    "arch": ("resnet9", "fastnet", "alexnet"),
    "pad_mode": ("reflect", "zero"),
    "flip_mode": ("random", "alternate"),  # fastcifar.ops.augment.FLIP_MODES reads it
    "tta": (0, 1, 2),  # fastcifar.ops.tta.TTA_LEVELS reads it
    "whiten_kernel": (2, 3),
    "activation": ("relu", "gelu", "celu", "silu"),  # fastcifar.ops.norm_act_pool.ACTIVATIONS reads it
    "device": ("auto", "cuda", "cpu"),
    "precision": ("auto", "fp16", "fp32"),
    "comm": ("bucketed", "ddp"),
    "cuda_graphs": ("auto", "on", "off"),
    "dist_group": ("auto", "always"),
    "kernels": ("auto", "triton", "torch"),  # fastcifar.models.blocks.KERNELS reads this one
    # fastcifar.parallel.compress reads these three: one source, no copy to keep in step
    "compress": ("none", "fp16", "bf16", "topk", "randomk", "threshold", "terngrad", "qsgd", "powersgd"),
    "compress_scope": ("layer", "bucket", "model"),
    "compress_transport": ("sparse", "dense"),
    "sparse_mask": ("none", "fisher", "random"),
    "mask_score": ("squared", "abs", "expected"),
    "sparse_update": ("full", "grad"),
    "merge": ("mean", "sum"),
    "mask_layout": ("shared", "disjoint"),
    "local_momentum": ("keep", "reset"),
    "download_set": ("cifar10", "cifar100"),
    "lr_at": ("end", "start"),
    "lookahead_epoch_end": ("fold", "reset"),
    "optimizer": ("sgd", "muon"),
}

# Every numeric field's range, in one place: field -> (low, high, brackets). None is unbounded on
# that side; brackets say which ends are included: "[]", "[)", "(]" or "()". validate() checks
# them all before any work and names the option, its value and the range. The upper bounds of the
# settings that size memory or time (epochs, runs, widths, batches, warm-up steps, ...) are far
# above any recipe's, and low enough that nothing is allocated or scheduled for hours before a
# step (``--epochs 1e9`` once built a schedule list of 1e9 x steps entries). Ranges that depend on
# another field (--warmup-epochs, --crop-pad's upper end) and --seed (0..2^63-1-runs) are
# checked after these.
MAX_EPOCHS = 1000
MAX_RUNS = 1000
MAX_WIDTH = 4096  # channels of one layer
MAX_BATCH = 65536  # images per step (training, global) or per evaluation batch (per rank)
MAX_STEPS = 10**6  # training steps of a run (epochs x steps per epoch; the trainer checks, it knows the data)
RANGES: dict[str, tuple[float | None, float | None, str]] = {
    "subset": (0, None, "[)"),
    "val_split": (0, None, "[)"),
    "whiten_eps": (0, None, "()"),
    "whiten_images": (0, None, "[)"),
    "whiten_bias_epochs": (0, None, "[)"),
    "bn_momentum": (0, 1, "(]"),
    "epochs": (0, MAX_EPOCHS, "(]"),
    "batch_size": (1, MAX_BATCH, "[]"),
    "lr": (0, None, "[)"),
    "warmup_epochs": (0, None, "[)"),  # and at most --epochs (validate)
    "lr_start": (0, None, "[)"),
    "lr_end": (0, None, "[)"),
    "bias_lr_scale": (0, None, "()"),
    "momentum": (0, 1, "[)"),
    "weight_decay": (0, None, "[)"),
    "label_smoothing": (0, 1, "[)"),
    "tta_share": (0, 1, "(]"),
    "lookahead_steps": (0, None, "[)"),
    "lookahead_decay": (0, 1, "[)"),
    "crop_pad": (0, None, "[)"),  # and below the image side (validate: it depends on --pad-mode)
    "cutout": (0, 32, "[]"),  # IMAGE_SIDE
    "brightness": (0, 10, "[]"),  # stds: 10 shifts any pixel far past the data set's range
    "contrast": (0, 1, "[)"),  # a scale stays positive: 1 would allow an image scaled to 0
    "bn_eps": (0, 1, "()"),
    "lookahead_start_epoch": (0, None, "[)"),
    "muon_lr": (0, None, "[)"),
    "muon_momentum": (0, 1, "[)"),
    "muon_ns_steps": (1, 100, "[]"),
    "head_lr_scale": (0, None, "()"),
    "logit_scale": (0, None, "[)"),
    "sparse_fraction": (0, 1, "(]"),
    "mask_samples": (1, 10**6, "[]"),
    "mask_every": (0, None, "[)"),
    "local_steps": (0, None, "[)"),
    "bucket_mb": (0, 1024, "(]"),
    "eval_batch_size": (1, MAX_BATCH, "[]"),
    "warmup_steps": (0, 1000, "[]"),
    "dist_timeout_s": (0, 10**6, "(]"),  # seconds; datetime.timedelta overflows far above
    "emulate_ranks": (1, 1024, "[]"),  # the batch must divide over them (validate)
    "compress_ratio": (0, 1, "(]"),
    "compress_threshold": (0, None, "[)"),
    "qsgd_levels": (1, 32767, "[]"),  # int8 on the wire up to 127, int16 beyond
    "powersgd_rank": (1, MAX_WIDTH, "[]"),
    "compress_warmup_steps": (0, None, "[)"),
    "runs": (1, MAX_RUNS, "[]"),
    "target_acc": (0, 100, "[]"),
    "checkpoint_every": (0, None, "[)"),
}
WIDTH_RANGE = (1, MAX_WIDTH, "[]")  # each of --widths


def _range_text(low, high, brackets: str, integer: bool) -> str:
    """'positive', 'at least 1', '1..1000', '[0, 1)': the words for one RANGES entry."""
    if high is None:
        if low == 0:
            return "positive" if brackets[0] == "(" else "not negative"
        return f"at least {low}" if brackets[0] == "[" else f"greater than {low}"
    if integer and brackets == "[]":
        return f"{low}..{high}"
    return f"{brackets[0]}{low}, {high}{brackets[1]}"


def _in_range(value, low, high, brackets: str) -> bool:
    above = low is None or (value >= low if brackets[0] == "[" else value > low)
    below = high is None or (value <= high if brackets[1] == "]" else value < high)
    return above and below


def _range_error(name: str, value, low, high, brackets: str) -> ConfigError:
    integer = isinstance(value, int) and all(isinstance(b, int) for b in (low, high) if b is not None)
    text = _range_text(low, high, brackets, integer)
    phrase = {"positive": "must be positive", "not negative": "must not be negative"}.get(
        text, f"must be {text}" if high is None else f"must lie in {text}"
    )
    return ConfigError(f"--{_flag(name)} {phrase}, not {value}")


def _whole(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)  # True is an int to Python


# A field's annotation (a string here: __future__) -> whether a value has that type, and the words
# for it. Shared by a Config's check (``_check_types``) and a config file's (``_typed``).
_FIELD_TYPES = {
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "int": (_whole, "a whole number"),
    "float": (lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool), "a number"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "tuple": (lambda v: isinstance(v, (tuple, list)) and all(map(_whole, v)), "a list of whole numbers"),
}


def _field_type(name: str, annotation: str):
    """``_FIELD_TYPES``' entry for ``annotation`` ("tuple[int, ...]" is "tuple")."""
    try:
        return _FIELD_TYPES[annotation.split("[")[0]]
    except KeyError:
        raise AssertionError(f"Config.{name}: no type check for {annotation!r}") from None  # a new field's type


def _check_types(cfg: Config) -> None:
    """Each field holds its default's type (an API Config, a model file's metadata): a string
    where a number belongs would otherwise fail later with a traceback."""
    for f in fields(Config):
        value = getattr(cfg, f.name)
        ok, what = _field_type(f.name, str(f.type))
        if not ok(value):
            raise ConfigError(f"--{_flag(f.name)} must be {what}, not {value!r}")


def from_preset(name: str = DEFAULT_PRESET, **overrides) -> Config:
    """The preset's config with ``overrides``; like the command line, a changed ``epochs`` without
    a ``warmup_epochs`` keeps the peak at the same fraction of the run."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return _overridden(dataclasses.replace(Config(), preset=name, **PRESETS[name]), overrides)


def _overridden(base: Config, overrides: dict) -> Config:
    """``base`` with ``overrides``; a changed ``epochs`` without a ``warmup_epochs`` scales base's
    warm-up with it, so the peak stays at the same fraction of the run (a preset's, a config file's)."""
    if "epochs" in overrides and "warmup_epochs" not in overrides and overrides["epochs"] != base.epochs:
        overrides = {**overrides, "warmup_epochs": base.warmup_epochs * overrides["epochs"] / base.epochs}
    return dataclasses.replace(base, **overrides)


SEED_MAX = 2**63 - 1  # torch.manual_seed and numpy's SeedSequence both take seeds in 0..2^63-1 here
IMAGE_SIDE = 32  # pixels: the CIFAR-10 image the crop and cutout are measured against


def check_fields(cfg: Config) -> Config:
    """Each field on its own: its type, a finite number, one of its CHOICES, within its RANGES
    (every width too) and the widths' count for the architecture. ``validate`` starts here; a model
    file's metadata is checked with this before anything is built from it."""
    _check_types(cfg)
    for f in fields(Config):  # nan passes every comparison below, inf most: refuse both first
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"--{_flag(f.name)} must be a finite number, not {value}")
    for name, allowed in CHOICES.items():
        if getattr(cfg, name) not in allowed:
            raise ConfigError(
                f"--{_flag(name)} must be one of {', '.join(map(str, allowed))}, not {getattr(cfg, name)!r}"
            )
    for name, (low, high, brackets) in RANGES.items():
        if not _in_range(getattr(cfg, name), low, high, brackets):
            raise _range_error(name, getattr(cfg, name), low, high, brackets)
    n_widths = {"resnet9": 4, "fastnet": 3, "alexnet": 5}[cfg.arch]
    if len(cfg.widths) != n_widths or min(cfg.widths) <= 0:
        raise ConfigError(
            f"--widths takes {('three', 'four', 'five')[n_widths - 3]} positive channel counts for "
            f"--arch {cfg.arch}, not {tuple(cfg.widths)}"
        )
    for width in cfg.widths:
        if not _in_range(width, *WIDTH_RANGE):
            raise ConfigError(
                f"--widths: each must lie in {_range_text(*WIDTH_RANGE, True)} channels, "
                f"not {width} (in {tuple(cfg.widths)})"
            )
    return cfg


def validate(cfg: Config, world_size: int = 1) -> Config:
    """Reject settings that cannot work, with one sentence naming the field."""
    check_fields(cfg)
    world_size = _validate_emulated(cfg, world_size)  # below, the emulated ranks count as ranks
    if cfg.fused_conv and (cfg.compile or cfg.emulate_ranks > 1 or cfg.kernels == "torch"):
        raise ConfigError(
            "--fused-conv runs the Triton conv + normalize kernels in eager mode on one batch's "
            "statistics: it does not combine with --compile, --emulate-ranks or --kernels torch"
        )
    if not 0 <= cfg.warmup_epochs <= cfg.epochs:
        raise ConfigError(f"--warmup-epochs must lie in 0..{cfg.epochs} (the epochs), not {cfg.warmup_epochs}")
    if not 0 <= cfg.seed <= SEED_MAX - cfg.runs:  # run r uses seed + r - 1; bench's warm-up run seed + runs
        raise ConfigError(f"--seed must lie in 0..2^63-1-runs ({SEED_MAX - cfg.runs}), not {cfg.seed}")
    if 0 < cfg.val_split < world_size:  # each rank evaluates every world_size-th held-out image
        raise ConfigError(f"--val-split must be 0 or at least the number of ranks ({world_size}), not {cfg.val_split}")
    max_pad = IMAGE_SIDE - 1 if cfg.pad_mode == "reflect" else IMAGE_SIDE  # reflection needs pad < side
    if cfg.crop_pad > max_pad:
        raise ConfigError(
            f"--crop-pad must be at most {max_pad} with --pad-mode {cfg.pad_mode} "
            f"(the image side is {IMAGE_SIDE}), not {cfg.crop_pad}"
        )
    if cfg.activation != "gelu" and cfg.arch != "fastnet":
        raise ConfigError(f"--activation applies to --arch fastnet only ({cfg.arch} uses ReLU), not {cfg.activation!r}")
    if cfg.optimizer == "muon" and cfg.lr == 0:  # Muon's rate is --muon-lr x (the scheduled rate / the peak)
        raise ConfigError("--optimizer muon needs a positive --lr (Muon's rate follows --lr's schedule), not 0")
    _validate_compress(cfg)
    _validate_sparse(cfg, world_size)
    try:
        parse_window(cfg.profile_steps)
    except ValueError as exc:
        raise ConfigError(f"--profile-steps: {exc}") from None
    if (cfg.checkpoint_every or cfg.resume) and cfg.runs != 1:
        raise ConfigError(f"--checkpoint-every and --resume hold one run; use --runs 1, not {cfg.runs}")
    if (cfg.checkpoint_every or cfg.resume) and (
        cfg.compress != "none" or cfg.sparse_mask != "none" or cfg.local_steps
    ):
        # their state (error-feedback residuals, masks, local-SGD anchors) is not in the checkpoint
        raise ConfigError(
            "--checkpoint-every and --resume do not yet hold --compress, --sparse-mask or "
            "--local-steps state; use one or the other"
        )
    if cfg.optimizer == "muon" and (cfg.sparse_mask != "none" or cfg.local_steps):
        # the default preset trains with Muon: say where it came from and what to run instead
        from_muon_preset = PRESETS.get(cfg.preset, {}).get("optimizer") == "muon"  # an API Config may name none
        source = f"preset {cfg.preset} trains with --optimizer muon" if from_muon_preset else "--optimizer muon"
        raise ConfigError(
            f"{source}, which does not combine with --sparse-mask or --local-steps (their "
            f"masked update and local merges wrap Nesterov SGD); use an SGD preset, e.g. --preset resnet9"
        )
    if cfg.batch_size % world_size:
        raise ConfigError(
            f"--batch-size {cfg.batch_size} does not divide over {world_size} ranks "
            f"(the per-rank batch must be a whole number)"
        )
    return cfg


def _validate_emulated(cfg: Config, world_size: int) -> int:
    """``--emulate-ranks N``: one process, and only what it emulates (the shards, the batchnorm
    statistics per rank, the plain average of gradients); the number of ranks the rest of
    ``validate`` checks the settings against (N: the batch must divide over them as over N ranks)."""
    if cfg.emulate_ranks == 1:
        return world_size
    if world_size > 1:
        raise ConfigError(
            f"--emulate-ranks {cfg.emulate_ranks} emulates ranks in one process, but this run has "
            f"{world_size} real ranks (torchrun): use one or the other"
        )
    if cfg.compress != "none" or cfg.sparse_mask != "none" or cfg.local_steps:
        raise ConfigError(
            f"--emulate-ranks {cfg.emulate_ranks} emulates the plain average of gradients; it does "
            f"not combine with --compress, --sparse-mask or --local-steps"
        )
    return cfg.emulate_ranks


def _validate_compress(cfg: Config) -> None:
    if cfg.compress == "none":
        return
    if cfg.comm != "bucketed":
        raise ConfigError(f"--compress {cfg.compress} needs --comm bucketed (it runs inside its buckets)")
    if cfg.compress == "powersgd" and cfg.compress_transport == "dense":
        raise ConfigError("--compress powersgd has no --compress-transport dense (its two all-reduces are the method)")


def _validate_sparse(cfg: Config, world_size: int) -> None:
    if cfg.sparse_checkpoints and cfg.sparse_mask == "none":
        raise ConfigError("--sparse-checkpoints needs --sparse-mask fisher or random (a dense run's diffs are dense)")
    if cfg.local_steps and cfg.compress != "none":
        raise ConfigError(
            f"--compress {cfg.compress} needs --local-steps 0 (local SGD merges weights, "
            "it has no gradient all-reduce to compress)"
        )
    if cfg.local_steps and cfg.lookahead_steps:
        raise ConfigError(
            "--local-steps needs --lookahead-steps 0 (each rank's slow copy would drift from the merged weights)"
        )
    if cfg.mask_layout == "disjoint":
        if not cfg.local_steps or cfg.sparse_mask == "none":
            raise ConfigError("--mask-layout disjoint needs --local-steps and --sparse-mask fisher or random")
        if world_size * cfg.sparse_fraction > 1:
            raise ConfigError(
                f"--mask-layout disjoint deals {world_size} x --sparse-fraction "
                f"{cfg.sparse_fraction} of the parameters: more than all of them"
            )


def full_recipe(cfg: Config) -> bool:
    """Whether a run is its preset's full recipe on the full data, where the --target-acc bar
    (94%, set for the full recipes on CIFAR-10) means something: no --subset or --val-split, the
    preset's network at no narrower widths, and no fewer epochs. A toy run (a CPU smoke test, a
    sweep's shortened point) gets no "missed" verdict."""
    if cfg.preset not in PRESETS:
        return False
    base = from_preset(cfg.preset)
    return (
        cfg.subset == 0
        and cfg.val_split == 0
        and cfg.arch == base.arch
        and cfg.epochs >= base.epochs
        and len(cfg.widths) == len(base.widths)
        and all(w >= b for w, b in zip(cfg.widths, base.widths, strict=True))
    )


# ---------------------------------------------------------------------------------------------
# Command line: --preset, then one flag per field, each defaulting to the preset's value.


def _flag(name: str) -> str:
    return name.replace("_", "-")


class _HelpFormatter(argparse.HelpFormatter):
    """Each option's default as a user types it: 6 significant digits (a preset's derived rates are
    long fractions), widths comma-separated; nothing for a flag without one."""

    def _get_help_string(self, action):
        text = action.help or ""
        if not action.option_strings or action.default in (None, argparse.SUPPRESS):
            return text
        value = action.default
        if isinstance(value, float):
            shown = f"{value:.6g}"
        elif isinstance(value, (tuple, list)):
            shown = ",".join(map(str, value))
        else:
            shown = str(value)
        return f"{text} (default: {shown.replace('%', '%%')})"


class OneLineParser(argparse.ArgumentParser):
    """Errors as one line on stderr, ``fastcifar: error: ...``, and exit 2, as every other bad input
    (argparse's own prints the usage first). Every command's parser is one."""

    def error(self, message: str):
        self.exit(2, f"fastcifar: error: {message} (see {self.prog} --help)\n")


def _parse_widths(text: str) -> tuple:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _parse_epochs(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid epoch count {text!r}: expected a number such as 24 or 9.9") from None
    return int(value) if value.is_integer() else value


def _comments() -> dict[str, str]:
    """Field name -> the comment after it in this file: --help shows the units written there."""
    return {name: text for name, (_, text) in _field_notes().items()}


def _field_notes() -> dict[str, tuple[str, str]]:
    """Field name -> (its ``# --- section ---`` in Config, the comment after it)."""
    import inspect
    import re

    out, section = {}, ""
    for line in inspect.getsource(Config).splitlines():
        head = re.match(r"\s+# --- (.*?) ---", line)
        if head:
            section = head.group(1)
            continue
        m = re.match(r"\s+(\w+): [^=]+=.*?#\s*(.*)$", line)
        if m:
            out[m.group(1)] = (section, m.group(2))
    return out


# --help: the basic options first, then one group per kind; the other fields follow their section
# in Config (a section not named here becomes a group of its own, after these).
BASIC_FIELDS = ("data", "download", "device", "epochs", "batch_size", "lr", "runs", "seed", "subset", "out_dir")
HELP_GROUPS = (  # (title, Config sections it holds)
    ("data", ("data",)),
    ("model", ("model",)),
    ("recipe", ("recipe",)),
    (
        "recipe: airbench94 parity and Muon",
        ("recipe, issue 14: airbench94 parity, its former departures, orthogonalized momentum",),
    ),
    ("engines", ("engine",)),
    ("distributed (torchrun)", ("distributed",)),
    (
        "compressed gradient communication",
        ("compressed gradient communication (fastcifar.parallel.compress; several ranks, --comm bucketed)",),
    ),
    ("sparse training and local SGD", ("sparse training (fastcifar.run.sparse)",)),
    ("checkpoints and model files", ("checkpoints (fastcifar.checkpoint)",)),
    ("output and logging", ("runs and reporting",)),
)
# fields whose Config section is not the group they read best in
HELP_GROUP_OF = {
    "comm": "distributed",
    "bucket_mb": "distributed",
    "dist_timeout_s": "distributed",
    "dist_group": "distributed",
    "muon_shard": "distributed",
    "nvtx": "runs and reporting",
    "profile_steps": "runs and reporting",
    "emulate_ranks": "distributed",
}
ARCH_NAMES = {"resnet9": "ResNet-9", "fastnet": "FastNet", "alexnet": "AlexNet"}


def _description() -> str:
    d = from_preset(DEFAULT_PRESET)
    optimizer = {"muon": "Muon on the conv filters", "sgd": "Nesterov SGD"}[d.optimizer]
    return (
        f"Train a network on CIFAR-10 (or CIFAR-100, or your own image folders), on one device or "
        f"data-parallel under torchrun. The default preset, {DEFAULT_PRESET}, trains "
        f"{ARCH_NAMES[d.arch]} {'/'.join(map(str, d.widths))} for {d.epochs:g} epochs at batch "
        f"{d.batch_size} with {optimizer}; --preset resnet9 is the ResNet-9 seed recipe. Every field of "
        f"the run's config has a flag; the preset sets their defaults. --lr is the peak learning rate "
        f"for the mean loss per 512 images of global batch: the run's peak is --lr x --batch-size / 512 "
        f"(the default preset: {d.lr:g} x {d.batch_size} / 512 = {d.lr * d.batch_size / 512:.4g}), and "
        f"the log's lr column prints the rate at each epoch's last step on that scale (the peak times "
        f"the schedule)."
    )


def build_parser(base: Config, prog: str = "python -m fastcifar.train") -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=prog,
        allow_abbrev=False,  # --warmup-epo would pass for --warmup-epochs
        usage="%(prog)s [--preset NAME] [--data PATH] [--download] [--device DEVICE] [OPTION ...]",
        description=_description(),
        formatter_class=_HelpFormatter,
    )
    notes = _field_notes()
    groups = {"basic": parser.add_argument_group("basic options")}
    groups["basic"].add_argument(
        "--preset", default=base.preset, choices=list(PRESETS), help="named recipe that sets the defaults below"
    )
    groups["basic"].add_argument(
        "--config",
        default=argparse.SUPPRESS,  # no "(default: None)" in --help; parse_command_line reads it first
        metavar="FILE",
        help=f"a run folder's {CONFIG_FILE}: its settings are the defaults (the options given override them), "
        "so one command repeats a run",
    )
    for title, sections in HELP_GROUPS:
        group = parser.add_argument_group(title)
        for section in sections:
            groups[section] = group
    for f in fields(Config):
        if not f.metadata.get("cli", True):
            continue
        section, note = notes.get(f.name, ("", ""))
        section = "basic" if f.name in BASIC_FIELDS else HELP_GROUP_OF.get(f.name, section)
        if section not in groups:  # a section added to Config since HELP_GROUPS was written
            groups[section] = parser.add_argument_group(section or "other")
        default = getattr(base, f.name)
        kwargs: dict[str, Any] = {"default": default, "help": note.replace("%", "%%")}
        if isinstance(default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif f.name == "tta":  # a level; bare --tta means flip TTA, --no-tta (below) means none
            kwargs.update(type=int, nargs="?", const=1)
        elif isinstance(default, tuple):
            kwargs["type"] = _parse_widths
        elif f.name == "epochs":  # whole (24) or fractional (9.9)
            kwargs["type"] = _parse_epochs
        else:
            kwargs["type"] = type(default)
        if f.name in CHOICES:
            kwargs["choices"] = CHOICES[f.name]
        groups[section].add_argument(f"--{_flag(f.name)}", dest=f.name, **kwargs)
        if f.name == "tta":
            groups[section].add_argument("--no-tta", dest="tta", action="store_const", const=0, help="same as --tta 0")
    return parser


CONFIG_FILE = "config.json"  # every run folder's settings (run.report writes it); `--config FILE` reads one back


def config_file_text(cfg: Config) -> str:
    """What a run folder's config.json holds: every setting, as JSON."""
    return json.dumps(dataclasses.asdict(cfg), indent=2) + "\n"


def _typed(where: str, name: str, annotation: str, value):
    """``value`` of the JSON file as the field's type (a list as a tuple), or ConfigError."""
    ok, _ = _field_type(name, annotation)
    if not ok(value):
        raise ConfigError(f"{where}: {name} must be {annotation.split('[')[0]}, not {json.dumps(value)}")
    return tuple(value) if isinstance(value, list) else value


def read_config_file(path: str) -> Config:
    """The settings of a run folder's config.json (``--config FILE``), or ConfigError in one line: a
    file that cannot be read, is not JSON, or holds an unknown setting or a value of the wrong type.
    A setting it lacks (added since it was written) is its preset's; ``resume`` is not read back
    (the repeated run starts fresh, as ``--resume`` given beside it says otherwise)."""
    from fastcifar.core.readfile import read_regular, why

    where = f"--config {path}"
    try:
        doc = json.loads(read_regular(path))
    except OSError as exc:
        raise ConfigError(f"{where}: {why(exc)}") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ConfigError(f"{where}: not a JSON file of settings ({exc})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: not a JSON object of settings (a run folder's {CONFIG_FILE})")
    known = {f.name: f for f in fields(Config)}
    unknown = sorted(set(doc) - set(known))
    if unknown:
        raise ConfigError(
            f"{where}: unknown setting {unknown[0]!r} (the settings are the options' names, as in --help)"
        )
    preset = doc.get("preset", DEFAULT_PRESET)
    if preset not in PRESETS:
        raise ConfigError(f"{where}: unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    values = {k: _typed(where, k, str(known[k].type), v) for k, v in doc.items() if k != "resume"}
    return dataclasses.replace(from_preset(preset), **values)


def parse_args(argv: list[str] | None = None, prog: str = "python -m fastcifar.train") -> Config:
    return parse_command_line(argv, prog)[0]


def parse_command_line(
    argv: list[str] | None = None, prog: str = "python -m fastcifar.train"
) -> tuple[Config, dict[str, Any]]:
    """The run's config, and the fields given explicitly on the command line with their values
    (``--resume`` takes the checkpoint's settings for the others: run.state.resume_settings)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--preset", default=DEFAULT_PRESET)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.preset not in PRESETS:
        build_parser(Config(), prog).error(f"unknown preset {known.preset!r}; choose from {', '.join(PRESETS)}")
    base = from_preset(known.preset)
    if known.config is not None:  # a saved run's settings are the defaults; the flags given still override them
        if _given(argv, "--preset"):
            build_parser(base, prog).error(
                "--config holds its preset and settings: give --preset or --config, not both"
            )
        try:
            base = read_config_file(known.config)
        except ConfigError as exc:
            build_parser(base, prog).error(str(exc))
    args = vars(build_parser(base, prog).parse_args(argv))
    args.pop("config", None)
    preset = args.pop("preset")
    # no abbreviations (allow_abbrev=False), so the flag is given exactly as --warmup-epochs[=V]
    if not _given(argv, "--warmup-epochs"):
        del args["warmup_epochs"]  # a changed --epochs scales the warm-up (the preset's, or the file's)
    cfg = _overridden(base, args)  # base: the preset's settings (known.preset is preset) or the file's
    # A second parse with no defaults: only what the command line names (argparse's own trick).
    quiet = build_parser(base, prog)
    for action in quiet._actions:
        action.default = argparse.SUPPRESS
    given = vars(quiet.parse_args(argv))
    given.pop("config", None)
    return cfg, {k: (getattr(cfg, k) if k != "preset" else preset) for k in given}


def _given(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


RECIPE_FREE_FIELDS = ("seed", "runs")  # which seeds, and how many: the same recipe either way


def recipe_flags(config: dict) -> list[str]:
    """The command-line flags that turn the preset ``config`` names into ``config`` (a config as
    plain data, as summary.json holds it), over the fields that shape the recipe, in field order:
    ``["--widths 64,288,288", "--epochs 7"]``. A report names a variant of a preset by them. A field
    missing from ``config`` counts as the preset's; a changed ``epochs`` scales the preset's warm-up,
    as on the command line, so only a warm-up given besides it is named."""
    plain = from_preset(config.get("preset", DEFAULT_PRESET))
    scaled = from_preset(plain.preset, epochs=config.get("epochs", plain.epochs))

    def as_data(value):  # tuples and lists alike, as JSON holds them
        return json.loads(json.dumps(value))

    flags = []
    for f in fields(Config):
        name = f.name
        if name not in config or name == "preset" or name in TRAJECTORY_FREE_FIELDS + RECIPE_FREE_FIELDS:
            continue
        value = as_data(config[name])
        if value == as_data(getattr(plain if name == "epochs" else scaled, name)):
            continue
        if isinstance(value, bool):
            flags.append(f"--{_flag(name)}" if value else f"--no-{_flag(name)}")
        elif isinstance(value, list):
            flags.append(f"--{_flag(name)} {','.join(map(str, value))}")
        elif isinstance(value, float):  # repr: the shortest text that gives the value back
            flags.append(f"--{_flag(name)} {value!r}")
        else:
            flags.append(f"--{_flag(name)} {value}")
    return flags


def check_run_length(cfg: Config, steps_per_epoch: int, images: int, world_size: int) -> None:
    """Once the data fixes the steps per epoch: refuse a batch larger than the training set, and a
    run of more than MAX_STEPS steps in all (the schedule holds one rate per step). One line,
    before the run folder is made."""
    if steps_per_epoch == 0:
        raise ConfigError(
            f"--batch-size {cfg.batch_size} is larger than the training set "
            f"({images} images over {world_size} rank{'s' if world_size > 1 else ''})"
        )
    total = math.ceil(cfg.epochs * steps_per_epoch)
    if total > MAX_STEPS:
        raise ConfigError(
            f"--epochs {cfg.epochs} x {steps_per_epoch} steps per epoch (--batch-size {cfg.batch_size}) is "
            f"{total} steps, more than {MAX_STEPS}: fewer epochs or a larger batch"
        )
