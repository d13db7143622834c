"""NesterovSGD against torch.optim.SGD, and the learning-rate schedule."""

import pytest
import torch

from fastcifar.run.optim import NesterovSGD
from fastcifar.run.schedule import warmup_decay_lr


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
