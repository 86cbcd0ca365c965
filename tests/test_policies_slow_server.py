"""The model policy on a server that runs a few decode steps a second (SGLang on a CPU, the
real-server tier): after acceptance changes it must follow within about a minute of traffic,
as it does within seconds at a GPU's step rate. Its memories are counted in decode steps,
which on such a server are many minutes; the busy-second memories bound them.

A closed loop against a small fake world (no clock: every observation carries its busy
seconds): step time ``T0(b) · (1 + c·k)`` at ±25 % jitter, chain acceptance with independent
positions, concurrency alternating 1 and 4 every 20 s, readings every 0.5 s, a table every
2 s, as the tier's daemon runs.
"""

from __future__ import annotations

import random

from policies import Buckets, Observation, make_policy

ARMS = (0, 1, 3)
T0 = {1: 0.3, 4: 0.5}  # seconds per step at k = 0: a few steps a second
DRAFT_COST = 0.15  # each draft step adds this share of T0: k3 best at α 0.8, k1 at 0.25
BEFORE_S, AFTER_S = 100.0, 90.0
RUNS = 40  # seeded closed loops; at most one in ten may end off the best arm


def goodput(alpha: float, b: int, k: int) -> float:
    return (1 + sum(alpha**i for i in range(1, k + 1))) / (T0[b] * (1 + DRAFT_COST * k))


def near_best(alpha: float, b: int, k: int) -> bool:
    return goodput(alpha, b, k) >= 0.95 * max(goodput(alpha, b, a) for a in ARMS)


def arm_for(table, b: int) -> int:
    return next(k for bound, k in table if bound is None or b <= bound)


def run(seed: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The greedy arms just before the change (α 0.8 -> 0.25) and AFTER_S seconds after."""
    rng = random.Random(seed)
    policy = make_policy("model", arms=ARMS, buckets=Buckets((1, 2, 4, 8)), seed=seed)
    table, carry, before = policy.propose(), {1: 0.0, 4: 0.0}, ()
    for tick in range(int((BEFORE_S + AFTER_S) / 0.5)):
        t = tick * 0.5
        if t == BEFORE_S:
            before = policy.greedy_arms()
        alpha = 0.8 if t < BEFORE_S else 0.25
        b = 1 if int(t // 20) % 2 == 0 else 4
        k = arm_for(table, b)
        step_s = T0[b] * (1 + DRAFT_COST * k) * rng.uniform(0.8, 1.25)
        carry[b] += 0.5 / step_s
        n = int(carry[b])
        carry[b] -= n
        if n:
            # Accepted drafts of each request-step: the first rejection ends its chain.
            accepted = sum(next((i for i in range(k) if rng.random() >= alpha), k)
                           for _ in range(n * b))  # fmt: skip
            policy.update(Observation(b=b, k=k, decode_steps=n, emitted_tokens=n * b + accepted,
                                      accepted_drafts=accepted, drafted_tokens=n * b * k,
                                      busy_s=n * step_s))  # fmt: skip
        if tick % 4 == 3:
            table = policy.propose()
    return before, policy.greedy_arms()


def test_a_slow_server_s_acceptance_change_is_followed_within_90_s():
    # After the change k = 1 leads k = 0 by only 9 %, and at a few steps a second with
    # ±25 % jitter a run can end on the wrong one of the two: the default policy does in
    # about one closed loop in thirty (3 of seeds 0-99). So the test asks for the rate,
    # not for any one seed: a policy that did not follow would miss nearly all of them.
    followed = []
    for seed in range(RUNS):
        before, after = run(seed)
        # Buckets b<=1 and b<=4 (indices 0 and 2) carry the traffic.
        assert near_best(0.8, 1, before[0]) and near_best(0.8, 4, before[2]), (seed, before)
        followed.append(near_best(0.25, 1, after[0]) and near_best(0.25, 4, after[2]))
    assert sum(followed) >= RUNS - RUNS // 10, [s for s, ok in enumerate(followed) if not ok]
