"""Loads (schedules, Poisson, traces), workloads and the oracle."""

from __future__ import annotations

import math

import pytest

from tuner.errors import ConfigError
from tuner.sim.engine import Engine
from tuner.sim.load import ClosedLoop, NoLoad, Poisson, Trace, parse_load
from tuner.sim.oracle import (
    expected_emitted,
    expected_goodput,
    oracle_arm,
    oracle_goodput,
    oracle_table,
    survival,
    table_goodput,
    workload_emitted,
)
from tuner.sim.profiles import TableProfile
from tuner.sim.workloads import LengthDist, Phase, RequestClass, Workload, get_workload

# --- load -------------------------------------------------------------------------------------


def test_parse_load_forms():
    cl = parse_load("60:1,60:4,60:16")
    assert isinstance(cl, ClosedLoop) and cl.phases == ((60.0, 1), (60.0, 4), (60.0, 16))
    assert not cl.repeat
    assert parse_load("loop:10:1,10:2").repeat
    hold = parse_load("64")
    assert isinstance(hold, ClosedLoop) and hold.concurrency_at(1e9) == 64
    assert isinstance(parse_load("none"), NoLoad)
    p = parse_load("poisson:2.5:30")
    assert isinstance(p, Poisson) and p.rate == 2.5 and p.duration_s == 30


@pytest.mark.parametrize(
    "spec, message",
    [
        ("abc", "is not SECONDS:CONCURRENCY"),
        ("60:x", "is not SECONDS:CONCURRENCY"),
        ("10,20:3", "only the last phase may omit"),
        ("0:3", "bad phase"),
        ("60:-2", "bad phase"),
        ("poisson:", "poisson:RATE"),
        ("poisson:-1", "rate must be > 0"),
        ("poisson:1:2:3", "poisson:RATE"),
        ("trace:/nonexistent/x.csv", "cannot read trace"),
        (",", "no phases"),
    ],
)
def test_bad_load_specs(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_load(spec)


def _in_system(eng: Engine) -> int:
    return eng.num_running + eng.num_waiting


def test_closed_loop_follows_its_schedule():
    eng = Engine(profile="h200-llama8b", workload="chat", load=parse_load("10:2,10:20,10:5"))
    seen = []
    for t in (5.0, 15.0, 40.0):
        eng.run_until(t)
        seen.append(_in_system(eng))
    assert seen[:2] == [2, 20]
    assert seen[2] <= 20  # draining towards 5: nobody new starts until below it
    eng.run_until(200.0)
    assert _in_system(eng) == 5


def test_a_replaced_load_starts_no_successors():
    eng = Engine(profile="h200-llama8b", workload="chat", load=ClosedLoop([(1e9, 10)]))
    eng.run_until(5.0)
    eng.attach_load(ClosedLoop([(1e9, 2)]))
    eng.run_until(300.0)
    assert _in_system(eng) == 2


def test_closed_loop_repeats():
    load = ClosedLoop([(10, 1), (10, 3)], repeat=True)
    eng = Engine(profile="h200-llama8b", workload="chat", load=load)
    assert [load.concurrency_at(t) for t in (0, 9.9, 10, 25, 35)] == [1, 1, 3, 1, 3]
    eng.run_until(25.0)
    assert load.in_flight >= 1


def test_poisson_arrivals():
    eng = Engine(
        profile="h200-llama8b", workload="chat", load=Poisson(2.0, duration_s=100.0, seed=1)
    )
    eng.run_until(150.0)
    n = eng.counters.requests_submitted
    assert 200 - 4 * math.sqrt(200) < n < 200 + 4 * math.sqrt(200)


def test_trace_replay(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens\n0.5,100,10\n2.0,,20\n1.0,50,5\n")
    trace = Trace.from_csv(path)
    assert [r.arrival_s for r in trace.rows] == [0.5, 1.0, 2.0]
    eng = Engine(profile="h200-llama8b", workload="chat", load=trace)
    eng.run_until(0.75)
    assert eng.counters.requests_submitted == 1
    eng.run_until(5.0)
    assert eng.counters.requests_submitted == 3 and eng.counters.requests_finished == 3
    assert eng.request_stats().output_tokens == 35


@pytest.mark.parametrize(
    "text, message",
    [
        ("time,x\n1,2\n", "needs a header with 'arrival_s'"),
        ("arrival_s\n", "no rows"),
        ("arrival_s,output_tokens\nsoon,3\n", r"t.csv:2: column 'arrival_s' is not a number"),
        (
            "arrival_s,output_tokens\n1,0\n",
            r"t.csv:2: column 'output_tokens' must be an integer >= 1",
        ),
        (
            "arrival_s,output_tokens\n1,2\n-1,2\n",
            r"t.csv:3: column 'arrival_s' must be a finite number >= 0",
        ),
    ],
)
def test_bad_traces(tmp_path, text, message):
    path = tmp_path / "t.csv"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        parse_load(f"trace:{path}")


# --- workloads --------------------------------------------------------------------------------


def test_workload_presets_and_shifts():
    chat = get_workload("chat")
    assert chat.mix_at(0)[0][1].alpha_delta("eagle3-dense") == (0.775, 0.973)
    assert chat.mix_at(0)[0][1].alpha_delta("kimi-eagle3") == (0.70, 1.0)
    assert get_workload("summarize").name == "summarise"
    shift = get_workload("shift")
    assert [shift.mix_at(t)[0][1].name for t in (0, 700, 1300, 1900)] == [
        "chat",
        "code",
        "hard",
        "chat",
    ]
    custom = get_workload("chat:10,hard:5")
    assert [custom.mix_at(t)[0][1].name for t in (9, 11, 16)] == ["chat", "hard", "chat"]
    with pytest.raises(ConfigError, match="unknown workload"):
        get_workload("poetry")
    with pytest.raises(ConfigError, match="unknown request class 'poetry'"):
        get_workload("chat:10,poetry:5")
    with pytest.raises(ConfigError, match="bad duration"):
        get_workload("chat:soon")


# --- oracle -----------------------------------------------------------------------------------


def test_survival_and_closed_form():
    assert survival(0.8, 1.0, 3) == pytest.approx([0.8, 0.64, 0.512])
    assert expected_emitted(0.8, 1.0, 3) == pytest.approx((1 - 0.8**4) / (1 - 0.8))
    # anchors §3.3: chat (α .775, δ .973) at k=1,3,5 -> 1.77, 2.79, 3.31
    assert [round(expected_emitted(0.775, 0.973, k), 2) for k in (1, 3, 5)] == [1.77, 2.79, 3.31]
    # Beta(κα, κ(1−α)) moments: E[α²] = α(κα+1)/(κ+1)
    a, kap = 0.7, 20.0
    assert survival(a, 1.0, 2, kappa=kap)[1] == pytest.approx(a * (kap * a + 1) / (kap + 1))


def _toy():
    # b=1: every arm costs 10 ms (verify is free at bs 1) -> deepest arm wins.
    # b=64: target(64, q) = 10·q ms -> speculation never pays -> k=0 wins.
    rows = []
    for b in (1, 64):
        for q in (1, 2, 3, 4):
            rows.append((b, q, 10.0 if b == 1 else 10.0 * q, 0.0))
    prof = TableProfile(rows=rows, name="toy")
    cls = RequestClass(
        name="c",
        acceptance={"eagle3-dense": (0.8, 1.0)},
        prompt=LengthDist(10, 0.0),
        output=LengthDist(100, 0.0),
    )
    return prof, Workload(name="w", phases=(Phase(1.0, ((1.0, cls),)),))


def test_oracle_on_a_hand_made_profile():
    prof, wl = _toy()
    kw = dict(heterogeneous=False, graph_bs=())
    assert oracle_arm(prof, wl, 1, (0, 1, 3), **kw) == 3
    assert oracle_arm(prof, wl, 64, (0, 1, 3), **kw) == 0
    assert expected_goodput(prof, wl, 1, 3, **kw) == pytest.approx(
        (1 + 0.8 + 0.64 + 0.512) / 0.010
    )
    assert expected_goodput(prof, wl, 64, 0, **kw) == pytest.approx(64 / 0.010)
    # Midway (b=32.5 interpolated): target(b,q) = 10 + (10q−10)(b−1)/63.
    table = oracle_table(prof, wl, (0, 1, 3), max_batch=64, **kw)
    assert table[0] == (1, 3) or table[0][1] == 3
    assert table[-1] == (None, 0)
    for b in range(1, 65):
        best = max((expected_goodput(prof, wl, b, k, **kw), -k) for k in (0, 1, 3))
        assert oracle_arm(prof, wl, b, (0, 1, 3), **kw) == -best[1]


def test_table_goodput_and_oracle_goodput():
    prof, wl = _toy()
    kw = dict(heterogeneous=False, graph_bs=())
    occupancy = {1: 100.0, 64: 100.0}
    oracle = oracle_goodput(prof, wl, (0, 1, 3), occupancy, **kw)
    always3 = table_goodput(prof, wl, ((None, 3),), occupancy, **kw)
    never = table_goodput(prof, wl, ((None, 0),), occupancy, **kw)
    assert oracle > max(always3, never)
    # time-weighted mean of per-b goodputs with the oracle's arms (3 at b=1, 0 at b=64)
    assert oracle == pytest.approx((2.952 / 0.010 + 64 / 0.010) / 2)
    assert always3 == pytest.approx((2.952 / 0.010 + 64 * 2.952 / 0.040) / 2)
    with pytest.raises(ValueError, match="at least one batch size"):
        table_goodput(prof, wl, ((None, 0),), {}, **kw)


def test_workload_emitted_weightings_agree_without_heterogeneity():
    prof, wl = _toy()
    for k in (0, 1, 3):
        a = workload_emitted(wl, "eagle3-dense", k, heterogeneous=False)
        b = workload_emitted(wl, "eagle3-dense", k, heterogeneous=False, weighting="request")
        assert a == pytest.approx(b) == pytest.approx(expected_emitted(0.8, 1.0, k))
    with pytest.raises(ValueError, match="weighting"):
        workload_emitted(wl, "eagle3-dense", 1, weighting="vibes")
