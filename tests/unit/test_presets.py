"""fastcifar.core.presets: every preset resolves to the settings recorded in
tests/fixtures/presets.json (Config's defaults, then each preset's differences from them), floats
to the bit; the former defaults are one table apart, still accepted wherever a preset is named."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fastcifar.core.config import CONFIG_FILE, Config, config_file_text, from_preset, read_config_file
from fastcifar.core.options import parse_command_line
from fastcifar.core.presets import CURRENT_PRESETS, DEFAULT_PRESET, FORMER_PRESETS, PRESETS

RECORDED = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "presets.json").read_text())


def _exact(value):
    """A value as JSON holds it, each float as its bits (0.1 + 0.2 and 0.3 differ here)."""
    if isinstance(value, float):
        return ("float", value.hex())
    if isinstance(value, (list, tuple)):
        return [_exact(v) for v in value]
    return (type(value).__name__, value)


@pytest.mark.parametrize("name", list(RECORDED["presets"]))
def test_a_preset_resolves_to_its_recorded_settings(name):
    expected = {**RECORDED["Config()"], **RECORDED["presets"][name]}
    got = json.loads(json.dumps(dataclasses.asdict(from_preset(name))))
    assert list(got) == list(expected), "Config's fields changed: record them again"
    wrong = {k: (got[k], expected[k]) for k in got if _exact(got[k]) != _exact(expected[k])}
    assert not wrong, f"{name}: (now, recorded) {wrong}"


def test_the_exact_comparison_tells_floats_apart_by_their_bits():
    assert _exact(0.1 + 0.2) != _exact(0.3) and _exact(1.0) != _exact(1) and _exact(0.75) == _exact(0.75)


def test_every_preset_is_current_or_former_listed_in_the_recorded_order():
    """--help's choices and the error messages list the presets in one order; each name is in
    exactly one of the two tables; the default is a current recipe."""
    assert list(PRESETS) == list(RECORDED["presets"])
    assert not set(CURRENT_PRESETS) & set(FORMER_PRESETS)
    assert set(PRESETS) == set(CURRENT_PRESETS) | set(FORMER_PRESETS)
    assert all(PRESETS[n] is table[n] for table in (CURRENT_PRESETS, FORMER_PRESETS) for n in table)
    assert set(FORMER_PRESETS) == {"fast-departures", "fast-muon320", "fast-muon9"}
    assert DEFAULT_PRESET in CURRENT_PRESETS


@pytest.mark.parametrize("name", sorted(FORMER_PRESETS))
def test_a_former_default_still_runs_and_loads(name, tmp_path):
    """--preset takes it, and a run folder's config.json that names it repeats that run."""
    cfg, given = parse_command_line(["--preset", name, "--epochs", "2"])
    assert cfg == from_preset(name, epochs=2) and given == {"preset": name, "epochs": 2}
    path = tmp_path / CONFIG_FILE
    path.write_text(config_file_text(cfg))
    assert read_config_file(str(path)) == cfg
    assert isinstance(cfg, Config) and cfg.preset == name
