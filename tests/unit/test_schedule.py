"""The run's schedule (run.schedule): the vectorized table is the per-step functions, bit for bit."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fastcifar.core.config import Config
from fastcifar.run.schedule import DeviceSchedule, epoch_lengths, lr_schedule, stepwise_lr, warmup_decay_lr


def per_step(cfg, steps, peak):
    total = sum(epoch_lengths(cfg.epochs, steps))
    if cfg.lr_at == "end":
        return [
            warmup_decay_lr((i + 1) / steps, cfg.epochs, cfg.warmup_epochs, peak, cfg.lr_start, cfg.lr_end)
            for i in range(total)
        ]
    warm = int(round(total * cfg.warmup_epochs / cfg.epochs, 9))
    return [stepwise_lr(i, total, warm, peak, cfg.lr_start, cfg.lr_end) for i in range(total)]


CASES = list(
    itertools.product(["end", "start"], [1, 2.5, 9.9, 24], [0, 0.5, 2.3, 30], [(0.0, 0.0), (0.2, 0.07)], [1, 48, 97])
)


@pytest.mark.parametrize("lr_at,epochs,warmup,ends,steps", CASES)
def test_table_equals_the_per_step_functions(lr_at, epochs, warmup, ends, steps):
    cfg = Config(lr_at=lr_at, epochs=epochs, warmup_epochs=warmup, lr_start=ends[0], lr_end=ends[1])
    table = lr_schedule(cfg, steps, peak=27.136 / 2000)
    want = per_step(cfg, steps, 27.136 / 2000)
    assert table.dtype == np.float64 and len(table) == len(want)
    bad = [i for i, (a, b) in enumerate(zip(table, want, strict=True)) if a != b]
    assert not bad, f"step {bad[0]}: {table[bad[0]]!r} != {want[bad[0]]!r}"


def test_device_schedule_logs_the_host_value():
    s = DeviceSchedule(np.array([0.1, 0.2]), "cpu")
    assert s.value(1) == 0.2 and isinstance(s.value(1), float) and len(s) == 2
