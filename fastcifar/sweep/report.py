"""What a store says: per arm, runs done / failed / pending with the mean test accuracy and its
spread (``fastcifar sweep status``), the per-run cost beyond training, first run of a worker and
later ones apart, and the paired comparison of two arms (``fastcifar sweep compare``)."""

from __future__ import annotations

import math
import statistics

from fastcifar.core.config import ConfigError
from fastcifar.core.stats import t_sf


def t_quantile(p: float, df: int) -> float:
    """The t with P(T > t) = 1 - p for Student's t with ``df`` degrees of freedom (bisection on
    ``t_sf``: scipy is not a dependency)."""
    low, high = 0.0, 1e3
    for _ in range(200):
        mid = (low + high) / 2
        if t_sf(mid, df) > 1 - p:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def paired(a: list[float], b: list[float]) -> dict:
    """Paired difference of means a - b: mean, 95% interval, two-sided p-value of "no difference"
    (the paired t-test: scipy's ttest_rel). Needs 2 pairs or more."""
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    n = len(diffs)
    mean = statistics.fmean(diffs)
    sd = statistics.stdev(diffs)
    if sd == 0.0:
        return {"n": n, "mean": mean, "low": mean, "high": mean, "p": 1.0 if mean == 0 else 0.0}
    se = sd / math.sqrt(n)
    half = t_quantile(0.975, n - 1) * se
    p = min(1.0, 2 * t_sf(abs(mean / se), n - 1))
    return {"n": n, "mean": mean, "low": mean - half, "high": mean + half, "p": p}


def status_lines(spec, rows: list[dict]) -> list[str]:
    """One line for the study, then one per arm: done/failed/pending, mean accuracy ± std; then the
    per-run times; then the failed runs' reasons (up to 5)."""
    total = len(rows)
    by = {s: sum(r["status"] == s for r in rows) for s in ("done", "failed", "running", "pending")}
    head = f"{by['done']}/{total} done, {by['failed']} failed, {by['running']} running, {by['pending']} pending"
    ended = [r for r in rows if r["status"] in ("done", "failed") and r.get("started") and r.get("ended")]
    if ended:  # the rate from the first start to the last end: the study's pace, pauses included
        span = max(r["ended"] for r in ended) - min(r["started"] for r in ended)
        rate = len(ended) / span * 3600 if span > 0 else 0.0
        left = by["running"] + by["pending"]
        head += f"; {rate:.0f} models/h" + (f", ETA {left / rate * 3600:.0f} s" if left and rate else "")
    lines = [head]
    width = max(len(a.name) for a in spec.arms)
    lines.append(f"{'arm':<{width}}  done  failed  pending  test acc (mean ± std)")
    for arm in spec.arms:
        mine = [r for r in rows if r["arm"] == arm.index]
        accs = [r["test_acc"] for r in mine if r["status"] == "done"]
        failed = sum(r["status"] == "failed" for r in mine)
        pending = len(mine) - len(accs) - failed
        acc = ""
        if accs:
            acc = f"{statistics.fmean(accs):.2f}%" + (f" ± {statistics.stdev(accs):.2f}" if len(accs) > 1 else "")
        lines.append(f"{arm.name:<{width}}  {len(accs):>4}  {failed:>6}  {pending:>7}  {acc}")
    for first, label in ((1, "first run of a worker"), (0, "later runs")):
        done = [r for r in rows if r["status"] == "done" and r["first_of_worker"] == first]
        if done:
            over = statistics.fmean(r["wall_time"] - r["train_time"] for r in done)
            lines.append(
                f"{label}: {len(done)}, each {statistics.fmean(r['wall_time'] for r in done):.2f} s "
                f"({over:.2f} s beyond training; set-up {statistics.fmean(r['setup_time'] for r in done):.2f} s)"
            )
    for r in [r for r in rows if r["status"] == "failed"][:5]:
        lines.append(f"run {r['idx']} ({r['arm_name']}, rep {r['rep']}) failed: {r['reason']}")
    return lines


def arm_index(spec, name: str) -> int:
    for arm in spec.arms:
        if name in (arm.name, str(arm.index)):
            return arm.index
    raise ConfigError(f"no arm {name!r}; the arms: {', '.join(a.name for a in spec.arms)} (or their numbers)")


def compare_line(spec, rows: list[dict], name_a: str, name_b: str) -> str:
    a, b = arm_index(spec, name_a), arm_index(spec, name_b)
    accs = {(r["arm"], r["rep"]): r["test_acc"] for r in rows if r["status"] == "done"}
    reps = sorted(rep for (arm, rep) in accs if arm == a and (b, rep) in accs)
    if len(reps) < 2:
        raise ConfigError(f"arms {name_a} and {name_b} have {len(reps)} runs both finished; a comparison needs 2")
    s = paired([accs[(a, r)] for r in reps], [accs[(b, r)] for r in reps])
    return (
        f"{spec.arms[a].name} - {spec.arms[b].name}: {s['mean']:+.3f} points of test accuracy over {s['n']} "
        f"paired runs, 95% interval [{s['low']:+.3f}, {s['high']:+.3f}], p = {s['p']:.3g} (paired t-test)"
    )
