"""The switchback experiment (run --holdout): its schedule and estimate (pure), and the daemon
running it against the simulator in simulated time (a lockstep clock, no sleeps)."""

from __future__ import annotations

import json
import random
import threading

import pytest

from tuner.switchback import Budget, Pair, Schedule, estimate, parse_fraction, t975


def test_t975_matches_the_table_of_students_t():
    for df, t in ((1, 12.706), (2, 4.303), (5, 2.571), (10, 2.228), (11, 2.201), (20, 2.086),
                  (30, 2.042), (60, 2.000), (120, 1.980)):
        assert t975(df) == pytest.approx(t, abs=1.5e-3), df
    assert t975(0) == float("inf")


@pytest.mark.parametrize(("text", "value"), [("5%", 0.05), ("0.05", 0.05), ("50%", 0.5),
                                             (" 12.5% ", 0.125)])
def test_parse_fraction(text, value):
    assert parse_fraction(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["0", "0%", "51%", "0.6", "-5%", "five", "nan", ""])
def test_parse_fraction_refuses(text):
    with pytest.raises(ValueError):
        parse_fraction(text)


def test_each_block_has_one_adjacent_pair_in_random_order():
    s = Schedule(0.05, 10.0, seed=3)
    assert s.block == 20 and s.share == pytest.approx(0.05)
    positions, orders = set(), set()
    for n in range(200):
        roles = [s.at((n * s.block + i) * 10.0 + 3.0) for i in range(s.block)]
        assert {blk for blk, _ in roles} == {n}
        kinds = [r for _, r in roles]
        assert kinds.count("base") == 1 and kinds.count("control") == 1
        b, c = kinds.index("base"), kinds.index("control")
        assert abs(b - c) == 1
        positions.add(min(b, c))
        orders.add(b < c)
    assert orders == {True, False}
    assert len(positions) > 10  # spread over the block, not a fixed slot
    # Seeded: the same seed, the same schedule; another seed, another one.
    assert [Schedule(0.05, 10.0, seed=3).at(t) for t in range(0, 4000, 7)] == \
        [s.at(t) for t in range(0, 4000, 7)]
    assert [Schedule(0.05, 10.0, seed=4).at(t) for t in range(0, 4000, 7)] != \
        [s.at(t) for t in range(0, 4000, 7)]


def _bursty_run(seed, *, budget, fraction=0.05, window=5, ticks=6000):
    """Readings every second of a load that idles at 100 tokens/s with bursts of 30 to 60 s
    at 3,000 tokens/s; each reading goes where the schedule (and the budget) put it, as the
    daemon does. Returns the baseline's share of the tokens after each baseline window."""
    rng = random.Random(seed)
    sched = Schedule(fraction, float(window), seed=seed)
    b = Budget(fraction)
    rate, burst_left = 100.0, 0
    last_window = window_tokens = last_tick = float("inf")
    role, pair_open, shares = "tuned", None, []
    for t in range(ticks):
        if t > 0:  # the interval before this tick ran the role set at the last one
            x = rate * rng.uniform(0.8, 1.2)
            b.add(x, 1.0, base=role == "base")
            window_tokens, last_tick = (0.0 if window_tokens == float("inf") else
                                        window_tokens) + x, x
            if burst_left:
                burst_left -= 1
            elif rng.random() < 0.01:
                burst_left = rng.randrange(30, 60)
            rate = 3000.0 if burst_left else 100.0
        if t % window == 0 and t > 0:
            last_window, window_tokens = window_tokens, 0.0
        block, drawn = sched.at(t)
        if pair_open is not None and (pair_open != block or drawn == "tuned"):
            pair_open = None
        was = role
        role = (b.admit(block, drawn, pair_open=pair_open is not None,
                        window_forecast=last_window,
                        tick_forecast=max(last_tick, last_window / window))
                if budget else drawn)
        if role in ("base", "control"):
            pair_open = block
        if was == "base" and role != "base":
            shares.append(b.base_tokens / b.tokens)
    return shares


def test_the_budget_keeps_the_baselines_share_of_tokens_whatever_the_load():
    """Without the budget a baseline window in a burst carries many times its share of the
    tokens (the cost bound then fails run by run); with it, never more than ``fraction``."""
    fraction = 0.05
    without = [max(_bursty_run(s, budget=False)) for s in range(20)]
    assert sum(x > fraction for x in without) >= 5
    for s in range(20):
        shares = _bursty_run(s, budget=True)
        assert len(shares) >= 30  # most blocks still run their pair (60 blocks)
        assert max(shares) <= fraction + 1e-12, s


def test_the_budget_skips_a_pair_it_cannot_pay_for_and_cuts_a_window_short():
    b = Budget(0.1)
    # Nothing banked yet: the first pair is skipped, for its whole block.
    assert b.admit(0, "base", pair_open=False, window_forecast=100, tick_forecast=20) == "tuned"
    assert b.skipped == 0
    assert b.admit(0, "control", pair_open=False, window_forecast=0, tick_forecast=0) == "tuned"
    b.add(2000, 10, base=False)  # 200 banked
    assert b.banked == pytest.approx(200)
    assert b.admit(1, "control", pair_open=False, window_forecast=200,
                   tick_forecast=50) == "control"
    assert b.admit(1, "base", pair_open=True, window_forecast=200, tick_forecast=50) == "base"
    b.add(180, 1, base=True)  # 218 - 180 = 38 banked: too little for 50 more (0.9 x 50)
    assert b.banked == pytest.approx(38)
    assert b.admit(1, "base", pair_open=True, window_forecast=200, tick_forecast=50) == "cut"
    assert b.admit(1, "base", pair_open=True, window_forecast=0, tick_forecast=0) == "cut"
    assert b.base_tokens / b.tokens <= 0.1
    # The next block starts afresh: its pair runs once the tokens are banked again.
    b.add(4000, 20, base=False)
    assert b.admit(2, "base", pair_open=False, window_forecast=200, tick_forecast=40) == "base"


def _pair(rng, gain, drift, noise, n_strata=3):
    """A pair whose control is ``gain`` better in every stratum, with load drift shared by
    both windows and independent noise."""
    base, control = {}, {}
    for j in range(n_strata):
        level = 1000 * (j + 1) * (1 + drift * rng.gauss(0, 1))
        sb, sc = rng.uniform(1, 5), rng.uniform(1, 5)
        base[str(j)] = (level * (1 + noise * rng.gauss(0, 1)) * sb, sb)
        control[str(j)] = (level * (1 + gain) * (1 + noise * rng.gauss(0, 1)) * sc, sc)
    return Pair(0, base, control, (0, 1), (1, 2))


def test_the_interval_covers_a_known_gain_at_its_nominal_rate():
    rng = random.Random(7)
    hits = 0
    for _ in range(400):
        pairs = [_pair(rng, 0.04, drift=0.3, noise=0.05) for _ in range(6)]
        r = estimate(pairs, all_tokens=1e9, all_busy_s=1e6)
        hits += r.low <= 0.04 <= r.high
    assert 0.92 <= hits / 400 <= 0.99  # 95 % nominal, from pairs as units


def test_one_pair_gives_no_finite_interval_and_the_cost_is_bounded():
    rng = random.Random(1)
    one = estimate([_pair(rng, 0.1, 0.0, 0.01)], all_tokens=1e6, all_busy_s=1e3)
    assert one.pairs == 1 and one.high == float("inf")
    pairs = [_pair(rng, 0.1, 0.1, 0.01) for _ in range(5)]
    base_busy = sum(v[1] for p in pairs for v in p.base.values())
    all_busy = base_busy * 20  # the baseline ran 5 % of the busy time
    all_tokens = sum(v[0] for p in pairs for v in p.base.values()) * 21
    r = estimate(pairs, all_tokens=all_tokens, all_busy_s=all_busy)
    assert r.base_share == pytest.approx(0.05)
    assert 0 < r.cost <= 0.05 * r.ratio


def test_pairs_without_a_shared_stratum_are_left_out():
    p = Pair(0, {"1": (100.0, 1.0)}, {"2": (100.0, 1.0)}, (0, 1), (1, 2))
    assert p.terms() is None
    assert estimate([p], all_tokens=1.0, all_busy_s=1.0) is None


def test_a_pair_round_trips_and_fits_an_event():
    from policies import Buckets

    edges = Buckets().edges
    sums = {str(e): (123456.789, 9.87654321) for e in edges} | {"rest": (1.0, 2.0)}
    p = Pair(12, sums, sums, (1.7e9, 1.7e9 + 10), (1.7e9 + 10, 1.7e9 + 20), "b<=8:k5 rest:k3",
             (1.7e9 - 100, 1.7e9 + 100))
    text = p.to_json()
    assert len(text) < 2000  # events keep 2,000 characters
    back = Pair.from_json(text)
    assert back.block == 12 and back.base_table == "b<=8:k5 rest:k3"
    assert back.terms() == pytest.approx(p.terms(), rel=1e-6)
    assert json.loads(text)["block_span"] == [1.7e9 - 100, 1.7e9 + 100]


# --- the daemon against the simulator ------------------------------------------------------


def _simulate(tmp_path, *, duration=240.0, holdout=0.25, window=4.0, seed=2, stop_when=None):
    from tuner.config import SimulateConfig, TunerConfig
    from tuner.simulate import run_simulation

    db = f"sqlite:///{tmp_path / 'sim.db'}"
    cfg = TunerConfig(db_url=db, seed=seed, holdout=holdout, holdout_window_s=window)
    sim = SimulateConfig(seed=seed, duration_s=duration, speed=10_000, port=0,
                         load="15:1,15:4,15:16,15:64")
    stop = threading.Event()

    def on_tick(status):
        if stop_when is not None and stop_when(status):
            stop.set()

    return run_simulation(cfg, sim, stop_event=stop, on_tick=on_tick), db


def test_switchback_measures_the_true_gain_and_ends_on_the_tuned_table(tmp_path):
    from storage import Storage

    s, db = _simulate(tmp_path)
    r = s.switchback
    assert r is not None and r.pairs >= 10
    assert r.low <= s.switchback_truth <= r.high
    assert r.high - r.low < 0.2  # an interval that says something
    assert 0.1 <= r.base_share <= 0.3  # of busy time; the budget holds its share of tokens
    assert r.cost <= 0.25 * max(r.ratio, 0) + 1e-9
    assert s.server_table == s.greedy_table  # never left on a baseline window
    with Storage(db, read_only=True) as st:
        kinds = [e.kind for e in st.events(server=s.server)]
        versions = st.policy_versions(server=s.server)
    assert kinds.count("holdout_start") == kinds.count("holdout_end") >= r.pairs
    assert kinds.count("holdout_pair") == r.pairs
    assert kinds.count("holdout_skip") >= 1  # the first block: nothing banked yet
    held = [v for v in versions if v.reason == "holdout: baseline window"]
    assert held and all(v.table == s.start_table for v in held)
    assert versions[-1].reason != "holdout: baseline window"


def test_sigterm_during_a_baseline_window_leaves_the_greedy_table(tmp_path):
    from storage import Storage

    s, db = _simulate(tmp_path, duration=600.0,
                      stop_when=lambda st: st.ticks > 30 and st.servers[0].holdout_active)
    assert s.simulated_s < 590  # stopped early, inside a baseline window
    assert s.server_table == s.greedy_table != s.start_table
    with Storage(db, read_only=True) as st:
        events = st.events(server=s.server)
        last = st.policy_versions(server=s.server)[-1]
    ends = [e for e in events if e.kind == "holdout_end"]
    assert "stopped during a baseline window" in ends[-1].detail
    assert last.reason == "shutdown: greedy table" and last.outcome == "applied"
    assert not [e for e in events if e.kind == "stop_unclean"]


def test_report_and_metrics_show_the_measured_gain(tmp_path):
    from tuner.report import build_report, render_text, report_to_json
    from tuner.report import open_history
    from tuner.tuner_metrics import TunerMetrics

    s, db = _simulate(tmp_path, duration=120.0)
    with open_history(db) as st:
        report = build_report(st)
    text = render_text(report)
    assert "measured gain over the server's starting table (switchback," in text
    lines = text.splitlines()
    first = next(x for x in lines if "(switchback," in x)
    assert first.endswith("]") and "…" not in first  # whole, not clipped to the width
    assert any(x.startswith("  the baseline ran") and x.endswith("of goodput") for x in lines)
    doc = report_to_json(report)["servers"][0]["switchback"]
    assert doc["pairs"] == s.switchback.pairs
    assert doc["ratio"] == pytest.approx(s.switchback.ratio, abs=1e-4)
    m = TunerMetrics()
    m.set_switchback("a:1", s.switchback, active=True)
    from prometheus_client import generate_latest

    body = generate_latest(m.registry).decode()
    assert 'dynspec_holdout_active{server="a:1"} 1.0' in body
    assert 'dynspec_switchback_gain_ratio_lower{server="a:1"}' in body
    assert f'dynspec_switchback_pairs{{server="a:1"}} {float(s.switchback.pairs)}' in body


@pytest.mark.parametrize(("argv", "message"), [
    (["--holdout", "5%", "--dry-run"], "not with --dry-run"),
    (["--holdout", "70%"], "at most 50%"),
    (["--holdout", "5%", "--holdout-window", "1"], "must be >= 2 intervals"),
])
def test_bad_holdout_settings_are_one_line_and_exit_2(argv, message, capsys):
    from tuner.cli import main

    assert main(["run", "--server", "127.0.0.1:1", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_status_lines_show_the_switchback():
    from tuner.daemon import DaemonStatus, ServerStatus
    from tuner.status import status_lines
    from tuner.switchback import SwitchbackGain

    def status(**kw):
        st = ServerStatus(address="a:1", mode="plugin", up=True, arms=(0, 3), version=2,
                          server_table=((None, 3),), snapshot=None, last_push=None,
                          last_error=None, down_since=None, observations=1, decode_steps=10,
                          interval_goodput=100.0, pushes=1, restarts=0, **kw)
        return DaemonStatus(ts=0.0, ticks=1, policy="model", dry_run=False, servers=(st,),
                            storage_ok=True, buffered_rows=0, dropped_rows=0)

    (plain,) = status_lines(status())
    assert "switchback" not in plain
    (waiting,) = status_lines(status(holdout_active=True))
    assert "switchback: on the baseline table now" in waiting
    r = SwitchbackGain(0.031, 0.004, 0.058, 7, 0.05, 0.0015, 0.0028)
    (line,) = status_lines(status(switchback=r))
    assert "switchback: measured gain +3.1% [+0.4%, +5.8%] from 7 pairs, cost 0.15%" in line
