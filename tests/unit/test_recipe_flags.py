"""options.recipe_flags: the flags that name a variant of a preset in a report (scripts/race.py
names each fastcifar contender by its preset and them)."""

from __future__ import annotations

import dataclasses
import json
import shlex

import pytest

from fastcifar.core.config import from_preset, training_settings
from fastcifar.core.options import parse_args, recipe_flags


def as_summary(argv: list[str]) -> dict:
    """The config as summary.json holds it (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(parse_args(argv))))


@pytest.mark.parametrize(
    "argv",
    [
        ["--epochs", "7"],
        ["--epochs", "7.5", "--widths", "64,288,288"],
        ["--preset", "resnet9", "--epochs", "12", "--warmup-epochs", "1", "--no-nesterov", "--tta", "0"],
        ["--preset", "fast", "--activation", "silu", "--fused-conv", "--label-smoothing", "0.15"],
        ["--brightness", "0.14", "--contrast", "0.13", "--batch-size", "1536"],
    ],
)
def test_the_flags_rebuild_the_recipe(argv):
    """Parsing PRESET + the flags gives back every field that shapes training (seeds and run count
    aside), so two contenders with the same name trained the same recipe."""
    config = as_summary([*argv, "--seed", "3", "--runs", "4", "--data", "elsewhere", "--quiet"])
    flags = recipe_flags(config)
    rebuilt = parse_args(["--preset", config["preset"], *(word for f in flags for word in shlex.split(f))])
    mine = {k: v for k, v in training_settings(rebuilt).items() if k not in ("seed", "runs")}
    theirs = {k: v for k, v in as_summary(argv).items() if k in mine}
    assert json.loads(json.dumps(mine)) == theirs
    assert not any(f.startswith(("--seed", "--runs", "--data", "--quiet")) for f in flags)


def test_only_what_differs_from_the_preset_is_named():
    assert recipe_flags(as_summary([])) == []
    assert recipe_flags(as_summary(["--preset", "fast"])) == []
    assert recipe_flags(as_summary(["--widths", "64,288,288", "--epochs", "7"])) == [
        "--widths 64,288,288",
        "--epochs 7",
    ]
    # resnet9 warms up for 5 of 24 epochs: a changed --epochs scales it, so it is not named ...
    assert recipe_flags(as_summary(["--preset", "resnet9", "--epochs", "12"])) == ["--epochs 12"]
    # ... unless given besides it, other than the scaled value (2.5: the same recipe)
    assert recipe_flags(as_summary(["--preset", "resnet9", "--epochs", "12", "--warmup-epochs", "1"])) == [
        "--epochs 12",
        "--warmup-epochs 1.0",
    ]
    assert recipe_flags(as_summary(["--preset", "resnet9", "--epochs", "12", "--warmup-epochs", "2.5"])) == [
        "--epochs 12"
    ]
    assert recipe_flags(as_summary(["--no-whiten-frozen", "--tta", "1"])) == ["--no-whiten-frozen", "--tta 1"]


def test_a_partial_config_counts_missing_fields_as_the_presets():
    assert recipe_flags({"preset": "fast-muon320", "fused_conv": True}) == ["--fused-conv"]
    assert recipe_flags({"preset": "fast-muon320", "widths": from_preset("fast-muon320").widths}) == []


def test_values_that_differ_get_names_that_differ():
    """Two recipes pooled under one name would report one mean for both."""
    a = recipe_flags(as_summary(["--lr", "27.1360001"]))
    b = recipe_flags(as_summary(["--lr", "27.1360002"]))
    assert a != b and a == ["--lr 27.1360001"]
