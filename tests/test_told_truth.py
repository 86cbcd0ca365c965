"""benchmarks/told_truth.py: the model policy told the world's step times or acceptance."""

from __future__ import annotations

import math
from unittest import mock

import pytest

from policies import Observation
from tests._bench_scripts import load_benchmark
from tuner.bench_config import build_policy
from tuner.sim.engine import Engine
from tuner.sim.oracle import workload_emitted
from tuner.sim.profiles import load_profile
from tuner.sim.workloads import get_workload

ARMS = (0, 1, 3, 5)


@pytest.fixture(scope="module")
def tt():  # type: ignore[no-untyped-def]
    return load_benchmark("told_truth")


@pytest.fixture
def told(tt):  # type: ignore[no-untyped-def]
    """A bench policy beside an engine on the H200 table and the chat workload (built under
    the script's watch, as the bench builds it), having seen one interval at k = 3 that
    says nothing like the truth."""
    prof, wl = load_profile("h200-llama8b"), get_workload("chat")
    pol = build_policy("model", ARMS, 0, prof, wl)
    with mock.patch.object(Engine, "__init__", tt._watched_init):
        Engine(profile=prof, workload=wl, arms=ARMS, started_at=0.0)
    pol.update(Observation(b=8, k=3, decode_steps=100, emitted_tokens=900, accepted_drafts=100,
                           drafted_tokens=2400, busy_s=5.0))
    return pol, prof, wl


def test_told_the_cost_every_cell_is_the_profile_s_step_time(tt, told) -> None:  # type: ignore[no-untyped-def]
    pol, prof, _ = told
    learned = pol._step_times()
    truth = tt._true_step_times(pol)
    j = pol.buckets.index(8)
    for ai, k in enumerate(ARMS):
        want = math.log(prof.step_s(round(pol._rep_b(j)), k))
        assert truth.mean[j, ai] == pytest.approx(want)
        assert truth.sd[j, ai] < 1e-3
    # 100 steps in 5 s are 50 ms a step: the learner's k = 3 cell is far from the table's
    assert abs(learned.mean[j, ARMS.index(3)] - truth.mean[j, ARMS.index(3)]) > 1.0


def test_told_the_acceptance_every_arm_is_the_workload_s_expectation(tt, told) -> None:  # type: ignore[no-untyped-def]
    pol, prof, wl = told
    learned, _ = pol._acceptance()
    mean, sd = tt._true_acceptance(pol)
    for k in ARMS[1:]:
        assert mean[k] == pytest.approx(workload_emitted(wl, prof.acceptance, k, t=0.0) - 1.0)
        assert sd[k] < 1e-3
    assert learned[3] < 0.2  # one accepted draft in 12 request-steps... the truth is not that
    assert mean[3] > 1.0


def test_what_to_tell_must_be_known(tt, capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit):
        tt.main(["--know", "everything", "--", "--worlds", "0"])
    assert "--know takes a list of cost, acceptance" in capsys.readouterr().err
