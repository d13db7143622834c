"""--deterministic on the CPU: two runs with the same seed end with the same weights bit for bit, in
one process or in two gloo ranks, whichever run of an invocation they are; and --save-outputs
under two gloo ranks puts every rank's rows back in the data set's order (rank 0 writes them)."""

from __future__ import annotations

import sys

import forkserver
import numpy as np
import pytest
from cli import ROOT, env, run_dirs, summary_of, torchrun
from conftest import write_official
from safetensors.torch import load_file

from fastcifar.data import load_dataset
from fastcifar.data.dali import dali_available
from fastcifar.evaluate import logits_of
from fastcifar.models.files import load_model

# the default preset made small (its whitening conv, lookahead and jitter all draw or average); the
# loader is the CPU's default (DALI's CPU pipeline where DALI imports, else torch's)
ARGS = [
    *("--device", "cpu", "--widths", "16,32,32", "--batch-size", "100", "--epochs", "1"),
    *("--warmup-steps", "1", "--eval-batch-size", "150", "--whiten-images", "100"),
    *("--quiet", "--deterministic"),
]
OUTPUTS = ("test_logits", "test_margins", "train_logits", "train_margins")


def train(cmd: list[str], out, data, *extra: str) -> None:
    proc = forkserver.run(
        [*cmd, *ARGS, "--data", str(data), "--out-dir", str(out), *extra],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def unequal(a, b) -> list[str]:
    """The tensors of two model files whose bytes differ (-0.0 is not 0.0 here), or that only one has."""
    x, y = load_file(a), load_file(b)
    return sorted(
        k
        for k in x.keys() | y.keys()
        if k not in x or k not in y or x[k].dtype != y[k].dtype or x[k].numpy().tobytes() != y[k].numpy().tobytes()
    )


def test_two_deterministic_runs_with_one_seed_end_with_the_same_weights(tmp_path):
    """Seed 0 alone, and seed 0 as the first of two runs (seeds 0 and 1) of another invocation:
    the same bits; seed 1 is another model. The log names what --deterministic covers, once."""
    data, _ = write_official(tmp_path / "data", per_batch=80, n_test=200)
    cmd = [sys.executable, "-m", "fastcifar.train"]
    train(cmd, tmp_path / "a", data)
    train(cmd, tmp_path / "b", data, "--runs", "2")
    (a,), (b,) = run_dirs(tmp_path / "a"), run_dirs(tmp_path / "b")
    assert unequal(a / "model.safetensors", b / "model-run1.safetensors") == []
    assert unequal(b / "model-run1.safetensors", b / "model-run2.safetensors") != []
    lines = [line for line in (a / "log.txt").read_text().splitlines() if "deterministic: " in line]
    assert len(lines) == 1 and "thread count (1 here" in lines[0], lines
    assert "engine: loader dali" in (a / "log.txt").read_text() or not dali_available()[0]


@pytest.mark.slow  # four gloo ranks' runs
def test_two_gloo_ranks_deterministic_and_their_outputs_in_the_sets_order(tmp_path, monkeypatch):
    # fresh interpreters, each rank with its own string-hash seed as in a real launch: ranks forked
    # from one server would share one, and agree on any set's order by that alone
    monkeypatch.setenv("FASTCIFAR_TEST_FORK", "0")
    data, _ = write_official(tmp_path / "data", per_batch=80, n_test=200)
    # the torch loader here (the one-process test above takes the default); TTA share 1: a
    # one-process evaluation of the model file gives the same rows
    extra = ("--save-outputs", "both", "--tta", "1", "--loader", "torch")
    for name in ("a", "b"):
        train(torchrun(), tmp_path / name, data, *extra)
    (a,), (b,) = run_dirs(tmp_path / "a"), run_dirs(tmp_path / "b")
    assert summary_of(tmp_path / "a")["device"]["world_size"] == 2
    assert unequal(a / "model.safetensors", b / "model.safetensors") == []
    for name in OUTPUTS:  # rank 0 wrote them all, the same bits both times
        x, y = (np.load(d / "outputs" / f"{name}.npy") for d in (a, b))
        assert x.tobytes() == y.tobytes(), name
    whole = load_dataset(str(data))
    test = np.load(a / "outputs" / "test_logits.npy", mmap_mode="r")
    acc = summary_of(tmp_path / "a")["results"][0]["test_acc"]
    assert 100.0 * int((test.argmax(1) == whole.test_labels).sum()) / len(whole.test_labels) == acc
    net, info = load_model(a / "model.safetensors", "cpu")
    for images, name, tta in ((whole.test_images, "test_logits", 1), (whole.train_images, "train_logits", 0)):
        alone = logits_of(net, images, mean=info.mean, std=info.std, tta=tta, batch_size=150).numpy()
        np.testing.assert_allclose(
            np.load(a / "outputs" / f"{name}.npy").astype(np.float32), alone, rtol=2e-3, atol=2e-3
        )
