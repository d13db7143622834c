"""The whitening conv's component (run.whitening): which networks get it, the data-dependent init at
epoch 0, the bias freeze (and the captured step without the conv's backward), its warm-up work."""

import copy
import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastcifar.core.config import Config, from_preset
from fastcifar.data.loader import TorchLoader
from fastcifar.models.fastnet import init_whitening
from fastcifar.models.network import WhiteningNetwork, keeps, make_network
from fastcifar.ops.augment import AugmentSpec, normalize
from fastcifar.ops.norm_act_pool import NormActPool
from fastcifar.parallel.distributed import DistContext
from fastcifar.run import whitening
from fastcifar.run.optim import NesterovSGD
from fastcifar.run.recipe import param_groups
from fastcifar.run.whitening import Whitening, WhiteningWindow

CPU = DistContext(0, 1, 0, torch.device("cpu"), None)


def tiny_fast(**overrides) -> Config:
    return from_preset("fast", widths=(8, 16, 16), **overrides)


@pytest.mark.parametrize("arch", ["fastnet", "resnet9", "alexnet"])
def test_a_run_gets_the_component_when_its_network_has_a_whitening_conv(arch):
    """By the contract (a ``whiten`` conv), not by the class: FastNet's run gets one, the others none,
    and a network that drops its conv loses it."""
    cfg = tiny_fast() if arch == "fastnet" else from_preset(arch)
    model = make_network(cfg, NormActPool)
    opt = NesterovSGD(param_groups(model, cfg, 8), lr=0.0)
    parts = whitening.for_model(cfg, model, opt, None, CPU)
    assert [type(p) for p in parts] == ([Whitening] if arch == "fastnet" else [])
    assert keeps(model, WhiteningNetwork) is (arch == "fastnet")
    if arch == "fastnet":
        del model.whiten
        assert not keeps(model, WhiteningNetwork) and whitening.for_model(cfg, model, opt, None, CPU) == []


def train_epochs(cfg, model, n, start_epoch=0):
    """One step an epoch, the whitening component told of each epoch's start (no data init)."""
    opt = NesterovSGD(
        param_groups(model, cfg, 8), lr=0.0, momentum=cfg.momentum, weight_decay=cfg.weight_decay * 8, nesterov=True
    )
    hooks = Whitening(dataclasses.replace(cfg, whiten_images=0), model, opt, None, CPU)
    torch.manual_seed(1)
    for epoch in range(start_epoch, start_epoch + n):
        hooks.epoch_start(epoch)
        x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
        opt.set_lr(0.01)
        F.cross_entropy(model(x), y, reduction="sum").backward()
        opt.step()
        opt.zero_grad()
    return opt


def test_whitening_bias_trains_then_freezes():
    cfg = tiny_fast(whiten_bias_epochs=2)
    model = make_network(cfg, NormActPool)
    bias = model.whiten.bias
    opt = train_epochs(cfg, model, 2)
    trained = bias.detach().clone()
    assert trained.abs().sum() > 0, "the bias trains in the first whiten_bias_epochs epochs"
    train_epochs(cfg, model, 2, start_epoch=2)  # a fresh optimizer: the freeze comes at epoch 2
    assert torch.equal(bias, trained)
    assert opt.lr_scales["whiten_bias"].item() == 1.0


class RecordingStep:
    def __init__(self):
        self.selected = []

    def select(self, variant):
        self.selected.append(variant)


@pytest.mark.parametrize("world_size, comm, stops", [(1, "ddp", True), (2, "bucketed", True), (2, "ddp", False)])
def test_bias_freeze_ends_backward_at_the_whitening_conv_except_under_ddp(world_size, comm, stops):
    """At the freeze the bias stops requiring grad and the step switches to its captured variant,
    once (a later epoch start, as after a resume, changes nothing); DDP keeps the gradient, since
    it fails a step where a parameter gets none."""
    cfg = tiny_fast(whiten_bias_epochs=2, whiten_images=0, lookahead_steps=0, comm=comm)
    model = make_network(cfg, NormActPool)
    opt = NesterovSGD(param_groups(model, cfg, 8), lr=0.0)
    ctx = DistContext(0, world_size, 0, torch.device("cpu"), "gloo" if world_size > 1 else None)
    step = RecordingStep()
    hooks = Whitening(cfg, model, opt, None, ctx, step)
    hooks.epoch_start(1)
    assert model.whiten.bias.requires_grad and not step.selected
    hooks.epoch_start(2)
    hooks.epoch_start(3)
    assert opt.lr_scales["whiten_bias"].item() == 0.0
    assert model.whiten.bias.requires_grad is not stops
    assert step.selected == ([Whitening.BIAS_FROZEN] if stops else [])


def test_warm_up_captures_the_frozen_step_with_the_bias_out_of_backward(monkeypatch):
    """The variant is captured with the bias not requiring grad (else its graph would hold the
    full backward and the freeze would save nothing), the default graph stays selected, and the
    bias requires grad again after the warm-up; with --sparse-mask no variant is captured. On the
    CPU the warm-up whitens no scratch images (that loads CUDA's solver; the CPU has none to load)."""
    import fastcifar.run.graphs as graphs
    import fastcifar.run.whitening as whitening
    from fastcifar.run.graphs import StaticBatch, TrainStep

    cfg = tiny_fast(whiten_bias_epochs=2, whiten_images=16, lookahead_steps=0)
    model = make_network(cfg, NormActPool)
    opt = NesterovSGD(param_groups(model, cfg, 8), lr=0.0)
    seen = []
    monkeypatch.setattr(
        graphs, "capture", lambda body, iters, stream=None: seen.append(model.whiten.bias.requires_grad) or object()
    )
    step = TrainStep(lambda x, y: None, StaticBatch(2, torch.float32, torch.device("cpu")), capture=True)
    step.warm_up_and_capture(2)
    default = step.graph
    whitened = []
    monkeypatch.setattr(whitening, "init_whitening", lambda *args, **kwargs: whitened.append(args))
    hooks = Whitening(cfg, model, opt, None, CPU, step)
    hooks.warm_up(2)
    assert not whitened, "a scratch whitening on the CPU"
    assert seen == [True, False] and set(step.graphs) == {TrainStep.DEFAULT, Whitening.BIAS_FROZEN}
    assert model.whiten.bias.requires_grad and step.graph is default
    sparse = Whitening(dataclasses.replace(cfg, sparse_mask="fisher"), model, opt, None, CPU, step)
    assert not sparse.stops_backward
    sparse.freeze_bias()
    assert model.whiten.bias.requires_grad and step.variant == TrainStep.DEFAULT


def test_resume_past_the_freeze_freezes_at_its_first_epoch():
    cfg = tiny_fast(whiten_bias_epochs=2, whiten_images=0, lookahead_steps=0)
    model = make_network(cfg, NormActPool)
    opt = NesterovSGD(param_groups(model, cfg, 8), lr=0.0)
    step = RecordingStep()
    Whitening(cfg, model, opt, None, CPU, step).epoch_start(5)
    assert not model.whiten.bias.requires_grad and step.selected == [Whitening.BIAS_FROZEN]


@pytest.mark.slow  # trains the default network both ways
def test_ending_backward_at_the_whitening_conv_changes_no_weight(learnable_data, tmp_path, monkeypatch):
    """The run with the whitening conv out of backward after the freeze ends with the same bits in
    every weight and statistic as one that still backpropagates into it (the frozen bias took no
    step either way); momentum of the frozen bias aside, nothing else may differ."""
    import fastcifar

    cfg = from_preset(
        "fast",
        data=str(learnable_data),
        device="cpu",
        widths=(8, 16, 16),
        batch_size=100,
        epochs=3,
        warmup_epochs=1,
        warmup_steps=1,
        eval_batch_size=200,
        whiten_images=200,
        whiten_bias_epochs=1,
        quiet=True,
        out_dir=str(tmp_path / "runs"),
    )
    frozen = []
    freeze = Whitening.freeze_bias
    monkeypatch.setattr(
        Whitening, "freeze_bias", lambda self: freeze(self) or frozen.append(self.model.whiten.bias.requires_grad)
    )
    (cut,) = fastcifar.train(cfg)
    assert frozen == [False], "the freeze did not take the bias out of backward"
    assert cut.model.whiten.bias.requires_grad, "run.model must come back as the model file loads: bias trainable"
    monkeypatch.setattr(Whitening, "stops_backward", property(lambda self: False))
    (full,) = fastcifar.train(cfg)
    assert frozen == [False, True]
    for (name, a), b in zip(full.model.state_dict().items(), cut.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert cut.test_acc == full.test_acc


@pytest.mark.parametrize("eps", [5e-4, 0.5])
def test_whitening_init_runs_at_epoch_zero_from_the_loader(eps):
    cfg = tiny_fast(whiten_images=30, lookahead_steps=0, whiten_eps=eps)
    model = make_network(cfg, NormActPool)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (40, 32, 32, 3), dtype=np.uint8)
    loader = TorchLoader(
        images,
        np.zeros(40, np.int64),
        np.arange(40),
        10,
        4,
        augment=AugmentSpec(crop_pad=2, pad_mode="reflect", cutout=0, flip=True),
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    plain = loader.plain_images(30)
    assert plain.shape == (30, 3, 32, 32)
    torch.testing.assert_close(plain, normalize(torch.from_numpy(images[:30])))
    opt = NesterovSGD(param_groups(model, cfg, 10), lr=0.0)
    before = model.whiten.weight.detach().clone()
    Whitening(cfg, model, opt, loader, CPU).epoch_start(0)
    assert not torch.equal(model.whiten.weight, before)
    expected = init_whitening(copy.deepcopy(model.whiten), plain, eps=eps)  # --whiten-eps reaches the init
    torch.testing.assert_close(model.whiten.weight, expected.to(model.whiten.weight.dtype), rtol=0, atol=0)
    w = model.whiten.weight.detach().double()
    out = F.conv2d(plain.double(), w)[:, :12].permute(0, 2, 3, 1).reshape(-1, 12)
    assert torch.cov(out.T).diag().max() < 1.0 + 1e-3  # whitened: unit variance at most (eps shrinks)


@pytest.mark.parametrize("epochs, steps, window", [(0.19, 25, 5), (0.2, 25, 5), (0.5, 7, 4), (1.5, 10, 15), (0, 10, 0)])
def test_a_fractional_bias_window_freezes_after_its_steps(epochs, steps, window):
    """ceil(epochs x steps) steps train the bias (the record script's count; 0.2 x 25 is 5 in floats
    after rounding, not 6), then the freeze, mid-epoch: the rate goes to 0 and the step switches
    once; the step index crosses epochs (1.5 x 10: frozen after step 15, the 6th of epoch 1)."""
    cfg = tiny_fast(whiten_bias_epochs=epochs, whiten_images=0, lookahead_steps=0)
    model = make_network(cfg, NormActPool)
    opt = NesterovSGD(param_groups(model, cfg, 8), lr=0.0)
    step = RecordingStep()
    hooks = WhiteningWindow(cfg, model, opt, None, CPU, step, steps_per_epoch=steps)
    assert hooks.window_steps == window == whitening.bias_window_steps(epochs, steps)
    trained = 0  # steps run with the bias trainable
    for epoch in range(3):
        hooks.epoch_start(epoch)
        for _ in range(steps):
            trained += opt.lr_scales["whiten_bias"].item() > 0
            assert hooks.bias_frozen is (trained < epoch * steps + _ + 1), "frozen exactly when the window ends"
            hooks.after_step()
    assert trained == window
    assert step.selected == [Whitening.BIAS_FROZEN] and not model.whiten.bias.requires_grad


def test_the_decayed_bias_rate_falls_linearly_to_zero_over_the_window():
    """1 - step / window before each step of the window (the record's linear decay), 0 after; a
    resume at an epoch inside the window starts at that epoch's value."""
    cfg = tiny_fast(whiten_bias_epochs=2, whiten_bias_decay=True, whiten_images=0, lookahead_steps=0)
    model = make_network(cfg, NormActPool)
    opt = NesterovSGD(param_groups(model, cfg, 8), lr=0.0)
    hooks = WhiteningWindow(cfg, model, opt, None, CPU, RecordingStep(), steps_per_epoch=4)
    seen = []
    for epoch in range(3):
        hooks.epoch_start(epoch)
        for _ in range(4):
            seen.append(opt.lr_scales["whiten_bias"].item())
            hooks.after_step()
    assert seen == pytest.approx([1 - i / 8 for i in range(8)] + [0.0] * 4, abs=1e-7)
    resumed = WhiteningWindow(cfg, model, opt := NesterovSGD(param_groups(model, cfg, 8), lr=0.0), None, CPU, None, 4)
    resumed.epoch_start(1)
    assert opt.lr_scales["whiten_bias"].item() == pytest.approx(0.5) and not resumed.bias_frozen


@pytest.mark.parametrize(
    "epochs, decay, kind",
    [(3, False, Whitening), (0, False, Whitening), (0.2, False, WhiteningWindow), (3, True, WhiteningWindow)],
)
def test_only_a_mid_epoch_or_decayed_window_counts_steps(epochs, decay, kind):
    """A whole-epoch window without decay keeps the epoch-start freeze (no per-step hook, the same
    run bit for bit); the others get the step-counting component."""
    cfg = tiny_fast(whiten_bias_epochs=epochs, whiten_bias_decay=decay)
    model = make_network(cfg, NormActPool)
    opt = NesterovSGD(param_groups(model, cfg, 8), lr=0.0)
    loader = [None] * 25  # only its length is read
    (part,) = whitening.for_model(cfg, model, opt, loader, CPU)
    assert type(part) is kind
