"""report: built on a database written by a short simulated run (real SQLite in tmp_path)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from policies import Buckets
from storage import (
    EventRecord,
    ObservationRecord,
    PolicyVersionRecord,
    ServerSeen,
    Storage,
)
from tuner.errors import ConfigError
from tuner.plugin.core import PluginCore
from tuner.protocol import encode_update
from tuner.report import (
    REPORT_SCHEMA,
    always_arm,
    build_report,
    parse_since,
    render_html,
    render_text,
    report_to_json,
    write_report,
)
from tuner.sim.engine import Engine
from tuner.sim.load import parse_load

SERVER = "127.0.0.1:30000"
ARMS = (0, 1, 3, 5)
T0 = 1_764_400_000.0  # wall-clock origin of the simulated run
FINAL_TABLE = ((2, 5), (16, 3), (None, 0))


def simulate_history(url: str, *, seconds: int = 60, seed: int = 1) -> None:
    """A short simulated run recorded as the daemon records one.

    The simulator's engine runs the plugin core; once per virtual second the counters are
    read, turned into per-(b, k) deltas and recorded with the tick. Every 5 s a new table
    (one arm everywhere, round robin) is applied so that each arm is seen at each load phase
    (concurrency 2, 16, 48); the run ends with a learned-looking table. One outage, one
    restart and one rejected update are recorded on the way.
    """
    core = PluginCore(ARMS, started_at=T0)
    eng = Engine(profile="h200-llama8b", workload="chat", core=core, seed=seed,
                 load=parse_load(f"{seconds / 3}:2,{seconds / 3}:16,{seconds / 3}:48"))
    prev: dict[tuple[int, int], tuple[int, int, int, int, float]] = {}
    version = 0
    with Storage(url) as st:
        st.record_tick(servers=[ServerSeen(address=SERVER, arms=ARMS, seen_at=T0,
                                           started_at=T0)])
        for sec in range(seconds):
            versions, events = [], []
            if sec % 5 == 0:
                version += 1
                k = ARMS[version % len(ARMS)]
                table = ((None, k),)
                ok, _ = core.apply_update(encode_update(table, version))
                assert ok
                versions.append(PolicyVersionRecord(
                    server=SERVER, ts=T0 + eng.now, version=version, table=table,
                    policy="round-robin", reason=f"explore k={k}"))
            if sec == 21:
                events.append(EventRecord(SERVER, T0 + eng.now, "outage", "connection refused"))
            if sec == 22:
                events.append(EventRecord(SERVER, T0 + eng.now, "recovered", ""))
            if sec == 30:
                events.append(EventRecord(SERVER, T0 + eng.now, "restart", "new start time"))
            eng.run_for(1.0)
            obs = []
            for c in core.state().counters:
                key = (c.b, c.k)
                now = (c.decode_steps, c.emitted_tokens, c.accepted_drafts, c.drafted_tokens,
                       c.busy_s)
                old = prev.get(key, (0, 0, 0, 0, 0.0))
                if now[0] > old[0]:
                    obs.append(ObservationRecord(
                        server=SERVER, ts=T0 + eng.now, b=c.b, k=c.k,
                        decode_steps=now[0] - old[0], emitted_tokens=now[1] - old[1],
                        accepted_drafts=now[2] - old[2], drafted_tokens=now[3] - old[3],
                        busy_s=now[4] - old[4]))
                prev[key] = now
            st.record_tick(observations=obs, policy_versions=versions, events=events)
        version += 1
        st.record_tick(policy_versions=[
            PolicyVersionRecord(server=SERVER, ts=T0 + eng.now, version=version,
                                table=((1, 5),), policy="thompson", reason="bad table",
                                outcome="rejected"),
        ])
        version += 1
        st.record_tick(policy_versions=[
            PolicyVersionRecord(server=SERVER, ts=T0 + eng.now + 0.5, version=version,
                                table=FINAL_TABLE, policy="thompson",
                                reason="greedy on stop"),
        ])


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('hist') / 'dynspec.db'}"
    simulate_history(url)
    return url


def test_numbers_match_stored_observations(history: str) -> None:
    buckets = Buckets((2, 16, 48))
    with Storage(history, read_only=True) as st:
        report = build_report(st, buckets=buckets, now=T0 + 100)
        rows = st.observations(server=SERVER)
    (s,) = report.servers
    assert s.server == SERVER and s.arms == ARMS
    assert s.observations == len(rows)
    assert s.decode_steps == sum(r.decode_steps for r in rows)
    seen = 0
    for bk in s.buckets:
        for a in bk.arms:
            mine = [r for r in rows if r.k == a.arm and buckets.index(r.b) == bk.index]
            seen += len(mine)
            assert a.intervals == len(mine)
            assert a.decode_steps == sum(r.decode_steps for r in mine)
            assert a.emitted_tokens == sum(r.emitted_tokens for r in mine)
            # One batch size per bucket here, so goodput is plain Σ emitted / Σ busy.
            assert len({r.b for r in mine}) == 1
            e = sum(r.emitted_tokens for r in mine)
            t = sum(r.busy_s for r in mine)
            assert a.goodput == pytest.approx(e / t)
            assert a.raw_goodput == pytest.approx(e / t)
            # The 95 % interval from the database's sums of squares equals the one computed
            # row by row in Python.
            b = mine[0].b
            r_ = e / (b * t)
            ss = sum((x.emitted_tokens - r_ * b * x.busy_s) ** 2 for x in mine)
            n = len(mine)
            assert n >= 2
            half = math.sqrt(ss * n / ((n - 1) * (b * t) ** 2)) * b
            assert a.ci_low <= a.goodput <= a.ci_high  # k=0 is deterministic in the sim
            assert a.ci_high - a.goodput == pytest.approx(half * _t(n - 1), rel=1e-6,
                                                          abs=1e-6 * a.goodput)
            if a.arm > 0:
                acc = sum(r.accepted_drafts for r in mine)
                assert a.accepted_per_step == pytest.approx(acc / (b * a.decode_steps))
                assert a.acceptance_rate == pytest.approx(
                    acc / sum(r.drafted_tokens for r in mine))
            else:
                assert a.accepted_per_step is None
    assert seen == len(rows)


def _t(df: int) -> float:
    from tuner.report import _t975

    return _t975(df)


def test_decisions_gains_crossover_history(history: str) -> None:
    buckets = Buckets((2, 16, 48))
    with Storage(history, read_only=True) as st:
        report = build_report(st, server=SERVER, buckets=buckets, now=T0 + 100)
    (s,) = report.servers
    assert s.table is not None and s.table.table == FINAL_TABLE and s.chosen_from == "policy"
    assert [bk.chosen for bk in s.buckets] == [5, 3, 0, 0]
    assert s.crossover_b == 17
    assert s.always_arm == 3  # SGLang's union[len // 2] of (0, 1, 3, 5)
    b2 = s.buckets[0]
    k5, k0, k3 = b2.arm(5), b2.arm(0), b2.arm(3)
    assert b2.gain_vs_off == pytest.approx(k5.goodput / k0.goodput - 1)
    assert b2.gain_vs_always == pytest.approx(k5.goodput / k3.goodput - 1)
    # At batch size 2 speculation pays on this profile; the best arm is a drafting one.
    assert b2.best != 0 and b2.gain_vs_off > 0.2
    # History: 12 round-robin versions, a rejected one, the final one.
    assert [v.version for v in s.versions] == list(range(1, 15))
    assert s.counts == {"pushes": 13, "rejected_updates": 1, "outages": 1, "restarts": 1}
    assert [e.kind for e in s.events] == ["outage", "recovered", "restart"]
    # Timeline: one point per bin for all arms together, covering every observation.
    total = sum(p.decode_steps for p in s.timeline if p.k is None)
    assert total == s.decode_steps


def test_since_window_and_unknown_server(history: str) -> None:
    with Storage(history, read_only=True) as st:
        late = build_report(st, since=T0 + 40, now=T0 + 100)
        with pytest.raises(ConfigError, match="nobody:1.*127.0.0.1:30000"):
            build_report(st, server="nobody:1")
        rows = [r for r in st.observations() if r.ts >= T0 + 40]
    (s,) = late.servers
    assert s.observations == len(rows) and s.decode_steps == sum(r.decode_steps for r in rows)
    # The table in effect is still known although it was set before ... after the window?
    assert s.table is not None and s.table.version == 14
    assert all(v.ts >= T0 + 40 for v in s.versions)


def test_text_fits_100_columns_and_says_what_matters(history: str) -> None:
    with Storage(history, read_only=True) as st:
        text = render_text(build_report(st, buckets=Buckets((2, 16, 48)), now=T0 + 100))
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "speculation stops paying from batch size 17" in text
    assert "v14" in text and "greedy on stop" in text and "rejected" in text
    assert re.search(r"^\s+k5\s+[\d,.]+ \[", text, re.M)  # an arm row with its interval


def test_json_is_stable_and_complete(history: str) -> None:
    with Storage(history, read_only=True) as st:
        report = build_report(st, buckets=Buckets((2, 16, 48)), now=T0 + 100)
    doc = report_to_json(report)
    assert doc["schema"] == REPORT_SCHEMA
    assert json.loads(json.dumps(doc)) == doc  # plain JSON, no NaN
    (srv,) = doc["servers"]
    assert srv["metrics_only"] is False
    assert set(srv) >= {"server", "arms", "always_arm", "table", "crossover_b", "buckets",
                        "goodput_by_batch_size", "timeline", "versions", "events", "counts"}
    arm = srv["buckets"][0]["arms"][0]
    assert set(arm) == {"arm", "goodput", "ci95", "decode_steps", "intervals", "busy_s",
                        "emitted_tokens", "raw_goodput", "mean_b", "accepted_per_step",
                        "acceptance_rate"}
    # Same database, same report (apart from nothing): deterministic.
    with Storage(history, read_only=True) as st:
        again = report_to_json(build_report(st, buckets=Buckets((2, 16, 48)), now=T0 + 100))
    assert again == doc


def test_html_embeds_plots_and_text_writes_them_beside(history: str, tmp_path: Path) -> None:
    with Storage(history, read_only=True) as st:
        report = build_report(st, buckets=Buckets((2, 16, 48)), now=T0 + 100)
    body, files = write_report(report, fmt="html", out=tmp_path / "r.html")
    assert body is None and files == [tmp_path / "r.html"]
    page = (tmp_path / "r.html").read_text()
    assert page.count("data:image/png;base64,") == 3
    _, files = write_report(report, fmt="json", out=tmp_path / "r.json")
    pngs = [f for f in files if f.suffix == ".png"]
    assert len(pngs) == 3 and all(f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for f in pngs)
    doc = json.loads((tmp_path / "r.json").read_text())
    assert sorted(doc["servers"][0]["plots"]) == sorted(
        ["goodput-vs-batch", "chosen-arm-over-time", "goodput-over-time"])
    text, files = write_report(report, fmt="text", out=None)
    assert files == [] and "dynspec-tuner report" in text
    assert "<table>" in render_html(report)


def test_empty_database(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    Storage(url).close()
    with Storage(url, read_only=True) as st:
        report = build_report(st, now=T0)
    assert report.servers == ()
    assert "no servers recorded" in render_text(report)
    assert report_to_json(report)["servers"] == []


def test_server_without_observations(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'h.db'}"
    with Storage(url) as st:
        st.record_tick(servers=[ServerSeen(address="a:1", arms=(0, 3), seen_at=T0)])
        report = build_report(st, now=T0)
    (s,) = report.servers
    assert s.observations == 0 and s.table is None and s.crossover_b is None
    text = render_text(report)
    assert "no observations in the window" in text
    _, _ = write_report(report, fmt="html", out=tmp_path / "r.html")  # plots cope with no data


def test_the_model_a_server_runs_is_reported(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'h.db'}"
    with Storage(url) as st:
        st.record_tick(servers=[ServerSeen(address="a:1", arms=(0, 3), seen_at=T0,
                                           model="meta-llama/Llama-3.1-8B-Instruct")])
        st.record_tick(servers=[ServerSeen(address="b:1", arms=(0, 3), seen_at=T0)])
        report = build_report(st, now=T0)
    text = render_text(report)
    assert "== server a:1 (meta-llama/Llama-3.1-8B-Instruct) ==" in text
    assert "== server b:1 ==" in text
    models = {s["server"]: s["model"] for s in report_to_json(report)["servers"]}
    assert models == {"a:1": "meta-llama/Llama-3.1-8B-Instruct", "b:1": None}


def test_parse_since() -> None:
    assert parse_since("90s", now=1000.0) == 910.0
    assert parse_since("15m", now=1000.0) == 100.0
    assert parse_since("1h", now=10_000.0) == 6400.0
    assert parse_since("2d", now=200_000.0) == 200_000.0 - 172_800
    assert parse_since("30", now=100.0) == 70.0
    assert parse_since("2025-11-30T12:00:00", now=0) == 1764504000.0
    with pytest.raises(ConfigError, match="--since 'yesterday'"):
        parse_since("yesterday", now=0)


def test_always_arm() -> None:
    assert always_arm((0, 1, 3, 5, 7)) == 3  # SGLang's default for its default config
    assert always_arm((0, 1, 3, 5)) == 3
    assert always_arm((0, 1)) == 1
    assert always_arm((0, 4)) == 4
    assert always_arm((0,)) is None


def test_open_history_refuses_a_missing_file_without_creating_it(tmp_path: Path) -> None:
    from tuner.report import open_history

    missing = tmp_path / "nope.db"
    with pytest.raises(ConfigError, match="no such file"):
        open_history(f"sqlite:///{missing}")
    assert not missing.exists()
    with pytest.raises(ConfigError, match="not a database URL"):
        open_history("::::")


def test_cli_report_text_json_and_errors(history: str, tmp_path: Path, capsys) -> None:
    from tuner.cli import main

    assert main(["report", "--db", history, "--buckets", "2,16,48"]) == 0
    out = capsys.readouterr().out
    assert "speculation stops paying from batch size 17" in out
    assert max(len(line) for line in out.splitlines()) <= 100
    assert main(["report", "--db", history, "--format", "json", "--server", SERVER]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == REPORT_SCHEMA and doc["servers"][0]["server"] == SERVER
    assert main(["report", "--db", history, "--format", "html", "--no-plots",
                 "--out", str(tmp_path / "r.html")]) == 0
    assert "data:image/png" not in (tmp_path / "r.html").read_text()
    assert main(["report", "--db", f"sqlite:///{tmp_path / 'missing.db'}"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["report", "--db", history, "--server", "nobody:1"]) == 2
    assert main(["report", "--db", history, "--since", "last tuesday"]) == 2


def check_against_rows(report_server, rows, buckets: Buckets) -> None:
    """Recompute every per-bucket, per-arm figure from the raw rows, row by row."""
    assert report_server.observations == len(rows)
    for bk in report_server.buckets:
        inb = [r for r in rows if buckets.index(r.b) == bk.index]
        assert {a.arm for a in bk.arms} == {r.k for r in inb}
        if not inb:
            continue
        b_ref = sum(r.b * r.decode_steps for r in inb) / sum(r.decode_steps for r in inb)
        assert bk.b_ref == pytest.approx(b_ref)
        for a in bk.arms:
            mine = [r for r in inb if r.k == a.arm]
            e = sum(r.emitted_tokens for r in mine)
            y = sum(r.b * r.busy_s for r in mine)
            assert a.intervals == len(mine)
            assert a.decode_steps == sum(r.decode_steps for r in mine)
            assert a.goodput == pytest.approx(e / y * b_ref)
            assert a.raw_goodput == pytest.approx(e / sum(r.busy_s for r in mine))
            if len(mine) >= 2:
                rate = e / y
                ss = sum((r.emitted_tokens - rate * r.b * r.busy_s) ** 2 for r in mine)
                n = len(mine)
                half = _t(n - 1) * math.sqrt(ss * n / ((n - 1) * y * y)) * b_ref
                assert a.ci_high - a.goodput == pytest.approx(half, rel=1e-6,
                                                              abs=1e-6 * a.goodput)
        if bk.best is not None:
            assert bk.arm(bk.best).goodput == max(a.goodput for a in bk.arms)


@pytest.fixture(scope="module")
def daemon_history(tmp_path_factory: pytest.TempPathFactory):
    """The real daemon against the simulator over HTTP (`run --simulate`), 30 simulated s."""
    from tuner.config import SimulateConfig, TunerConfig
    from tuner.simulate import run_simulation

    url = f"sqlite:///{tmp_path_factory.mktemp('daemon') / 'dynspec.db'}"
    summary = run_simulation(
        TunerConfig(db_url=url, interval_s=1.0, decision_period_s=2.0, seed=3),
        SimulateConfig(load="10:2,10:16,10:48", speed=2000, duration_s=30, seed=3),
    )
    return url, summary


def test_report_on_a_daemon_run_matches_its_history(daemon_history, tmp_path: Path) -> None:
    from tuner.daemon._tables import flat, is_banded
    from tuner.export import export, load_sglang_adaptive
    from tuner.protocol import is_uniform

    url, summary = daemon_history
    with Storage(url, read_only=True) as st:
        report = build_report(st)
        rows = st.observations()
        exported = export(st, fmt="sglang-adaptive", out=tmp_path / "a.json")
    # The simulator speaks protocol v2, so the daemon may leave it on a banded table; the
    # report and the export read it band-agnostic (each row's unknown-band arm).
    left = flat(summary.server_table)
    merged = tuple((b, k) for i, (b, k) in enumerate(left)
                   if i + 1 == len(left) or left[i + 1][1] != k)
    # What stock SGLang would be told is what the daemon left the server on.
    assert load_sglang_adaptive(tmp_path / "a.json")[0] == merged
    banded = is_banded(summary.server_table) and not is_uniform(summary.server_table)
    note = ("the table was learnt per acceptance band; SGLang's format holds one k per batch "
            "size, so its band-agnostic view is written (--format dynspec keeps the bands for "
            "the plugin)")
    assert exported.warnings == ((note,) if banded else ())
    (s,) = report.servers
    check_against_rows(s, rows, Buckets())
    # The table in effect is the one the daemon left the server on.
    assert s.table is not None and s.table.table == left
    assert s.table.version == summary.final_version
    assert s.counts["pushes"] == sum(1 for v in s.versions if v.outcome == "applied") > 0
    assert s.curve and s.timeline
