"""The per-step oracle: each step's best arm for the requests in it, against hand figures and
against the per-bucket oracle where every request accepts alike."""

from __future__ import annotations

import numpy as np
import pytest

from tuner.plugin.core import PluginCore
from tuner.protocol import encode_update
from tuner.sim._requests import Request
from tuner.sim._running import RunningRows
from tuner.sim._step_oracle import StepOracle
from tuner.sim.engine import Engine
from tuner.sim.load import ClosedLoop
from tuner.sim.oracle import expected_goodput, oracle_arm
from tuner.sim.profiles import load_profile
from tuner.sim.workloads import Workload, get_workload

# Step times of arms 0, 1 and 3 at one request (arbitrary units).
COST = {0: 1.0, 1: 1.2, 3: 1.6}


def _request(alpha: float) -> Request:
    return Request(0, "chat", alpha, 1.0, 10, 100, 0.0, None, None)


def test_two_populations_at_one_request_beat_one_arm_by_the_hand_computed_ratio():
    rows = RunningRows(4, 3, 0.2, None, np.random.default_rng(0))
    oracle = StepOracle((0, 1, 3), lambda pb, k: COST[k])
    # A request that accepts 90 % of drafts, then one that accepts 10 % (chain, δ = 1), for
    # one second each, both launched at arm 1.
    rows.admit(0, [_request(0.9)])
    oracle.step(rows, 1, 1, 1, 0.5)
    oracle.step(rows, 1, 1, 1, 0.5)  # same batch: added to the cached values
    rows.compact(np.array([False]), 1)
    rows.admit(0, [_request(0.1)])
    oracle.step(rows, 1, 1, 1, 1.0)
    (sums,) = oracle.take().values()
    # Tokens per step at arms 0, 1, 3: 1, 1.9, 1 + .9 + .81 + .729 = 3.439 for the first;
    # 1, 1.1, 1.111 for the second. Per unit of time: 1, 1.58333, 2.149375 and
    # 1, 0.916667, 0.694375. The best single arm is 3 (2.84375 over both); the per-step
    # oracle runs 3 then 0: 2.149375 + 1 = 3.149375, 10.75 % more.
    assert sums.busy_s == pytest.approx(2.0)
    assert sums.arm_tokens == pytest.approx(
        (2.0, 1.9 / 1.2 + 1.1 / 1.2, 3.439 / 1.6 + 1.111 / 1.6)
    )
    assert sums.best_tokens == pytest.approx(3.439 / 1.6 + 1.0)
    assert sums.ran_tokens == pytest.approx(sums.arm_tokens[1])
    assert sums.best_tokens / max(sums.arm_tokens) == pytest.approx(3.149375 / 2.84375)
    assert oracle.take() == {}  # taken: the sums start again


def test_an_arm_change_on_the_same_batch_keeps_the_values_and_splits_what_ran():
    rows = RunningRows(4, 3, 0.2, None, np.random.default_rng(0))
    oracle = StepOracle((0, 1, 3), lambda pb, k: COST[k])
    rows.admit(0, [_request(0.9), _request(0.1)])
    oracle.step(rows, 2, 2, 0, 1.0)
    oracle.step(rows, 2, 2, 3, 1.0)
    (sums,) = oracle.take().values()
    # Two requests: tokens 2, 3.0, 4.55 at arms 0, 1, 3; one second at arm 0, one at arm 3.
    assert sums.arm_tokens == pytest.approx((4.0, 6.0 / 1.2, 2 * 4.55 / 1.6))
    assert sums.ran_tokens == pytest.approx(2.0 + 4.55 / 1.6)
    assert sums.best_tokens == pytest.approx(2 * 4.55 / 1.6)


def test_with_one_acceptance_for_every_request_it_is_the_per_bucket_oracle():
    # κ so large that every request's α is the class mean to ~1e-5.
    wl = Workload("alike", get_workload("chat").phases, kappa=1e10)
    prof = load_profile("h200-llama8b")
    arms = (0, 1, 3, 5, 7)
    core = PluginCore(arms, started_at=0.0)
    eng = Engine(profile=prof, workload=wl, core=core, load=ClosedLoop([(1e12, 6)]), seed=1)
    k = oracle_arm(prof, wl, eng.padded(6), arms, graph_bs=eng.graph_bs, heterogeneous=False)
    assert core.apply_update(encode_update(((None, k),), 1))[0]
    eng.run_until(60.0)
    sums = eng.step_oracle.take()
    assert sums and 6 in sums
    for b, s in sums.items():
        want = [expected_goodput(prof, wl, b, a, graph_bs=eng.graph_bs, heterogeneous=False)
                for a in arms]
        assert [v / s.busy_s for v in s.arm_tokens] == pytest.approx(want, rel=1e-4)
        assert s.best_tokens / s.busy_s == pytest.approx(max(want), rel=1e-4)
    assert sums[6].ran_tokens == pytest.approx(sums[6].best_tokens, rel=1e-4)


def test_the_oracle_draws_nothing_so_a_run_is_the_same_with_it(monkeypatch):
    def run() -> tuple[int, int, float]:
        eng = Engine(profile="seed-kimi-pcie", workload="diverse", seed=3,
                     load=ClosedLoop([(1e12, 4)]))
        eng.run_until(20.0)
        return eng.counters.decode_steps, eng.counters.decode_tokens, eng.now

    a = run()
    # The same run with the oracle's every call made twice: no draw, no state it changes.
    orig = StepOracle.step

    def twice(self, rows, n, pb, k, dt, band=0):
        orig(self, rows, n, pb, k, 0.0, band)
        orig(self, rows, n, pb, k, dt, band)

    monkeypatch.setattr(StepOracle, "step", twice)
    assert run() == a
