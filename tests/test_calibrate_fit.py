"""calibrate --from-db: a cost table fitted to stored step times reproduces the simulator."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from storage import ObservationRecord, Storage
from tuner.calibrate import (
    DEFAULT_DRAFT_RATIO,
    StepCell,
    fit_from_storage,
    fit_observations,
    read_table,
    write_table,
)
from tuner.cli import main
from tuner.errors import ConfigError, DynspecError
from tuner.plugin.core import PluginCore
from tuner.sim.engine import Engine
from tuner.sim.graphs import cuda_graph_bs
from tuner.sim.load import ClosedLoop
from tuner.sim.profiles import load_profile

SERVER = "10.0.0.7:30000"
ARMS = (0, 1, 3, 5)
LEVELS = (1, 2, 4, 7, 12, 20, 32, 48)  # closed-loop concurrency, one virtual second each


def _cells(profile, bs, ks, *, steps=100, skip=False):
    return [
        StepCell(b=b, k=k, decode_steps=steps,
                 busy_s=steps * profile.step_s(b, k, skip_zero_draft_extend=skip))
        for b in bs for k in ks
    ]


@pytest.mark.parametrize("skip", [False, True])
def test_fit_reproduces_every_measured_step_exactly(tmp_path: Path, skip: bool):
    ref = load_profile("h200-llama8b")
    fit = fit_observations(_cells(ref, (1, 8, 64, 256), ARMS, skip=skip), skip_zero_draft_extend=skip)
    assert fit.count("measured") == 16 and fit.count("interpolated") == 0
    # The simulator, loading the file, charges what the server measured, at both k=0 modes.
    prof = load_profile(write_table(tmp_path / "fit.jsonl", fit.info, fit.rows))
    for b in (1, 8, 64, 256):
        for k in ARMS:
            want = ref.step_s(b, k, skip_zero_draft_extend=skip)
            assert prof.step_s(b, k, skip_zero_draft_extend=skip) == pytest.approx(want, rel=1e-4)
    for r in fit.rows:
        assert r.draft_ms == pytest.approx(DEFAULT_DRAFT_RATIO * r.target_ms)


def test_missing_cells_are_interpolated_or_extrapolated_and_say_so():
    ref = load_profile("h200-llama8b")
    cells = _cells(ref, (1, 64), (0, 3)) + _cells(ref, (8,), (1,)) + _cells(ref, (1,), (5,))
    fit = fit_observations(cells)
    src = {(r.b, r.q): r.source for r in fit.rows}
    assert sorted(src) == [(b, q) for b in (1, 8, 64) for q in (1, 2, 4, 6)]
    assert src[(1, 1)] == src[(1, 4)] == src[(1, 6)] == src[(8, 2)] == src[(64, 4)] == "measured"
    assert src[(8, 1)] == "interpolated"  # target(b, 1) between b=1 and b=64 (k=0 there)
    assert src[(8, 4)] == "interpolated"  # in b, between b=1 and b=64
    assert src[(1, 2)] == src[(64, 2)] == "interpolated"  # in q, between q=1 and q=4
    assert src[(8, 6)] == src[(64, 6)] == "extrapolated"  # q=6 only at b=1
    assert fit.info["cells"] == {"measured": 6, "interpolated": 4, "extrapolated": 2}
    by = {(r.b, r.q): r.target_ms for r in fit.rows}
    assert by[(1, 1)] < by[(8, 1)] < by[(64, 1)]
    assert by[(8, 4)] == pytest.approx(by[(1, 4)] + (by[(64, 4)] - by[(1, 4)]) * 7 / 63)
    assert by[(1, 2)] == pytest.approx((2 * by[(1, 1)] + by[(1, 4)]) / 3)
    # Scaled from b=1 by the two batch sizes' q=1 cells.
    assert by[(64, 6)] == pytest.approx(by[(1, 6)] * by[(64, 1)] / by[(1, 1)])


def test_target_at_one_token_from_the_arms_alone_when_nothing_brackets_it():
    ref = load_profile("h200-llama8b")
    fit = fit_observations(_cells(ref, (32,), (1, 3, 5)))
    row = {r.q: r for r in fit.rows}
    assert row[1].source == "extrapolated"
    # Step times are close to a line in k: its intercept is (1 + ρ) · target(b, 1).
    assert row[1].target_ms == pytest.approx(ref.target_ms(32, 1), rel=0.10)


def test_padding_pools_batch_sizes_that_run_in_one_graph_and_thin_cells_are_left_out():
    cells = [
        StepCell(b=17, k=0, decode_steps=30, busy_s=30 * 0.006),
        StepCell(b=18, k=0, decode_steps=30, busy_s=30 * 0.008),
        StepCell(b=3, k=0, decode_steps=5, busy_s=5 * 0.005),
        StepCell(b=4, k=1, decode_steps=10, busy_s=0.0),
    ]
    fit = fit_observations(cells, graph_bs=cuda_graph_bs(64), min_steps=20)
    assert [(c.b, c.k, c.decode_steps) for c in fit.used] == [(18, 0, 60)]
    assert fit.rows[0].target_ms == pytest.approx(7.0 / (1 + DEFAULT_DRAFT_RATIO))
    reasons = sorted(why for _, why in fit.ignored)
    assert reasons == ["no decode steps or no busy time", "only 5 decode steps (< 20)"]
    with pytest.raises(DynspecError, match="nothing to fit"):
        fit_observations(cells[2:], min_steps=20)
    with pytest.raises(ValueError, match="draft_ratio"):
        fit_observations(cells, draft_ratio=1.5)


# --- a database built by a simulated run ------------------------------------------------------


def _simulated_history(url: str, *, skip: bool) -> tuple[Engine, int]:
    """Run the simulator at each arm over a concurrency ramp; store its counters."""
    engines = []
    with Storage(url) as st:
        for i, k in enumerate(ARMS):
            core = PluginCore(ARMS, started_at=0.0, default_arm=k)
            eng = Engine(
                profile="h200-llama8b",
                workload="chat",
                core=core,
                load=ClosedLoop([(1.0, c) for c in LEVELS]),
                skip_zero_draft_extend=skip,
                seed=i,
            )
            eng.run_until(float(len(LEVELS)))
            st.record_tick(observations=[
                ObservationRecord(SERVER, 1000.0 + i, r.b, r.k, r.decode_steps, r.emitted_tokens,
                                  r.accepted_drafts, r.drafted_tokens, r.busy_s)
                for r in core.telemetry.rows()
            ])
            engines.append(eng)
        n = st.count_observations(server=SERVER)
    return engines[0], n


@pytest.mark.parametrize("skip", [False, True])
def test_table_fitted_from_a_simulated_history_reproduces_the_simulators_cost(
    tmp_path: Path, skip: bool
):
    url = f"sqlite:///{tmp_path / 'h.db'}"
    eng, n = _simulated_history(url, skip=skip)
    assert n >= len(LEVELS) * len(ARMS)
    with Storage(url, read_only=True) as st:
        fit = fit_from_storage(st, SERVER, graph_bs=eng.graph_bs, skip_zero_draft_extend=skip)
    assert fit.info["server"] == SERVER and fit.info["observations"] == n
    prof = load_profile(write_table(tmp_path / "twin.jsonl", fit.info, fit.rows))
    measured = [(c.b, c.k) for c in fit.used]
    assert len({b for b, _ in measured}) >= 8 and {k for _, k in measured} == set(ARMS)
    worst = 0.0
    for b, k in measured:
        want = eng.profile.step_s(b, k, skip_zero_draft_extend=skip)
        got = prof.step_s(b, k, skip_zero_draft_extend=skip)
        worst = max(worst, abs(got / want - 1))
    assert worst < 0.05
    # The base step (speculation off entirely) is right too when k=0 was measured.
    for b in {b for b, k in measured if k == 0}:
        assert prof.base_step_s(b) == pytest.approx(eng.profile.base_step_s(b), rel=0.05)


def test_cli_from_db_writes_the_table_and_says_which_cells_were_measured(tmp_path: Path, capsys):
    url = f"sqlite:///{tmp_path / 'h.db'}"
    _simulated_history(url, skip=False)
    out = tmp_path / "twin.jsonl"
    rc = main(["calibrate", "--from-db", url, "--server", SERVER, "--out", str(out),
               "--graph-max-bs", "48"])
    assert rc == 0
    text = capsys.readouterr().out
    table = read_table(out)
    n_measured = sum(1 for r in table.rows if r.source == "measured")
    assert f"{n_measured} measured" in text and "interpolated" in text
    assert table.info["source"] == "fitted" and table.info["server"] == SERVER
    assert all(r.source in ("measured", "interpolated", "extrapolated") for r in table.rows)
    assert math.isfinite(load_profile(out).step_s(48, 3))


def test_cli_from_db_unknown_server_names_the_known_ones(tmp_path: Path, capsys):
    url = f"sqlite:///{tmp_path / 'h.db'}"
    _simulated_history(url, skip=False)
    rc = main(["calibrate", "--from-db", url, "--server", "other:1", "--out", str(tmp_path / "t")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "other:1" in err and SERVER in err
    with Storage(url, read_only=True) as st, pytest.raises(ConfigError):
        fit_from_storage(st, "other:1")
