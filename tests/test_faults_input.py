"""Issue 48: bad input and hostile files end cleanly: one line on stderr, exit 2, nothing written.

Options out of range (items 1, 6), ``--kernels triton`` without a GPU (2), a tampered training
checkpoint (3), hostile model metadata and weights (7), official batches with labels that are not
integers in range (10).
"""

from __future__ import annotations

import dataclasses
import json
import pickle
from fractions import Fraction

import numpy as np
import pytest
import torch

from cli import SHORT, run_dirs
from conftest import batch_bytes, make_images, one_line_error, write_official
from fastcifar.core.config import CHOICES, RANGES, Config, ConfigError, fields, from_preset, validate
from fastcifar.core.errors import DataError
from fastcifar.train import main as train_main


def _train_cli(argv, tmp_path, capfd):
    """The trainer's command line in this process: (exit code, its one stderr line); asserts that
    no run folder was made."""
    out = tmp_path / "runs"
    code = train_main([str(a) for a in ["--out-dir", out, *argv]])
    err = capfd.readouterr().err
    assert not run_dirs(out), "nothing may be written for a refused run"
    return code, (one_line_error(err) if code else err)


# --- items 1 and 6: every numeric option has a range, checked before any work ------------------

NOT_IN_TABLE = {"seed", "whiten_kernel", "tta"}  # seed: 0..2^63-1-runs (validate); the others: CHOICES


def test_every_numeric_field_has_a_range_in_one_table():
    numeric = {f.name for f in fields(Config) if f.type in ("int", "float")}
    assert set(RANGES) <= numeric
    assert numeric - set(RANGES) - set(CHOICES) <= NOT_IN_TABLE, numeric - set(RANGES) - set(CHOICES)
    for name, (low, high, brackets) in RANGES.items():
        assert brackets in ("[]", "[)", "(]", "()"), name
        assert low is not None and (high is None or low < high), name
    for name in ("epochs", "runs", "batch_size", "eval_batch_size"):  # they size memory or time
        assert RANGES[name][1] is not None, f"--{name} has no upper bound"
    for name in PRESET_NAMES:
        validate(from_preset(name))  # every preset lies within the ranges


PRESET_NAMES = ("resnet9", "apple8", "alexnet", "fast", "fast-departures", "fast-muon", "fast-muon320")


@pytest.mark.parametrize("args, message", [
    (["--momentum", "2"], "--momentum must lie in [0, 1), not 2.0"),
    (["--momentum", "1"], "--momentum must lie in [0, 1), not 1.0"),
    (["--target-acc", "150"], "--target-acc must lie in [0, 100], not 150.0"),
    (["--target-acc", "-1"], "--target-acc must lie in [0, 100], not -1.0"),
    (["--epochs", "1e9"], "--epochs must lie in (0, 1000], not 1000000000"),
    (["--runs", "100000"], "--runs must lie in 1..1000, not 100000"),
    (["--batch-size", "1000000"], "--batch-size must lie in 1..65536, not 1000000"),
    (["--eval-batch-size", "1000000"], "--eval-batch-size must lie in 1..65536, not 1000000"),
    (["--widths", "8,16,30000,64"], "--widths: each must lie in 1..4096 channels, not 30000"),
    (["--warmup-steps", "100000000"], "--warmup-steps must lie in 0..1000, not 100000000"),
    (["--lr", "-0.1"], "--lr must not be negative, not -0.1"),
])
def test_out_of_range_options_are_one_line_before_any_work(args, message, tmp_path, capfd):
    # --data names nothing: the refusal comes before any data is read
    code, line = _train_cli(["--data", tmp_path / "absent", *SHORT, *args], tmp_path, capfd)
    assert code == 2 and line.startswith("fastcifar: error: ") and message in line, line


@pytest.mark.parametrize("overrides, message", [
    ({"epochs": "3"}, "--epochs must be a number, not '3'"),
    ({"batch_size": 2.5}, "--batch-size must be a whole number, not 2.5"),
    ({"momentum": True}, "--momentum must be a number, not True"),
    ({"widths": (8, "16", 32, 64)}, "--widths must be a list of whole numbers"),
    ({"nesterov": 1}, "--nesterov must be true or false, not 1"),
])
def test_api_config_of_wrong_types_is_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        validate(dataclasses.replace(from_preset("resnet9"), **overrides))


# --- item 2: --kernels triton without a GPU is Triton's interpreter: refused unless asked for ------

def test_triton_kernels_without_a_gpu_are_refused_unless_asked_for(tmp_path, capfd, monkeypatch):
    from fastcifar.models.blocks import resolve_kernels
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without a GPU, also on one with
    monkeypatch.delenv("FASTCIFAR_ALLOW_INTERPRETER", raising=False)
    folder, _ = write_official(tmp_path / "d")
    for device in (["--device", "cpu"], ["--device", "auto"]):
        code, line = _train_cli(["--data", folder, *SHORT, *device, "--kernels", "triton"], tmp_path, capfd)
        assert code == 2 and line.startswith("fastcifar: error: --kernels triton without a GPU runs Triton's "
                                             "interpreter"), line
        assert "--kernels torch" in line and "FASTCIFAR_ALLOW_INTERPRETER=1" in line
    assert resolve_kernels("auto", torch.device("cpu")) == "torch"  # the default is not affected
    monkeypatch.setenv("FASTCIFAR_ALLOW_INTERPRETER", "1")  # the tests' opt-in: the interpreter runs
    assert resolve_kernels("triton", torch.device("cpu")) == "triton"
