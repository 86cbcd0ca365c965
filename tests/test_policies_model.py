"""The model-based policy: what it shares across buckets, and how it follows a shift."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from policies import Buckets, ModelPolicy, Observation, expected_emitted, make_policy
from policies._acceptance import chain_accepted, fit_chain
from policies._model import DEFAULT_CHAIN_DELTA
from policies._pooled import PooledAcceptance

ARMS = (0, 1, 3, 5)


def step_s(b: int, k: int) -> float:
    # Bilinear, as the anchors' cost model: per-request and per-draft-token costs.
    return (5 + 0.04 * b + k * (0.5 + 0.06 * b)) / 1000


def obs(b: int, k: int, alpha: float, steps: int = 200) -> Observation:
    emitted = round(expected_emitted(alpha, 1.0, k) * b * steps)
    return Observation(b, k, steps, emitted, emitted - b * steps, k * b * steps,
                       step_s(b, k) * steps)


def best_arm(b: int, alpha: float) -> int:
    return max(ARMS, key=lambda k: expected_emitted(alpha, 1.0, k) / step_s(b, k))


def test_predicts_a_bucket_it_never_ran_from_the_others():
    p = make_policy("model", arms=ARMS, seed=0)
    for _ in range(3):
        for b in (1, 64):
            for k in ARMS:
                assert p.update(obs(b, k, 0.8))
    buckets = Buckets()
    chosen = p.snapshot().chosen
    # Measured buckets: the measured best arm.
    assert chosen[buckets.index(1)] == best_arm(1, 0.8) == 5
    assert chosen[buckets.index(64)] == best_arm(64, 0.8) == 1
    # b = 25..32 never ran; acceptance and step time carry over: k = 3 (not a neighbour's).
    assert chosen[buckets.index(32)] == best_arm(32, 0.8) == 3
    est = {(e.bucket, e.arm): e for e in p.snapshot().estimates}
    e = est[(buckets.index(32), 3)]
    assert e.n == 0 and e.estimate > 0 and e.std > 0


def test_acceptance_shift_is_detected_and_followed():
    p = make_policy("model", arms=ARMS, seed=0)
    j = Buckets().index(16)
    for _ in range(5):
        for k in ARMS:
            p.update(obs(16, k, 0.8))
    assert p.snapshot().chosen[j] == best_arm(16, 0.8) == 3
    # The workload turns hard: the arms that draft keep running, acceptance drops.
    for i in range(12):
        p.update(obs(16, (1, 3, 5)[i % 3], 0.5, steps=100))
    assert p.snapshot().chosen[j] == best_arm(16, 0.5) == 1
    assert any("acceptance changed" in n for n in p.snapshot().notes)


def test_acceptance_that_rises_with_depth_is_followed_past_the_measured_arms():
    # Rejection shrinking by a quarter per position (0.6, 0.7, 0.775, ...): a draft that got
    # far is on an easy stretch. Measured at k = 1 and 3, a chain of the default δ through
    # them puts k = 5 at ~1.5 accepted drafts where it accepts 1.85; the two arms' shape
    # moves it most of the way (δ's prior gives way only to this much evidence).
    def accepted(k: int) -> float:
        total, p = 0.0, 1.0
        for i in range(k):
            p *= 1 - 0.4 * 0.75**i
            total += p
        return total

    p = make_policy("model", arms=ARMS, seed=0)
    assert isinstance(p, ModelPolicy)
    for _ in range(5):
        for k in (1, 3):
            a = round(accepted(k) * 16 * 200)
            p.update(Observation(16, k, 200, 16 * 200 + a, a, k * 16 * 200, step_s(16, k) * 200))
    mean, _ = p._acceptance()
    assert mean[1] == pytest.approx(accepted(1), abs=0.02)
    assert mean[3] == pytest.approx(accepted(3), abs=0.05)
    assert accepted(5) - 0.2 < mean[5] < accepted(5) + 0.1


def test_a_chain_is_fitted_in_alpha_and_delta_and_caps_each_position_at_one():
    assert chain_accepted(0.8, 0.95, 5) == pytest.approx(expected_emitted(0.8, 0.95, 5) - 1)
    # δ above 1: position 2's conditional acceptance 0.9·1.2 is capped at 1.
    assert chain_accepted(0.9, 1.2, 3) == pytest.approx(0.9 + 0.9 + 0.9)
    exact = [(k, chain_accepted(0.62, 1.06, k), 1.0) for k in (1, 3, 5)]
    alpha, delta = fit_chain((1, 3, 5, 7), exact, 0.973)
    assert alpha == pytest.approx(0.62, abs=0.003) and delta == pytest.approx(1.06)
    # One arm cannot tell δ apart: the prior's δ stays, exactly.
    alpha, delta = fit_chain((1, 3, 5, 7), exact[1:2], 0.973, 0.1)
    assert delta == 0.973
    assert chain_accepted(alpha, delta, 3) == pytest.approx(exact[1][1], abs=0.01)


def test_one_measured_arm_keeps_the_default_chain():
    p = make_policy("model", arms=ARMS, seed=0)
    assert isinstance(p, ModelPolicy)
    for _ in range(5):
        p.update(obs(16, 3, 0.8))
    mean, _ = p._acceptance()
    assert p._delta == p.params.chain_delta
    assert mean[5] == pytest.approx(expected_emitted(p._alpha[0], p.params.chain_delta, 5) - 1)


def moe_step_s(b: int, k: int) -> float:
    # Mixture of experts (128 experts, top-8): a step reads the experts its b·(k+1) tokens
    # route to, which saturates, so deep drafts get relatively cheaper up to mid batches.
    n = b * (k + 1)
    draft = 0.2 + 0.002 * b
    return (2 + 10 * (1 - (1 - 8 / 128) ** n) + 0.01 * n + (k + 1) * draft) / 1000


def tiled_step_s(b: int, k: int) -> float:
    # The MoE surface with its verify padded to power-of-two widths (CUDA graphs), where a
    # width of exactly 128 rows fills the kernel's tiles and runs 15 % cheaper: steps and a
    # dip no smooth cost model follows.
    n = 2 ** math.ceil(math.log2(max(b * (k + 1), 1)))
    draft = 0.2 + 0.002 * b
    t = (2 + 6 * (1 - (1 - 8 / 128) ** n) + 0.03 * n + (k + 1) * draft) / 1000
    return t * 0.85 if n == 128 else t


def surface_obs(step: Callable[[int, int], float], b: int, k: int, steps: int = 200,
                alpha: float = 0.8) -> Observation:
    # Acceptance is the model's own chain, so only the step-time surface can misfit.
    emitted = round(expected_emitted(alpha, DEFAULT_CHAIN_DELTA, k) * b * steps)
    return Observation(b, k, steps, emitted, emitted - b * steps, k * b * steps,
                       step(b, k) * steps)


def surface_best(step: Callable[[int, int], float], b: int) -> int:
    return max(ARMS7, key=lambda k: expected_emitted(0.8, DEFAULT_CHAIN_DELTA, k) / step(b, k))


ARMS7 = (0, 1, 3, 5, 7)


def _run_mid_batch(step: Callable[[int, int], float], seed: int
                   ) -> tuple[ModelPolicy, int, list[int]]:
    """k = 7 measured at one request only; every other arm at 1, 16 and 64. Then 150
    decisions at b = 16, each fed what the policy chose."""
    buckets = Buckets()
    j = buckets.index(16)
    p = make_policy("model", arms=ARMS7, seed=seed)
    assert isinstance(p, ModelPolicy)
    for _ in range(3):
        for b in (1, 16, 64):
            for k in ARMS7 if b == 1 else ARMS7[:-1]:
                assert p.update(surface_obs(step, b, k))
    first = p.snapshot().chosen[j]
    chosen = []
    for _ in range(150):
        k = buckets.arms_of(p.propose())[j]
        chosen.append(k)
        p.update(surface_obs(step, 16, k, steps=50))
    return p, first, chosen


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_deep_draft_the_cost_model_rules_out_is_tried_where_the_model_misfits(seed):
    # On the tiled surface k = 7 loses at one request (where it was measured) and wins at 16,
    # by a dip the cost model cannot follow, so its mean prefers k = 5 there. The cells'
    # misfit widens the unmeasured k = 7 at b = 16: it is tried, and wins.
    assert surface_best(tiled_step_s, 1) == 3 and surface_best(tiled_step_s, 16) == 7
    p, first, chosen = _run_mid_batch(tiled_step_s, seed)
    assert first != 7 and 7 in chosen
    assert p.snapshot().chosen[Buckets().index(16)] == 7


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_where_the_cost_model_fits_nothing_is_explored(seed):
    # The same history on the bilinear surface: the model fits, the unmeasured k = 7 at
    # b = 16 is predicted tightly (far behind), and the bucket stays on its best arm.
    assert surface_best(step_s_all, 16) == 3
    _, first, chosen = _run_mid_batch(step_s_all, seed)
    assert first == 3 and set(chosen) == {3}


def step_s_all(b: int, k: int) -> float:
    return step_s(b, k)


def test_every_arm_of_a_bucket_with_traffic_keeps_a_chance():
    # k = 0 never ran anywhere, k = 7 only at b = 1: the posterior still gives every arm of
    # every bucket with traffic a spread, so none is excluded by the model alone.
    p, _, _ = _run_mid_batch(moe_step_s, 0)
    snap = p.snapshot()
    for j in {Buckets().index(b) for b in (1, 16, 64)}:
        arms = {e.arm: e for e in snap.estimates if e.bucket == j}
        assert set(arms) == set(ARMS7)
        assert all(e.std > 0 and e.estimate > 0 for e in arms.values())


def test_zero_arm_sd_is_validated():
    with pytest.raises(ValueError, match="zero_arm_sd"):
        make_policy("model", arms=ARMS, zero_arm_sd=0.0)


def _judged(jitter: float) -> float:
    """Posterior spread of k = 1's log step time at one request after k = 1 ran once for 60
    steps and k = 3 ran 40 intervals whose step times swing by ``jitter`` (log)."""
    p = make_policy("model", arms=(0, 1, 3), seed=0)
    assert isinstance(p, ModelPolicy)
    for i in range(40):
        t = 0.03 * math.exp(jitter if i % 2 else -jitter)
        p.update(Observation(1, 3, 30, 45, 15, 90, 30 * t))
        if i == 0:
            p.update(Observation(1, 1, 60, 75, 15, 60, 60 * 0.03))
    return float(p._step_times().sd[Buckets().index(1), 1])


def test_a_briefly_measured_arm_is_judged_by_the_jitter_the_server_shows():
    # A loaded CPU server's step times swing several-fold from one second to the next: one
    # arm's two seconds there say little, and its estimate must say so (else it is never
    # run again); on a steady server the same two seconds are precise.
    steady, noisy = _judged(0.0), _judged(0.5)
    assert steady < 0.01 and noisy > 0.05


def test_youth_ends_after_its_busy_seconds_on_a_slow_server():
    with pytest.raises(ValueError, match="young_s"):
        make_policy("model", arms=ARMS, young_s=-1.0)
    # Two-second decode steps: 500 steps would be a quarter of an hour of youth.
    p = make_policy("model", arms=(0, 1, 3), seed=0)
    assert isinstance(p, ModelPolicy)
    j = Buckets().index(1)
    for _ in range(2):
        p.update(Observation(1, 3, 2, 3, 1, 6, 4.0))
    assert p._state[j].steps < p.params.young_steps and p._busy[j] < p.params.young_s
    p.update(Observation(1, 3, 2, 3, 1, 6, 4.0))
    assert p._busy[j] >= p.params.young_s  # youth is over: posterior sampling from here


def dear_step_s(k: int) -> float:
    # One request on a mixture of experts whose drafts wake more experts: a drafting step
    # costs 1.7x a k = 0 step and more.
    return 0.010 * (1.0 if k == 0 else 1.4 + 0.3 * k)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_an_arm_the_bucket_measured_poor_is_not_explored_on_the_models_doubt_alone(seed):
    # At α 0.45 drafting loses by 15 % and more at one request, so the row is off and
    # acceptance is seen only while exploring: 80 request-steps at k = 1 and k = 5, too few
    # for the chain to pin α (sd ~0.29: its draws reach 0.75, where k = 3 would win). The
    # bucket's own goodput at those arms, measured over the same steps, says they lose; the
    # draws must heed it, and the unmeasured k = 3 is tried about once.
    buckets, j = Buckets(), Buckets().index(1)
    p = _explored_rarely(ARMS, seed)
    assert p.snapshot().chosen[j] == 0 and p._alpha[1] > 0.2  # α barely known
    drafted = 0
    for _ in range(200):
        k = buckets.arms_of(p.propose())[j]
        drafted += k > 0
        p.update(dear_obs(k, 20))
    assert drafted <= 6, f"{drafted} of 200 decisions drafted"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_bucket_back_after_minutes_away_explores_on_the_models_doubt_again(monkeypatch, seed):
    # The same history, then five minutes of busy time at 64 requests: what the bucket of
    # one request measured was measured under the acceptance of its time, so it ages as
    # acceptance does, and the model's doubt decides again how often drafting is tried.
    # (The draws themselves: what a drawn probe would lose is weighed after them, below.)
    from policies import _model

    monkeypatch.setattr(_model, "_EXPLORE_REGRET", 1.0)
    j = Buckets().index(1)
    p = _explored_rarely((0, 1, 5), seed)
    fresh = sum(p._sample(j, 0) > 0 for _ in range(400))
    for _ in range(30):
        assert p.update(dear_obs(0, 1000, b=64))
    aged = sum(p._sample(j, 0) > 0 for _ in range(400))
    assert fresh <= 20 and aged >= 40, (fresh, aged)


def dear_obs(k: int, steps: int, b: int = 1) -> Observation:
    emitted = round(expected_emitted(0.45, DEFAULT_CHAIN_DELTA, k) * steps * b)
    return Observation(b, k, steps, emitted, emitted - steps * b, k * steps * b,
                       dear_step_s(k) * steps)


def _explored_rarely(arms: tuple[int, ...], seed: int) -> ModelPolicy:
    """One request, k = 0 for a minute; 80 request-steps each at k = 1 and k = 5 between."""
    p = make_policy("model", arms=arms, seed=seed)
    assert isinstance(p, ModelPolicy)
    for i in range(60):
        assert p.update(dear_obs(0, 100))
        if i % 4 == 0:
            assert p.update(dear_obs((1, 5)[i // 4 % 2], 10))
    return p


def test_a_step_time_measured_minutes_ago_gives_way_to_a_fresh_one():
    # Three requests, k = 1 timed at 20 ms while the machine was loaded; then three minutes
    # of k = 0 at 12 ms, and k = 1 tried again for 150 steps at 14 ms. Counted in decode
    # steps alone the old 1,800 steps would still outweigh the fresh ones (k = 1 ~19 ms,
    # behind k = 0 at this acceptance); in the bucket's busy seconds they have aged out.
    p = make_policy("model", arms=(0, 1, 3), seed=0)
    assert isinstance(p, ModelPolicy)
    j = Buckets().index(4)

    def ran(k: int, steps: int, step_s: float) -> None:
        emitted = 4 * steps + (round(0.6 * 4 * steps) if k else 0)
        assert p.update(Observation(4, k, steps, emitted, emitted - 4 * steps, 4 * k * steps,
                                    step_s * steps))  # fmt: skip

    for _ in range(60):
        ran(1, 30, 0.020)
    for _ in range(300):
        ran(0, 50, 0.012)
    for _ in range(5):
        ran(1, 30, 0.014)
    k1_ms = 1000 * math.exp(p._components()[0].mean[j, 1])
    assert k1_ms < 17.0, f"k = 1 predicted at {k1_ms:.1f} ms"


def test_step_time_memory_is_validated():
    with pytest.raises(ValueError, match="step_time_memory_s"):
        make_policy("model", arms=ARMS, step_time_memory_s=0.0)


def test_the_pooled_counts_restart_from_their_short_memory_when_acceptance_shifts():
    pool = PooledAcceptance((0, 1, 3), memory_request_steps=1e5, memory_steps=5e3,
                            memory_s=math.inf, corr=30.0, chain_delta=0.973,
                            delta_prior_sd=0.1, shift_z=3.0)
    for _ in range(100):  # 2 of 3 drafts accepted per request-step, long enough to be sure
        assert pool.add(3, 100, 800, 1600, 1.0) is None
    assert pool.direct()[3][0] == pytest.approx(2.0)
    assert not pool.delta_measured()  # one depth only: δ is its prior's
    said = None
    for _ in range(20):  # now 0.5: the short memory sees it long before the long one
        said = pool.add(3, 100, 800, 400, 1.0)
        if said is not None:
            break
    assert said is not None and "k=3" in said
    mean, _ = pool.direct()[3]
    # restarted from the short memory (a few hundred steps, part old, part new); the long
    # one, of tens of thousands of request-steps at 2.0, would still read above 1.9
    assert 0.5 < mean < 1.6
    pool.add(1, 10, 1000, 500, 1.0)
    assert pool.delta_measured()  # a second depth with 1000 request-steps


def test_a_shift_forgets_what_deeper_drafts_said_of_the_old_requests():
    """What the depth counts told of shallower arms and of the chain's shape is part of the
    long memory: after a shift it describes the old requests, and it restarts too."""
    pool = PooledAcceptance((0, 1, 3), memory_request_steps=1e5, memory_steps=5e3,
                            memory_s=math.inf, corr=30.0, chain_delta=0.973,
                            delta_prior_sd=0.1, shift_z=3.0)
    for _ in range(100):
        assert pool.add(3, 100, 800, 1600, 1.0) is None
        pool.add_depths(3, (10, 10, 20, 60), 8.0)  # 2.3 drafts: k = 1 accepts 0.9
    assert pool.shape() is not None
    assert pool.direct()[1][0] == pytest.approx(0.9)
    said = None
    while said is None:  # acceptance falls to 0.5 a request-step
        said = pool.add(3, 100, 800, 400, 1.0)
    assert pool.shape() is None
    assert 1 not in pool.direct()  # k = 1 never ran itself; nothing is left of the old


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_an_exploring_draw_is_weighed_by_what_its_probe_would_lose(monkeypatch, seed):
    # The Kimi PCIe box: every arm measured at 1-4 requests, k = 0 up to 64. At 64 requests
    # the model puts k = 7 at about two thirds of k = 0's goodput (the table: 30 %), k = 3 at
    # four fifths. A draw that picks an arm is run with probability 0.1 / its expected loss:
    # k = 7 about a quarter as often as its draws pick it, yet still tried.
    from policies import _model
    from tuner.sim.profiles import load_profile

    table, arms = load_profile("seed-kimi-pcie"), ARMS7
    picks = {}
    for weighed in (False, True):
        monkeypatch.setattr(_model, "_EXPLORE_REGRET", 0.1 if weighed else 1.0)
        p = make_policy("model", arms=arms, seed=seed)
        assert isinstance(p, ModelPolicy)
        for _ in range(10):
            for b in (1, 2, 4, 8, 16, 32, 64):
                for k in arms if b <= 4 else (0,):
                    assert p.update(surface_obs(table.step_s, b, k, steps=50, alpha=0.7))
        j = p.buckets.index(64)
        assert p.snapshot().chosen[j] == 0
        drawn = [p._sample(j, 0) for _ in range(2000)]
        picks[weighed] = {k: drawn.count(k) for k in arms}
    assert 0 < picks[True][7] <= picks[False][7] / 2.5, picks
    assert picks[True][3] >= picks[False][3] / 3, picks
