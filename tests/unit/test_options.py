"""fastcifar.core.options, the trainer's command line: its --help is held to a recorded copy
(tests/fixtures/train_help.txt, `python -m fastcifar train --help` at 80 columns), so an option, a
default, a group or a help text cannot change unnoticed; the groups and texts come from the fields'
metadata."""

from __future__ import annotations

import argparse
import difflib
from dataclasses import fields
from pathlib import Path

import pytest

from fastcifar import train
from fastcifar.core.config import HELP_GROUPS, Config, from_preset, setting
from fastcifar.core.options import build_parser
from fastcifar.core.presets import DEFAULT_PRESET

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
