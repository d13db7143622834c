"""Named recipes: each preset is the table of the Config fields it changes from Config's defaults
(the seed recipe, ``resnet9``). ``fastcifar.core.config.from_preset`` builds a Config from one.

``PRESETS`` holds every name ``--preset``, a config file, a checkpoint or a model file may give:
the recipes in use (``CURRENT_PRESETS``) and the former defaults kept only to reproduce earlier
results (``FORMER_PRESETS``; docs/presets.md, "Former defaults"). Plain data: this module imports
nothing of fastcifar, so the settings' checks can name a preset.
"""

from __future__ import annotations

from typing import Any

# airbench94 (Jordan, 2024: 94.01% mean over 1,000 runs on one A100) transcribed fact by fact into
# this trainer's conventions; tests/unit/test_recipe.py holds a few of its steps to a
# plain-PyTorch transcription of the published recipe. Official CIFAR-10 has no row for it yet
# (bench/results/official.jsonl); on the JPEG copy, docs/results-jpeg.md.
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
_FAST: dict[str, Any] = {
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
}

# airbench94_muon (Jordan: 94.01% in 2.59 s on one A100, per its authors): orthogonalized momentum
# on the conv filters, Nesterov SGD on the biases and the head, batch 2000, 8 epochs, the rate
# falling linearly from the peak to 0, no lookahead. Their per-group rates (summed loss): biases
# 0.053, head 0.67, filters 0.24 (Muon); decay 2e-6 x 2000 per step x the schedule. Here: lr
# 0.053 x 512 = 27.136 per 512 (= 0.053 per image of summed loss at 2000 on any rank count), head
# x 12.64, weight decay 0.004 / 0.053 / 2000 = 3.774e-5 per example. Logits / 256 from a unit-std
# head. Two departures: their whitening bias's rate falls to 0 over its 3 epochs (here it follows
# the global schedule until frozen at epoch 3), and it starts from torch's default conv-bias init
# (here from 0, as in airbench94).
_FAST_MUON: dict[str, Any] = {
    **_FAST,
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

# The default: `fast-muon` for 8.5 epochs (213 steps) with the record script's brightness/contrast
# jitter (its ranges, 0.1399 and 0.1308, rounded). The jitter costs no time and adds about 0.07
# point; at 8.5 epochs it holds 94% over 25 runs at x0.956 the time of 9 epochs without it, and at
# 8 it falls short (93.95%) (bench/results/official.jsonl, calls "visit 12c" and "visit 12";
# bench/results/visits/visit-12.md).
_FAST_JITTER: dict[str, Any] = {**_FAST_MUON, "epochs": 8.5, "brightness": 0.14, "contrast": 0.13}

CURRENT_PRESETS: dict[str, dict[str, Any]] = {
    # The seed recipe: ResNet-9, 24 epochs at 512, Nesterov SGD, label smoothing 0.2, cutout 8.
    "resnet9": {},
    # The 8-GPU seed recipe: ResNet-9 at 256 images per GPU, 2048 global. Only the batch is known;
    # every other setting is the seed recipe's, and lr 0.4 per 512 scales linearly to a peak of 1.6
    # for the mean loss at 2048 (docs/presets.md, "Learning-rate rule").
    "apple8": {"batch_size": 2048},
    # The CIFAR AlexNet that the compressed-communication experiments train (docs/compression.md),
    # on the seed recipe.
    "alexnet": {"arch": "alexnet", "widths": (64, 192, 384, 256, 256)},
    "fast": _FAST,  # airbench94 (above)
    "fast-muon": _FAST_MUON,  # airbench94_muon (above)
    "fast-jitter": _FAST_JITTER,  # the default (above)
    # The candidate: the default with the record's time levers that leave the trained map alone or
    # follow the record script (hiverge cifar10_speedrun.py), each a field or a pair of fields that
    # the GPU's levers stage screens alone. Not the default until the GPU confirms it over 25 runs.
    #   TTA views for the least sure 25% of the whole test set (the record's share and scope; 0.25
    #     within each batch cost 0.001 point paired: bench/results/visits/visit-11.md, 11d);
    #   Newton-Schulz on one zero-padded stack of the six filters (the same map, to rounding);
    #   the whitening bias trained for 0.19 epoch (5 steps at 2000), its rate falling linearly to 0
    #     over them, as the record trains it (airbench94_muon: 3 epochs, decayed).
    "fast-levers": {
        **_FAST_JITTER,
        "tta_share": 0.25,
        "tta_scope": "test",
        "newton_schulz": "stacked",
        "whiten_bias_epochs": 0.19,
        "whiten_bias_decay": True,
        # the step's 7 strided adds and 19 memsets of gradients zeroed in place (docs/step-fixed-cost.md)
        "grads_to_none": True,
    },
}

# Former defaults, kept only so that an earlier result can be reproduced and an old run folder,
# checkpoint or model file that names one still loads. No new work starts from them; each one's
# recipe, and the rows that compare it with what replaced it: docs/presets.md, "Former defaults".
FORMER_PRESETS: dict[str, dict[str, Any]] = {
    # `fast` with its departures from airbench94, each a field: batchnorm eps 1e-5, whitening from
    # the centred covariance, the rate read at each step's end, lookahead from the start and folded,
    # 10 whole epochs, rounded rate and decay. No result row compares it with `fast` yet.
    "fast-departures": {
        **_FAST,
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
    },
    # `fast-muon` with its two wide blocks at 320 channels: 94.28% in 1.51 s on official CIFAR-10
    # (bench/results/official.jsonl, rows "fastcifar:fast-muon320"), 0.28 point above the bar but
    # slower than `fast-muon9`, which keeps the margin 25 runs need.
    "fast-muon320": {**_FAST_MUON, "widths": (64, 320, 320)},
    # `fast-muon` for 9 epochs: 94.14% in 1.315 s over 25 runs, beside `fast-jitter`'s 94.10% in
    # 1.257 s (bench/results/official.jsonl, call "visit 12c").
    "fast-muon9": {**_FAST_MUON, "epochs": 9},
}

# Every name --preset takes, in the order --help and the error messages list them: each former
# default beside the recipe it led to.
_ORDER = (
    "resnet9",
    "apple8",
    "alexnet",
    "fast",
    "fast-departures",
    "fast-muon",
    "fast-muon320",
    "fast-muon9",
    "fast-jitter",
    "fast-levers",
)
PRESETS: dict[str, dict[str, Any]] = {name: {**CURRENT_PRESETS, **FORMER_PRESETS}[name] for name in _ORDER}
DEFAULT_PRESET = "fast-jitter"  # what `python -m fastcifar.train` runs
