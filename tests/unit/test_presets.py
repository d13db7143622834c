"""fastcifar.core.presets: every preset resolves to the settings recorded in
tests/fixtures/presets.json (Config's defaults, then each preset's differences from them), floats
to the bit; the former defaults are one table apart, still accepted wherever a preset is named."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fastcifar.core.config import (
    CONFIG_FILE,
    Config,
    config_file_text,
    from_preset,
    read_config_file,
    validate,
)
from fastcifar.core.options import parse_args, parse_command_line
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


def test_presets():
    assert DEFAULT_PRESET == "fast-jitter" and parse_args([]).preset == "fast-jitter"
    fast = from_preset("fast")
    assert (fast.arch, fast.widths, fast.epochs, fast.batch_size, fast.tta, fast.flip_mode, fast.cutout) == (
        "fastnet",
        (64, 256, 256),
        9.9,
        1024,
        2,
        "alternate",
        0,
    )
    validate(fast)
    default = from_preset()  # fast-muon9 with the jitter, for 8.5 epochs
    assert default == dataclasses.replace(
        from_preset("fast-muon9"), preset="fast-jitter", epochs=8.5, brightness=0.14, contrast=0.13
    )
    assert (default.optimizer, default.batch_size, default.epochs, default.widths) == (
        "muon",
        2000,
        8.5,
        (64, 256, 256),
    )
    # exactly the recipe visit 12 confirmed: the former default with the flags it ran under
    # (official.jsonl's "fastcifar:fast-muon9 --epochs 8.5 --brightness 0.14 --contrast 0.13", call "visit 12c")
    confirmed = parse_args(["--preset", "fast-muon9", "--brightness", "0.14", "--contrast", "0.13", "--epochs", "8.5"])
    assert dataclasses.replace(confirmed, preset="fast-jitter") == default
    fast_muon9 = from_preset("fast-muon9")  # the default before it: visit 10's confirmed recipe
    assert fast_muon9 == dataclasses.replace(from_preset("fast-muon"), preset="fast-muon9", epochs=9)
    confirmed = parse_args(["--preset", "fast-muon320", "--widths", "64,256,256", "--epochs", "9"])
    assert dataclasses.replace(confirmed, preset="fast-muon9") == fast_muon9
    assert from_preset("fast-muon320") == dataclasses.replace(
        from_preset("fast-muon"), preset="fast-muon320", widths=(64, 320, 320)
    )
    validate(default, world_size=8)  # torchrun's 8 ranks: 250 images each
    seed = from_preset("resnet9")
    assert seed == dataclasses.replace(Config(), preset="resnet9"), "the seed preset is the field defaults"
    apple8 = from_preset("apple8")
    assert apple8.batch_size == 2048 and dataclasses.replace(apple8, batch_size=512, preset="resnet9") == seed
    validate(apple8, world_size=8)
    for name in PRESETS:
        validate(from_preset(name))
