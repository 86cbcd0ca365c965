"""tuner.gain: the gain of the table in effect over a baseline, with its 95 % interval."""

from __future__ import annotations

import math
import random

import pytest

from tuner.gain import Z95, ArmValue, BucketValues, estimate_gain


def bv(weight, high, **arms):
    return BucketValues(weight, high, {int(k[1:]): ArmValue(*v) for k, v in arms.items()})


def test_exact_figures_and_sources():
    buckets = [bv(1.0, 4, k0=(100.0, 0.0, True), k3=(150.0, 0.0, True)),
               bv(3.0, 64, k0=(400.0, 0.0, True), k3=(300.0, 0.0, False))]
    table = ((4, 3), (None, 0))
    g = estimate_gain("k0", buckets, table, ((None, 0),))
    # (0.25 * 50) / (0.25 * 100 + 0.75 * 400): only the first bucket differs.
    assert g.ratio == pytest.approx(12.5 / 325.0) and g.low == g.high == pytest.approx(g.ratio)
    assert g.measured_share == 1.0 and g.source == "measured"
    g3 = estimate_gain("always", buckets, table, ((None, 3),))
    assert g3.ratio == pytest.approx(0.75 * 100 / (0.25 * 150 + 0.75 * 300))
    assert g3.measured_share == pytest.approx(0.25) and g3.source == "measured+model"
    assert estimate_gain("k0", [bv(1.0, 4, k3=(1.0, 0.0, True))], table, ((None, 0),)) is None


def test_interval_covers_the_truth_about_95_percent_of_the_time():
    rng = random.Random(7)
    truth = {(0, 0): 100.0, (0, 3): 130.0, (1, 0): 400.0, (1, 3): 360.0}
    table, base = ((4, 3), (None, 0)), ((None, 0),)
    true_ratio = (0.5 * 30) / (0.5 * 100 + 0.5 * 400)
    hits, n = 0, 2000
    for _ in range(n):
        se = {key: 0.05 * g for key, g in truth.items()}
        buckets = [BucketValues(1.0, high, {k: ArmValue(rng.gauss(truth[(i, k)], se[(i, k)]),
                                                        se[(i, k)], True) for k in (0, 3)})
                   for i, high in enumerate((4, 64))]
        g = estimate_gain("k0", buckets, table, base)
        hits += g.low <= true_ratio <= g.high
    assert 0.93 <= hits / n <= 0.97
    assert Z95 == pytest.approx(1.96, abs=1e-3) and not math.isnan(true_ratio)
