"""Static baselines, SGLang's settle rule, the Optuna policy's storage, import hygiene."""

from __future__ import annotations

import pytest

from policies import (
    Buckets,
    Observation,
    expected_accepted,
    make_policy,
    sglang_settled_arm,
    sglang_static_table,
)
from tests._imports import heavy_imports

ARMS = (0, 1, 3, 5, 7)


def test_static_tables():
    assert make_policy("never", arms=ARMS).propose() == ((None, 0),)
    assert make_policy("always", arms=ARMS, k=5).greedy() == ((None, 5),)
    assert make_policy("threshold", arms=ARMS).propose() == ((5, 3), (None, 0))
    assert make_policy("threshold", arms=ARMS, max_batch=8, k=1).propose() == ((8, 1), (None, 0))
    table = ((4, 7), (64, 1), (None, 0))
    assert make_policy("table", arms=ARMS, table=table).propose() == table


@pytest.mark.parametrize(
    "name, params, field",
    [
        ("always", {"k": 2}, "not a built arm"),
        ("always", {"k": -1}, "k must be"),
        ("threshold", {"max_batch": 0}, "max_batch"),
        ("table", {"table": ((4, 7), (2, 1), (None, 0))}, "row 1"),
        ("table", {"table": ((4, 7),)}, "row 0"),
        ("sglang-default", {"alpha": 1.5}, "alpha"),
        ("never", {"k": 1}, "unknown parameter 'k'"),
    ],
)
def test_static_bad_parameters(name, params, field):
    with pytest.raises(ValueError, match=field):
        make_policy(name, arms=ARMS, **params)


def test_never_needs_arm_zero():
    with pytest.raises(ValueError, match="k=0 is not a built arm"):
        make_policy("never", arms=(1, 3))


def test_static_policy_counts_what_it_sees():
    p = make_policy("threshold", arms=ARMS, buckets=Buckets((5,)))
    assert p.update(Observation(2, 3, 100, 500, 300, 600, 1.0))
    assert not p.update(Observation(2, 3, 100, 500, 300, 600, float("nan")))
    (est,) = p.snapshot().estimates
    assert (est.bucket, est.arm, est.n) == (0, 3, 100)
    assert est.estimate == pytest.approx(500.0)
    assert p.snapshot().chosen == (3, 0)


def test_settle_rule_keeps_the_start_arm_under_good_acceptance():
    acc = lambda k: expected_accepted(0.775, 0.973, k)  # noqa: E731 - chat, anchors §3.3
    assert sglang_settled_arm((1, 3, 5, 7), acc) == 3
    assert sglang_settled_arm((0, 1, 3), acc) == 3
    assert sglang_settled_arm((0, 1), acc) == 1
    assert sglang_settled_arm((0,), acc) == 0


def test_settle_rule_drops_and_rises():
    # Poor acceptance: 3 -> 1 (EMA 0.248 <= 1 - 0.5 - 0.25); with 0 available, 0 <-> 1 flips
    # and the slot keeps falling back to 0.
    poor = lambda k: expected_accepted(0.2, 1.0, k)  # noqa: E731
    assert sglang_settled_arm((1, 3, 5, 7), poor) == 1
    assert sglang_settled_arm((0, 1, 3), poor) == 0
    # Saturated acceptance: the EMA at 3 is 2.9 > 3 - 0.5, so it rises to 5, then 7.
    near_perfect = {3: 2.9, 5: 4.8, 7: 6.7}
    assert sglang_settled_arm((1, 3, 5, 7), near_perfect) == 7
    # From 5, an EMA of 2.0 <= 3 - 0.5 - 0.25 drops to 3, where the EMA 1.9 stays.
    assert sglang_settled_arm((1, 3, 5, 7), {5: 2.0, 3: 1.9}, start=5) == 3


def test_sglang_table_follows_graph_padding():
    acc = lambda k: expected_accepted(0.775, 0.973, k)  # noqa: E731
    # Slots are lower bounds of the padded batch size: 31 pads to 32, 61 pads to 64.
    assert sglang_static_table(acc, arms=ARMS) == ((30, 3), (60, 1), (None, 0))
    poor = lambda k: expected_accepted(0.2, 1.0, k)  # noqa: E731
    assert sglang_static_table(poor, arms=ARMS) == ((7, 1), (None, 0))
    # Arms the server lacks map down to the largest built arm below them.
    assert sglang_static_table(acc, arms=(0, 2)) == ((30, 2), (None, 0))
    p = make_policy("sglang-default", arms=ARMS, alpha=0.775, delta=0.973)
    assert p.propose() == ((30, 3), (60, 1), (None, 0))


def test_optuna_studies_live_in_the_given_database(tmp_path):
    import optuna
    url = f"sqlite:///{tmp_path / 'dynspec.db'}"
    p = make_policy("optuna", arms=(0, 1, 3), buckets=Buckets((1,)), storage_url=url,
                    trial_steps=50, explore_allowance_steps=100_000)
    emitted = {0: 1.0, 1: 1.8, 3: 2.6}
    for _ in range(12):
        k = p.propose()[0][1]
        p.update(Observation(1, k, 100, round(100 * emitted[k]), round(100 * (emitted[k] - 1)),
                             100 * k, 1.0))
    names = {s.study_name for s in optuna.get_all_study_summaries(storage=url)}
    assert "dynspec:b1" in names
    study = optuna.load_study(study_name="dynspec:b1", storage=url)
    done = [t for t in study.trials if t.value is not None]
    assert len(done) >= 5
    assert {t.params["k"] for t in done} <= {0, 1, 3}
    # Told values are goodputs in tokens/s: 100 steps of one request per second each.
    assert max(t.value for t in done) == pytest.approx(260.0, rel=1e-6)


def test_optuna_rejects_a_bad_storage_url():
    with pytest.raises(ValueError, match="storage_url"):
        make_policy("optuna", arms=ARMS, storage_url="dynspec.db")


def test_import_policies_stays_light():
    heavy = ("optuna", "sqlalchemy", "tuner", "storage", "httpx")
    assert heavy_imports("import policies", heavy) == []
