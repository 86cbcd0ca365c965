"""The guardrail: a bucket's greedy arm must not measurably lose to a known alternative.

Pure functions over the measured, discounted statistics of one bucket, shared by every
learning policy. A policy's greedy choice can go stale or wrong (hysteresis holding an old
arm, a model extrapolating, an optimiser's best trial from another workload); the guardrail
only trusts measurements, and only when the difference is both large and significant.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from policies._stats import ArmStats

__all__ = ["GuardVerdict", "guard_check"]


@dataclass(frozen=True, slots=True)
class GuardVerdict:
    """The greedy arm ``bad`` measurably loses to ``better``; ``reason`` says by how much."""

    bad: int
    better: int
    reason: str


def guard_check(
    stats: Mapping[int, ArmStats],
    greedy: int,
    *,
    margin: float,
    z: float,
    min_steps: float,
    mean_sd: Callable[[ArmStats], float],
) -> GuardVerdict | None:
    """Return a verdict if ``greedy`` is measurably worse than another arm, else None.

    Both arms need ``min_steps`` (discounted) decode steps behind them; the alternative must
    beat ``greedy`` by more than ``margin`` in log goodput (0.02 = 2 %) with a z-score above
    ``z`` (``mean_sd`` gives each arm's standard error). The largest such gap wins.
    """
    g = stats.get(greedy)
    if g is None or g.w < min_steps:
        return None
    g_sd = mean_sd(g)
    best: tuple[float, int, float] | None = None
    for arm in sorted(stats):
        st = stats[arm]
        if arm == greedy or st.w < min_steps:
            continue
        diff = st.mean - g.mean
        se = math.hypot(g_sd, mean_sd(st))
        score = diff / se if se > 0 else math.inf
        if diff > margin and score > z and (best is None or diff > best[0]):
            best = (diff, arm, score)
    if best is None:
        return None
    diff, arm, score = best
    reason = (
        f"k={greedy} measured {100 * (1 - math.exp(-diff)):.1f}% below k={arm} "
        f"({g.w:.0f} vs {stats[arm].w:.0f} steps, z={score:.1f}); reverted to k={arm}"
    )
    return GuardVerdict(bad=greedy, better=arm, reason=reason)
