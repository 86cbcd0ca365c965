"""What the table in effect gains over a baseline table, with a 95 % interval. Pure.

Baselines: ``start`` (the table the server started on: SGLang's startup step, or a policy
file installed at start), ``k0`` (never speculate) and ``always`` (the always-speculate arm
SGLang starts on for the arm set, ``report.always_arm``).

Per bucket ``i`` with weight ``w_i`` (the share of the server's time, or of its decode steps,
spent there) the table runs arm ``a_i`` and the baseline ``c_i``, each with an estimated
goodput ``g`` and standard error ``s``. The gain is

    r = Σ w_i (g(a_i) − g(c_i)) / Σ w_i g(c_i)

the goodput the table adds over the same batch-size mix, as a share of the baseline's. Its
interval is the delta method's for that ratio, arms treated as independent estimates (a
bucket where both tables run one arm contributes exactly 0 to the difference).

Each ``g`` is *measured* (a ratio estimate from stored intervals of that arm in that bucket)
when there is one with an interval, else *modelled* (the policy's estimate, e.g. the model
policy's, which shares strength across batch sizes). ``measured_share`` says how much of the
weight rests on measurements alone; buckets where an arm has neither are left out and counted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["BASELINES", "Z95", "ArmValue", "BucketValues", "Gain", "as_ran", "estimate_gain",
           "table_arm"]

BASELINES = ("start", "k0", "always")
Z95 = 1.959964


@dataclass(frozen=True, slots=True)
class ArmValue:
    goodput: float
    se: float
    measured: bool


def as_ran(parts: Iterable[tuple[float, ArmValue]]) -> ArmValue | None:
    """A bucket's arms together, each goodput weighed by its busy seconds (the ``float`` of
    each part), errors taken as independent: what a banded row yielded as it ran, each arm
    only in the acceptance bands that chose it. None without busy time."""
    parts = [(w, v) for w, v in parts if w > 0]
    busy = sum(w for w, _ in parts)
    if not busy:
        return None
    return ArmValue(sum(w * v.goodput for w, v in parts) / busy,
                    math.sqrt(sum((w * v.se) ** 2 for w, v in parts)) / busy,
                    all(v.measured for _, v in parts))


@dataclass(frozen=True, slots=True)
class BucketValues:
    """One bucket: its weight, its batch-size range, and the goodput of every arm known."""

    weight: float
    high: int  # the bucket's largest batch size (its lower bound for the open last bucket)
    arms: Mapping[int, ArmValue]


@dataclass(frozen=True, slots=True)
class Gain:
    baseline: str
    ratio: float  # (table − baseline) / baseline over the weighted batch-size mix
    low: float
    high: float
    measured_share: float  # weight whose both goodputs are measured, not modelled
    covered_share: float  # weight of the buckets the estimate covers (the rest lacked an arm)

    @property
    def source(self) -> str:
        if self.measured_share >= 0.999:
            return "measured"
        return "model" if self.measured_share <= 0.001 else "measured+model"


def table_arm(table: Sequence[tuple[int | None, int]], b: int) -> int:
    for bound, k in table:
        if bound is None or b <= bound:
            return k
    return table[-1][1]


def estimate_gain(
    baseline: str,
    buckets: Sequence[BucketValues],
    table: Sequence[tuple[int | None, int]],
    base: Sequence[tuple[int | None, int]],
) -> Gain | None:
    """The gain of ``table`` over ``base`` (see the module docstring); None without a bucket
    where both arms have a goodput, or a baseline goodput of zero."""
    total = sum(bv.weight for bv in buckets if bv.weight > 0)
    if total <= 0:
        return None
    diff = base_sum = var_diff = var_base = cov = 0.0
    covered = measured = 0.0
    for bv in buckets:
        if bv.weight <= 0:
            continue
        a, c = table_arm(table, bv.high), table_arm(base, bv.high)
        ga, gc = bv.arms.get(a), bv.arms.get(c)
        if ga is None or gc is None:
            continue
        w = bv.weight / total
        covered += w
        base_sum += w * gc.goodput
        var_base += (w * gc.se) ** 2
        if a != c:
            diff += w * (ga.goodput - gc.goodput)
            var_diff += w * w * (ga.se ** 2 + gc.se ** 2)
            cov -= w * w * gc.se ** 2
            measured += w if ga.measured and gc.measured else 0.0
        else:
            measured += w if gc.measured else 0.0
    if covered <= 0 or base_sum <= 0:
        return None
    r = diff / base_sum
    var = max(0.0, var_diff - 2 * r * cov + r * r * var_base) / base_sum ** 2
    half = Z95 * math.sqrt(var)
    return Gain(baseline, r, r - half, r + half, measured / covered, covered)
