"""core.stats: the one-sided t-test of "mean accuracy > bar", against Student's t table and the
closed forms of 1 and 2 degrees of freedom (scipy is not a dependency to compare with)."""

from __future__ import annotations

import math

import pytest

from fastcifar.core.stats import p_above, t_sf


@pytest.mark.parametrize(
    "t, df, p",
    [  # Student's t table: the one-sided tail beyond t
        (1.711, 24, 0.05),
        (2.064, 24, 0.025),
        (2.492, 24, 0.01),
        (3.467, 24, 0.001),
        (6.314, 1, 0.05),
        (12.706, 1, 0.025),
        (2.228, 10, 0.025),
        (0.0, 24, 0.5),
        (-1.711, 24, 0.95),
    ],
)
def test_t_tail_matches_the_table(t, df, p):
    assert t_sf(t, df) == pytest.approx(p, rel=2e-3)


def test_t_tail_matches_the_closed_forms_of_one_and_two_degrees_of_freedom():
    for t in (-30.0, -3.0, -0.4, 0.2, 1.0, 2.5, 8.0, 300.0):
        assert t_sf(t, 1) == pytest.approx(0.5 - math.atan(t) / math.pi, rel=1e-10)  # Cauchy
        assert t_sf(t, 2) == pytest.approx(0.5 - t / (2 * math.sqrt(2 + t * t)), rel=1e-10)


def test_p_value_is_the_one_sided_t_test_of_a_mean_above_the_bar():
    accs = [94.1, 94.2, 93.9, 94.3, 94.0]  # mean 94.1, std 0.1581: t = 1.414 on 4 degrees of freedom
    assert p_above(accs, 94.0) == pytest.approx(0.1151, abs=2e-4)
    assert p_above([93.9, 94.0, 93.8], 94.0) > 0.5  # below the bar: no evidence for it
    assert p_above([94.2], 94.0) is None  # one run: no test
    assert p_above([94.2, 94.2], 94.0) == 0.0 and p_above([93.8, 93.8], 94.0) == 1.0
