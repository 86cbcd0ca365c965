"""Acceptance posterior: the chain as the mean, each arm's deviation learnt from data; and the
model policy's use of it (misfit widens, a fitting chain keeps exploration low)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from policies import Buckets, Observation, expected_accepted, make_policy
from policies._acceptance_fit import ArmAcceptance, acceptance_posterior, chain_accepted
from tuner.sim.acceptance import AcceptanceShape

ARMS = (0, 1, 3, 5, 7)
DELTA = 0.973


def rising(a: float, rise: float, k: int) -> float:
    """Mean accepted drafts of conditional acceptance rising with depth (the worlds' shape)."""
    return float(AcceptanceShape(kind="rising", rise=rise).survival(a, k).sum()) if k else 0.0


def measured(accepted, arms=(1, 3, 5), sd=0.01) -> list[ArmAcceptance]:
    return [ArmAcceptance(k, accepted(k), sd) for k in arms]


def test_the_vectorised_chain_is_the_chain():
    for alpha in (0.0, 0.3, 0.77, 1.0):
        got = chain_accepted(alpha, DELTA, ARMS)
        want = [expected_accepted(alpha, DELTA, k) for k in ARMS]
        assert np.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_misfit_is_learnt_from_the_arms_and_widens_the_arm_never_run():
    k7 = ARMS.index(7)
    chain = acceptance_posterior(measured(lambda k: expected_accepted(0.75, DELTA, k)),
                                 ARMS, delta=DELTA)
    rise = acceptance_posterior(measured(lambda k: rising(0.55, 0.7, k)), ARMS, delta=DELTA)
    assert chain.tau < 0.02 < 0.05 < rise.tau
    # k = 7 never ran: tight and right where the chain fits ...
    assert chain.sd[k7] < 0.02
    assert abs(chain.mean[k7] - math.log1p(expected_accepted(0.75, DELTA, 7))) < 0.02
    # ... wide where it does not, with the truth inside the spread.
    assert rise.sd[k7] > 2 * chain.sd[k7] and rise.sd[k7] > 0.04
    assert abs(rise.mean[k7] - math.log1p(rising(0.55, 0.7, 7))) < 2 * rise.sd[k7]


def test_a_measured_arm_is_its_measurement_and_k0_emits_one_token():
    post = acceptance_posterior(measured(lambda k: rising(0.55, 0.7, k), sd=0.001), ARMS,
                                delta=DELTA)
    for k in (1, 3, 5):
        assert abs(post.mean[ARMS.index(k)] - math.log1p(rising(0.55, 0.7, k))) < 0.003
    assert post.mean[0] == 0.0 and post.sd[0] < 1e-4


def test_draws_are_reproducible_joint_and_within_what_an_arm_can_emit():
    post = acceptance_posterior(measured(lambda k: expected_accepted(0.6, DELTA, k),
                                         arms=(3,), sd=0.3), ARMS, delta=DELTA)
    a, b = post.draw(random.Random(3)), post.draw(random.Random(3))
    assert np.array_equal(a, b)
    rng = random.Random(0)
    draws = np.array([post.draw(rng) for _ in range(400)])
    assert (draws >= 0).all() and (draws <= np.log1p(np.array(ARMS)) + 1e-12).all()
    assert np.allclose(draws[:, 0], 0.0, atol=1e-3)
    # One arm measured, loosely: the others move with it (one α moves them all).
    assert np.corrcoef(draws[:, 3], draws[:, 4])[0, 1] > 0.5


def test_without_measurements_every_drafting_arm_is_wide():
    post = acceptance_posterior([], ARMS, delta=DELTA)
    assert (post.sd[1:] > 0.05).all()


# --- the policy -------------------------------------------------------------------------

def step_s(b: int, k: int) -> float:
    # Bilinear (the cost model fits exactly): only acceptance can mislead the policy here.
    return (5 + 0.04 * b + k * (0.5 + 0.06 * b)) / 1000


def obs(b: int, k: int, accepted: float, steps: int = 200) -> Observation:
    acc = round(accepted * b * steps)
    emitted = b * steps + acc
    return Observation(b, k, steps, emitted, acc, k * b * steps, step_s(b, k) * steps)


def warmed(accepted, seed: int = 0, b: int = 16):
    """A model policy that measured arms 0, 1 and 3 at ``b`` requests, and that bucket."""
    p = make_policy("model", arms=ARMS, seed=seed)
    for _ in range(10):
        for k in (0, 1, 3):
            assert p.update(obs(b, k, accepted(k)))
    return p, Buckets().index(b)


def spread(p, j: int, arm: int) -> float:
    """Relative spread of the policy's goodput estimate of ``arm`` in bucket ``j``."""
    e = next(e for e in p.snapshot().estimates if e.bucket == j and e.arm == arm)
    return e.std / e.estimate


def best(accepted, b: int = 16) -> int:
    return max(ARMS, key=lambda k: (1 + accepted(k)) / step_s(b, k))


def test_misfit_widens_the_policys_estimate_of_the_deep_arms():
    # The same history shape (k = 0, 1, 3 at 16 requests); acceptance rising with depth
    # (k = 7 best, which a chain through k = 1 and 3 cannot say) against a chain.
    def rise(k):
        return rising(0.7, 0.5, k)

    def chain(k):
        return expected_accepted(0.75, DELTA, k)

    assert best(rise) == 7 and best(chain) == 3
    p_rise, j = warmed(rise)
    p_chain, _ = warmed(chain)
    for arm in (5, 7):
        assert spread(p_rise, j, arm) > 1.5 * spread(p_chain, j, arm)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_where_the_chain_fits_the_deep_arms_are_left_alone(seed):
    def acc(k):
        return expected_accepted(0.75, DELTA, k)

    p, j = warmed(acc, seed)
    buckets = Buckets()
    assert p.snapshot().chosen[j] == best(acc) == 3
    chosen = []
    for _ in range(150):
        k = buckets.arms_of(p.propose())[j]
        chosen.append(k)
        p.update(obs(16, k, acc(k), steps=50))
    assert chosen.count(3) >= 145 and p.snapshot().chosen[j] == 3
def test_an_arm_whose_measurements_scatter_is_less_certain():
    # Same mean acceptance at k = 3; one server's requests all alike, the other's alternating
    # easy and hard (diverse traffic): the second arm's estimate is wider.
    def fed(values):
        p = make_policy("model", arms=ARMS, seed=0)
        for v in values:
            p.update(obs(4, 3, v))
        j = Buckets().index(4)
        return next(e for e in p.snapshot().estimates if e.bucket == j and e.arm == 3)

    steady = fed([1.5] * 20)
    diverse = fed([0.5, 2.5] * 10)
    assert abs(steady.estimate - diverse.estimate) < 0.02 * steady.estimate
    assert diverse.std > 2 * steady.std
