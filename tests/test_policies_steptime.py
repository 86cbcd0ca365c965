"""Step-time posterior: the cost model as the mean, each cell's deviation learnt from data."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import numpy as np

from policies import Buckets
from policies._steptime import Cell, step_time_posterior

ARMS = (0, 1, 3, 5, 7)
BUCKETS = Buckets()
REP_B = [float(min(e, 300)) for e in (*BUCKETS.edges, 300)]


def bilinear_s(b: float, k: int) -> float:
    return (5 + 0.04 * b + k * (0.5 + 0.06 * b)) / 1000


def moe_s(b: float, k: int) -> float:
    n = b * (k + 1)
    draft = 0.2 + 0.002 * b
    return (2 + 10 * (1 - (1 - 8 / 128) ** n) + 0.01 * n + (k + 1) * draft) / 1000


def padded_s(b: float, k: int) -> float:
    """A verify padded to the next power-of-two width (CUDA graphs): steps no smooth cost
    model in b and k follows."""
    pad = 2 ** math.ceil(math.log2(max(b * (k + 1), 1)))
    return (3 + 0.08 * pad + 0.3 * k + 0.01 * b * k) / 1000


def cells(step: Callable[[float, int], float], sd: float = 0.005) -> list[Cell]:
    """Every arm at 1, 16 and 64 requests, except k = 7 at 16 and 64."""
    return [
        Cell(bucket=BUCKETS.index(b), arm=k, b=b, log_t=math.log(step(b, k)), sd=sd, weight=200)
        for b in (1, 16, 64) for k in ARMS if b == 1 or k != 7
    ]


def test_misfit_is_learnt_from_the_cells_and_widens_the_cells_never_run():
    j, k7 = BUCKETS.index(16), ARMS.index(7)
    dense = step_time_posterior(cells(bilinear_s), REP_B, ARMS)
    padded = step_time_posterior(cells(padded_s), REP_B, ARMS)
    assert dense.tau < 0.02 < 0.05 < padded.tau
    # The unmeasured k = 7 at b = 16: tight and right where the model fits ...
    assert dense.sd[j, k7] < 0.02
    assert abs(dense.mean[j, k7] - math.log(bilinear_s(16, 7))) < 0.02
    # ... wide where it does not, and the truth well inside the spread.
    assert padded.sd[j, k7] > 0.05
    assert abs(padded.mean[j, k7] - math.log(padded_s(16, 7))) < 2 * padded.sd[j, k7]


def test_weight_reads_that_saturate_in_tokens_are_shared_across_arms():
    # MoE: the experts a step wakes saturate in the tokens it carries, b·(k+1). Every arm at
    # 1-16 requests, deep arms at 64 too: k = 0 at 256 requests carries 256 tokens, as k = 3
    # at 64 does, so the model places k = 0 there from the deep arms' curve ...
    few = [Cell(bucket=BUCKETS.index(b), arm=k, b=b, log_t=math.log(moe_s(b, k)), sd=0.005,
                weight=200) for b in (1, 4, 16, 64) for k in ARMS if b < 64 or k >= 3]
    post = step_time_posterior(few, REP_B, ARMS)
    j = BUCKETS.index(256)
    assert abs(post.mean[j, 0] - math.log(moe_s(256, 0))) < 0.1
    # ... where a straight line through k = 0's own cells (steep at few requests, as the
    # experts it wakes grow) overshoots by a factor of two or more.
    slope = (moe_s(16, 0) - moe_s(4, 0)) / 12
    assert math.log((moe_s(16, 0) + 240 * slope) / moe_s(256, 0)) > 0.7


def test_a_measured_cell_is_its_measurement():
    post = step_time_posterior(cells(moe_s, sd=0.001), REP_B, ARMS)
    for c in cells(moe_s):
        assert abs(post.mean[c.bucket, ARMS.index(c.arm)] - c.log_t) < 0.005
        assert post.sd[c.bucket, ARMS.index(c.arm)] < 0.005


def test_the_cost_model_keeps_its_costs_non_negative():
    # MoE cells at 4 and 16 requests pull a free bilinear fit to a negative cost per draft
    # token and request, i.e. deep drafts cheaper than none at large batches.
    few = [Cell(bucket=BUCKETS.index(b), arm=k, b=b, log_t=math.log(moe_s(b, k)), sd=0.005,
                weight=200) for b in (4, 16) for k in ARMS]
    post = step_time_posterior(few, REP_B, ARMS)
    assert post.theta is not None and (post.theta[:7] >= 0).all()
    assert post.fit_log_t(256, 7) > post.fit_log_t(256, 1)


def test_joint_draws_are_reproducible_and_move_shared_errors_together():
    post = step_time_posterior(cells(moe_s)[:6], REP_B, ARMS)  # b = 1 only
    j = BUCKETS.index(64)
    a = [post.draw(j, random.Random(7)) for _ in range(2)]
    assert np.array_equal(a[0], a[1])
    rng = random.Random(1)
    draws = np.array([post.draw(j, rng) for _ in range(400)])
    # Far from every measurement, k = 3 and k = 5 share most of their error.
    assert np.corrcoef(draws[:, 2], draws[:, 3])[0, 1] > 0.5
    assert abs(draws.std(axis=0)[2] - post.sd[j, 2]) < 0.3 * post.sd[j, 2]


def test_without_cells_every_cell_is_wide():
    post = step_time_posterior([], REP_B, ARMS)
    assert post.theta is None and (post.sd >= 0.5).all()
    assert post.draw(0, random.Random(0)).shape == (len(ARMS),)


def test_the_constrained_fit_is_the_optimum():
    # Karush-Kuhn-Tucker at the solution, on random problems: the shared costs are >= 0 and
    # none could lower the objective by rising (or, where positive, by moving at all); k = 0's
    # own two are free and stationary.
    from policies._steptime import _N_SHARED, _nnls

    rng = np.random.default_rng(3)
    p = _N_SHARED + 2
    for _ in range(200):
        a = rng.normal(size=(p + 3, p))
        reg = a.T @ a + 1e-3 * np.eye(p)
        rhs = rng.normal(size=p)
        theta = _nnls(reg, rhs)
        grad = rhs - reg @ theta
        scale = 1e-8 * (1 + np.abs(rhs).max())
        assert (theta[:_N_SHARED] >= 0).all()
        assert (grad[:_N_SHARED] <= scale * 10).all()
        assert np.abs(theta[:_N_SHARED] * grad[:_N_SHARED]).max() < scale * 10
        assert np.abs(grad[_N_SHARED:]).max() < scale * 10
