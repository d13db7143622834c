"""fastcifar.run.optim: NesterovSGD against torch.optim.SGD, the Optimizer contract every optimizer
keeps, the --optimizer table; orthogonalized momentum (`fast-muon`): Newton-Schulz against an SVD
reference, the Muon step against a plain reference, a short CPU run that learns, and 2 ranks equal
to 1 (gloo)."""

from __future__ import annotations

import dataclasses
import inspect
import textwrap
from typing import Protocol

import pytest
import torch
from cli import run_train, torchrun

from fastcifar import train as trainer
from fastcifar.core.config import CHOICES, ConfigError, from_preset, validate
from fastcifar.core.presets import DEFAULT_PRESET, PRESETS
from fastcifar.models.network import make_network
from fastcifar.ops.norm_act_pool import NormActPool
from fastcifar.parallel.distributed import DistContext
from fastcifar.run import graphs, recipe
from fastcifar.run.optim import (
    NEWTON_SCHULZ,
    NS_COEFFICIENTS,
    Maskable,
    Muon,
    MuonSGD,
    NesterovSGD,
    Optimizer,
    PaddedStack,
    newton_schulz,
)
from fastcifar.run.recipe import conv_filters, make_optimizer, param_groups
from fastcifar.run.schedule import DeviceSchedule
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


CPU = DistContext(0, 1, 0, torch.device("cpu"), None)


def quintic_on_singular_values(g: torch.Tensor, steps: int) -> torch.Tensor:
    """The reference: g = U S V^T, then U p(S / |g|_F) V^T with p the quintic iterated ``steps`` times."""
    u, s, vh = torch.linalg.svd(g.double(), full_matrices=False)
    x = s / g.double().norm()
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        x = a * x + b * x**3 + c * x**5
    return (u * x) @ vh


@pytest.mark.parametrize("shape", [(16, 72), (72, 16), (32, 216), (64, 576)])  # filter-like: out x in*3*3
def test_newton_schulz_is_the_quintic_on_the_singular_values(shape):
    torch.manual_seed(0)
    g = torch.randn(*shape)
    for steps in (3, 5):
        out = newton_schulz(g, steps)
        assert out.shape == g.shape and out.dtype == g.dtype
        torch.testing.assert_close(out.double(), quintic_on_singular_values(g, steps), rtol=0, atol=2e-5)
        s = torch.linalg.svdvals(out)
        # the band: every direction lifted near 1, not exactly 1 (measured 0.68-1.21 on these shapes)
        assert 0.6 < s.min() and s.max() < 1.25, (steps, s.min().item(), s.max().item())
    # the same singular vectors as g: U^T out V is diagonal
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    inner = u.T @ newton_schulz(g, 3) @ vh.T
    off = inner - torch.diag(torch.diagonal(inner))
    assert off.abs().max() < 1e-4


def test_newton_schulz_ill_conditioned_and_low_precision():
    torch.manual_seed(1)
    u, _, vh = torch.linalg.svd(torch.randn(32, 64), full_matrices=False)
    g = u @ torch.diag(torch.logspace(0, -2, 32)) @ vh  # condition number 100
    s = torch.linalg.svdvals(newton_schulz(g, 5))
    assert 0.6 < s.min() and s.max() < 1.25
    assert torch.linalg.svdvals(newton_schulz(g, 3)).min() < 0.5, "3 steps leave the weakest directions short"
    half = newton_schulz(g, 5, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), newton_schulz(g, 5), rtol=0, atol=0.05)


def written_out(g: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """The iteration as the public Muon writes it, one matrix, every scalar term its own operation."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    x = x / (x.norm() + 1e-7)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.T if tall else x


def test_newton_schulz_of_a_stack_is_each_matrix_alone():
    """A stack of matrices (Muon's filters of one shape) gives each matrix's own result, and the
    fused iteration (scalar terms inside the products) is the written-out one: to fp32 rounding in
    fp32, to bf16's in bf16 (where it rounds less often)."""
    torch.manual_seed(2)
    for shape in ((3, 16, 72), (2, 40, 12)):  # wide and tall
        g = torch.randn(*shape) * torch.tensor([1.0, 30.0, 0.01][: shape[0]]).view(-1, 1, 1)  # norms far apart
        out = newton_schulz(g, 3)
        assert out.shape == g.shape and out.dtype == g.dtype
        for k in range(shape[0]):
            torch.testing.assert_close(out[k], newton_schulz(g[k], 3), rtol=0, atol=1e-6)
            torch.testing.assert_close(out[k], written_out(g[k], 3, torch.float32), rtol=0, atol=1e-5)
        half = newton_schulz(g, 3, dtype=torch.bfloat16)
        assert half.dtype == torch.bfloat16
        for k in range(shape[0]):
            ref = written_out(g[k], 3, torch.bfloat16).float()
            torch.testing.assert_close(half[k].float(), ref, rtol=0, atol=0.03)
            # closer to the fp32 result than the written-out bf16 is, or about as close
            err_fused = (half[k].float() - out[k]).abs().max()
            assert err_fused <= 1.5 * (ref - out[k]).abs().max() + 1e-3


def test_muon_orthogonalizes_filters_of_one_shape_as_one_stack(monkeypatch):
    """Filters of one flattened shape go through one Newton-Schulz call (the default's three
    256 x 2304 filters: one set of kernels), and each filter's result is its own."""
    from fastcifar.run import optim

    calls = []
    plain = optim.newton_schulz
    monkeypatch.setattr(optim, "newton_schulz", lambda g, *a, **k: calls.append(tuple(g.shape)) or plain(g, *a, **k))
    torch.manual_seed(3)
    shapes = [(8, 3, 3, 3), (16, 8, 3, 3), (16, 16, 3, 3), (16, 8, 3, 3), (16, 16, 3, 3), (16, 16, 3, 3), (6, 40)]
    updates = [torch.randn(s) for s in shapes]
    muon = Muon([torch.zeros(s, requires_grad=True) for s in shapes], torch.tensor(0.1), 1.0)
    out = muon._orthogonalize(updates)
    assert sorted(calls) == sorted([(1, 8, 27), (2, 16, 72), (3, 16, 144), (1, 6, 40)])
    for u, o in zip(updates, out, strict=True):
        torch.testing.assert_close(o, plain(u.reshape(len(u), -1), 3), rtol=0, atol=1e-6)


def test_zero_padding_is_exact_for_newton_schulz():
    """A matrix in the corner of a zero-padded slot comes out as it does alone (float64: no rounding
    to hide behind), a tall one taken on its shorter side as ``newton_schulz`` takes it alone, and
    the padding stays exactly 0: X X^T of [[A, 0], [0, 0]] is [[A A^T, 0], [0, 0]], and the
    Frobenius norm that scales each slot is its own matrix's (norms 1e-3 to 1e3 apart: one norm for
    the whole stack would leave the small one's singular values near 0)."""
    torch.manual_seed(4)
    shapes = [(5, 12), (9, 4), (16, 40), (16, 40), (3, 3)]
    scales = [1e-3, 1e3, 1.0, 30.0, 0.5]
    mats = [torch.randn(s, dtype=torch.float64) * k for s, k in zip(shapes, scales, strict=True)]
    stack = PaddedStack(shapes, torch.float64, torch.device("cpu"))
    filled = stack.fill(mats)
    assert filled.shape == (5, 16, 40) and stack.tall == [False, True, False, False, False]
    for steps in (3, 5):
        out = newton_schulz(filled, steps)
        blocks = stack.unpack(out)
        for m, o in zip(mats, blocks, strict=True):
            assert o.shape == m.shape
            torch.testing.assert_close(o, newton_schulz(m, steps), rtol=0, atol=1e-12)
        for k, s in enumerate(stack.slots):
            outside = out[k].clone()
            outside[: s.shape[0], : s.shape[1]] = 0
            assert torch.count_nonzero(outside) == 0, f"slot {k}: the padding took a value"


def preset_filter_shapes(name: str, widths=None) -> list[tuple[int, ...]]:
    cfg = from_preset(name, **({"widths": widths} if widths else {}))
    return [tuple(p.shape) for p in conv_filters(param_groups(make_network(cfg, NormActPool), cfg, 8))[1]]


# each dtype's bound on |stacked - loop| / max |loop| over a filter: a few units of its last place
# grown by three iterations (the quintic's slope reaches 3.4). Measured on the CPU: fp32 9e-7,
# fp16 3.4e-4 on the full shapes and 2.6e-3 on an 8 x 27 filter (sums of other lengths round
# differently), bf16 0 (its products accumulate in fp32, and the padding adds exact zeros)
ROUNDING = {torch.float32: 1e-5, torch.float16: 8e-3, torch.bfloat16: 8e-3}


def check_stacked_equals_loop(shapes, dtype, seed=5):
    torch.manual_seed(seed)
    params = [torch.zeros(s, requires_grad=True) for s in shapes]
    updates = [torch.randn(s) * 10 ** torch.empty(()).uniform_(-3, 3) for s in shapes]  # norms far apart
    loop = Muon(params, torch.tensor(0.1), 1.0, ns_dtype=dtype)._orthogonalize(updates)
    stacked = Muon(params, torch.tensor(0.1), 1.0, ns_dtype=dtype, layout="stacked")._orthogonalize(updates)
    for k, (a, b) in enumerate(zip(loop, stacked, strict=True)):
        assert b.dtype == a.dtype and b.shape == a.shape
        err = ((a.float() - b.float()).abs().max() / a.float().abs().max()).item()
        assert err <= ROUNDING[dtype], f"filter {k} {tuple(shapes[k])} {dtype}: stacked differs by {err:.2e} of its max"


@pytest.mark.parametrize("dtype", list(ROUNDING))
@pytest.mark.parametrize("name", ["resnet9", "alexnet", "fast", "fast-muon320", DEFAULT_PRESET])
def test_stacked_newton_schulz_equals_the_loop_on_each_presets_narrowed_shapes(name, dtype):
    """Every preset's filters (their shapes at an eighth of the widths: odd, tall and wide ones
    alike), in each precision the optimizer runs Newton-Schulz in: one padded stack gives each
    filter the loop's result to that precision's rounding."""
    widths = tuple(max(w // 8, 1) for w in from_preset(name).widths)
    check_stacked_equals_loop(preset_filter_shapes(name, widths), dtype)


def presets_by_filter_shapes() -> dict[tuple, list[str]]:
    """Each distinct list of full-width filter shapes among the presets, and the presets that have it
    (the check below depends on the shapes alone: five Muon presets share FastNet's)."""
    sharing: dict[tuple, list[str]] = {}
    for name in PRESETS:
        sharing.setdefault(tuple(preset_filter_shapes(name)), []).append(name)
    return sharing


@pytest.mark.slow  # full widths: 512 x 4608 stacks in fp16 and bf16 on the CPU take minutes
@pytest.mark.parametrize("dtype", list(ROUNDING))
@pytest.mark.parametrize("names", list(presets_by_filter_shapes().values()), ids=lambda names: "=".join(names))
def test_stacked_newton_schulz_equals_the_loop_on_each_presets_shapes(names, dtype):
    if dtype != torch.float32 and all(from_preset(name).optimizer != "muon" for name in names):
        pytest.skip("low precision only where a preset runs Muon (its GPU precision); fp32 covers the rest's shapes")
    check_stacked_equals_loop(preset_filter_shapes(names[0]), dtype)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype, ns_dtype, tol", [(torch.float32, None, 1e-5), (torch.float16, torch.bfloat16, 2e-3)])
def test_stacked_muon_steps_the_filters_as_the_loop_does(dtype, ns_dtype, tol, layout):
    """Three Muon steps (momentum, renormalized weights, a rate from the source tensor) leave every
    filter where the loop leaves it, to the precision's rounding: the stacked step's cast, scale and
    list subtraction are the loop's per-filter ones, in the trainer's channels-last filters too;
    filters of one dtype only."""
    torch.manual_seed(6)
    shapes = [(8, 3, 3, 3), (16, 8, 3, 3), (16, 16, 3, 3), (16, 16, 3, 3), (30, 2)]
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    start = [
        torch.randn(s).to(dtype).contiguous(memory_format=fmt if len(s) == 4 else torch.contiguous_format)
        for s in shapes
    ]
    rate = torch.tensor(0.3)
    opts = {}
    for layout in NEWTON_SCHULZ:
        params = [w.clone().requires_grad_() for w in start]
        opts[layout] = (params, Muon(params, rate, 0.5, ns_dtype=ns_dtype, layout=layout))
    for _ in range(3):
        grads = [torch.randn(s).to(dtype) for s in shapes]
        for params, muon in opts.values():
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            muon.step()
    for k, (a, b) in enumerate(zip(opts["loop"][0], opts["stacked"][0], strict=True)):
        assert not torch.equal(a, start[k]), "the filter took no step"
        torch.testing.assert_close(b.float(), a.float(), rtol=0, atol=tol, msg=f"filter {k} {shapes[k]}")
    mixed = [torch.zeros(4, 3, requires_grad=True), torch.zeros(4, 3, dtype=torch.float16, requires_grad=True)]
    with pytest.raises(ValueError, match="one dtype"):
        Muon(mixed, rate, 1.0, layout="stacked")


def test_stacked_muon_runs_one_newton_schulz_for_all_its_filters(monkeypatch):
    """--newton-schulz stacked: one call, on one padded stack of the rank's filters; sharded, rank r
    stacks filters r, r + world, ... alone and leaves the others to the all-reduce; the optimizer
    built from the config takes the layout."""
    from fastcifar.run import optim

    calls = []
    plain = optim.newton_schulz
    monkeypatch.setattr(optim, "newton_schulz", lambda g, *a, **k: calls.append(tuple(g.shape)) or plain(g, *a, **k))
    shapes = [(8, 3, 3, 3), (16, 8, 3, 3), (16, 16, 3, 3), (30, 2)]
    params = [torch.zeros(s, requires_grad=True) for s in shapes]
    muon = Muon(params, torch.tensor(0.1), 1.0, layout="stacked")
    muon._orthogonalize([torch.randn(s) for s in shapes])
    assert calls == [(4, 16, 144)]  # (30, 2) taken as 2 x 30
    calls.clear()
    shard = Muon(params, torch.tensor(0.1), 1.0, layout="stacked", shard=(1, 2), reduce=lambda flat: None)
    out = shard._orthogonalize([torch.randn(s) for s in shapes])
    assert calls == [(2, 16, 72)] and torch.count_nonzero(out[0]) == 0 and torch.count_nonzero(out[1]) > 0
    with pytest.raises(ValueError, match="layout"):
        Muon(params, torch.tensor(0.1), 1.0, layout="fused")
    cfg = tiny_muon(newton_schulz="stacked")
    opt = make_optimizer(make_network(cfg, NormActPool), cfg, 50, peak=0.053, ctx=CPU)
    assert opt.muon.stack is not None and tiny_muon().newton_schulz == "loop"
    assert make_optimizer(make_network(tiny_muon(), NormActPool), tiny_muon(), 50, 0.053, CPU).muon.stack is None


def tiny_muon(**overrides):
    return from_preset("fast-muon", widths=(8, 16, 16), **overrides)


def test_groups_give_the_filters_to_muon_and_the_rest_to_sgd():
    cfg = tiny_muon()
    model = make_network(cfg, NormActPool)
    rest, taken = conv_filters(param_groups(model, cfg, 100))
    groups = {g["name"]: g for g in rest}
    filters = [p for p in model.parameters() if p.dim() == 4 and p.requires_grad]
    assert len(filters) == 6 and [id(p) for p in taken] == [id(p) for p in filters]
    # every trainable tensor is a filter, a bias or the head (frozen ones the optimizer skips)
    assert not [p for p in groups["weights"]["params"] if p.requires_grad]
    assert groups["head"]["params"] == [model.fc.weight] and groups["head"]["lr_scale"] == pytest.approx(0.67 / 0.053)
    opt = make_optimizer(model, cfg, 2000, peak=0.053, ctx=CPU)
    assert isinstance(opt, MuonSGD) and opt.muon.lr_ratio == pytest.approx(0.24 / 0.053)
    assert [id(p) for p in opt.muon.params] == [id(p) for p in filters]
    assert opt.muon.ns_dtype == torch.float32  # the CPU; bfloat16 on CUDA
    assert model.fc.weight.std().item() == pytest.approx(1.0, rel=1e-5) and model.logit_scale == 1 / 256
    assert (
        make_optimizer(make_network(from_preset("fast"), NormActPool), from_preset("fast"), 10, 0.1).__class__.__name__
        == "NesterovSGD"
    )


def test_muon_sgd_step_equals_a_plain_reference():
    """MuonSGD over 4 steps with a changing rate and a group frozen mid-way, against torch SGD on
    the non-filter groups and the published Muon update written out per filter."""
    torch.manual_seed(0)
    cfg = tiny_muon()
    model = make_network(cfg, NormActPool)
    ref = make_network(cfg, NormActPool)
    ref.load_state_dict(model.state_dict())
    per_rank, peak = 50, 0.053
    opt = make_optimizer(model, cfg, per_rank, peak)
    groups, filters = conv_filters(param_groups(ref, cfg, per_rank))
    groups = [g for g in groups if g["params"]]
    ref_sgd = torch.optim.SGD(
        [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups],
        lr=1.0,
        momentum=cfg.momentum,
        nesterov=True,
    )
    scales = [g.get("lr_scale", 1.0) for g in groups]
    bufs = [torch.zeros_like(p) for p in filters]
    ours = [p for p in model.parameters() if p.requires_grad]
    theirs = [p for p in ref.parameters() if p.requires_grad]
    for step in range(4):
        lr = peak * (1 - step / 4)
        if step == 2:
            opt.set_lr_scale("whiten_bias", 0.0)
            scales[[g["name"] for g in groups].index("whiten_bias")] = 0.0
        for p, q in zip(ours, theirs, strict=True):
            g = torch.randn_like(p)
            p.grad, q.grad = g.clone(), g.clone()
        opt.set_lr(lr)
        opt.step()
        for group, scale in zip(ref_sgd.param_groups, scales, strict=True):
            group["lr"] = lr * scale
        ref_sgd.step()
        with torch.no_grad():
            for p, buf in zip(filters, bufs, strict=True):
                buf.mul_(cfg.muon_momentum).add_(p.grad)
                update = p.grad + cfg.muon_momentum * buf
                p.mul_(p.shape[0] ** 0.5 / p.norm())
                o = quintic_on_singular_values(update.reshape(len(update), -1), cfg.muon_ns_steps)
                p.sub_(cfg.muon_lr * (lr / peak) * o.view_as(p).float())
        for p, q in zip(ours, theirs, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
    opt.reset_state()
    assert all(b.abs().sum() == 0 for b in opt.muon.buffers)


def test_muon_refuses_what_it_cannot_do():
    w = torch.zeros(4, 3, requires_grad=True)
    lr = torch.tensor(0.1)
    with pytest.raises(ValueError, match="reduce"):
        Muon([w], lr, 1.0, shard=(0, 2))
    with pytest.raises(ValueError, match="matrices"):
        Muon([torch.zeros(3, requires_grad=True)], lr, 1.0)
    with pytest.raises(RuntimeError, match="no gradient"):
        Muon([w], lr, 1.0).step()
    for bad, msg in (
        ({"muon_momentum": 1.0}, "--muon-momentum"),
        ({"muon_ns_steps": 0}, "--muon-ns-steps"),
        ({"optimizer": "adam"}, "--optimizer must be one of"),
    ):
        with pytest.raises(ConfigError, match=msg):
            validate(tiny_muon(**bad))


def test_muon_state_round_trip_continues_the_same_steps():
    """A checkpoint's optimizer state: saved after 2 steps, loaded (in place) into a fresh optimizer
    over a copy of the weights, the next 2 steps give the same weights; an SGD state or one of
    other filter shapes is refused before anything is written."""

    def steps(model, opt, n, seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(n):
            for p in model.parameters():
                if p.requires_grad:
                    p.grad = torch.randn(p.shape, generator=g)
            opt.step()

    torch.manual_seed(0)
    cfg = tiny_muon()
    model = make_network(cfg, NormActPool)
    opt = make_optimizer(model, cfg, 50, 0.053)
    steps(model, opt, 2, seed=1)
    saved, weights = opt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    assert set(saved) == {"buffers", "lr_scales", "muon"} and all(b.abs().sum() > 0 for b in saved["muon"]["buffers"])
    steps(model, opt, 2, seed=2)

    other = make_network(cfg, NormActPool)
    other.load_state_dict(weights)
    fresh = make_optimizer(other, cfg, 50, 0.053)
    held = fresh.muon.buffers[0]
    fresh.load_state_dict(saved)
    assert fresh.muon.buffers[0] is held  # in place: a captured graph keeps reading the same tensor
    steps(other, fresh, 2, seed=2)
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b), name

    sgd_only = {k: v for k, v in saved.items() if k != "muon"}
    with pytest.raises(ValueError, match="no Muon momentum"):
        fresh.load_state_dict(sgd_only)
    wide_cfg = from_preset("fast-muon", widths=(8, 16, 32))
    wider = make_optimizer(make_network(wide_cfg, NormActPool), wide_cfg, 50, 0.053)
    before = [b.clone() for b in wider.sgd.buffers[0]]
    with pytest.raises(ValueError, match="conv filters"):
        wider.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(before, wider.sgd.buffers[0], strict=True)), "refused, yet written"
    # the filters fit but SGD's groups do not: Muon's momentum is not written either
    muon_before = [b.clone() for b in fresh.muon.buffers]
    wrong_groups = {
        **saved,
        "muon": {"buffers": [b + 1 for b in saved["muon"]["buffers"]]},
        "lr_scales": {**saved["lr_scales"], "extra": 1.0},
    }
    with pytest.raises(ValueError, match="parameter groups"):
        fresh.load_state_dict(wrong_groups)
    assert all(torch.equal(a, b) for a, b in zip(muon_before, fresh.muon.buffers, strict=True)), "refused, yet written"


def test_default_preset_names_itself_where_muon_cannot_go():
    """The default preset trains with Muon, which sparse training and local SGD do not wrap: the
    refusal names the preset and the way out; checkpoints now hold Muon's state."""
    for extra in ({"sparse_mask": "fisher"}, {"local_steps": 4}):
        with pytest.raises(
            ConfigError, match=f"preset {DEFAULT_PRESET} trains with --optimizer muon.*--preset resnet9"
        ):
            validate(from_preset(**extra), world_size=2)
        validate(from_preset("resnet9", **extra), world_size=2)  # the way out it names
    with pytest.raises(ConfigError, match="^--optimizer muon, which does not combine"):
        validate(from_preset("fast", optimizer="muon", sparse_mask="fisher"))
    with pytest.raises(ConfigError, match="^--optimizer muon, which"):  # a Config built by hand, no preset of ours
        validate(from_preset(preset="mine", local_steps=4), world_size=2)
    validate(from_preset(checkpoint_every=2))
    validate(from_preset(resume="checkpoint.pt"))
    with pytest.raises(ConfigError, match="do not yet hold --compress"):
        validate(from_preset(checkpoint_every=2, compress="topk"), world_size=2)


@pytest.mark.slow  # trains the Muon preset
def test_fast_muon_preset_learns_on_the_cpu(tmp_path, learnable_data):
    cfg = tiny_muon(
        data=str(learnable_data),
        batch_size=100,
        epochs=3,
        device="cpu",
        loader="torch",
        kernels="torch",
        cuda_graphs="off",
        eval_batch_size=200,
        warmup_steps=1,
        whiten_bias_epochs=1,
        out_dir=str(tmp_path / "runs"),
    )
    validate(cfg)
    (result,) = trainer.train(cfg, CPU)
    accs = [e.test_acc for e in result.epochs]
    assert len(accs) == 3 and accs[-1] > 60.0, accs  # 10 classes: chance is 10%
    assert from_preset("fast-muon").lookahead_steps == 0 and from_preset("fast-muon").batch_size == 2000


TWO_RANKS = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from fastcifar.parallel import distributed
    from fastcifar.parallel.comm import GradBuckets
    from fastcifar.core.config import from_preset
    from fastcifar.ops.norm_act_pool import NormActPool
    from fastcifar.models.network import make_network
    from fastcifar.run.recipe import make_optimizer

    # No batchnorm statistics differ between half and whole batches: evaluation mode throughout,
    # so each rank's gradient of its half is exactly half the whole batch's.
    ctx = distributed.setup("cpu")
    steps, batch, peak = 3, 16, 0.053

    def run(shard, ranks):
        cfg = from_preset("fast-muon", widths=(8, 16, 16), muon_shard=shard)
        torch.manual_seed(0)
        model = make_network(cfg, NormActPool).eval()
        per_rank = batch // (ctx.world_size if ranks else 1)
        buckets = GradBuckets(model.parameters(), 0.01) if ranks else None
        opt = make_optimizer(model, cfg, per_rank, peak * batch / per_rank, ctx if ranks else None)
        g = torch.Generator().manual_seed(1)
        for step in range(steps):
            x, y = torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)
            if ranks:
                x, y = x[ctx.rank::ctx.world_size], y[ctx.rank::ctx.world_size]
            F.cross_entropy(model(x), y, reduction="sum").backward()
            if buckets is not None:
                buckets.finish()
            opt.set_lr(peak * batch / per_rank * (1 - step / steps))
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    alone = run(False, ranks=False)
    for shard in (False, True):
        mine = run(shard, ranks=True)
        for a, b in zip(mine, alone):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        flat = torch.cat([p.flatten() for p in mine])
        other = [torch.empty_like(flat) for _ in range(2)]
        torch.distributed.all_gather(other, flat)
        assert torch.equal(other[0], other[1]), "the ranks' weights differ"
    print(f"rank {ctx.rank} ok")
    distributed.teardown(ctx)
""")


@pytest.mark.slow
def test_two_ranks_equal_one_rank(tmp_path):
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    launcher = torchrun(str(script))
    proc = run_train([], launcher=launcher, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0 ok" in proc.stdout and "rank 1 ok" in proc.stdout


@pytest.mark.cuda
def test_muon_step_replays_from_a_cuda_graph():
    """The optimizer step captured once and replayed with a changing device-side rate equals the
    eager step (bfloat16 Newton-Schulz on both sides)."""
    dev = torch.device("cuda")
    cfg = tiny_muon()
    results = []
    for capture in (False, True):
        torch.manual_seed(0)
        model = make_network(cfg, NormActPool).to(dev)
        opt = make_optimizer(model, cfg, 100, peak=0.053)
        params = [p for p in model.parameters() if p.requires_grad]
        grads = [[torch.randn_like(p) for p in params] for _ in range(4)]
        for p, g in zip(params, grads[0], strict=True):
            p.grad = g.clone()
        # the trainer's device-side schedule: indexing a table with a device tensor (rate[i]) reads
        # the index back to the host, which a capture refuses; DeviceSchedule advances on the device
        schedule = DeviceSchedule([0.053, 0.04, 0.03, 0.02], dev)

        def body(schedule=schedule, opt=opt):
            schedule.apply(opt.lr)
            opt.step()

        graph = None
        if capture:
            initial = [p.detach().clone() for p in params]
            graph = graphs.capture(body, warmup_iters=1)  # the trainer's: one warm-up step on a side stream
            with torch.no_grad():
                for p, p0 in zip(params, initial, strict=True):
                    p.copy_(p0)
            opt.reset_state()
            schedule.reset()  # warm-up advanced the counter (the capture itself ran nothing)
        for i in range(4):
            for p, g in zip(params, grads[i], strict=True):
                p.grad.copy_(g)
            graph.replay() if graph is not None else body()
        torch.cuda.synchronize()
        results.append([p.detach().float().cpu() for p in params])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
