"""report's "does it pay?": gains of the table in effect over the starting table, k=0 and
always-speculate, with intervals, in text and JSON."""

from __future__ import annotations

import json

import pytest
from test_report import SERVER, T0, simulate_history

from storage import EventRecord, Storage
from tuner.report import build_report, render_json, render_text
from tuner.report_gain import parse_table_text


@pytest.fixture(scope="module")
def history(tmp_path_factory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('gain') / 'h.db'}"
    simulate_history(url, seconds=60)
    return url


def test_parse_table_text_round_trips_format_table():
    assert parse_table_text("b<=8:k5 b<=64:k3 rest:k1") == ((8, 5), (64, 3), (None, 1))
    assert parse_table_text("rest:k3") == ((None, 3),)
    assert parse_table_text("b<=8:k5") is None and parse_table_text("nonsense") is None


def test_report_gives_each_baseline_with_an_interval_and_its_source(history):
    with Storage(history, read_only=True) as st:
        (s,) = build_report(st).servers
    names = [rg.gain.baseline for rg in s.gains]
    assert names == ["start", "k0", "always"]
    start = s.gains[0]
    assert start.assumed  # no initial_table event in this history: SGLang's step assumed
    for rg in s.gains:
        g = rg.gain
        assert g.low <= g.ratio <= g.high and 0 <= g.measured_share <= 1
    with Storage(history, read_only=True) as st:
        (srv_json,) = json.loads(render_json(build_report(st)))["servers"]
    assert [g["baseline"] for g in srv_json["gains"]] == names
    assert srv_json["gains"][0]["ci95"][0] <= srv_json["gains"][0]["ratio"]


def test_the_recorded_starting_table_is_the_baseline(tmp_path):
    url = f"sqlite:///{tmp_path / 'h.db'}"
    simulate_history(url, seconds=30)
    with Storage(url) as st:
        st.record_tick(events=[EventRecord(SERVER, T0, "initial_table", "v0 b<=8:k1 rest:k0")])
        report = build_report(st)
    start = report.servers[0].gains[0]
    assert not start.assumed and start.base_table == ((8, 1), (None, 0))
    text = render_text(report)
    assert "gain over the server's starting table (b<=8:k1 rest:k0):" in text
    assert "gain over k=0 (no speculation):" in text


def test_the_interval_comes_from_stretches_of_time_when_errors_drift(tmp_path):
    """Two arms alternating in long runs while goodput drifts slowly: per-interval errors are
    strongly autocorrelated, so the delta method's interval is too narrow; the report's
    (jackknife over stretches of time) is wider, and holds the true gain."""
    import math
    import random

    from policies import Buckets
    from storage import ObservationRecord, PolicyVersionRecord, ServerSeen
    from tuner.report_gain import server_gains

    url = f"sqlite:///{tmp_path / 'h.db'}"
    rng = random.Random(5)
    drift, rows = 0.0, []
    for i in range(2000):
        drift = 0.995 * drift + 0.02 * rng.gauss(0, 1)  # slow wander of the load's level
        k = 5 if (i // 50) % 2 else 3  # long runs of one arm
        rate = 1000 * (1.1 if k == 5 else 1.0) * math.exp(drift)
        rows.append(ObservationRecord(SERVER, T0 + i, 8, k, 100, int(rate), 50, 100, 1.0))
    with Storage(url) as st:
        st.record_tick(
            servers=[ServerSeen(SERVER, (0, 3, 5), T0, T0 - 10, None, None)],
            observations=rows,
            events=[EventRecord(SERVER, T0, "initial_table", "v0 rest:k3")],
            policy_versions=[PolicyVersionRecord(SERVER, T0, 1, ((None, 5),), "model",
                                                 "greedy", "applied")],
        )
        (s,) = build_report(st).servers
        delta = {rg.gain.baseline: rg.gain for rg in server_gains(st, s, Buckets())}
    honest = {rg.gain.baseline: rg.gain for rg in s.gains}
    d, h = delta["start"], honest["start"]
    assert h.ratio == pytest.approx(d.ratio)
    assert h.high - h.low > 2 * (d.high - d.low)
    assert h.low <= 0.1 <= h.high


def test_a_banded_table_is_valued_as_it_ran_and_only_against_k0(tmp_path):
    """Under a banded table k5 ran only in the high-acceptance band (200 tok/s there) and k0
    in the low one (100 tok/s): k5's cell is not what k5 would do on all traffic. The gain is
    the rows as they ran (busy-weighted) over k0, and no drafting baseline is priced."""
    from storage import ObservationRecord, PolicyVersionRecord, ServerSeen
    from tuner.export import export

    url = f"sqlite:///{tmp_path / 'h.db'}"
    bands = ((None, (5, 0, 0, 5, 5)),)
    rows = []
    for i in range(40):  # b = 4: k0 3 s of busy time per 1 s of k5, alternating
        ts = T0 + i
        if i % 4 == 3:
            rows.append(ObservationRecord(SERVER, ts, 4, 5, 50, 200 + i % 2, 150, 250, 1.0))
        else:
            rows.append(ObservationRecord(SERVER, ts, 4, 0, 100, 100 + i % 2, 0, 0, 1.0))
    with Storage(url) as st:
        st.record_tick(servers=[ServerSeen(SERVER, (0, 1, 3, 5), T0)], observations=rows,
                       policy_versions=[PolicyVersionRecord(SERVER, T0, 1, ((None, 5),), "model",
                                                            "learned", "applied", bands)])
        report = build_report(st)
        data = export(st, fmt="dynspec", out=tmp_path / "p.json", source="data")
    (s,) = report.servers
    (g,) = s.gains
    assert g.banded and g.gain.baseline == "k0"
    assert g.gain.ratio == pytest.approx((0.75 * 100.5 + 0.25 * 200.5) / 100.5 - 1, rel=0.01)
    (bk,) = [b for b in s.buckets if b.arms]
    assert bk.gain_vs_always is None and bk.gain_vs_off == pytest.approx(g.gain.ratio, rel=0.01)
    text = render_text(report)
    assert f"gain over k=0 (no speculation): {g.gain.ratio:+.1%}" in text
    assert "as the banded tables ran" in text
    assert "not estimated" in text and "chosen k5/0,0,5,5" in text
    # The data's best arm is the band-selected k5: export from the data says so.
    assert data.learned.table == ((None, 5),)
    assert any("banded tables" in n for n in data.learned.notes)
