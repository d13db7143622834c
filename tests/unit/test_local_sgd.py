"""fastcifar.parallel.local_sgd: replicas merged every H steps, counted from the last merge."""

from __future__ import annotations

from models import tiny

from fastcifar.run.optim import NesterovSGD
from fastcifar.run.recipe import param_groups
from fastcifar.run.sparse import fisher


def test_local_sgd_merges_every_h_steps_counted_from_the_last_merge():
    """An epoch-end merge restarts the count: with H=3 and 5 steps per epoch the merges fall
    after steps 3, 5 | 8, 10 (not 3, 5 | 6, 9, 10, as a run-wide step counter would place them)."""
    from fastcifar.parallel.local_sgd import LocalSGD

    cfg, model = tiny()
    params = fisher.trainable(model)
    local = LocalSGD(params, list(model.buffers()), NesterovSGD(param_groups(model, cfg, 8), lr=0.05), every=3)
    merged_after = []
    step = 0
    for _ in range(2):
        for _ in range(5):
            step += 1
            before = local.merges
            local.after_step()
            if local.merges > before:
                merged_after.append(step)
        before = local.merges
        local.epoch_end()
        if local.merges > before:
            merged_after.append(step)
    assert merged_after == [3, 5, 8, 10]
