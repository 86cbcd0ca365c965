"""benchmarks/shift_recovery.py: its recovery time and the windowed load it scores with."""

from __future__ import annotations

import math

import pytest

from tests._bench_scripts import load_benchmark
from tuner.bench import run_one


@pytest.fixture(scope="module")
def sr():  # type: ignore[no-untyped-def]
    return load_benchmark("shift_recovery")


def test_recovery_is_the_start_from_which_every_stretch_stays_within(sr) -> None:  # type: ignore[no-untyped-def]
    stretches = [(0.0, 0.90), (2.0, 0.99), (4.0, 0.97), (6.0, 0.99), (8.0, 1.10)]
    assert sr.recovery_s(stretches, 0.02) == 6.0
    assert sr.recovery_s([(0.0, 0.99), (2.0, 0.98)], 0.02) == 0.0
    assert math.isinf(sr.recovery_s([(0.0, 0.99), (2.0, 0.95)], 0.02))
    assert math.isinf(sr.recovery_s([(0.0, 0.99), (2.0, math.nan)], 0.02))


def test_rolling_stretches_are_busy_weighted_over_the_horizon(sr) -> None:  # type: ignore[no-untyped-def]
    # [start, busy, got, per-bucket oracle, per-step oracle]
    windows = [[t, 1.0, 1.0, 1.0, 1.0] for t in (0.0, 2.0)]
    windows += [[4.0, 1.0, 0.0, 1.0, 1.0], [6.0, 3.0, 3.0, 3.0, 4.0], [8.0, 1.0, 1.0, 1.0, 1.0]]
    got = sr.rolling(windows, 4.0, 4.0, 4.0, 2.0, 3)
    assert got == [(0.0, 0.75)]  # only the two windows inside 4..8 s, weighted by tokens
    step = sr.rolling(windows, 2.0, 6.0, 4.0, 2.0, 4)
    assert step == [(0.0, 0.5), (2.0, 3.0 / 5.0)]


def test_cutting_the_load_into_windows_changes_nothing(sr) -> None:  # type: ignore[no-untyped-def]
    job = dict(profile="h100-llama8b", workload="shift", c=2, seed=3, policy="model",
               phase_s=8.0, window_s=2.0)
    res = sr.run_windows(job)
    assert len(res["windows"]) == 12
    whole = run_one(profile="h100-llama8b", workload="shift", load="24:2", policy="model",
                    seed=3, warmup_s=0.0)
    got = sum(w[2] for w in res["windows"])
    best = sum(w[3] for w in res["windows"])
    (phase,) = whole.phases
    assert got == pytest.approx(phase.goodput * phase.decode_busy_s, rel=1e-9)
    assert best == pytest.approx(phase.oracle_goodput * phase.decode_busy_s, rel=1e-9)
    assert res["switches"] == whole.switches
