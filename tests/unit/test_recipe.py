"""fastcifar.run.recipe: param groups, frozen batchnorm scales, the shifts' rate, the activation in
every block; and the `fast` preset against the published airbench94 recipe (Jordan, 2024), on the
CPU (the transcription below)."""

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fastcifar import train as trainer
from fastcifar.core.config import Config, ConfigError, from_preset, validate
from fastcifar.core.options import parse_args
from fastcifar.core.streams import Streams
from fastcifar.data import load_dataset, shard_indices
from fastcifar.data.loader import EvalSet, TorchLoader
from fastcifar.models.fastnet import init_whitening
from fastcifar.models.network import make_network, norm_layers
from fastcifar.ops.augment import AugmentSpec
from fastcifar.ops.norm_act_pool import NormActPool
from fastcifar.parallel.distributed import DistContext
from fastcifar.run.optim import NesterovSGD
from fastcifar.run.recipe import param_groups
from fastcifar.run.schedule import epoch_lengths, lr_schedule

CPU = DistContext(0, 1, 0, torch.device("cpu"), None)


def tiny_fast(**overrides) -> Config:
    return from_preset("fast", widths=(8, 16, 16), **overrides)


# --- optimizer param groups ------------------------------------------------------------------


def test_param_groups_match_torch_sgd_with_groups():
    torch.manual_seed(0)
    ours = [
        torch.randn(4, 3, requires_grad=True),
        torch.randn(5, requires_grad=True),
        torch.randn(2, requires_grad=True),
    ]
    ref = [p.detach().clone().requires_grad_() for p in ours]
    groups = [
        {"name": "w", "params": [ours[0]], "weight_decay": 0.5},
        {"name": "b", "params": [ours[1]], "lr_scale": 64.0, "weight_decay": 0.5 / 64},
        {"name": "z", "params": [ours[2]]},
    ]  # default weight decay from the argument
    opt = NesterovSGD(groups, lr=0.0, momentum=0.85, weight_decay=0.1, nesterov=True)
    ref_opt = torch.optim.SGD(
        [
            {"params": [ref[0]], "weight_decay": 0.5},
            {"params": [ref[1]], "weight_decay": 0.5 / 64},
            {"params": [ref[2]], "weight_decay": 0.1},
        ],
        lr=0.1,
        momentum=0.85,
        nesterov=True,
    )
    scales = [1.0, 64.0, 1.0]
    for step in range(6):
        lr = 0.002 * (step + 1)
        if step == 3:  # freeze group z mid-run, as the whitening bias is frozen
            opt.set_lr_scale("z", 0.0)
            scales[2] = 0.0
        grads = [torch.randn_like(p) for p in ours]
        for p, q, g in zip(ours, ref, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        opt.set_lr(lr)
        for group, scale in zip(ref_opt.param_groups, scales, strict=True):
            group["lr"] = lr * scale
        opt.step()
        ref_opt.step()
        for p, q in zip(ours, ref, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    frozen_at = ours[2].detach().clone()
    ours[2].grad = torch.randn(2)
    opt.step()
    assert torch.equal(ours[2], frozen_at), "a group at rate scale 0 must not move"


def test_a_parameter_in_two_groups_is_refused():
    p = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match="more than one group"):
        NesterovSGD([{"params": [p]}, {"params": [p]}], lr=0.1)


def test_recipe_groups_cover_every_trainable_parameter_once():
    for cfg in (tiny_fast(), from_preset("resnet9", widths=(8, 16, 32, 64))):
        model = make_network(cfg, NormActPool)
        groups = param_groups(model, cfg, per_rank_batch=100)
        ids = [id(p) for g in groups for p in g["params"]]
        assert len(ids) == len(set(ids))
        assert set(ids) == {id(p) for p in model.parameters()}
        by_name = {g["name"]: g for g in groups}
        shifts = {id(m.bias) for m in norm_layers(model)}
        assert {id(p) for p in by_name["bn_shifts"]["params"]} == shifts
        assert by_name["bn_shifts"]["lr_scale"] == cfg.bias_lr_scale
        # lr x weight decay, the decay per step, is the same in both groups
        assert (
            by_name["bn_shifts"]["weight_decay"] * cfg.bias_lr_scale
            == pytest.approx(by_name["weights"]["weight_decay"])
            == cfg.weight_decay * 100
        )
        assert by_name["whiten_bias"]["params"] == ([model.whiten.bias] if cfg.arch == "fastnet" else [])
    assert not make_network(tiny_fast(), NormActPool).whiten.weight.requires_grad  # frozen: in no group


# --- frozen batchnorm scales, higher bias lr ------------------------------------------------


def run_steps(cfg, model, n):
    opt = NesterovSGD(
        param_groups(model, cfg, 8), lr=0.0, momentum=cfg.momentum, weight_decay=cfg.weight_decay * 8, nesterov=True
    )
    torch.manual_seed(1)
    for _ in range(n):
        x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
        opt.set_lr(0.01)
        F.cross_entropy(model(x), y, reduction="sum").backward()
        opt.step()
        opt.zero_grad()
    return opt


def test_frozen_bn_scales_do_not_change_and_shifts_do():
    cfg = tiny_fast()
    model = make_network(cfg, NormActPool)
    norms = norm_layers(model)
    assert len(norms) == 6 and all(not m.weight.requires_grad for m in norms)
    before = [(m.weight.detach().clone(), m.bias.detach().clone()) for m in norms]
    run_steps(cfg, model, 3)
    for m, (w, b) in zip(norms, before, strict=True):
        assert torch.equal(m.weight, w) and torch.equal(m.weight, torch.ones_like(w))
        assert not torch.equal(m.bias, b)
    unfrozen = make_network(dataclasses.replace(cfg, bn_scale_frozen=False), NormActPool)
    assert all(m.weight.requires_grad for m in norm_layers(unfrozen))
    assert all(m.momentum == 0.4 for m in norm_layers(unfrozen))


def test_shifts_step_at_bias_lr_scale_times_the_rate():
    cfg = tiny_fast(momentum=0.0, weight_decay=0.0)
    model = make_network(cfg, NormActPool)
    shift = norm_layers(model)[0].bias
    weight = model.fc.weight
    opt = NesterovSGD(param_groups(model, cfg, 8), lr=0.01, momentum=0.0, nesterov=False)
    shift.grad, weight.grad = torch.ones_like(shift), torch.ones_like(weight)
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    s0, w0 = shift.detach().clone(), weight.detach().clone()
    opt.step()
    torch.testing.assert_close(s0 - shift, torch.full_like(s0, 0.01 * 64))
    torch.testing.assert_close(w0 - weight, torch.full_like(w0, 0.01))


def test_activation_reaches_every_fastnet_block():
    gelu, silu = (make_network(tiny_fast(activation=act), NormActPool) for act in ("gelu", "silu"))
    acts = {m.act for m in silu.modules() if isinstance(m, NormActPool)}
    assert silu.act == "silu" and acts == {"silu"}
    silu.load_state_dict(gelu.state_dict())
    x = torch.randn(2, 3, 32, 32)
    assert not torch.allclose(silu(x), gelu(x))  # the same weights, another nonlinearity
    with pytest.raises(ConfigError, match="--whiten-eps must be positive"):
        validate(tiny_fast(whiten_eps=0.0))
    with pytest.raises(ConfigError, match="--activation must be one of"):
        validate(tiny_fast(activation="tanh"))
    with pytest.raises(ConfigError, match="--activation applies to --arch fastnet only"):
        validate(from_preset("resnet9", activation="silu"))  # not a silent ReLU


# --- the published recipe, transcribed ------------------------------------------------------
# ``Airbench94`` below is this project's own plain-PyTorch transcription of that recipe's published
# description: its network (whitening 2x2 conv + GELU, three conv/pool/BN/GELU groups, 3x3 max
# pool, linear head x 1/9; batchnorm eps 1e-12, momentum 0.6 in its convention, scales frozen),
# torch.optim.SGD with its decoupled hyperparameters (lr 11.5 and weight decay 0.0153 per 1024,
# divided by 1024 x (1 + 1 / (1 - momentum)); BN biases at 64x the rate, not the decay), the
# triangular schedule 0.2 -> 1 at 23% -> 0.07 read at each step's index over ceil(9.9 x steps)
# steps, the whitening bias trained for 3 epochs, the lookahead from epoch 3 (every 5 steps, decay
# 0.95^5 x (step / total)^3, weights reset to the slow copy at every epoch end), and level-2 TTA.
#
# Both sides start from the same weights and see the same batches (fastcifar's loader, whose crop
# and alternating flip are tested elsewhere). Two choices are the test's, not the recipe's: the
# whitening statistics in float64 (the published code: float32; a precision choice), and the
# network's widths and the data (tiny, for 2 cores).


class Group(nn.Module):
    """conv 3x3 -> max-pool 2 -> BN -> GELU -> conv 3x3 -> BN -> GELU (airbench's conv group)."""

    def __init__(self, c_in, c_out):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.norm1 = nn.BatchNorm2d(c_out, eps=1e-12, momentum=1 - 0.6)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.norm2 = nn.BatchNorm2d(c_out, eps=1e-12, momentum=1 - 0.6)
        for norm in (self.norm1, self.norm2):
            norm.weight.requires_grad = False

    def forward(self, x):
        x = F.gelu(self.norm1(F.max_pool2d(self.conv1(x), 2)))
        return F.gelu(self.norm2(self.conv2(x)))


class Airbench94Net(nn.Module):
    def __init__(self, widths):
        super().__init__()
        self.whiten = nn.Conv2d(3, 24, 2, padding=0, bias=True)
        self.whiten.weight.requires_grad = False
        self.groups = nn.Sequential(Group(24, widths[0]), Group(widths[0], widths[1]), Group(widths[1], widths[2]))
        self.head = nn.Linear(widths[2], 10, bias=False)

    def forward(self, x):
        x = self.groups(F.gelu(self.whiten(x)))
        x = F.max_pool2d(x, 3).flatten(1)
        return self.head(x) / 9


def second_moment_whitening(images, eps=5e-4):
    """The whitening weights the recipe describes: eigenvectors of the uncentred second moment of
    all 2x2 patches, strongest first, each over sqrt(eigenvalue + eps), then negated copies."""
    c = images.shape[1]
    rows = images.double().unfold(2, 2, 1).unfold(3, 2, 1)  # N, C, 31, 31, 2, 2
    rows = rows.permute(0, 2, 3, 1, 4, 5).reshape(-1, c * 4)
    moment = rows.T @ rows / len(rows)
    values, vectors = torch.linalg.eigh(moment)
    values, vectors = values.flip(0), vectors.flip(1)
    scaled = vectors.T.reshape(-1, c, 2, 2) / torch.sqrt(values + eps).view(-1, 1, 1, 1)
    return torch.cat([scaled, -scaled])


def triangle(total, start=0.2, end=0.07, peak_at=0.23):
    """Rate multipliers of steps 0..total: linear through (0, start), (int(peak_at x total), 1), (total, end)."""
    top = int(peak_at * total)
    return [
        start + (1 - start) * i / top if i < top else 1 + (end - 1) * (i - top) / (total - top)
        for i in range(total + 1)
    ]


def tta2(net, x):
    mirror = lambda v: 0.5 * net(v) + 0.5 * net(v.flip(-1))  # noqa: E731
    padded = F.pad(x, (1,) * 4, mode="reflect")
    shifted = 0.5 * (mirror(padded[:, :, :32, :32]) + mirror(padded[:, :, 2:, 2:]))
    return 0.5 * mirror(x) + 0.5 * shifted


def airbench94(net, loader, epochs, seed, whiten_images, test_images, test_labels):
    """Train ``net`` by the recipe on ``loader``'s batches; per epoch: (train loss, TTA test loss, acc)."""
    batch = loader.batch_size
    momentum = 0.85
    kilostep = 1024 * (1 + 1 / (1 - momentum))
    lr, wd = 11.5 / kilostep, 0.0153 * batch / kilostep
    norm_biases = [p for n, p in net.named_parameters() if "norm" in n and p.requires_grad]
    others = [p for n, p in net.named_parameters() if "norm" not in n and p.requires_grad]
    opt = torch.optim.SGD(
        [
            {"params": norm_biases, "lr": lr * 64, "weight_decay": wd / (lr * 64)},
            {"params": others, "lr": lr, "weight_decay": wd / lr},
        ],
        momentum=momentum,
        nesterov=True,
    )
    total = math.ceil(len(loader) * epochs)
    multipliers = triangle(total)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: multipliers[i])
    with torch.no_grad():
        net.whiten.weight.copy_(second_moment_whitening(whiten_images))
    slow, step, history = None, 0, []

    def sync(decay):
        for s, f in zip(slow, [t for t in net.state_dict().values() if t.is_floating_point()], strict=True):
            s.lerp_(f, 1 - decay)
            f.copy_(s)

    for epoch in range(math.ceil(epochs)):
        net.whiten.bias.requires_grad = epoch < 3
        loader.set_epoch(seed, epoch)
        net.train()
        loss_sum, seen = 0.0, 0
        for x, y in loader:
            loss = F.cross_entropy(net(x), y, label_smoothing=0.2, reduction="none").sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            schedule.step()
            loss_sum, seen, step = loss_sum + loss.item(), seen + len(y), step + 1
            if epoch >= 3 and step % 5 == 0:
                with torch.no_grad():
                    if slow is None:
                        slow = [t.clone() for t in net.state_dict().values() if t.is_floating_point()]
                    else:
                        sync(0.95**5 * (step / total) ** 3)
            if step >= total:
                break
        if slow is not None:
            with torch.no_grad():
                sync(1.0)
        net.eval()
        with torch.no_grad():
            logits = tta2(net, test_images)
        history.append(
            (
                loss_sum / seen,
                F.cross_entropy(logits, test_labels).item(),
                100.0 * (logits.argmax(1) == test_labels).float().mean().item(),
            )
        )
    return history


def test_fast_preset_states_the_published_facts():
    fast = from_preset("fast")
    assert (
        fast.bn_eps,
        fast.whiten_centred,
        fast.lr_at,
        fast.epochs,
        fast.lookahead_start_epoch,
        fast.lookahead_epoch_end,
        fast.tta,
    ) == (1e-12, False, "start", 9.9, 3, "reset", 2)
    kilostep = 1024 * (1 + 1 / 0.15)
    assert fast.lr / 512 == pytest.approx(11.5 / kilostep, rel=1e-12)  # per image of summed loss
    assert fast.weight_decay * 1024 * fast.lr / 512 == pytest.approx(0.0153 * 1024 / kilostep, rel=1e-12)
    # at full size: 48 steps of 1024 per epoch, 476 in all, the warm-up 109 steps, the last epoch 44
    lengths = epoch_lengths(fast.epochs, 48)
    assert sum(lengths) == 476 and lengths == [48] * 9 + [44]
    rates = lr_schedule(fast, 48, peak=1.0)
    want = triangle(476)[:476]
    assert rates[0] == pytest.approx(0.2) and rates[109] == pytest.approx(1.0)
    np.testing.assert_allclose(rates, want, rtol=1e-12)
    # each former departure is still one field away
    old = from_preset("fast-departures")
    assert (
        old.bn_eps,
        old.whiten_centred,
        old.lr_at,
        old.epochs,
        old.lookahead_start_epoch,
        old.lookahead_epoch_end,
    ) == (1e-5, True, "end", 10, 0, "fold")
    validate(old)
    assert parse_args(["--epochs", "9.9"]).epochs == 9.9 and parse_args(["--epochs", "10"]).epochs == 10


def test_whitening_is_the_eigendecomposition_of_the_uncentred_second_moment():
    torch.manual_seed(0)
    images = torch.randn(20, 3, 32, 32) * 0.5 + 0.3  # a mean far from 0: centring would matter
    want = second_moment_whitening(images)
    conv = nn.Conv2d(3, 24, 2)
    init_whitening(conv, images)
    torch.testing.assert_close(conv.weight, want.float(), rtol=1e-5, atol=1e-5)
    centred = nn.Conv2d(3, 24, 2)
    init_whitening(centred, images, centred=True)
    assert (centred.weight - want.float()).abs().max() > 0.1, "the centred option differs on off-centre data"


@pytest.mark.slow  # trains the fast preset against the published recipe step by step
def test_fast_training_equals_the_published_recipe(tmp_path, learnable_data):
    """The whole trainer (warm-up and restore, whitening, bias freeze, schedule, lookahead from
    epoch 3 with its epoch-end resets, a fractional last epoch, TTA evaluation) on the `fast`
    preset vs the transcription: per-epoch train loss, TTA test loss and accuracy.

    4.5 epochs of 8 steps (36): every piece acts, the epoch-end resets included (8 is no
    multiple of 5, so each reset drops steps), and fp32 rounding is not yet amplified: the two
    sides differed by at most 1.1e-7 (relative) per epoch. The tiny net is chaotic (at 10 steps
    per epoch, scaling the initial weights by 1 + 1e-7 moved the test loss by up to 2.5e-3), so
    the tolerance is 1e-4; each former departure alone, run through the trainer, moved the test
    loss by 6.0e-4 (eps 1e-5) to 0.17 (lookahead from the start), and a rate 1% high by 1.9e-3
    (all measured on this CPU, torch 2.14.1, 2026-11-22).
    """
    widths, batch, seed, epochs = (8, 16, 16), 125, 0, 4.5
    cfg = from_preset(
        "fast",
        data=str(learnable_data),
        widths=widths,
        batch_size=batch,
        device="cpu",
        loader="torch",
        kernels="torch",
        precision="fp32",
        cuda_graphs="off",
        epochs=epochs,
        warmup_epochs=0.23 * epochs,
        eval_batch_size=200,
        warmup_steps=2,
        out_dir=str(tmp_path / "runs"),
        seed=seed,
    )
    validate(cfg)
    ours = trainer.train(cfg, CPU)[0].epochs

    data = load_dataset(str(learnable_data), log=lambda _: None)
    steps = len(data.train_labels) // batch
    loader = TorchLoader(
        data.train_images,
        data.train_labels,
        shard_indices(len(data.train_labels), 0, 1),
        batch,
        steps,
        augment=AugmentSpec(crop_pad=2, pad_mode="reflect", cutout=0, flip=True, flip_mode="alternate"),
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    test = EvalSet(data.test_images, data.test_labels, 10**6, dtype=torch.float32, device=torch.device("cpu"))
    torch.manual_seed(Streams.derived(seed).init)  # the trainer's initial weights (its init stream), copied over
    start = make_network(cfg, NormActPool)
    ref = Airbench94Net(widths)
    theirs_state = ref.state_dict()
    assert len(theirs_state) == len(start.state_dict())
    for (name, mine), (their_name, t) in zip(start.state_dict().items(), theirs_state.items(), strict=True):
        assert mine.shape == t.shape, (name, their_name)
        t.copy_(mine)
    history = airbench94(ref, loader, epochs, seed, loader.plain_images(5000), test.images, test.labels)

    assert len(ours) == len(history) == 5
    for epoch, (record, (train_loss, test_loss, test_acc)) in enumerate(zip(ours, history, strict=True), 1):
        assert record.train_loss == pytest.approx(train_loss, rel=1e-4), f"epoch {epoch} train loss"
        assert record.test_loss == pytest.approx(test_loss, rel=1e-4), f"epoch {epoch} TTA test loss"
        assert record.test_acc == pytest.approx(test_acc, abs=0.26), f"epoch {epoch} TTA accuracy (1 of 400)"
    assert history[-1][2] > 50, "the recipe learns the synthetic classes (10% is chance)"
