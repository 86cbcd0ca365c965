"""Step-time noise that persists over a stint: how far a cell's mean moves between visits.

A (bucket, arm) cell's step time is measured in *stints*, the runs of decisions in which the
bucket runs that arm. Within a stint its readings average the steps' jitter away; between
stints the machine itself may have moved (a loaded CPU server's step times drift by 1.5-2x
over minutes, other tenants come and go). A cell measured in two stints then knows its
step time no better than two readings of that drift, however many steps each held, and an
arm whose one short stint fell in a slow minute looks decisively worse than it is.

:class:`StintDrift` measures that drift from the cells themselves: each time a cell's stint
ends, its mean is compared with the cell's previous stint at about the same batch size, and
the squared difference, less what the steps' jitter explains, estimates the variance a stint
adds. The policy then adds ``variance() / stints`` to each cell's own error. Where step
times do not drift (a GPU server, the simulator, whose noise is independent per step) the
differences are the jitter's and the estimate stays at zero: it is used only once it is
clearly positive, so the policy is unchanged there (on the bench's generated worlds 0-49 at
seed 0 every phase came out bit-identical).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["StintDrift"]

# Stint pairs behind the estimate (older ones forgotten geometrically): conditions change.
_MEMORY_PAIRS = 20.0
# Two stints are compared only at mean batch sizes within this relative distance: a bucket
# spans a range of batch sizes, and their step times differ by more than any drift.
_B_TOLERANCE = 0.05
# The estimate counts once this many pairs stand behind it (and only once it is ``z``
# standard errors above zero).
_MIN_PAIRS = 4.0


class StintDrift:
    """Between-stint variance of log step time, pooled over every cell (see the module doc)."""

    def __init__(self, buckets: int, arms: Sequence[int], *, z: float = 2.0) -> None:
        self._arms = tuple(arms)
        self._z = z
        # per bucket: the open stint (arm, weight, weighted sums of log step time and of b)
        self._open: list[list[float] | None] = [None] * buckets
        # per bucket, per arm: the last closed stint (mean log t, weight, mean b)
        self._last: list[dict[int, tuple[float, float, float]]] = [{} for _ in range(buckets)]
        # per bucket, per arm: stints behind the cell, aged as the cell is
        self._stints = [dict.fromkeys(self._arms, 0.0) for _ in range(buckets)]
        # discounted sums over pairs: count, d², h (= 1/W + 1/W'), d⁴, d²·h, h²
        self._sums = [0.0] * 6

    def observe(self, bucket: int, arm: int, log_t: float, weight: float, b: float,
                aged: float) -> None:
        """One reading of ``bucket`` at ``arm``: mean log step time ``log_t`` over ``weight``
        steps at mean batch size ``b``; ``aged``: the discount the bucket's cells took."""
        stints = self._stints[bucket]
        for k in stints:
            stints[k] *= aged
        cur = self._open[bucket]
        if cur is None or cur[0] != arm:
            if cur is not None:
                self._close(bucket, cur)
            cur = self._open[bucket] = [float(arm), 0.0, 0.0, 0.0]
            stints[arm] += 1.0
        cur[1] += weight
        cur[2] += weight * log_t
        cur[3] += weight * b

    def _close(self, bucket: int, cur: list[float]) -> None:
        arm, w, s, sb = int(cur[0]), cur[1], cur[2], cur[3]
        if w <= 0:
            return
        mean, b = s / w, sb / w
        prev = self._last[bucket].get(arm)
        self._last[bucket][arm] = (mean, w, b)
        if prev is None or abs(math.log(b / prev[2])) > _B_TOLERANCE:
            return
        d2, h = (mean - prev[0]) ** 2, 1.0 / w + 1.0 / prev[1]
        keep = 1.0 - 1.0 / _MEMORY_PAIRS
        for i, x in enumerate((1.0, d2, h, d2 * d2, d2 * h, h * h)):
            self._sums[i] = self._sums[i] * keep + x

    def stints(self, bucket: int, arm: int) -> float:
        """Stints behind the cell (at least one once it ran)."""
        return max(self._stints[bucket][arm], 1.0)

    def variance(self, step_var: float) -> float:
        """The variance a stint adds to a cell's mean log step time, given the variance of
        one step's (``step_var``); 0 unless clearly positive."""
        n, d2, h, d4, d2h, h2 = self._sums
        if n < _MIN_PAIRS:
            return 0.0
        mean = (d2 - step_var * h) / n
        second = (d4 - 2 * step_var * d2h + step_var * step_var * h2) / n
        se = math.sqrt(max(second - mean * mean, 0.0) / n)
        # Each of the two stints carries its own drift: the pair's difference holds two.
        return mean / 2 if mean > self._z * se else 0.0
