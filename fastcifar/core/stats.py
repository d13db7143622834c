"""The statistics a result is judged by: the one-sided one-sample t-test the record scripts use for
"the mean test accuracy exceeds the bar" (the trainer's summary and scripts/race.py both call it)."""

from __future__ import annotations

import math
import statistics


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function (torch and numpy have none; scipy is not
    a dependency)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_sf(t: float, df: int) -> float:
    """P(T > t) for Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return tail if t > 0 else 1.0 - tail


def p_above(values: list[float], bar: float) -> float | None:
    """One-sided one-sample t-test of "the mean exceeds ``bar``" (scipy's ttest_1samp with
    alternative="greater"; hiverge's notebook quotes the two-sided value, twice this when the mean
    is above the bar). None for fewer than 2 values; with no spread, 0 or 1."""
    if len(values) < 2:
        return None
    mean, std = statistics.fmean(values), statistics.stdev(values)
    if std == 0.0:
        return 0.0 if mean > bar else 1.0
    return t_sf((mean - bar) / (std / math.sqrt(len(values))), len(values) - 1)
