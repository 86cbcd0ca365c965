"""The world bench's summary: shares, floors, the worst world and the gap to the bandits."""

from __future__ import annotations

import math

import pytest

from policies import DEFAULT_POLICY
from tuner.bench import PhaseResult, RunResult
from tuner.bench_worlds import WorldBenchConfig, WorldBenchResult, render_worlds
from tuner.errors import ConfigError
from tuner.sim.worlds import make_world


def _run(world: int, policy: str, pcts: list[float], explore: float = 0.5) -> RunResult:
    phases = tuple(
        PhaseResult(index=i, start_s=0.0, end_s=1.0, concurrency=c, pct_oracle=p,
                    pct_oracle_all=p, goodput=1.0, goodput_after=1.0, oracle_goodput=1.0,
                    measured_goodput=1.0, decode_busy_s=1.0, explore_tokens_lost=0.0,
                    switches=0, tpot_p50_ms=1.0, tpot_p99_ms=1.0)
        for i, (c, p) in enumerate(zip((1, 16), pcts, strict=True))
    )
    return RunResult(profile=f"world-{world}", workload="generated", load="x", policy=policy,
                     seed=0, phases=phases, convergence=(), pct_oracle=min(pcts),
                     pct_oracle_all=min(pcts), explore_tokens_lost=0.0, explore_pct=explore,
                     switches=0, final_table=((None, 1),), notes=(), wall_s=0.0)


def _result() -> WorldBenchResult:
    me = DEFAULT_POLICY
    runs = (
        _run(0, "thompson", [99.0, 99.5]), _run(0, "ucb", [100.0, 97.0]),
        _run(0, me, [98.5, 99.0], 0.2),
        _run(1, "thompson", [90.0, 96.0]), _run(1, "ucb", [92.0, 99.0]),
        _run(1, me, [97.0, math.nan], 1.4),
        _run(2, "thompson", [100.0, 100.0]), _run(2, "ucb", [99.0, 99.0]),
        _run(2, me, [94.0, 98.0], 0.6),
    )
    return WorldBenchResult(
        config=WorldBenchConfig(worlds=(0, 1, 2), policies=("thompson", "ucb", me)),
        worlds=tuple(make_world(i) for i in range(3)), runs=runs, skipped=(), wall_s=1.0)


def test_summary_counts_worlds_meeting_the_target_and_names_the_worst():
    res = _result()
    mine = next(s for s in res.summaries() if s.policy == DEFAULT_POLICY)
    assert mine.worlds == 3
    assert mine.share_ok == pytest.approx(1 / 3)  # only world 0 is >= 98 % in every phase
    assert mine.below_floor == 1 and mine.worst_pct == 94.0 and mine.worst_world == 2
    assert mine.median_worst_pct == 97.0  # NaN phases (no decode time) are left out
    assert mine.mean_explore_pct == pytest.approx(2.2 / 3) and mine.max_explore_pct == 1.4


def test_gap_to_the_better_bandit_per_phase():
    gap, where, over = _result().bandit_gap()
    # Better bandit minus the default: world 0: 1.5, 0.5; world 1: -5, NaN (left out);
    # world 2: 6, 2. Over one point: three phases; the worst is world 2's first.
    assert gap == pytest.approx(6.0) and where == "world-2 phase 0 (c=1)"
    assert over == 3


def test_render_and_json_name_the_worst_world_with_its_parameters():
    res = _result()
    text = "\n".join(render_worlds(res))
    assert "worst world: world-2 (seed 0)" in text and "its parameters: {'index': 2" in text
    assert "[FAIL] never below 95 % after warm-up: worst 94.0 % on world-2" in text
    data = res.to_json()
    assert [t["ok"] for t in data["targets"]] == [False, False, True, False]
    assert "3 phases over" in data["targets"][3]["detail"]
    assert [r["world"] for r in data["runs"]] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert data["summary"]["bandit_gap"]["worst_points"] == pytest.approx(6.0)
    assert data["worlds"][2]["params"]["index"] == 2


def test_gap_target_is_not_applicable_without_the_bandits():
    res = _result()
    only = WorldBenchResult(config=res.config, worlds=res.worlds, skipped=(), wall_s=1.0,
                            runs=tuple(r for r in res.runs if r.policy == DEFAULT_POLICY))
    assert only.checks()[3].ok is None
    assert only.checks(policy="ucb") == []


def test_config_refuses_bad_worlds_and_policies():
    with pytest.raises(ConfigError, match="worlds"):
        WorldBenchConfig(worlds=())
    with pytest.raises(ConfigError, match="world seed"):
        WorldBenchConfig(worlds=(1,), world_seed=-1)
    with pytest.raises(ConfigError, match="nope"):
        WorldBenchConfig(worlds=(1,), policies=("nope",))
