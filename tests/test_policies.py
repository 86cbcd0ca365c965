"""Contract tests every learning policy must pass, plus the registry."""

from __future__ import annotations

import math
import random

import pytest

import policies
from policies import POLICIES, Buckets, Observation, make_policy

ARMS = (0, 1, 3, 5)
ONE_BUCKET = Buckets((1,))  # bucket 0 = b 1, bucket 1 = everything larger

LEARNING = ["thompson", "ucb", "model", "optuna"]


# Mean emitted tokens per request-step by arm (chain acceptance, α ≈ 0.8): the helper
# below derives accepted drafts from it, so acceptance and step time stay consistent.
EMITTED = {0: 1.0, 1: 1.8, 3: 2.66, 5: 2.89, 7: 3.0}


def obs(k: int, goodput: float, *, b: int = 1, steps: int = 100) -> Observation:
    """``steps`` decode steps of ``b`` requests at arm ``k`` yielding ``goodput`` tokens/s."""
    emitted = round(EMITTED[k] * b * steps)
    return Observation(
        b=b, k=k, decode_steps=steps, emitted_tokens=emitted,
        accepted_drafts=emitted - b * steps, drafted_tokens=k * b * steps,
        busy_s=emitted / goodput,
    )


def run(policy, truth, ticks: int, *, b: int = 1, seed: int = 7, noise: float = 0.02):
    """Drive ``policy`` against true per-arm goodputs; returns the arms it ran, in order."""
    rng = random.Random(seed)
    ran = []
    for _ in range(ticks):
        table = policy.propose()
        k = next(kk for bound, kk in table if bound is None or b <= bound)
        g = truth(k) if callable(truth) else truth[k]
        policy.update(obs(k, g * math.exp(rng.gauss(0, noise)), b=b))
        ran.append(k)
    return ran


TRUTH = {0: 100.0, 1: 150.0, 3: 190.0, 5: 170.0}


@pytest.mark.parametrize("name", LEARNING)
def test_same_seed_same_proposals(name):
    a = make_policy(name, arms=ARMS, buckets=ONE_BUCKET, seed=3)
    b = make_policy(name, arms=ARMS, buckets=ONE_BUCKET, seed=3)
    assert run(a, TRUTH, 80) == run(b, TRUTH, 80)


@pytest.mark.parametrize("name", LEARNING)
def test_better_arm_wins_on_fixed_history(name):
    p = make_policy(name, arms=ARMS, buckets=ONE_BUCKET, seed=0)
    for _ in range(3):  # 300 steps per arm, no noise
        for k, g in TRUTH.items():
            assert p.update(obs(k, g))
    assert p.snapshot().chosen[0] == 3
    if name != "model":  # the model predicts the empty bucket; the bandits borrow an arm
        assert p.greedy() == ((None, 3),)


@pytest.mark.parametrize("name", LEARNING)
def test_learns_online(name):
    p = make_policy(name, arms=ARMS, buckets=ONE_BUCKET, seed=1)
    ran = run(p, TRUTH, 300)
    assert p.greedy() == ((None, 3),)
    assert ran[-50:].count(3) >= 40


@pytest.mark.parametrize("name", LEARNING)
@pytest.mark.parametrize(
    "bad",
    [
        Observation(1, 3, 10, 30, 10, 30, float("nan")),
        Observation(1, 3, 10, 30, 10, 30, 0.0),
        Observation(1, 3, 10, 30, 10, 30, -1.0),
        Observation(1, 3, -10, 30, 10, 30, 0.1),
        Observation(1, 3, 10, -30, 10, 30, 0.1),
        Observation(1, 3, 10, float("nan"), 10, 30, 0.1),  # type: ignore[arg-type]
        Observation(1, 3, 0, 0, 0, 0, 0.1),
        Observation(1, 3, 10, 0, 0, 30, 0.1),
        Observation(1, 2, 10, 30, 10, 30, 0.1),  # not a built arm
        Observation(0, 3, 10, 30, 10, 30, 0.1),
    ],
)
def test_bad_observations_rejected_without_change(name, bad):
    p = make_policy(name, arms=ARMS, buckets=ONE_BUCKET, seed=0)
    for k, g in TRUTH.items():
        p.update(obs(k, g))
    before = p.snapshot()
    assert p.update(bad) is False
    assert p.snapshot() == before


@pytest.mark.parametrize("name", LEARNING)
def test_follows_a_change_of_best_arm(name):
    p = make_policy(name, arms=ARMS, buckets=ONE_BUCKET, seed=2, memory_steps=5_000)
    run(p, TRUTH, 300)
    assert p.greedy() == ((None, 3),)
    shifted = {0: 100.0, 1: 190.0, 3: 150.0, 5: 120.0}  # best arm moves 3 -> 1
    ran = run(p, shifted, 400, seed=8)
    assert p.greedy() == ((None, 1),)
    assert ran[-50:].count(1) >= 40


@pytest.mark.parametrize("name", LEARNING)
def test_guardrail_reverts_a_held_bad_arm(name):
    # A huge switch margin makes the greedy choice stick to its first arm; only the
    # guardrail can take it off once the alternative is measurably better.
    p = make_policy(name, arms=(1, 3), buckets=ONE_BUCKET, seed=0, switch_margin=5.0)
    p.update(obs(3, 60.0, steps=400))
    assert p.snapshot().chosen[0] == 3
    p.update(obs(3, 60.0, steps=400))
    p.update(obs(1, 100.0, steps=400))
    assert p.snapshot().chosen[0] == 1
    notes = p.snapshot().notes
    assert len(notes) == 1 and "reverted to k=1" in notes[0] and "bucket 1:" in notes[0]


@pytest.mark.parametrize("name", LEARNING)
def test_exploration_budget_respected(name):
    budget, allowance = 0.05, 500
    p = make_policy(
        name, arms=ARMS, buckets=ONE_BUCKET, seed=4, explore_budget=budget,
        explore_allowance_steps=allowance, memory_steps=math.inf, min_dwell_steps=100,
    )
    # Nearly equal arms: an unconstrained sampler would keep exploring.
    truth = {0: 100.0, 1: 101.0, 3: 102.0, 5: 101.5}
    run(p, truth, 1_000, noise=0.2)
    off, total = p.exploration(0)
    assert total > 90_000
    # At most one dwell over the cap.
    assert off <= budget * total + 100


@pytest.mark.parametrize("name", ["thompson", "ucb", "model"])
@pytest.mark.parametrize("slowdown", [1.0, 10.0])
def test_dwell_counts_in_greedy_steps_of_time(name, slowdown):
    """An exploring arm whose steps take ten times the greedy arm's has served its dwell
    after a tenth of the steps; the exploration budget still counts steps."""
    p = make_policy(name, arms=ARMS, buckets=ONE_BUCKET, seed=0, min_dwell_steps=8)
    for _ in range(5):
        for k, g in TRUTH.items():
            p.update(obs(k, g))
    assert p.greedy_arms()[0] == 3
    st = p._state[0]
    st.live, st.dwell = 5, 0.0  # k = 5 was just proposed
    off_before, _ = p.exploration(0)
    greedy_step_s = EMITTED[3] / TRUTH[3]
    emitted = round(EMITTED[5] * 2)
    p.update(Observation(b=1, k=5, decode_steps=2, emitted_tokens=emitted,
                         accepted_drafts=emitted - 2, drafted_tokens=10,
                         busy_s=2 * slowdown * greedy_step_s))
    off, _ = p.exploration(0)
    arm = next(kk for bound, kk in p.propose() if bound is None or bound >= 1)
    if slowdown == 1.0:
        assert arm == 5  # two greedy steps' worth of time: still within its dwell
    else:
        assert arm == 3  # twenty greedy steps' worth: the dwell is served
    # ... and the budget charges the two steps as two.
    assert off == pytest.approx(off_before * p._gamma**2 + 2)


@pytest.mark.parametrize("name", LEARNING)
def test_replaying_observations_rebuilds_the_state(name):
    live = make_policy(name, arms=ARMS, buckets=Buckets((1, 4)), seed=5)
    rng = random.Random(0)
    history = []
    for i in range(200):
        table = live.propose()
        b = (1, 3, 9)[i % 3]
        k = next(kk for bound, kk in table if bound is None or b <= bound)
        o = obs(k, TRUTH[k] * b / (1 + 0.1 * b) * math.exp(rng.gauss(0, 0.05)), b=b)
        live.update(o)
        history.append(o)
    restarted = make_policy(name, arms=ARMS, buckets=Buckets((1, 4)), seed=5)
    for o in history:
        restarted.update(o)
    assert restarted.snapshot() == live.snapshot()
    assert restarted.greedy() == live.greedy()


def test_registry_and_errors():
    assert "thompson" in POLICIES
    assert policies.DEFAULT_POLICY in POLICIES
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        make_policy("nope", arms=ARMS)
    with pytest.raises(ValueError, match="unknown parameter 'bogus'"):
        make_policy("thompson", arms=ARMS, bogus=1)
    with pytest.raises(ValueError, match="memory_steps"):
        make_policy("thompson", arms=ARMS, memory_steps=0)
    with pytest.raises(ValueError, match="explore_budget"):
        make_policy("thompson", arms=ARMS, explore_budget=1.5)
    with pytest.raises(ValueError, match="sample_scale"):
        make_policy("thompson", arms=ARMS, sample_scale=float("nan"))
    with pytest.raises(ValueError, match="initial_arm"):
        make_policy("thompson", arms=ARMS, initial_arm=4)


@pytest.mark.parametrize("name", LEARNING)
def test_tables_only_use_built_arms(name):
    p = make_policy(name, arms=ARMS, seed=0)
    for i in range(60):
        for _, k in p.propose():
            assert k in ARMS
        p.update(obs(ARMS[i % 4], 100.0 + i, b=1 + (i * 7) % 300))
    assert p.greedy()[-1][0] is None


def test_public_names_match_all():
    public = {n for n in dir(policies) if not n.startswith("_")} - {"annotations"}
    assert set(policies.__all__) == public


def test_sum_by_arm_adds_rows_of_one_b_k_in_b_k_order_without_stepless_ones() -> None:
    rows = [
        Observation(8, 2, 10, 50, 20, 30, 0.5),
        Observation(4, 1, 5, 12, 4, 5, 0.25),
        Observation(8, 2, 6, 30, 10, 18, 0.25),
        Observation(16, 0, 0, 0, 0, 0, 0.0),
    ]
    assert policies.sum_by_arm(rows) == [
        Observation(4, 1, 5, 12, 4, 5, 0.25),
        Observation(8, 2, 16, 80, 30, 48, 0.75),
    ]
