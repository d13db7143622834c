"""A run's engine kept for the next run (fastcifar/run/engine.py): what its key holds, which
settings take the fresh path, and the contract: on the CPU a run trained on a kept engine equals,
bit for bit, the same run trained fresh (weights, accuracy, per-example outputs)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import write_official

import fastcifar
import fastcifar.train as trainer
from fastcifar.core.config import from_preset
from fastcifar.parallel.distributed import DistContext
from fastcifar.run import engine as engines

CPU = DistContext(0, 1, 0, torch.device("cpu"), None)
# whiten_bias_epochs 0.5 of 4 steps: the bias freezes after step 2 of run 1 (its rate multiplier to
# 0, the frozen step selected), which the next run on the engine must find undone
TINY = dict(
    widths=(8, 16, 16),
    epochs=1,
    batch_size=50,
    warmup_steps=1,
    loader="torch",
    device="cpu",
    eval_batch_size=64,  # above the 50 test images: the evaluation's buffers hold 50 rows
    whiten_bias_epochs=0.5,
    whiten_bias_decay=False,
    whiten_images=100,  # the whitening init from 100 images, not 5000
    save_model=False,
    save_outputs="test",
    quiet=True,
)


def key_of(steps=4, ctx=CPU, **settings):
    return engines.key(from_preset("fast", **{**TINY, **settings}), ctx, steps, 50, 10, False)


def test_the_key_leaves_out_what_is_per_run_and_holds_what_is_built():
    base = key_of()
    assert base is not None
    per_run = dict(seed=9, seed_init=2, subset_fraction=0.5, out_dir="elsewhere", save_outputs="both", quiet=False)
    assert key_of(**per_run) == base
    assert set(per_run) <= engines.PER_RUN
    assert key_of(lr=0.1) != base and key_of(label_smoothing=0.0) != base and key_of(widths=(8, 8, 8)) != base
    assert key_of(steps=5) != base  # another subset size: another schedule table


@pytest.mark.parametrize(
    ("settings", "ctx", "why"),
    [
        ({"sparse_mask": "random", "sparse_fraction": 0.5}, CPU, "--sparse-mask"),
        ({"resume": "state.pt"}, CPU, "--resume"),
        ({}, DistContext(0, 1, 0, torch.device("cpu"), "gloo"), "several ranks"),  # --dist-group always too
    ],
)
def test_settings_whose_state_is_the_runs_own_take_the_fresh_path(settings, ctx, why):
    cfg = from_preset("fast", **{**TINY, **settings})
    assert engines.fresh_reason(cfg, ctx) == why
    assert key_of(ctx=ctx, **settings) is None
    holder = engines.Reuse()
    assert holder.take(None) is None


def test_a_holder_keeps_the_data_per_its_settings_and_a_bounded_number_of_engines():
    holder, reads = engines.Reuse(), []
    for key in ("a", "a", "b", "b"):
        assert holder.read(key, lambda key=key: reads.append(key) or key) == key
    assert reads == ["a", "b"]  # read again only when the data settings change
    made = [engines.Engine(str(i), *[None] * 6) for i in range(engines.MAX_ENGINES + 1)]
    assert [holder.keep(e) for e in made] == [True] * engines.MAX_ENGINES + [False]
    assert holder.take("0") is made[0] and holder.take("0") is None  # taken out while a run trains on it
    assert holder.keep(made[0]) and not holder.keep(engines.Engine(None, *[None] * 6))


def count_calls(monkeypatch, module, name: str) -> list:
    calls, real = [], getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.slow  # trains three tiny runs on the CPU (10-20 s on 2 cores)
def test_a_run_on_a_kept_engine_equals_the_same_run_trained_fresh(tmp_path, monkeypatch):
    data, _ = write_official(tmp_path / "data", per_batch=40, n_test=50)  # 200 images: 4 steps of 50
    cfg = from_preset("fast", data=str(data), out_dir=str(tmp_path / "runs"), **TINY)
    builds = count_calls(monkeypatch, trainer, "make_step")
    holder = engines.Reuse()
    first, second = fastcifar.train(dataclasses.replace(cfg, runs=2, seed=3), reuse=holder)
    assert len(builds) == 1  # run 2 took over run 1's engine: no build, warm-up or capture
    (kept,) = holder.engines.values()
    assert kept.runs == 2 and kept.model is not second.model  # each result holds its own copy
    assert kept.eval_step.batch.capacity == 50  # the test set's rows, no padding to --eval-batch-size

    (alone,) = fastcifar.train(dataclasses.replace(cfg, runs=1, seed=4))  # run 2's seed, fresh
    assert len(builds) == 2
    assert second.metrics.seed == alone.metrics.seed == 4
    assert second.test_acc == alone.test_acc
    np.testing.assert_array_equal(second.outputs.test_logits, alone.outputs.test_logits)
    got, want = second.model.state_dict(), alone.model.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert not torch.equal(first.model.fc.weight, second.model.fc.weight)  # run 1's copy is run 1's


@pytest.mark.slow  # trains three tiny runs on the CPU (about 10 s on 2 cores)
def test_a_run_whose_built_settings_differ_builds_its_own_engine(tmp_path, monkeypatch):
    data, _ = write_official(tmp_path / "data", per_batch=40, n_test=50)
    cfg = from_preset("fast", data=str(data), out_dir=str(tmp_path / "runs"), **TINY)
    builds = count_calls(monkeypatch, trainer, "make_step")
    reads = count_calls(monkeypatch, trainer, "load_dataset")
    holder = engines.Reuse()
    fastcifar.train(cfg, reuse=holder)
    fastcifar.train(dataclasses.replace(cfg, label_smoothing=0.0, seed=5), reuse=holder)  # baked into the step
    assert len(builds) == 2 and len(holder.engines) == 2
    fastcifar.train(dataclasses.replace(cfg, seed=6, subset_fraction=0.5), reuse=holder)  # 100 images: 2 steps
    assert len(builds) == 3 and len(holder.engines) == 3
    assert reads == ["load_dataset"]  # the data read once for all three


@pytest.mark.skipif(not torch.cuda.is_available(), reason="replays CUDA graphs: a GPU (gpu_visit.sh sweep)")
def test_on_a_gpu_a_kept_engines_graphs_replay_the_run_a_fresh_capture_trains(tmp_path, monkeypatch):
    """What the CPU cannot show: the graphs captured by run 1 read, for run 2, the tensors its
    restart wrote in place (weights, momentum, rate multipliers, schedule, static batches)."""
    data, _ = write_official(tmp_path / "data", per_batch=40, n_test=50)
    gpu = {**TINY, "device": "cuda", "cuda_graphs": "on", "deterministic": True}  # fp16, Triton kernels
    cfg = from_preset("fast", data=str(data), out_dir=str(tmp_path / "runs"), **gpu)
    builds = count_calls(monkeypatch, trainer, "make_step")
    benchmark = torch.backends.cudnn.benchmark
    try:
        _, second = fastcifar.train(dataclasses.replace(cfg, runs=2, seed=3))
        (alone,) = fastcifar.train(dataclasses.replace(cfg, runs=1, seed=4))
    finally:  # --deterministic sets the process's torch flags: the next test's are its own
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, benchmark
    assert len(builds) == 2
    assert second.test_acc == alone.test_acc
    np.testing.assert_array_equal(second.outputs.test_logits, alone.outputs.test_logits)
    got, want = second.model.state_dict(), alone.model.state_dict()
    for name in want:
        assert torch.equal(got[name], want[name]), name
