"""fastcifar.run.sparse: sparse training's pieces on the CPU: Fisher scores, masks, masked updates,
the sparse record and the chain of diffs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from models import tiny

from fastcifar.core.config import CHOICES, from_preset
from fastcifar.run.optim import NesterovSGD
from fastcifar.run.recipe import param_groups
from fastcifar.run.sparse import fisher, masks
from fastcifar.run.sparse.update import MaskedOptimizer


def batch(n=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 32, 32, generator=g).contiguous(memory_format=torch.channels_last)
    return x, torch.randint(0, 10, (n,), generator=g)


def loop_scores(model, x, y, variant):
    """The definition, one sample at a time with autograd."""
    params = fisher.trainable(model)
    out = {n: torch.zeros_like(p) for n, p in params.items()}
    for i in range(len(y)):
        logits = model(x[i : i + 1])
        labels = range(10) if variant == "expected" else [int(y[i])]
        probs = logits.softmax(1)[0].detach()
        for c in labels:
            grads = torch.autograd.grad(
                F.cross_entropy(logits, torch.tensor([c])), list(params.values()), retain_graph=True
            )
            for n, g in zip(params, grads, strict=True):
                if variant == "squared":
                    out[n] += g.square()
                elif variant == "abs":
                    out[n] += g.abs()
                else:
                    out[n] += probs[c] * g.square()
    return out


@pytest.mark.parametrize("variant", CHOICES["mask_score"])
@pytest.mark.slow  # a per-sample backward loop as the reference
def test_fisher_scores_match_a_per_sample_loop(variant):
    _, model = tiny()
    x, y = batch()
    model = fisher.scoring_copy(model, x)  # eval mode with statistics from x: per-sample is well defined
    got = fisher.fisher_scores(model, x, y, variant, chunk=5)  # chunks of 5, 5, 2
    want = loop_scores(model, x, y, variant)
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-9, msg=f"{variant} {n}")
        assert want[n].abs().sum() > 0, n


def test_fisher_scores_skip_frozen_parameters():
    """FastNet in the `fast` preset: frozen whitening weights and batchnorm scales are not scored,
    but they shape everyone else's gradients."""
    _, model = tiny("fastnet")
    x, y = batch(6)
    model = fisher.scoring_copy(model, x)
    got = fisher.fisher_scores(model, x, y, "squared", chunk=4)
    assert "whiten.weight" not in got and "blocks.0.conv1.norm.weight" not in got and "whiten.bias" in got
    want = loop_scores(model, x, y, "squared")
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-9, msg=n)


def test_scoring_copy_leaves_the_model_alone_and_uses_exact_statistics():
    _, model = tiny()
    x, _ = batch(20)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    scorer = fisher.scoring_copy(model, x, chunk=20)  # one chunk: the exact batch statistics
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    prep = scorer.prep.norm
    conv_out = scorer.prep.conv(x)
    torch.testing.assert_close(prep.running_mean, conv_out.mean((0, 2, 3)), rtol=1e-4, atol=1e-5)
    assert not scorer.training


def test_top_k_keeps_the_highest_scores_plus_classifier_and_shifts():
    _, model = tiny()
    scores = {n: torch.rand(p.shape) for n, p in fisher.trainable(model).items()}
    forced = masks.forced_names(model, bn_shifts=True)
    assert "fc.weight" in forced and "prep.norm.bias" in forced and "prep.norm.weight" not in forced
    mask = masks.top_k(scores, 0.05, forced)
    k = masks.budget(scores, 0.05)
    scored = torch.cat([scores[n].flatten() for n in scores if n not in forced])
    chosen = torch.cat([scores[n][mask[n]] for n in scores if n not in forced])
    assert chosen.numel() == k
    assert chosen.min() >= torch.topk(scored, k).values.min()
    assert all(mask[n].all() for n in forced)
    no_shifts = masks.top_k(scores, 0.05, masks.forced_names(model, bn_shifts=False))
    assert not no_shifts["prep.norm.bias"].all()


def test_random_mask_has_the_same_size_and_is_reproducible():
    _, model = tiny()
    like = {n: p.detach() for n, p in fisher.trainable(model).items()}
    forced = masks.forced_names(model, True)
    a = masks.top_k(masks.random_scores(like, 3), 0.1, forced)
    b = masks.top_k(masks.random_scores(like, 3), 0.1, forced)
    c = masks.top_k(masks.random_scores(like, 4), 0.1, forced)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert masks.count(a) == masks.count(c) and any(not torch.equal(a[n], c[n]) for n in a)


@pytest.mark.parametrize("world", [2, 3])
def test_disjoint_masks_never_overlap_and_cover_the_top(world):
    _, model = tiny()
    scores = {n: torch.rand(p.shape) for n, p in fisher.trainable(model).items()}
    forced = masks.forced_names(model, True)
    dealt = masks.deal(scores, 0.02, forced, world)
    union = masks.top_k(scores, 0.02 * world, forced)
    k = masks.budget(scores, 0.02)
    for n in scores:
        if n in forced:
            assert all(m[n].all() for m in dealt)
            continue
        stacked = torch.stack([m[n] for m in dealt]).int()
        assert stacked.sum(0).max() <= 1, f"ranks overlap in {n}"
        assert torch.equal(stacked.sum(0).bool(), union[n])
    sizes = [sum(int(m[n].sum()) for n in scores if n not in forced) for m in dealt]
    assert sizes == [k] * world


def train_steps(model, opt, steps=3):
    for i in range(steps):
        x, y = batch(8, seed=10 + i)
        F.cross_entropy(model(x), y, reduction="sum").backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("arch", ["resnet9", "fastnet"])
def test_full_masking_moves_exactly_the_masked_entries(arch):
    cfg, model = tiny(arch)
    params = fisher.trainable(model)
    opt = MaskedOptimizer(
        NesterovSGD(param_groups(model, cfg, 8), lr=0.05, momentum=0.9, weight_decay=5e-3), params, "full"
    )
    scores = {n: torch.rand(p.shape) for n, p in params.items()}
    mask = masks.top_k(scores, 0.1, masks.forced_names(model, True))
    opt.set_masks(mask)
    before = {n: p.detach().clone() for n, p in params.items()}
    train_steps(model, opt)
    trained = 0
    for n, p in params.items():
        moved = p.detach() != before[n]
        assert not (moved & ~mask[n]).any(), f"{n}: an unmasked entry moved"
        trained += int(moved[mask[n]].sum())
    assert trained > 0.9 * masks.count(mask), "masked entries did not train"
    # a new, smaller mask: the entries leaving it stop at once (their momentum is cleared)
    half = {n: m & (torch.rand(m.shape) < 0.5) for n, m in mask.items()}
    opt.set_masks(half)
    mid = {n: p.detach().clone() for n, p in params.items()}
    train_steps(model, opt, 2)
    for n, p in params.items():
        assert not ((p.detach() != mid[n]) & ~half[n]).any(), n


def test_gradient_only_masking_lets_decay_and_momentum_move_the_rest():
    cfg, model = tiny()
    params = fisher.trainable(model)
    opt = MaskedOptimizer(
        NesterovSGD(param_groups(model, cfg, 8), lr=0.05, momentum=0.9, weight_decay=5e-3), params, "grad"
    )
    mask = masks.top_k({n: torch.rand(p.shape) for n, p in params.items()}, 0.1, set())
    opt.set_masks(mask)
    before = {n: p.detach().clone() for n, p in params.items()}
    train_steps(model, opt)
    w = "layer2.conv.weight"
    outside = ~mask[w]
    assert (params[w].detach()[outside].abs() < before[w][outside].abs()).all()  # decayed, not frozen


def test_full_mask_of_ones_is_the_dense_optimizer():
    cfg, a = tiny()
    _, b = tiny()
    pa, pb = fisher.trainable(a), fisher.trainable(b)
    oa = NesterovSGD(param_groups(a, cfg, 8), lr=0.05, momentum=0.9, weight_decay=5e-3)
    ob = MaskedOptimizer(NesterovSGD(param_groups(b, cfg, 8), lr=0.05, momentum=0.9, weight_decay=5e-3), pb)
    ob.set_masks({n: torch.ones(p.shape, dtype=torch.bool) for n, p in pb.items()})
    train_steps(a, oa)
    train_steps(b, ob)
    for n in pa:
        torch.testing.assert_close(pa[n], pb[n], rtol=1e-6, atol=1e-7)


def test_sparse_record_is_written_atomically_and_a_write_failure_is_a_checkpoint_error(tmp_path):
    from types import SimpleNamespace

    from fastcifar.models.files import CheckpointError
    from fastcifar.run.sparse.run import SparseRun

    _, model = tiny()
    cfg = from_preset("resnet9", widths=(4, 8, 8, 8), sparse_mask="random", sparse_fraction=0.1)
    opt = NesterovSGD(param_groups(model, cfg, 8), lr=0.05)
    ctx = SimpleNamespace(distributed=False, world_size=1, rank=0, is_main=True)
    log = SimpleNamespace(dir=tmp_path, meta={}, line=lambda text: None)
    run = SparseRun(cfg, model, opt, None, ctx, log, run=1, seed=0)
    run.epoch_start(0)
    run.finish()
    record = json.loads((tmp_path / "sparse-run1.json").read_text())
    assert record["masks"] == [{"epoch": 0, "count": masks.count(run.optimizer.masks)}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sparse-run1.json"]  # no temporary left behind
    (tmp_path / "not-a-folder").write_text("")
    log.dir = tmp_path / "not-a-folder"  # a folder that cannot be made: as a full or read-only disk fails
    with pytest.raises(CheckpointError, match="cannot write"):
        run.finish()


def _chain(folder):
    """A base file and two diffs (epochs 1 and 2, test_acc 10 and 20) of a tiny network, and the
    state after each epoch."""
    from fastcifar.run.sparse import diffs

    cfg, model = tiny()
    writer = diffs.DiffWriter(folder, model, cfg, [f"c{i}" for i in range(10)], (0.0,) * 3, (1.0,) * 3)
    writer.start()
    states = []
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for epoch in (1, 2):
            for p in model.parameters():
                hit = torch.rand(p.shape, generator=g) < 0.1
                p[hit] = torch.randn(int(hit.sum()), generator=g)
            for b in model.buffers():
                if b.is_floating_point():
                    b.add_(1.0)
            writer.epoch(epoch, 10.0 * epoch)
            states.append(diffs.host_state(model))
    return writer, folder / "base.safetensors", [folder / f"epoch{i:03d}.safetensors" for i in (1, 2)], states


def test_diff_round_trip_is_bit_exact(tmp_path):
    from fastcifar.run.sparse import diffs

    writer, base, epochs, states = _chain(tmp_path)
    for e in (1, 2):
        got, _ = diffs.restore(base, epochs[:e])
        assert got.keys() == states[e - 1].keys()
        assert all(torch.equal(got[k], states[e - 1][k]) for k in got), f"epoch {e}"
    assert writer.records[1]["bytes"] < 0.5 * writer.dense_bytes


def test_a_chain_with_a_file_of_the_wrong_kind_or_without_a_digest_is_refused(tmp_path, capsys):
    """The base must be a model file, each diff a sparse diff, and both carry a digest: one reader
    (read_safetensors' fmt and digest_required) checks all three for restore, load and seal."""
    from safetensors.torch import load_file, save_file

    from fastcifar.checkpoint import main as checkpoint_main
    from fastcifar.models.files import CheckpointError, read_safetensors
    from fastcifar.run.sparse import diffs

    _, base, epochs, _ = _chain(tmp_path)
    with pytest.raises(CheckpointError, match=r"not a fastcifar sparse diff \(format 'fastcifar.model/1', expected"):
        diffs.restore(base, [base])
    with pytest.raises(CheckpointError, match=r"not a fastcifar model file \(format 'fastcifar.sparse_diff/1'"):
        diffs.restore(epochs[0], [])
    with pytest.raises(diffs.ChainError, match="chain broken"):
        diffs.restore(base, [epochs[1]])
    unsealed = tmp_path / "unsealed.safetensors"
    meta = {k: v for k, v in read_safetensors(epochs[0], "sparse diff")[1].items() if k != "sha256"}
    save_file(load_file(epochs[0]), unsealed, metadata=meta)
    with pytest.raises(CheckpointError, match="this sparse diff carries no digest"):
        diffs.restore(base, [unsealed])
    assert checkpoint_main(["seal", str(epochs[0]), "--out", str(tmp_path / "sealed.safetensors")]) == 2
    assert f"{epochs[0]}: not a fastcifar model file (format 'fastcifar.sparse_diff/1'" in capsys.readouterr().err
    assert not (tmp_path / "sealed.safetensors").exists()


def test_restoring_a_chain_reads_each_file_once_and_gives_the_last_epochs_accuracy(tmp_path, monkeypatch, capsys):
    """restore hashes each parent from the bytes it read (no second read of the base or a diff),
    and hands back the restored model's metadata: the checkpoint command writes the last diff's
    test_acc without reading that diff again."""
    from fastcifar.checkpoint import main as checkpoint_main
    from fastcifar.core import readfile
    from fastcifar.models import files
    from fastcifar.models.files import load_model
    from fastcifar.run.sparse import diffs

    _, base, epochs, states = _chain(tmp_path)
    opened = []

    def counted(real):
        def open_regular(path):
            opened.append(Path(path).name)
            return real(path)

        return open_regular

    monkeypatch.setattr(files, "open_regular", counted(files.open_regular))
    monkeypatch.setattr(readfile, "open_regular", counted(readfile.open_regular))  # hash_file's
    state, meta = diffs.restore(base, epochs)
    assert opened == ["base.safetensors", "epoch001.safetensors", "epoch002.safetensors"]
    assert all(torch.equal(state[k], states[1][k]) for k in states[1])
    assert float(meta["test_acc"]) == 20.0 and "sha256" not in meta  # not the base's "", nor its digest
    assert diffs.restore(base, [])[1]["test_acc"] == ""
    opened.clear()
    out = tmp_path / "restored.safetensors"
    assert checkpoint_main(["restore", str(base), *map(str, epochs), "--out", str(out)]) == 0
    assert opened == ["base.safetensors", "epoch001.safetensors", "epoch002.safetensors"]
    assert capsys.readouterr().out == f"wrote {out}\n" and load_model(out)[1].test_acc == 20.0


def test_restore_refuses_an_existing_out_before_reading_the_chain(tmp_path, capsys):
    from fastcifar.checkpoint import main as checkpoint_main

    out = tmp_path / "model.safetensors"
    out.write_bytes(b"mine")
    assert checkpoint_main(["restore", str(tmp_path / "no-base.safetensors"), "--out", str(out)]) == 2
    assert capsys.readouterr().err == f"fastcifar: error: {out} exists; not overwriting it\n"
    assert out.read_bytes() == b"mine"
