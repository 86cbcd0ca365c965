"""Sweep scheduling with a fake clock and a fake server: which (level, arm) cells Optuna's
sampler asks for, how long windows run, trial bounds, resume, interruption and output."""

from __future__ import annotations

import asyncio
import json
import math
import random

import optuna
import pytest
from optuna.trial import TrialState

from tests._fakes import FakeClock
from tuner.errors import ConfigError
from tuner.loadgen import WindowStats
from tuner.protocol import lookup
from tuner.sweep import (
    TABLE_ARM,
    Measurement,
    Planner,
    ServerSetup,
    ServerWindow,
    Sweep,
    SweepConfig,
    SweepResult,
    crossover_text,
    measurements_from_study,
    plot_png,
    render_text,
)

LEVELS = (1, 2, 4, 8, 16, 32, 64, 128)
ARMS = (0, 1, 3, 5)
FEW = (1, 2, 4, 16)


_REL = {
    1: {0: 0.60, 1: 0.80, 3: 0.92, 5: 1.00},
    2: {0: 0.70, 1: 0.88, 3: 1.00, 5: 0.92},
    4: {0: 0.85, 1: 1.00, 3: 0.90, 5: 0.80},
    8: {0: 1.00, 1: 0.90, 3: 0.70, 5: 0.55},
    16: {0: 1.00, 1: 0.80, 3: 0.60, 5: 0.45},
}


def truth(level: int, arm: int) -> float:
    """Tokens/s with the shape seen on PCIe boxes: deep drafting wins alone, loses crowded.

    Best arm: k=5 at 1, k=3 at 2, k=1 at 4, k=0 from 8 up (gaps of 8 % or more); an arm's
    advantage over a smaller one shrinks as the level grows, as draft cost does.
    """
    rel = _REL[min(level, 16)]
    return 100.0 * min(level, 48) ** 0.8 * rel[arm]


class FakeMeasurer:
    """Measures ``truth`` with seeded noise; every step advances the fake clock by step_s.

    ``rel_sd`` is the noise of one step's estimate; the reported standard error shrinks with
    the square root of the steps, as batch means would.
    """

    def __init__(
        self,
        clock: FakeClock,
        *,
        arms: tuple[int, ...] = ARMS,
        pinnable: bool = True,
        rel_sd: float = 0.02,
        seed: int = 0,
        cancel_at: int | None = None,
        truth_fn=truth,
    ) -> None:
        self.clock = clock
        self.arms = arms
        self.pinnable = pinnable
        self.rel_sd = rel_sd
        self.rng = random.Random(seed)
        self.cancel_at = cancel_at
        self.truth = truth_fn
        self.pins: list[tuple] = []
        self.windows: list[tuple[int, int, float]] = []  # (level, arm, seconds)
        self.restored = 0

    async def setup(self) -> ServerSetup:
        note = None if self.pinnable else "stock SGLang: measuring only the configured arm (k=3)"
        return ServerSetup(arms=self.arms, pinnable=self.pinnable, note=note)

    async def measure(self, level, table, *, warmup_s, step_s, on_phase, on_step):
        if self.cancel_at is not None and len(self.windows) == self.cancel_at:
            raise asyncio.CancelledError()
        if table is not None:
            self.pins.append(table)
        arm = lookup(table, level) if table is not None else self.arms[0]
        on_phase("warm-up")
        self.clock.t += warmup_s
        start = self.clock.t
        true = self.truth(level, arm)
        acc = []
        step = 0
        while True:
            step += 1
            self.clock.t += step_s
            acc.append(true * (1 + self.rng.gauss(0.0, self.rel_sd)))
            mean = sum(acc) / len(acc)
            se = true * self.rel_sd / math.sqrt(len(acc)) if len(acc) >= 3 else math.nan
            stats = WindowStats(
                start=start, end=self.clock.t, requests=10 * step, output_tokens=int(mean * step),
                avg_in_flight=float(level), tok_s=mean, tok_s_se=se, tok_s_completed=mean,
                tpot_p50_s=level / mean, tpot_p99_s=1.2 * level / mean, errors=0,
            )
            if on_step(step, stats):
                break
        self.windows.append((level, -1 if table is not None and len(table) > 1 else arm,
                             self.clock.t - start))
        server = ServerWindow(100 * step, int(mean * step), 0, 0, float(step), 100 * step * level,
                              {arm: 100 * step})
        return stats, server

    async def restore(self) -> None:
        self.restored += 1


def run_sweep(tmp_path, measurer, clock=None, db="sweep.db", **cfg):
    cfg.setdefault("levels", LEVELS)
    cfg.setdefault("per_level_s", 12.0)
    cfg.setdefault("warmup_s", 1.0)
    cfg.setdefault("study_name", "s")
    sweep = Sweep(
        SweepConfig(**cfg),
        measurer=measurer,
        db_url=f"sqlite:///{tmp_path / db}",
        study_attrs={"max_tokens": 256},
        clock=clock or measurer.clock,
    )
    return asyncio.run(sweep.run())


def best_truth(level: int, arms=ARMS) -> int:
    return max(arms, key=lambda a: truth(level, a))


def test_truth_has_a_staircase():
    assert [best_truth(c) for c in LEVELS] == [5, 3, 1, 0, 0, 0, 0, 0]


def test_sweep_names_the_true_best_arm_per_level_with_fewer_cells_than_the_grid(tmp_path):
    clock = FakeClock()
    fake = FakeMeasurer(clock)
    result = run_sweep(tmp_path, fake)
    assert result.best == {c: best_truth(c) for c in LEVELS}
    arm_windows = [w for w in fake.windows if w[1] != TABLE_ARM]
    cells = {(lv, a) for lv, a, _ in arm_windows}
    assert len(cells) < len(LEVELS) * len(ARMS) * 0.7
    # The learned table maps each level's batch size to that level's winner.
    assert result.table == ((1, 5), (2, 3), (4, 1), (None, 0))
    assert "speculation stops paying at concurrency 8" in result.crossover
    # The table was measured at every level once it mixed arms.
    assert sorted(lv for lv, a, _ in fake.windows if a == TABLE_ARM) == list(LEVELS)
    # Skipped cells are exactly the unmeasured ones, each with its reason.
    assert set(result.skipped) == {(c, a) for c in LEVELS for a in ARMS} - cells
    assert all("lost to k=" in why for why in result.skipped.values())
    assert fake.restored == 1
    # Measured time on the fake clock is below what the full grid would take.
    assert result.measured_s < len(LEVELS) * len(ARMS) * 12.0


def test_clearly_worse_arms_are_pruned_before_the_full_window(tmp_path):
    clock = FakeClock()
    fake = FakeMeasurer(clock)
    run_sweep(tmp_path, fake, levels=FEW, table_pass=False)
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 'sweep.db'}")
    pruned = study.get_trials(states=(TrialState.PRUNED,))
    assert pruned, "some losing arm should have been cut short"
    for t in pruned:
        level, arm = t.params["concurrency"], t.params["arm"]
        assert arm != best_truth(level)
        assert len(t.intermediate_values) < 6  # stopped before the last step
    # Every trial carries its per-step values for the dashboard.
    assert all(t.intermediate_values for t in study.get_trials(states=(TrialState.COMPLETE,)))


def test_exhaustive_measures_every_cell_once_for_the_full_window(tmp_path):
    clock = FakeClock()
    fake = FakeMeasurer(clock)
    result = run_sweep(tmp_path, fake, levels=FEW, exhaustive=True, table_pass=False)
    cells = [(lv, a) for lv, a, _ in fake.windows]
    assert sorted(cells) == sorted((c, a) for c in FEW for a in ARMS)
    assert all(s == pytest.approx(12.0) for _, _, s in fake.windows)
    assert result.best == {c: best_truth(c) for c in FEW}
    assert not result.skipped


def test_trials_bound_the_sweep_and_a_rerun_resumes_without_remeasuring(tmp_path):
    clock = FakeClock()
    first = FakeMeasurer(clock, seed=1)
    r1 = run_sweep(tmp_path, first, levels=FEW, max_trials=5)
    assert len(first.windows) == 5 and r1.windows == 5
    assert any("--trials 5" in n for n in r1.notes)
    second = FakeMeasurer(clock, seed=2)
    r2 = run_sweep(tmp_path, second, levels=FEW)
    assert any("resumed" in n and "5 windows" in n for n in r2.notes)
    firsts = [(lv, a) for lv, a, _ in first.windows]
    assert len(set(firsts)) == 5  # five different cells, none measured twice yet
    # The rerun picks up where the first stopped: its first window is a cell not measured
    # yet, the one the planner names for the stored measurements.
    planner = Planner(SweepConfig(levels=FEW, study_name="s"), ARMS)
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 'sweep.db'}")
    stored = [m for m in measurements_from_study(study) if m.trial is not None and m.trial < 5]
    resumed_at = (second.windows[0][0], second.windows[0][1])
    assert resumed_at == planner.next_cell(stored)
    assert resumed_at not in firsts
    assert r2.windows == 5 + len(second.windows)
    assert r2.best == {c: best_truth(c) for c in FEW}


def test_ctrl_c_keeps_completed_windows_marks_the_open_one_failed_and_resumes(tmp_path):
    clock = FakeClock()
    fake = FakeMeasurer(clock, cancel_at=4)
    result = run_sweep(tmp_path, fake, levels=FEW)
    assert result.interrupted
    assert result.windows == 4
    assert fake.restored == 1  # the server got its table back
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 'sweep.db'}")
    assert len(study.get_trials(states=(TrialState.FAIL,))) == 1
    assert len(measurements_from_study(study)) == 4
    again = FakeMeasurer(clock)
    r2 = run_sweep(tmp_path, again, levels=FEW)
    assert not r2.interrupted
    assert r2.best == {c: best_truth(c) for c in FEW}


def test_a_trial_left_running_by_a_killed_sweep_is_failed_on_resume(tmp_path):
    url = f"sqlite:///{tmp_path / 'sweep.db'}"
    study = optuna.create_study(study_name="s", storage=url, direction="maximize")
    study.ask()  # a killed process leaves this RUNNING
    clock = FakeClock()
    run_sweep(tmp_path, FakeMeasurer(clock), max_trials=1)
    study = optuna.load_study(study_name="s", storage=url)
    assert not study.get_trials(states=(TrialState.RUNNING,))


def test_a_study_measured_with_other_settings_is_refused(tmp_path):
    clock = FakeClock()
    run_sweep(tmp_path, FakeMeasurer(clock), max_trials=1)
    sweep = Sweep(
        SweepConfig(levels=LEVELS, study_name="s"),
        measurer=FakeMeasurer(clock),
        db_url=f"sqlite:///{tmp_path / 'sweep.db'}",
        study_attrs={"max_tokens": 128},
        clock=clock,
    )
    with pytest.raises(ConfigError, match="max_tokens=256.*max_tokens=128"):
        asyncio.run(sweep.run())


def test_arms_the_server_did_not_build_are_refused(tmp_path):
    clock = FakeClock()
    with pytest.raises(ConfigError, match=r"arms \[7\] are not built"):
        run_sweep(tmp_path, FakeMeasurer(clock), arms=(0, 7))


def test_stock_sglang_measures_only_the_configured_arm_and_says_so(tmp_path):
    clock = FakeClock()
    fake = FakeMeasurer(clock, arms=(3,), pinnable=False)
    result = run_sweep(tmp_path, fake, arms=(0, 1, 3))
    assert {a for _, a, _ in fake.windows} == {3}
    assert fake.pins == [] and fake.restored == 0
    assert any("stock SGLang" in n for n in result.notes)
    assert any("--arms 0,1,3 ignored" in n for n in result.notes)
    assert set(result.best.values()) == {3}


def test_an_arm_subset_is_measured_and_the_unbuilt_arms_never_pinned(tmp_path):
    clock = FakeClock()
    fake = FakeMeasurer(clock)
    result = run_sweep(tmp_path, fake, arms=(0, 3), levels=(1, 8, 64))
    assert result.arms == (0, 3)
    assert {lookup(t, 1) for t in fake.pins} <= {0, 3}
    assert result.best == {1: 3, 8: 0, 64: 0}


def test_close_arms_are_remeasured_and_the_level_settles_within_tolerance(tmp_path):
    # Arms 1 and 3 within 1 % at level 4: the winner may be either, but never worse than 2 %.
    def close(level, arm):
        if level == 4 and arm in (1, 3):
            return 1000.0 if arm == 1 else 990.0
        return truth(level, arm)

    clock = FakeClock()
    fake = FakeMeasurer(clock, truth_fn=close, rel_sd=0.03)
    result = run_sweep(tmp_path, fake, levels=(1, 4, 16))
    assert close(4, result.best[4]) >= 0.98 * 1000.0
    assert result.cells[(4, result.best[4])].windows <= 3


# --- the planner directly ---------------------------------------------------------------


def m(level, arm, tok_s, se=None, pruned=False, table=None):
    se = 0.005 * tok_s if se is None else se
    return Measurement(level=level, arm=arm, window_s=10.0, requests=50, output_tokens=1000,
                       tok_s=tok_s, tok_s_se=se, tpot_p50_ms=1.0, tpot_p99_ms=2.0,
                       avg_in_flight=level, pruned=pruned, table=table)


def test_planner_skips_arms_ruled_out_in_both_directions():
    p = Planner(SweepConfig(levels=(1, 4, 16)), ARMS)
    # At 4: k=3 beats k=1 clearly (rules k=1 and k=0 out at 1), and beats k=5 (rules k=5 out
    # at 16).
    ms = [m(4, 3, 300.0), m(4, 1, 250.0), m(4, 5, 260.0), m(4, 0, 200.0)]
    est = p.estimates(ms)
    assert set(p.skipped(est, 1)) == {0, 1}
    assert set(p.skipped(est, 16)) == {5}
    assert "lost to k=3 at concurrency 4" == p.skipped(est, 16)[5]
    # Next: level 1, the level-4 winner first.
    assert p.next_cell(ms) == (1, 3)


def test_planner_does_not_skip_on_a_difference_inside_the_noise():
    p = Planner(SweepConfig(levels=(1, 4)), ARMS)
    ms = [m(1, 5, 100.0, se=10.0), m(1, 3, 110.0, se=10.0)]
    assert p.skipped(p.estimates(ms), 4) == {}


def test_planner_learned_table_and_table_pass_only_for_mixed_tables():
    p = Planner(SweepConfig(levels=(1, 2, 4)), (0, 3))
    ms = [m(1, 3, 100.0), m(1, 0, 50.0), m(2, 3, 180.0), m(2, 0, 100.0), m(4, 0, 300.0),
          m(4, 3, 200.0)]
    est = p.estimates(ms)
    assert p.learned_table(est) == ((2, 3), (None, 0))
    assert p.next_cell(ms) == (1, TABLE_ARM)
    # A table measured for another table does not count.
    stale = m(1, TABLE_ARM, 99.0, table=((None, 3),))
    assert p.next_cell([*ms, stale]) == (1, TABLE_ARM)
    fresh = [m(lv, TABLE_ARM, 99.0, table=((2, 3), (None, 0))) for lv in (1, 2, 4)]
    assert p.next_cell([*ms, *fresh]) is None
    # One arm everywhere: no table pass (it would just repeat that arm).
    one = [m(1, 0, 100.0), m(1, 3, 50.0), m(2, 0, 100.0), m(2, 3, 50.0), m(4, 0, 9.0),
           m(4, 3, 5.0)]
    assert p.next_cell(one) is None


def test_crossover_text_names_each_run_and_where_speculation_stops_paying():
    assert crossover_text({1: 5, 2: 3, 4: 0, 8: 0}, ARMS) == (
        "best arm: k=5 at 1, k=3 at 2, k=0 at 4-8; speculation stops paying at concurrency 4"
    )
    assert crossover_text({1: 3, 2: 1}, ARMS).endswith("speculation pays at every level measured")
    assert "not monotone" in crossover_text({1: 0, 2: 3, 4: 0}, ARMS)


def test_config_rejects_bad_values():
    with pytest.raises(ConfigError, match="concurrency levels"):
        SweepConfig(levels=(0, 2))
    with pytest.raises(ConfigError, match="per_level_s"):
        SweepConfig(per_level_s=0)
    with pytest.raises(ConfigError, match="max_trials"):
        SweepConfig(max_trials=0)


# --- output -------------------------------------------------------------------------------


def test_text_json_and_png_outputs(tmp_path):
    clock = FakeClock()
    result = run_sweep(tmp_path, FakeMeasurer(clock), levels=(1, 4, 16))
    text = render_text(result, header="sweep of fake:1")
    lines = text.splitlines()
    assert lines[0] == "sweep of fake:1"
    row1 = next(line for line in lines if line.strip().startswith("1 "))
    assert "*" in row1 and "k=5" in row1
    row16 = next(line for line in lines if line.strip().startswith("16 "))
    assert "k=0" in row16 and "1.00x" in row16
    assert "learned table: b<=1:k5 b<=4:k1 rest:k0" in text
    obj = result.to_json()
    json.dumps(obj)  # serialisable
    assert obj["best"] == {"1": 5, "4": 1, "16": 0}
    assert obj["table"] == [[1, 5], [4, 1], [None, 0]]
    assert any(c["arm"] == "table" for c in obj["cells"])
    png = plot_png(result, tmp_path / "out" / "sweep.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_level_the_client_could_not_fill_is_flagged():
    def win(level, batch):
        return ServerWindow(100, 1000, 0, 0, 1.0, int(100 * batch), {0: 100})

    p = Planner(SweepConfig(levels=(8, 32, 64)), (0,))
    ms = [
        Measurement(level=lv, arm=0, window_s=10.0, requests=50, output_tokens=1000,
                    tok_s=100.0 * lv, tok_s_se=1.0, tpot_p50_ms=1.0, tpot_p99_ms=2.0,
                    avg_in_flight=lv, server=win(lv, b))
        for lv, b in ((8, 7.5), (32, 30.0), (64, 7.2))
    ]
    result = SweepResult.build(p, ms, study_name="s", notes=("first",))
    assert result.notes[0] == "first"
    assert len(result.notes) == 2 and result.notes[1].startswith(
        "concurrency 64: the server's decode batch averaged 7.2, not ~30"
    )
