"""Sparse training through the trainer: diff chains restore exactly, local SGD over 2 gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli import ROOT, SHORT, run_dirs, run_train, summary_of, torchrun, train_here
from conftest import one_line_error

from fastcifar import checkpoint as checkpoint_cmd
from fastcifar.core.config import ConfigError, from_preset, validate
from fastcifar.models.files import read_safetensors
from fastcifar.run.sparse import diffs

SPARSE = [
    "--sparse-mask",
    "fisher",
    "--sparse-fraction",
    "0.05",
    "--mask-samples",
    "100",
    "--sparse-checkpoints",
    "--loader",
    "torch",
]


def chain(run_dir: Path, run: int = 1) -> tuple[Path, list[Path]]:
    folder = run_dir / "sparse" / f"run{run}"
    return folder / "base.safetensors", sorted(folder.glob("epoch*.safetensors"))


@pytest.mark.slow
def test_diff_chain_restores_each_epoch_exactly(learnable_data, tmp_path, capsys):
    out = tmp_path / "runs"
    proc = run_train(
        ["--data", learnable_data, "--out-dir", out, *SHORT, "--epochs", "3", *SPARSE, "--mask-every", "2"]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = run_dirs(out)
    base, epochs = chain(run_dir)
    assert [p.name for p in epochs] == ["epoch001.safetensors", "epoch002.safetensors", "epoch003.safetensors"]
    accs = [e["test_acc"] for e in summary_of(out)["results"][0]["epochs"]]
    record = json.loads((run_dir / "sparse-run1.json").read_text())
    assert [m["epoch"] for m in record["masks"]] == [0, 2]  # --mask-every 2: recomputed at epoch 2
    for e in range(1, 4):
        state, meta = diffs.restore(base, epochs[:e])
        assert checkpoint_cmd.evaluate_state(state, meta, str(learnable_data)) == accs[e - 1], f"epoch {e}"
    assert accs[-1] > 20.0  # it learned something: the equality is not between two untrained models
    dense = base.stat().st_size
    for d, m in zip(record["diffs"], [0, 0, 1], strict=True):
        # under a fixed mask nothing outside it changes: no more changed entries than masked ones
        assert 0 < d["changed_entries"] <= record["masks"][m]["count"]
        assert d["bytes"] < 0.5 * dense and d["dense_bytes"] == dense
    assert "sparse diff epoch 3:" in proc.stdout
    with pytest.raises(diffs.ChainError, match="chain broken"):
        diffs.restore(base, [epochs[0], epochs[2]])
    # the command line (in-process: main(argv)): inspect, restore to a model file, a broken chain
    assert checkpoint_cmd.main(["inspect", str(epochs[1])]) == 0
    assert "sparse diff, epoch 2, parent epoch001.safetensors" in capsys.readouterr().out
    model_file = tmp_path / "m.safetensors"
    assert checkpoint_cmd.main(["restore", str(base), *map(str, epochs[:2]), "--out", str(model_file)]) == 0
    written, meta = read_safetensors(model_file)
    want, _ = diffs.restore(base, epochs[:2])
    assert meta["format"] == "fastcifar.model/1" and float(meta["test_acc"]) == accs[1]
    assert all(torch.equal(written[k], want[k]) for k in want)
    capsys.readouterr()
    assert checkpoint_cmd.main(["restore", str(base), str(epochs[1])]) == 2
    assert "chain broken" in one_line_error(capsys.readouterr().err)


@pytest.mark.parametrize(
    "overrides,world,needle",
    [
        ({"sparse_fraction": 0.0}, 1, "--sparse-fraction"),
        ({"sparse_checkpoints": True}, 1, "--sparse-checkpoints needs"),
        ({"local_steps": 2, "lookahead_steps": 5}, 2, "--lookahead-steps 0"),
        ({"mask_layout": "disjoint", "sparse_mask": "fisher"}, 2, "needs --local-steps"),
        (
            {"mask_layout": "disjoint", "sparse_mask": "fisher", "local_steps": 2, "sparse_fraction": 0.6},
            2,
            "more than all",
        ),
        ({"mask_samples": 0}, 1, "--mask-samples"),
        ({"local_steps": 2, "compress": "topk"}, 2, "--local-steps 0"),
    ],
)
def test_sparse_settings_that_cannot_work_are_refused(overrides, world, needle):
    with pytest.raises(ConfigError, match=needle):
        validate(from_preset("resnet9", **overrides), world)


def test_bad_sparse_flag_is_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "runs"
    proc = train_here(["--data", tmp_path, "--out-dir", out, *SHORT, "--sparse-checkpoints"], capsys)
    assert proc.returncode == 2 and "--sparse-checkpoints needs" in one_line_error(proc.stderr)
    assert not out.exists()


@pytest.mark.slow
def test_two_ranks_local_sgd_with_one_step_and_a_full_mask_is_data_parallel():
    proc = run_train(
        [], launcher=torchrun(str(ROOT / "tests" / "helpers" / "sparse_worker.py"), "equivalence", "disjoint")
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} equivalence ok" in proc.stdout and f"rank {rank} disjoint ok" in proc.stdout


@pytest.mark.slow
def test_two_ranks_keep_equal_weights_when_a_grad_only_mask_changes():
    proc = run_train(
        [],
        launcher=torchrun(
            str(ROOT / "tests" / "helpers" / "sparse_worker.py"), "grad_mask_change", "grad_mask_change_disjoint"
        ),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        for layout in ("shared", "disjoint"):
            assert f"rank {rank} grad_mask_change {layout} ok" in proc.stdout


@pytest.mark.slow
def test_two_ranks_sparse_local_sgd_through_the_trainer(learnable_data, tmp_path):
    out = tmp_path / "runs"
    proc = run_train(
        [
            "--data",
            learnable_data,
            "--out-dir",
            out,
            *SHORT,
            "--epochs",
            "2",
            "--warmup-epochs",
            "0.5",
            *SPARSE,
            "--sparse-mask",
            "random",
            "--local-steps",
            "3",
            "--mask-layout",
            "disjoint",
        ],
        launcher=torchrun(),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = run_dirs(out)
    record = json.loads((run_dir / "sparse-run1.json").read_text())
    steps = summary_of(out)["steps_per_epoch"]
    lsgd = record["local_sgd"]
    assert lsgd["merges"] == 2 * (steps // 3 + (steps % 3 > 0))  # every 3 steps, and at each epoch's end
    assert 0 < lsgd["per_merge"] < lsgd["dense_allreduce"]
    assert "local SGD: merge every 3 steps" in proc.stdout and "disjoint" in proc.stdout
    base, epochs = chain(run_dir)
    state, meta = diffs.restore(base, epochs)
    acc = summary_of(out)["results"][0]["epochs"][-1]["test_acc"]
    assert checkpoint_cmd.evaluate_state(state, meta, str(learnable_data)) == acc  # the ranks held the same weights
