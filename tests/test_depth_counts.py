"""How many drafts each request accepted: counted by the plugin per chain arm, carried by the
v2 readout, fed by the daemon and the bench to the model policy, which reads every shallower
arm's acceptance off them (a chain's first j drafts are the same whatever its depth)."""

from __future__ import annotations

import json

import pytest

from policies import Observation, make_policy
from tests._fakes import FakeClock
from tests.test_daemon_bands import Sim, _run, _ticks
from tuner.plugin.core import PluginCore
from tuner.protocol import (
    COUNTED_MAX_BATCH,
    DEPTH_EVERY,
    DepthCounter,
    DynspecState,
    ProtocolError,
    TreeShape,
    depth_counter_deltas,
)

# --- the plugin's counting -------------------------------------------------------------------


def test_the_core_counts_sampled_chain_forwards_and_a_spread_of_a_large_batch():
    core = PluginCore((0, 1, 3, 5), started_at=1.0)
    core.record_depths(5, [0, 2, 5], DEPTH_EVERY)  # counted
    core.record_depths(5, [5, 5], DEPTH_EVERY + 1)  # not a sampled forward
    core.record_depths(1, [1, 0], 2 * DEPTH_EVERY)  # k = 1: the band counters tell it all
    # A large batch, ordered by admission: COUNTED_MAX_BATCH requests spread over all of it
    # (the hook's cost stays flat), the old half and the young half alike.
    old, young = [1] * COUNTED_MAX_BATCH, [3] * COUNTED_MAX_BATCH
    core.record_depths(3, old + young, 3 * DEPTH_EVERY)
    core.record_depths(3, [3, 1], 4 * DEPTH_EVERY)
    half = COUNTED_MAX_BATCH // 2
    assert core.state().depths == (DepthCounter(3, (0, half + 1, 0, half + 1)),
                                   DepthCounter(5, (1, 0, 1, 0, 0, 1)))
    # A v1 plugin reports none; a tree's paths are not a chain's prefixes, so it counts none.
    v1 = PluginCore((0, 3), started_at=1.0, protocol=1)
    v1.record_depths(3, [3, 1], 0)
    assert "depths" not in v1.readout()
    tree = PluginCore((0, 3), started_at=1.0, tree=TreeShape(steps=3, topk=4, draft_tokens=8))
    tree.record_depths(3, [3, 1], 0)
    assert tree.state().depths == ()


def test_the_simulator_counts_through_the_plugin_code():
    with Sim() as sim:
        sim.step(30.0)
        with sim.server.lock:
            depths = sim.server.core.state().depths
            counters = sim.server.core.state().counters
    drafting = {c.k for c in counters if c.k >= 2}
    assert depths and {d.k for d in depths} <= drafting
    for d in depths:
        # about one step in DEPTH_EVERY of the arm's, one request each (one request running)
        steps = sum(c.decode_steps for c in counters if c.k == d.k)
        assert steps // DEPTH_EVERY - 2 <= d.requests <= steps // DEPTH_EVERY + 2
        accepted = sum(c.accepted_drafts for c in counters if c.k == d.k)
        assert d.accepted_at(d.k) <= accepted


# --- the readout -----------------------------------------------------------------------------


def _state(depths) -> DynspecState:
    return DynspecState(arms=(0, 1, 3, 5), policy_version=0, table=((None, 3),), counters=(),
                        started_at=1.0, depths=depths)


def test_depths_round_trip_in_base_64_and_read_as_none_where_missing():
    state = _state((DepthCounter(3, (70, 0, 64, 5)), DepthCounter(5, (1, 0, 0, 0, 0, 9))))
    raw = json.loads(json.dumps(state.to_json()))
    assert raw["depths"] == [[3, "16,0,10,5"], [5, "1,0,0,0,0,9"]]
    assert DynspecState.from_json(raw).depths == state.depths
    assert _state(()).to_json()["depths"] == []  # every v2 readout has the key
    before = {k: v for k, v in _state(()).to_json().items() if k != "depths"}
    assert DynspecState.from_json(before).depths == ()  # a plugin from before the field
    assert DepthCounter(3, (70, 0, 64, 5)).accepted_at(2) == 64 * 2 + 5 * 2


@pytest.mark.parametrize(
    "depths, rule",
    [
        ({"3": "1,2"}, "must be a list"),
        ([[3]], r"must be \[k, counts\]"),
        ([[1, "1,2"]], "not an arm >= 2"),
        ([[2, "1,2,3"]], "not an arm >= 2"),  # 2 is not among the arms
        ([[3, "1,2,3,4"], [3, "1,2,3,4"]], "or repeated"),
        ([[3, "1,2,3"]], "must have 4 numbers"),
        ([[3, "1,2,3,4;1,2,3,4"]], "one cell of 4 numbers"),
        ([[3, ""]], "one cell of 4 numbers"),
        ([[3, "1,2,3,*"]], "outside the digits"),
    ],
)
def test_malformed_depths_are_refused_by_name(depths, rule):
    raw = {**_state(()).to_json(), "depths": depths}
    with pytest.raises(ProtocolError, match=rule):
        DynspecState.from_json(raw)


def test_depth_deltas_refuse_counts_that_went_backwards_or_vanished():
    a = (DepthCounter(3, (1, 2, 3, 4)),)
    b = (DepthCounter(3, (1, 5, 3, 6)), DepthCounter(5, (0, 0, 0, 0, 0, 2)))
    assert depth_counter_deltas(a, b) == (DepthCounter(3, (0, 3, 0, 2)),
                                          DepthCounter(5, (0, 0, 0, 0, 0, 2)))
    assert depth_counter_deltas(a, a) == ()
    assert depth_counter_deltas(b, a) is None  # k = 5 vanished: not one run
    assert depth_counter_deltas((DepthCounter(3, (2, 2, 3, 4)),), a) is None


# --- the policy ------------------------------------------------------------------------------


def test_deeper_drafts_tell_the_model_what_a_shallower_arm_accepts():
    """Only k = 5 ran, on requests that accept their first three drafts and then almost
    never: the chain's prior shape says k = 3 accepts much less than k = 5's 3.1 drafts;
    the depth counts say 2.98."""
    arms = (0, 1, 3, 5)
    plain, told = (make_policy("model", arms=arms, seed=0) for _ in range(2))
    counts = (0, 0, 1, 90, 1, 8)  # 100 requests: mostly 3 accepted, some all 5
    for p in (plain, told):
        for _ in range(40):
            _feed(p, b=4, k=5, accepted_per_req=3.1)
            if p is told:
                assert p.update_depths(5, counts, every=DEPTH_EVERY)
    mean_plain = plain._acceptance()[0][3]
    mean_told = told._acceptance()[0][3]
    truth = sum(min(a, 3) * n for a, n in enumerate(counts)) / sum(counts)
    assert abs(mean_told - truth) < abs(mean_plain - truth) / 3
    assert abs(mean_told - truth) < 0.1


def _chain_counts(alpha: float, delta: float, k: int, n: int = 1000) -> tuple[int, ...]:
    """Of ``n`` requests of a chain (α, δ) at arm ``k``, how many accepted 0..k drafts."""
    reach, p = [1.0], 1.0
    for i in range(1, k + 1):
        p *= min(alpha * delta ** (i - 1), 1.0)
        reach.append(p)
    reach.append(0.0)
    return tuple(round(n * (reach[a] - reach[a + 1])) for a in range(k + 1))


@pytest.mark.parametrize("delta", [0.85, 0.973, 1.08])
def test_the_chains_shape_is_read_off_the_counted_positions(delta):
    pooled = make_policy("model", arms=(0, 1, 3, 5, 7), seed=0)._pooled
    assert pooled.shape() is None  # nothing counted: the prior's shape
    pooled.add_depths(7, _chain_counts(0.7, delta, 7, n=20), DEPTH_EVERY)
    assert pooled.shape() is None  # 20 requests are not enough to tell
    for _ in range(20):
        pooled.add_depths(7, _chain_counts(0.7, delta, 7), DEPTH_EVERY)
    got, sd = pooled.shape()
    assert abs(got - delta) <= 0.02 + 1e-9  # the grid's step
    assert sd <= 0.03


def test_a_cliff_is_no_chain_and_its_shape_is_held_loosely():
    """Requests that accept three drafts and then almost never: the best chain through
    their positions is precise and wrong, and its δ is held no tighter than the prior's."""
    pooled = make_policy("model", arms=(0, 1, 3, 5), seed=0)._pooled
    for _ in range(40):
        pooled.add_depths(5, (0, 0, 1, 90, 1, 8), DEPTH_EVERY)
        pooled.add_depths(5, _chain_counts(0.9, 0.9, 5, n=100), DEPTH_EVERY)
    chain_only = make_policy("model", arms=(0, 1, 3, 5), seed=0)._pooled
    for _ in range(40):
        chain_only.add_depths(5, _chain_counts(0.9, 0.9, 5, n=200), DEPTH_EVERY)
    assert pooled.shape()[1] >= 0.1
    assert chain_only.shape()[1] <= 0.02


def test_the_counted_shape_overrules_arms_that_ran_on_different_batches():
    """A banded row runs k = 1 on batches of low acceptance and k = 5 on those of high:
    compared across the arms, acceptance seems to rise with depth. The k = 5 steps' depth
    counts show their requests' own chain (δ = 0.9), and the chain fit takes it."""
    arms = (0, 1, 3, 5)
    plain, told = (make_policy("model", arms=arms, seed=0) for _ in range(2))
    high = _chain_counts(0.9, 0.9, 5)
    for p in (plain, told):
        for _ in range(40):
            _feed(p, b=4, k=1, accepted_per_req=0.5)
            _feed(p, b=4, k=5, accepted_per_req=sum(a * n for a, n in enumerate(high)) / 1000)
            if p is told:
                assert p.update_depths(5, high, every=DEPTH_EVERY)
        p._acceptance()
    assert plain._delta > 1.05
    assert abs(told._delta - 0.9) <= 0.02 + 1e-9


@pytest.mark.parametrize("k, counts, every", [
    (1, (3, 4), 1), (3, (1, 2, 3), 1), (3, (1, -2, 3, 4), 1), (3, (0, 0, 0, 0), 1),
    (True, (1, 2), 1), (3, (1.5, 2, 3, 4), 1), (3, (1, 2, 3, 4), 0),
    (3, (1, 2, 3, 4), float("nan")),
])
def test_malformed_depth_counts_change_nothing(k, counts, every):
    p = make_policy("model", arms=(0, 1, 3, 5), seed=0)
    before = p._pooled.direct()
    assert not p.update_depths(k, counts, every)
    assert p._pooled.direct() == before


def _feed(p, *, b: int, k: int, accepted_per_req: float, steps: int = 100) -> None:
    accepted = round(accepted_per_req * b * steps)
    busy = steps * 0.02 * (1 + 0.1 * k)
    assert p.update(Observation(b, k, steps, accepted + b * steps, accepted, k * b * steps,
                                busy))


# --- the daemon ------------------------------------------------------------------------------


def test_the_daemon_feeds_each_readings_depth_counts_and_none_across_a_restart(tmp_path):
    fed: list[dict[int, int]] = []  # per tick: requests fed per arm

    with Sim() as sim:
        d = _run(sim, tmp_path, 1)
        policy = d.policy_of(sim.addr)
        inner = policy.update_depths

        def spy(k, counts, every):
            assert every == DEPTH_EVERY
            fed[-1][k] = fed[-1].get(k, 0) + sum(counts)
            return inner(k, counts, every)

        policy.update_depths = spy
        clock = FakeClock(d.clock() + 1.0)
        d.clock = clock
        with sim.server.lock:
            start = {c.k: c.requests for c in sim.server.core.state().depths}
        for _ in range(30):
            fed.append({})
            _ticks(d, [sim], clock, 1)
        with sim.server.lock:
            now = {c.k: c.requests for c in sim.server.core.state().depths}
            old = sim.server.engine.core  # a restart with the same start time: counts go back
            sim.server.engine.core = PluginCore(old.arms, started_at=old.started_at,
                                                default_arm=3)
        sim.step()
        fed.append({})
        _ticks(d, [sim], clock, 1)
        d.shutdown()
    total = {k: sum(f.get(k, 0) for f in fed[:-1]) for k in now}
    assert total == {k: now[k] - start.get(k, 0) for k in now} and sum(total.values()) > 0
    assert fed[-1] == {}  # nothing across the restart
    assert sum(x for x, _ in policy._pooled._prefix.values()) > 0
