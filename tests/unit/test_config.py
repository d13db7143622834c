"""fastcifar.core.config: the settings' checks (validate): the fast recipe's refusals, and
--emulate-ranks' refusals, in one line on the command line."""

from __future__ import annotations

import pytest
from conftest import one_line_error

from fastcifar.core.config import ConfigError, from_preset, validate


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"widths": (8, 16, 32, 64)}, "three positive channel counts"),
        ({"bias_lr_scale": 0.0}, "--bias-lr-scale"),
        ({"lookahead_decay": 1.0}, "--lookahead-decay"),
        ({"bn_momentum": 0.0}, "--bn-momentum"),
        ({"profile_steps": "9:3"}, "--profile-steps"),
        ({"flip_mode": "sometimes"}, "--flip-mode must be one of random, alternate"),
        ({"tta": 4}, "--tta must be one of 0, 1, 2"),
        ({"tta_share": 0.0}, r"--tta-share must lie in \(0, 1\], not 0"),
        ({"tta_share": 1.5}, r"--tta-share must lie in \(0, 1\], not 1.5"),
        ({"brightness": -0.1}, r"--brightness must lie in \[0, 10\], not -0.1"),
        ({"contrast": 1.0}, r"--contrast must lie in \[0, 1\), not 1.0"),
    ],
)
def test_fast_validation(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(from_preset("fast", **overrides))


@pytest.mark.parametrize(
    "overrides, world_size, message",
    [
        ({"emulate_ranks": 2}, 2, "--emulate-ranks 2 emulates ranks in one process, but this run has 2 real ranks"),
        (
            {"emulate_ranks": 2, "compress": "topk"},
            1,
            "does not combine with --compress, --sparse-mask or --local-steps",
        ),
        ({"emulate_ranks": 2, "preset": "resnet9", "local_steps": 4}, 1, "does not combine with --compress"),
        ({"emulate_ranks": 3, "batch_size": 100}, 1, "--batch-size 100 does not divide over 3 ranks"),
        ({"emulate_ranks": 0}, 1, "--emulate-ranks must lie in 1..1024, not 0"),
    ],
)
def test_emulated_ranks_refusals(overrides, world_size, message):
    preset = overrides.pop("preset", "fast-muon320")
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        validate(from_preset(preset, **overrides), world_size)
    validate(from_preset(emulate_ranks=1), world_size=2)  # 1 is off: any launch


def test_emulated_ranks_refusal_on_the_command_line_is_one_line(tmp_path, capfd):
    from fastcifar.train import main

    code = main(
        [
            "--data",
            str(tmp_path / "absent"),
            "--out-dir",
            str(tmp_path / "runs"),
            "--device",
            "cpu",
            "--emulate-ranks",
            "3",
            "--batch-size",
            "100",
        ]
    )
    assert code == 2
    assert "does not divide over 3 ranks" in one_line_error(capfd.readouterr().err)
    assert not (tmp_path / "runs").exists()


def test_resume_accepts_other_display_and_path_settings_only():
    """--quiet, paths and logging may differ on resume; a training setting may not."""
    from fastcifar.core.config import from_preset
    from fastcifar.core.config import training_settings as _training_config

    base = from_preset("resnet9")
    assert _training_config(base) == _training_config(from_preset("resnet9", quiet=True, out_dir="x", data="y"))
    assert _training_config(base) != _training_config(from_preset("resnet9", lr=0.5))
