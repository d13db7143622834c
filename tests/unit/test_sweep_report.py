"""What a store says (fastcifar/sweep/report.py): the per-arm status lines and the paired comparison."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fastcifar.core.config import ConfigError
from fastcifar.sweep import report
from fastcifar.sweep.spec import parse

SPEC = parse({"preset": "fast", "runs": 3, "settings": {"data": "d"}, "axes": {"lr": [0.2, 0.4]}}, "spec.json", ".")


def row(idx, arm, rep, status, acc=None, first=0, wall=3.0, train=1.0, reason=None):
    return {
        "started": 1000.0 + 60 * idx if status in ("done", "failed") else None,
        "ended": 1060.0 + 60 * idx if status in ("done", "failed") else None,
        "idx": idx,
        "arm": arm,
        "arm_name": SPEC.arms[arm].name,
        "rep": rep,
        "status": status,
        "test_acc": acc,
        "first_of_worker": first,
        "wall_time": wall,
        "train_time": train,
        "setup_time": 0.5,
        "reason": reason,
    }


ROWS = [
    row(0, 0, 0, "done", 90.0, first=1, wall=9.0),
    row(1, 1, 0, "done", 91.0),
    row(2, 0, 1, "done", 92.0),
    row(3, 1, 1, "done", 92.5),
    row(4, 0, 2, "failed", reason="ConfigError: no data"),
    row(5, 1, 2, "pending"),
]


def test_t_quantile_matches_the_tables():
    assert report.t_quantile(0.975, 4) == pytest.approx(2.776445, abs=1e-5)
    assert report.t_quantile(0.975, 1) == pytest.approx(12.7062, abs=1e-3)
    assert report.t_quantile(0.975, 1000) == pytest.approx(1.96234, abs=1e-4)


def two_sided_p(t: float, df: int) -> float:
    """P(|T| > t) by integrating Student's t density (independent of stats.betainc)."""
    x = np.linspace(abs(t), 2000.0, 4_000_001)
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    y = c * (1 + x * x / df) ** (-(df + 1) / 2)
    return 2 * float(np.sum((y[1:] + y[:-1]) / 2 * np.diff(x)))


def test_the_paired_comparison_is_the_paired_t_test():
    a, b = [93.1, 93.4, 92.8, 93.9, 93.0], [92.9, 93.0, 92.9, 93.1, 92.5]
    s = report.paired(a, b)
    # differences 0.2, 0.4, -0.1, 0.8, 0.5: mean 0.36, sd sqrt(0.452 / 4), t = 0.36 / (sd / sqrt 5) = 2.3947
    sd = math.sqrt(0.452 / 4)
    assert s["mean"] == pytest.approx(0.36) and s["n"] == 5
    assert s["high"] - 0.36 == pytest.approx(2.776445 * sd / math.sqrt(5), rel=1e-5)
    assert s["p"] == pytest.approx(two_sided_p(0.36 / (sd / math.sqrt(5)), 4), abs=1e-5)
    assert 0.05 < s["p"] < 0.1  # t = 2.39 lies between the 10% (2.132) and 5% (2.776) two-sided values for df 4
    assert report.paired([1.0, 2.0], [1.0, 2.0])["p"] == 1.0  # no spread, no difference


def test_status_counts_each_arm_and_keeps_the_first_run_apart():
    lines = report.status_lines(SPEC, ROWS)
    # 5 runs ended, one a minute from t = 1000 s to 1300 s: 60 models/h, the last one a minute away
    assert lines[0] == "4/6 done, 1 failed, 0 running, 1 pending; 60 models/h, ETA 60 s"
    arm0 = next(line for line in lines if line.startswith("lr=0.2"))
    assert arm0.split()[1:4] == ["2", "1", "0"] and "91.00% ± 1.41" in arm0
    arm1 = next(line for line in lines if line.startswith("lr=0.4"))
    assert arm1.split()[1:4] == ["2", "0", "1"] and "91.75% ± 1.06" in arm1
    assert any(line.startswith("first run of a worker: 1, each 9.00 s (8.00 s beyond training") for line in lines)
    assert any(line.startswith("later runs: 3, each 3.00 s (2.00 s beyond training") for line in lines)
    assert lines[-1] == "run 4 (lr=0.2, rep 2) failed: ConfigError: no data"


def test_compare_pairs_the_runs_both_arms_finished():
    line = report.compare_line(SPEC, ROWS, "lr=0.4", "0")
    s = report.paired([91.0, 92.5], [90.0, 92.0])
    assert line.startswith(f"lr=0.4 - lr=0.2: {s['mean']:+.3f} points of test accuracy over 2 paired runs")
    assert f"p = {s['p']:.3g}" in line


def test_compare_refuses_an_unknown_arm_and_too_few_pairs():
    with pytest.raises(ConfigError, match="no arm 'lr=9'; the arms: lr=0.2, lr=0.4"):
        report.compare_line(SPEC, ROWS, "lr=9", "0")
    with pytest.raises(ConfigError, match="have 1 runs both finished"):
        report.compare_line(SPEC, ROWS[:3], "0", "1")
