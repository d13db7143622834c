"""fastcifar.core.options, the trainer's command line: its --help is held to a recorded copy
(tests/fixtures/train_help.txt, `python -m fastcifar train --help` at 80 columns), so an option, a
default, a group or a help text cannot change unnoticed; the groups and texts come from the fields'
metadata. ``recipe_flags``: the flags that name a variant of a preset in a report (scripts/race.py
names each fastcifar contender by its preset and them)."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import shlex
from dataclasses import fields
from pathlib import Path

import pytest

from fastcifar import train
from fastcifar.core.config import HELP_GROUPS, Config, from_preset, setting, training_settings
from fastcifar.core.options import build_parser, parse_args, parse_command_line, recipe_flags
from fastcifar.core.presets import DEFAULT_PRESET, PRESETS

RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "train_help.txt"


def _help(prog: str, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        train.main(["--help"], prog=prog)
    assert exit_.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("prog", ["python -m fastcifar train", "python -m fastcifar.train"])
def test_train_help_is_the_recorded_one(prog, capsys, monkeypatch):
    """Every option in the same group, with the same default and help text, in the same order.
    After a deliberate change: `COLUMNS=80 python -m fastcifar train --help > tests/fixtures/train_help.txt`."""
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps to the terminal; the copy was taken at 80
    recorded = RECORDED.read_text().replace("python -m fastcifar train", prog, 1)
    shown = _help(prog, capsys)
    diff = "".join(difflib.unified_diff(recorded.splitlines(True), shown.splitlines(True), "recorded", "now"))
    assert shown == recorded, f"--help changed:\n{diff}"


def test_the_comparison_sees_the_width_it_was_recorded_at(capsys, monkeypatch):
    """The copy is compared at the width it was taken at: another width wraps it differently (so a
    pass above is not a comparison that cannot fail)."""
    monkeypatch.setenv("COLUMNS", "120")
    assert _help("python -m fastcifar train", capsys) != RECORDED.read_text()


def test_help_groups_and_texts_are_the_fields_metadata():
    """Each flag sits in the group its field names, with its field's help text; only ``preset``
    (set by --preset or --config) has no flag of its own, and the harness's switches (group
    "testing") have flags that --help leaves out."""
    parser = build_parser(from_preset(DEFAULT_PRESET))
    group_of = {a.dest: g.title for g in parser._action_groups for a in g._group_actions}
    help_of = {a.dest: a.help for a in parser._actions if a.option_strings and a.dest != "tta"}
    for f in fields(Config):
        if f.name == "preset":
            assert f.metadata["group"] is None and f.name in group_of  # --preset, added by hand
            continue
        assert f.metadata["help"], f"{f.name} has no help text"
        if f.metadata["group"] == "testing":
            assert help_of[f.name] == argparse.SUPPRESS, f"{f.name}: a harness switch shows in --help"
            continue
        assert group_of[f.name] == HELP_GROUPS[f.metadata["group"]], f.name
        if f.name in help_of:
            assert help_of[f.name] == f.metadata["help"].replace("%", "%%"), f.name
    titles = [g.title for g in parser._action_groups][2:]  # after argparse's positionals and options
    assert titles == [title for title in HELP_GROUPS.values() if title is not None]


def test_a_setting_names_a_known_group():
    assert setting(3, "steps", group="recipe").metadata == {"help": "steps", "group": "recipe"}
    with pytest.raises(AssertionError, match="no --help group 'recipes'"):
        setting(3, "steps", group="recipes")


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


def test_tta_flag_forms():
    assert parse_args(["--tta", "2"]).tta == 2
    assert parse_args(["--tta"]).tta == 1
    assert parse_args(["--no-tta"]).tta == 0
    with pytest.raises(SystemExit):
        parse_args(["--tta", "5"])


def test_parse_command_line_names_only_the_options_given():
    cfg, given = parse_command_line(["--lr", "0.5", "--no-tta", "--data", "x"])
    assert given == {"lr": 0.5, "tta": 0, "data": "x"}
    assert cfg.preset == DEFAULT_PRESET and cfg.lr == 0.5
    assert parse_command_line(["--preset", "fast"])[1] == {"preset": "fast"}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_float_field_takes_a_fraction_over_every_preset(preset):
    """A flag's type comes from the preset's default: a whole default (3 epochs of whitening bias)
    must not make it refuse the fraction another preset sets (fast-levers' 0.19), or a lever named
    by scripts/race.py levers is refused before the GPU runs it; a whole value given stays whole."""
    for f in fields(Config):
        if f.type != "float" or f.metadata["group"] is None:
            continue
        flag = "--" + f.name.replace("_", "-")
        cfg = parse_args(["--preset", preset, flag, "0.25"])
        assert getattr(cfg, f.name) == 0.25, (preset, flag)
    for name in ("epochs", "whiten_bias_epochs"):
        cfg = parse_args(["--preset", preset, "--" + name.replace("_", "-"), "3"])
        assert getattr(cfg, name) == 3 and isinstance(getattr(cfg, name), int)
