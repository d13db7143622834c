"""fastcifar.run.averaging: Lookahead against a hand computation, its last steps folded in at the
end, and its refusals."""

import pytest
import torch

from fastcifar.run.averaging import Lookahead


def test_lookahead_against_hand_computation():
    model = torch.nn.Linear(1, 1, bias=False)
    bn = torch.nn.BatchNorm1d(1)
    both = torch.nn.Sequential(model, bn)
    with torch.no_grad():
        model.weight.fill_(1.0)
    la = Lookahead(both, every=2, final_decay=0.5, total_steps=4)
    slow, fast = 1.0, 1.0
    for step in range(1, 5):
        with torch.no_grad():
            model.weight.add_(1.0)  # the "optimizer step": +1 each time
            bn.running_mean.add_(2.0)
        fast += 1.0
        la.step()
        if step % 2 == 0:
            decay = 0.5 * (step / 4) ** 3
            slow = decay * slow + (1 - decay) * fast
            fast = slow
        assert model.weight.item() == pytest.approx(fast), step
    # step 2: decay 1/16 -> slow = 1/16 + 15/16 * 3 = 2.875; step 4: decay 1/2 -> slow = (2.875 + 4.875) / 2
    assert model.weight.item() == pytest.approx(3.875)
    assert bn.running_mean.item() == pytest.approx(0.5 * (0.0 + 15 / 16 * 4) + 0.5 * (15 / 16 * 4 + 4))
    assert bn.num_batches_tracked.item() == 0  # integer buffers untouched


def test_lookahead_finish_folds_in_the_last_steps():
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.0)
    la = Lookahead(model, every=5, final_decay=0.5, total_steps=3)
    for _ in range(3):
        with torch.no_grad():
            model.weight.add_(1.0)
        la.step()
    assert model.weight.item() == 3.0  # no sync yet
    la.finish()
    assert model.weight.item() == pytest.approx(0.5 * 0.0 + 0.5 * 3.0)
    la.finish()  # idempotent at a sync point
    assert model.weight.item() == pytest.approx(1.5)


def test_lookahead_rejects_bad_settings():
    with pytest.raises(ValueError):
        Lookahead(torch.nn.Linear(1, 1), every=0, final_decay=0.5, total_steps=3)
    with pytest.raises(ValueError):
        Lookahead(torch.nn.Linear(1, 1), every=2, final_decay=1.0, total_steps=3)
