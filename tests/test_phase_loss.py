"""benchmarks/phase_loss.py: a phase's loss split by why each step's arm ran."""

from __future__ import annotations

import pytest

from tests._bench_scripts import load_benchmark

ARMS = (0, 1, 3)
# Expected goodput per (batch size, arm): k = 3 is best at 1 request, k = 1 at 8.
GOOD = {(1, 0): 50.0, (1, 1): 80.0, (1, 3): 100.0, (8, 0): 300.0, (8, 1): 400.0, (8, 3): 350.0}


@pytest.fixture(scope="module")
def pl():  # type: ignore[no-untyped-def]
    return load_benchmark("phase_loss")


def good(b: int, k: int, t: float) -> float:
    return GOOD[(b, k)]


def step(t: float, b: int, k: int, dt: float = 1.0, band: int = 1) -> tuple:
    return (t, band, b, k, k, 1.0, dt, 0)


def test_an_arm_is_greedy_a_band_s_or_an_exploring_row_s(pl) -> None:  # type: ignore[no-untyped-def]
    assert pl.kind_of(3, 3, (3, 1, 3, 3, 5)) == "greedy"
    assert pl.kind_of(5, 3, (3, 1, 3, 3, 5)) == "band"
    assert pl.kind_of(0, 3, (0, 0, 0, 0, 0)) == "explore"
    # a row that is off lets a band draft (its unknown band drafts too): not exploring
    assert pl.kind_of(1, 0, (1, 0, 0, 1, 1)) == "band"
    assert pl.kind_of(1, 3, (1, 1, 1, 1, 1)) == "explore"
    # an arm in none of the row's bands: an update's exploring probe, outside the table
    assert pl.kind_of(7, 0, (0, 0, 0, 0, 0)) == "explore"
    assert pl.kind_of(7, 0, (1, 0, 0, 1, 5)) == "explore"


def test_the_split_adds_up_to_the_phase_shortfall_and_follows_the_tables(pl) -> None:  # type: ignore[no-untyped-def]
    tables = [
        (0.0, ((4, (3, 1, 3, 3, 3)), (None, (1, 1, 3, 3, 3))), (3, 1)),
        # from t = 10 the big bucket explores k = 0 in every band
        (10.0, ((4, (3, 1, 3, 3, 3)), (None, (0, 0, 0, 0, 0))), (3, 1)),
    ]
    trace = [
        step(-1.0, 1, 0),  # before the phase: not counted
        step(1.0, 1, 3),  # greedy and best: no loss
        step(2.0, 1, 1),  # the greedy row's arm is 3: band 1's arm (k = 1) is 'band'
        step(3.0, 8, 3),  # the big bucket's greedy arm 1: band 3 runs 3 -> 'band'
        step(4.0, 8, 1, dt=2.0),  # greedy, best
        step(11.0, 8, 0),  # the exploring row
        step(12.0, 1, 0),  # an arm in none of the row's bands: an exploring probe
        step(20.0, 1, 0),  # after the phase: not counted
    ]
    loss = pl.split_phase(trace, tables, 0.0, 20.0, good, ARMS, lambda b: 0 if b <= 4 else 1)
    best = 100 + 100 + 400 + 800 + 400 + 100
    assert loss.points["greedy"] == 0.0
    assert loss.points["band"] == pytest.approx(100 * (20 + 50) / best)
    assert loss.points["explore"] == pytest.approx(100 * (100 + 50) / best)
    got = 100 + 80 + 350 + 800 + 300 + 50
    assert sum(loss.points.values()) == pytest.approx(100 * (1 - got / best))
    assert loss.busy == {1: {3: 1.0, 1: 1.0, 0: 1.0}, 8: {3: 1.0, 1: 2.0, 0: 1.0}}


def test_a_wrong_greedy_arm_is_the_greedy_share(pl) -> None:  # type: ignore[no-untyped-def]
    tables = [(0.0, ((None, (0, 0, 0, 0, 0)),), (0,))]
    loss = pl.split_phase([step(0.0, 1, 0)], tables, 0.0, 1.0, good, ARMS, lambda b: 0)
    assert loss.points == {"greedy": pytest.approx(50.0), "band": 0.0, "explore": 0.0}


def test_a_banded_table_s_steps_are_scored_on_their_own_requests(pl) -> None:  # type: ignore[no-untyped-def]
    banded = ((None, (3, 1, 3, 3, 3)),)
    tables = [(0.0, banded, (3,))]
    # per step, expected goodput per arm (0, 1, 3) given the step's requests: on the first
    # (low acceptance) k = 1 beats the per-bucket oracle's k = 3, on the second it loses
    values = [(50.0, 90.0, 60.0), (50.0, 80.0, 100.0)]
    trace = [step(0.0, 1, 1, band=1), step(1.0, 1, 1, band=1)]
    loss = pl.split_phase(trace, tables, 0.0, 2.0, good, ARMS, lambda b: 0, values)
    # 100 (the per-bucket best at b = 1) x (1 - 90/60) and x (1 - 80/100), over 200
    assert loss.points["band"] == pytest.approx(100 * (100 * (1 - 1.5) + 100 * 0.2) / 200)
    # without the step values the same steps count at the workload's expectation
    plain = pl.split_phase(trace, tables, 0.0, 2.0, good, ARMS, lambda b: 0)
    assert plain.points["band"] == pytest.approx(100 * 2 * 20 / 200)


def test_a_shipped_profile_s_phases_are_split_as_a_world_s(pl) -> None:  # type: ignore[no-untyped-def]
    lines = pl.run_world({"profile": "h100-llama8b", "workload": "chat", "load": "40:1,40:4",
                          "seed": 0, "policy_seed": 0, "warmup_s": 30.0, "below": 1000.0})
    heads = [line for line in lines if not line.startswith(" ")]
    assert [h.split(":")[0] for h in heads] == ["h100-llama8b chat seed 0 phase 0 c=1",
                                                "h100-llama8b chat seed 0 phase 1 c=4"]
    assert all("greedy" in h and "band" in h and "explore" in h for h in heads)

