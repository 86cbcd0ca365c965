"""The model-based policy: what it shares across buckets, and how it follows a shift."""

from __future__ import annotations

from policies import Buckets, Observation, expected_emitted, make_policy

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


def test_explore_min_prob_is_validated():
    import pytest

    with pytest.raises(ValueError, match="explore_min_prob"):
        make_policy("model", arms=ARMS, explore_min_prob=0.5)


def _explored(explore_min_prob: float, b: int = 1) -> set[int]:
    """Arms a model policy proposes at ``b`` over 150 decisions fed with what it chose."""
    buckets = Buckets()
    j = buckets.index(b)
    p = make_policy("model", arms=ARMS, seed=3, explore_min_prob=explore_min_prob)
    for k in ARMS:
        p.update(obs(b, k, 0.8, steps=20))
    seen = set()
    for _ in range(150):
        k = buckets.arms_of(p.propose())[j]
        seen.add(k)
        p.update(obs(b, k, 0.8, steps=50))
    return seen


def test_an_arm_with_little_chance_of_winning_is_not_explored():
    # Without the floor the posterior occasionally draws k=3 at b=1 (the best is k=5);
    # with it, only arms with a real chance of winning are tried.
    assert _explored(0.0) > {best_arm(1, 0.8)}
    assert _explored(0.45) == {best_arm(1, 0.8)}


def _explored_unmeasured(explore_min_ratio: float, b: int = 1) -> set[int]:
    """Arms proposed at ``b`` over 200 decisions when k = 0 never ran anywhere."""
    buckets = Buckets()
    j = buckets.index(b)
    p = make_policy("model", arms=ARMS, seed=5, explore_min_ratio=explore_min_ratio)
    for k in ARMS[1:]:
        p.update(obs(b, k, 0.7, steps=20))
    seen = set()
    for _ in range(200):
        k = buckets.arms_of(p.propose())[j]
        seen.add(k)
        p.update(obs(b, k, 0.7, steps=50))
    return seen


def test_an_arm_expected_far_below_the_greedy_one_waits_for_a_cheaper_bucket():
    # k = 0 has never run, so the model's widest spread leaves it a few percent of chance at
    # one request, where it delivers half of k = 3's goodput; one dwell there costs more
    # than the tolerance. The expected-ratio bar skips it; without the bar it is tried.
    assert best_arm(1, 0.7) == 3
    assert 0 in _explored_unmeasured(0.0)
    assert 0 not in _explored_unmeasured(2 / 3)


def test_explore_min_ratio_is_validated():
    import pytest

    with pytest.raises(ValueError, match="explore_min_ratio"):
        make_policy("model", arms=ARMS, explore_min_ratio=1.0)
