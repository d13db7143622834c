"""fastcifar.run.state, the training checkpoint: the settings a resume takes (resume_settings), and a
checkpoint with one flipped byte refused by its digest and left as it was. The command-level resume
tests: tests/cli/test_resume.py."""

from __future__ import annotations

import pytest
import torch
from models import flip_in_largest_zip_member, small_checkpoint_state

from fastcifar.core.options import parse_command_line
from fastcifar.models.files import CheckpointError
from fastcifar.run import state as run_state


def test_agreeing_and_path_options_on_resume_are_accepted(uninterrupted, resume_data):
    """What the command line names and agrees with, and where-to-log fields, pass the check."""
    from fastcifar.run.state import resume_settings

    path = str(uninterrupted["dir"] / "checkpoint.pt")
    cfg, given = parse_command_line(["--resume", path, "--lr", "0.4", "--out-dir", "elsewhere", "--quiet"])
    resumed = resume_settings(cfg, given)
    assert (resumed.preset, resumed.widths, resumed.val_split) == ("resnet9", (8, 16, 32, 64), 40)
    assert (resumed.out_dir, resumed.quiet, resumed.resume) == ("elsewhere", True, path)


def test_a_checkpoint_with_one_flipped_byte_is_refused_and_left_as_it_was(tmp_path):
    cfg, state = small_checkpoint_state()
    good = tmp_path / "good.pt"
    torch.save(run_state.seal(state), good)
    assert run_state._read_state(good, cfg, 1)["epochs_done"] == 2  # untouched: loads
    bad = tmp_path / "checkpoint.pt"
    bad.write_bytes(good.read_bytes())
    flip_in_largest_zip_member(bad)
    loaded = torch.load(bad, weights_only=True)  # still decodes, finite
    assert bool(torch.isfinite(loaded["model"]["w"]).all()) and not torch.equal(
        loaded["model"]["w"], state["model"]["w"]
    )
    before = bad.read_bytes()
    with pytest.raises(CheckpointError, match="its contents do not match the digest written with them"):
        run_state._read_state(bad, cfg, 1)
    assert bad.read_bytes() == before
    unsealed = tmp_path / "old.pt"
    torch.save(state, unsealed)  # no digest at all
    with pytest.raises(CheckpointError, match="carries no digest"):
        run_state._read_state(unsealed, cfg, 1)
