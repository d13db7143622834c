"""NesterovSGD against torch.optim.SGD, the Optimizer contract every optimizer keeps, the
--optimizer table, and the learning-rate schedule."""

import dataclasses
import inspect
from typing import Protocol

import pytest
import torch

from fastcifar.core.config import CHOICES, from_preset
from fastcifar.models.network import make_network
from fastcifar.ops.norm_act_pool import NormActPool
from fastcifar.run import recipe
from fastcifar.run.optim import Maskable, MuonSGD, NesterovSGD, Optimizer
from fastcifar.run.schedule import warmup_decay_lr
from fastcifar.run.sparse import fisher
from fastcifar.run.sparse.update import MaskedOptimizer


@pytest.mark.parametrize("nesterov, wd", [(True, 5e-4 * 512), (False, 0.0), (True, 0.0)])
def test_matches_torch_sgd(nesterov, wd):
    torch.manual_seed(0)
    ours = [torch.randn(4, 3, requires_grad=True), torch.randn(5, requires_grad=True)]
    ref = [p.detach().clone().requires_grad_() for p in ours]
    opt = NesterovSGD(ours, lr=0.0, momentum=0.9, weight_decay=wd, nesterov=nesterov)
    ref_opt = torch.optim.SGD(ref, lr=0.1, momentum=0.9, weight_decay=wd, nesterov=nesterov)
    for step in range(5):
        lr = 0.01 * (step + 1)
        grads = [torch.randn_like(p) for p in ours]
        for p, q, g in zip(ours, ref, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        opt.set_lr(lr)
        for group in ref_opt.param_groups:
            group["lr"] = lr
        opt.step()
        ref_opt.step()
        for p, q in zip(ours, ref, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_mixed_dtypes_are_grouped_and_grads_zeroed_in_place():
    a = torch.zeros(3, dtype=torch.float16, requires_grad=True)
    b = torch.zeros(3, dtype=torch.float32, requires_grad=True)
    opt = NesterovSGD([a, b], lr=1.0, momentum=0.0, nesterov=False)
    assert len(opt.groups) == 2
    a.grad = torch.ones(3, dtype=torch.float16)
    b.grad = torch.ones(3)
    grad_storage = a.grad.data_ptr()
    opt.step()
    assert torch.equal(a, -torch.ones(3, dtype=torch.float16)) and torch.equal(b, -torch.ones(3))
    opt.zero_grad()
    assert a.grad.data_ptr() == grad_storage and not a.grad.any()


def test_step_without_gradient_is_an_error():
    p = torch.zeros(2, requires_grad=True)
    with pytest.raises(RuntimeError, match="no gradient"):
        NesterovSGD([p], lr=0.1).step()


def test_schedule_shape():
    lr = lambda t: warmup_decay_lr(t, epochs=24, warmup_epochs=5, peak=0.4)  # noqa: E731
    assert lr(0) == 0.0
    assert lr(2.5) == pytest.approx(0.2)
    assert lr(5) == pytest.approx(0.4)
    assert lr(14.5) == pytest.approx(0.2)
    assert lr(24) == 0.0
    assert warmup_decay_lr(0.0, epochs=10, warmup_epochs=0, peak=1.0) == 1.0


# --- the Optimizer contract ------------------------------------------------------------------


def protocol_members(protocol) -> dict[str, object]:
    """Each member a protocol (and the protocols it extends) names: its stub, or None for data."""
    found = {}
    for cls in reversed(protocol.__mro__):
        if cls is Protocol or not getattr(cls, "_is_protocol", False):
            continue
        found |= dict.fromkeys(vars(cls).get("__annotations__", {}))
        found |= {name: f for name, f in vars(cls).items() if inspect.isfunction(f) and not name.startswith("_")}
    return found


def unkept(opt, protocol) -> list[str]:
    """The members ``opt`` lacks or only inherits as the protocol's empty stub, or whose parameters
    differ from the protocol's."""
    bad = []
    for name, stub in protocol_members(protocol).items():
        if not hasattr(opt, name):
            bad.append(name)
        elif stub is not None:
            own = inspect.getattr_static(type(opt), name)
            if own is stub or list(inspect.signature(own).parameters) != list(inspect.signature(stub).parameters):
                bad.append(name)
    return bad


def built(name: str):
    """The --optimizer ``name`` of the table, over a small FastNet."""
    cfg = from_preset("fast", widths=(8, 16, 16), optimizer=name)
    return recipe.make_optimizer(make_network(cfg, NormActPool), cfg, 8, peak=0.01)


def test_the_optimizer_table_covers_every_choice():
    assert set(recipe.OPTIMIZERS) == set(CHOICES["optimizer"])
    assert type(built("sgd")) is NesterovSGD and type(built("muon")) is MuonSGD


@pytest.mark.parametrize("name", CHOICES["optimizer"])
def test_every_optimizer_of_the_table_keeps_the_contract(name):
    opt = built(name)
    assert isinstance(opt, Optimizer) and unkept(opt, Optimizer) == []
    assert isinstance(opt.lr, torch.Tensor) and opt.lr.dim() == 0 and opt.lr.dtype == torch.float32
    assert protocol_members(Optimizer).keys() == {
        "lr",
        "set_lr",
        "set_lr_scale",
        "step",
        "zero_grad",
        "reset_state",
        "state_dict",
        "load_state_dict",
    }


def test_sgd_is_maskable_and_the_masked_optimizer_keeps_the_contract():
    cfg = from_preset("resnet9", widths=(4, 8, 8, 8))
    model = make_network(cfg, NormActPool)
    sgd = NesterovSGD(recipe.param_groups(model, cfg, 8), lr=0.05)
    assert isinstance(sgd, Maskable) and unkept(sgd, Maskable) == []
    masked = MaskedOptimizer(sgd, fisher.trainable(model))
    assert isinstance(masked, Optimizer) and unkept(masked, Optimizer) == []
    assert masked.lr is sgd.lr  # the schedule's writes reach the wrapped optimizer
    masked.set_lr_scale("bn_shifts", 0.5)
    assert sgd.lr_scales["bn_shifts"].item() == 0.5 and masked.state_dict()["lr_scales"]["bn_shifts"] == 0.5


def test_a_member_removed_breaks_the_contract(monkeypatch):
    """The check above fails for an optimizer that loses a method (it would inherit the
    protocol's empty stub), or whose method takes other arguments."""
    monkeypatch.delattr(NesterovSGD, "set_lr_scale")
    assert unkept(built("sgd"), Optimizer) == ["set_lr_scale"]
    monkeypatch.undo()
    monkeypatch.setattr(MuonSGD, "reset_state", lambda self, hard: None)
    assert unkept(built("muon"), Optimizer) == ["reset_state"]
    monkeypatch.undo()
    monkeypatch.delattr(NesterovSGD, "take_weight_decay")
    sgd = built("sgd")
    assert unkept(sgd, Optimizer) == [] and unkept(sgd, Maskable) == ["take_weight_decay"]


def test_make_optimizer_picks_from_the_table(monkeypatch):
    """A new optimizer is one entry: make_optimizer hands it param_groups' groups."""
    seen = []
    monkeypatch.setitem(recipe.OPTIMIZERS, "toy", lambda groups, cfg, peak, ctx: seen.append(groups) or "toy")
    cfg = dataclasses.replace(from_preset("fast", widths=(8, 16, 16)), optimizer="toy")
    model = make_network(cfg, NormActPool)
    assert recipe.make_optimizer(model, cfg, 8, peak=0.01) == "toy"
    assert [g["name"] for g in seen[0]] == ["weights", "head", "bn_shifts", "whiten_bias"]
