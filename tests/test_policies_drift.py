"""Step-time drift between an arm's stints: measured from the cells, zero where there is none."""

from __future__ import annotations

import math
import random

import pytest

from policies import Buckets, ModelPolicy, Observation, make_policy
from policies._drift import StintDrift

JITTER = 0.05  # per reading, log step time


def _alternate(drift_sd: float, stints: int = 120, seed: int = 0, b_of=lambda i: 8.0):
    """One bucket alternating k = 0 and k = 1 in stints of five readings; each stint's step
    times sit ``drift_sd`` (log) off the cell's true mean, each reading ``JITTER`` more."""
    rng = random.Random(seed)
    d = StintDrift(buckets=1, arms=(0, 1))
    for i in range(stints):
        k, off = i % 2, rng.gauss(0.0, drift_sd)
        for _ in range(5):
            d.observe(0, k, math.log(0.01 * (1 + k)) + off + rng.gauss(0.0, JITTER),
                      1.0, b_of(i), 1.0)
    return d


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_independent_jitter_is_no_drift(seed):
    # The stints' means differ by the jitter alone: the estimate stays at zero, so the
    # policy is exactly what it is without it.
    assert _alternate(0.0, seed=seed).variance(JITTER * JITTER) == 0.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_drift_between_stints_is_measured(seed):
    var = _alternate(0.15, seed=seed).variance(JITTER * JITTER)
    assert 0.3 * 0.15**2 < var < 3 * 0.15**2


def test_stints_at_other_batch_sizes_are_not_compared():
    # The bucket's batch size moves by a fifth from one stint to the next: their step times
    # differ by that, not by drift, and no pair is formed.
    d = _alternate(0.15, b_of=lambda i: 8.0 * (1.2 if i % 4 < 2 else 1.0))
    assert d.variance(JITTER * JITTER) == 0.0


def test_stints_are_counted_per_cell_and_age_with_it():
    d = StintDrift(buckets=1, arms=(0, 1))
    assert d.stints(0, 1) == 1.0  # never ran: as one stint
    for k in (0, 1, 0, 1, 0):
        d.observe(0, k, -4.0, 1.0, 8.0, 1.0)
    assert d.stints(0, 0) == 3.0 and d.stints(0, 1) == 2.0
    d.observe(0, 0, -4.0, 1.0, 8.0, 0.5)  # same stint; the cells' weights halve
    assert d.stints(0, 0) == 1.5 and d.stints(0, 1) == 1.0


def _k1_sd(drift_sd: float) -> float:
    """Posterior spread of k = 1's log step time at eight requests after 60 stints of it,
    alternating with k = 0, 40 steps each, whose step times drift by ``drift_sd`` (log)."""
    rng = random.Random(0)
    p = make_policy("model", arms=(0, 1, 3), seed=0)
    assert isinstance(p, ModelPolicy)
    for i in range(120):
        k, t = i % 2, 0.01 * (1.0 + 0.2 * (i % 2)) * math.exp(rng.gauss(0.0, drift_sd))
        for _ in range(4):
            p.update(Observation(8, k, 10, 80 + 40 * k, 40 * k, 80 * k, 10 * t))
    return float(p._step_times().sd[Buckets().index(8), 1])


def test_a_cell_measured_over_drifting_stints_knows_its_step_time_no_better_than_them():
    # Sixty stints of k = 1 under a 20 % drift pin its mean to ~20 %/sqrt(60) = 2.6 %,
    # however many steps they held; without drift the same 2,400 steps pin it far closer.
    steady, drifting = _k1_sd(0.0), _k1_sd(0.2)
    assert steady < 0.01 and drifting > 0.015, (steady, drifting)
