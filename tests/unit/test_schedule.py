"""The run's schedule (run.schedule): the vectorized table is the per-step functions, bit for bit;
the schedule's shape and its start and end fractions."""

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


def test_schedule_with_start_and_end_fractions():
    lr = lambda t: warmup_decay_lr(t, 10, 2.3, 1.5, start=0.2, end=0.07)  # noqa: E731
    assert lr(0) == pytest.approx(0.3)
    assert lr(2.3) == pytest.approx(1.5)
    assert lr(1.15) == pytest.approx(1.5 * 0.6)
    assert lr(10) == pytest.approx(1.5 * 0.07)
    assert lr(2.3 + 7.7 / 2) == pytest.approx(1.5 * (0.07 + 0.93 / 2))


def test_schedule_shape():
    lr = lambda t: warmup_decay_lr(t, epochs=24, warmup_epochs=5, peak=0.4)  # noqa: E731
    assert lr(0) == 0.0
    assert lr(2.5) == pytest.approx(0.2)
    assert lr(5) == pytest.approx(0.4)
    assert lr(14.5) == pytest.approx(0.2)
    assert lr(24) == 0.0
    assert warmup_decay_lr(0.0, epochs=10, warmup_epochs=0, peak=1.0) == 1.0
