"""Rolling up old observations (Storage.rollup) and schema v2: totals, the report's numbers,
warm starts and live pool readers survive a roll-up; a v1 file migrates on open; the daemon
rolls up on schedule. Tests taking ``db_url`` run on SQLite and PostgreSQL."""

from __future__ import annotations

import logging
import math
import random
import sqlite3

import pytest

from policies import Buckets
from storage import SCHEMA_VERSION, ObservationRecord, ServerSeen, Storage
from tests.test_daemon import A as SRV
from tests.test_daemon import FakeClock, FakeServer, make_daemon, tick
from tuner.config import TunerConfig
from tuner.errors import ConfigError, StorageError
from tuner.report import build_report

A, B = "10.0.0.1:30000", "10.0.0.2:30000"
HOUR = 3600.0
T0 = 19_675 * 86400.0  # midnight UTC, 14 Nov 2023: day and hour bins align
BATCHES = (1, 2, 4, 8, 16, 32, 64)
ARMS = (0, 1, 3)


def history(seed: int = 0, *, hours: int = 6, every_s: float = 60.0) -> list[ObservationRecord]:
    """Noisy observations of two servers, one tick every ``every_s``: a few (b, k) a tick,
    several batch sizes per report bucket, so b_ref weighting and intervals all matter."""
    rng = random.Random(seed)
    rows = []
    t = T0 + 7.5
    while t < T0 + hours * HOUR:
        for server in (A, B):
            for b in rng.sample(BATCHES, 3):
                k = rng.choice(ARMS)
                steps = rng.randint(5, 200)
                acc = sum(rng.random() < 0.7 for _ in range(min(b * k * steps, 60)))
                acc = acc * max(1, b * k * steps // 60) if k else 0
                emitted = b * steps + acc
                busy = steps * (0.01 + 0.0004 * b) * (1 + 0.3 * k) * rng.uniform(0.8, 1.25)
                rows.append(ObservationRecord(server, t, b, k, steps, emitted, acc,
                                              b * k * steps, busy))
        t += every_s
    return rows


def fill(url: str, rows: list[ObservationRecord]) -> Storage:
    st = Storage(url)
    st.record_tick(
        servers=[ServerSeen(s, ARMS, seen_at=T0, started_at=T0 - 100, pool="p") for s in (A, B)],
        observations=rows,
    )
    return st


def totals(st: Storage, **kw) -> dict:
    return {
        (a.server, a.b, a.k): (a.rows, a.decode_steps, a.emitted_tokens, a.accepted_drafts,
                               a.drafted_tokens, round(a.busy_s, 9))
        for a in st.aggregate(**kw)
    }


def moments(st: Storage, **kw) -> dict:
    return {
        (m.server, m.bin, m.b, m.k): (m.rows, m.decode_steps, m.emitted_tokens, m.busy_s,
                                      m.emitted_sq, m.emitted_busy, m.busy_sq)
        for m in st.moments(**kw)
    }


def assert_moments_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, w in want.items():
        g = got[key]
        assert g[:3] == w[:3], key
        assert g[3:] == pytest.approx(w[3:], rel=1e-12), key


# --- the storage contract (SQLite and PostgreSQL) ------------------------------------------------


def test_rollup_keeps_every_total_and_moment_and_shrinks(db_url):
    rows = history()
    with fill(db_url, rows) as st:
        n0 = st.count_observations()
        whole, per_hour = totals(st), moments(st)
        hourly = moments(st, bin_s=HOUR)
        cutoff = T0 + 4 * HOUR + 1800  # mid-hour: only the 4 whole hours before it roll up
        recent = st.observations(since=T0 + 4 * HOUR)
        removed = st.rollup(older_than=cutoff, bin_s=HOUR)
        n1 = st.count_observations()
        assert removed == n0 - n1 > 0
        # 4 h of 1-min ticks, 2 servers x 3 rows a tick, into <= 2 x 4 x 21 (b, k) rows.
        assert n1 <= len(recent) + 2 * 4 * len(BATCHES) * len(ARMS) < n0 / 2
        assert totals(st) == whole
        assert_moments_equal(moments(st), per_hour)
        assert_moments_equal(moments(st, bin_s=HOUR), hourly)  # bins aligned with the roll-up
        assert st.observations(since=T0 + 4 * HOUR) == recent  # younger rows untouched
        # Per server too, and a second call with the same cutoff changes nothing.
        assert totals(st, server=A) == {k: v for k, v in whole.items() if k[0] == A}
        assert st.rollup(older_than=cutoff, bin_s=HOUR) == 0
        assert st.count_observations() == n1
        # Coarser bins merge rolled-up rows again, still exactly.
        assert st.rollup(older_than=T0 + 6 * HOUR, bin_s=6 * HOUR) > 0
        assert totals(st) == whole
        assert_moments_equal(moments(st), per_hour)
        assert st.count_observations() <= 2 * len(BATCHES) * len(ARMS)


def test_rollup_of_one_server_and_edge_cases(db_url):
    with fill(db_url, history(1, hours=2)) as st:
        before_b = st.observations(server=B)
        whole = totals(st)
        assert st.rollup(older_than=T0 + 2 * HOUR, bin_s=HOUR, server=A) > 0
        assert st.observations(server=B) == before_b
        assert totals(st) == whole
        assert st.rollup(older_than=T0, bin_s=HOUR) == 0  # nothing that old
        assert st.rollup(older_than=T0 + HOUR, bin_s=HOUR, server="nobody:1") == 0
        for bad in (0, -1.0, math.nan, math.inf):
            with pytest.raises(ValueError, match="bin_s"):
                st.rollup(older_than=T0 + HOUR, bin_s=bad)
        with pytest.raises(ValueError, match="older_than"):
            st.rollup(older_than=math.nan, bin_s=HOUR)
    with Storage(db_url, read_only=True) as ro, pytest.raises(StorageError, match="read-only"):
        ro.rollup(older_than=T0 + HOUR, bin_s=HOUR)


def test_report_numbers_survive_a_rollup(db_url, tmp_path):
    """Goodput estimates and 95 % intervals per bucket and arm are those of the raw rows,
    over the whole history and over a window starting on a bin boundary."""
    rows = history(2)
    raw = fill(f"sqlite:///{tmp_path / 'raw.db'}", rows)
    rolled = fill(db_url, rows)
    assert rolled.rollup(older_than=T0 + 5 * HOUR, bin_s=HOUR) > 0
    buckets = Buckets((2, 16, 48))
    try:
        for since in (None, T0 + 2 * HOUR):
            want = build_report(raw, since=since, buckets=buckets, now=T0)
            got = build_report(rolled, since=since, buckets=buckets, now=T0)
            assert [s.server for s in got.servers] == [A, B]
            for gs, ws in zip(got.servers, want.servers):
                assert (gs.observations, gs.decode_steps) == (ws.observations, ws.decode_steps)
                compared = 0
                for gb, wb in zip(gs.buckets, ws.buckets):
                    assert gb.b_ref == pytest.approx(wb.b_ref, rel=1e-12, nan_ok=True)
                    assert (gb.best, gb.chosen) == (wb.best, wb.chosen)
                    assert [a.arm for a in gb.arms] == [a.arm for a in wb.arms]
                    for ga, wa in zip(gb.arms, wb.arms):
                        assert (ga.intervals, ga.decode_steps, ga.emitted_tokens) == (
                            wa.intervals, wa.decode_steps, wa.emitted_tokens)
                        assert wa.intervals >= 2 and wa.ci_low is not None
                        for f in ("goodput", "ci_low", "ci_high", "raw_goodput", "mean_b"):
                            assert getattr(ga, f) == pytest.approx(getattr(wa, f), rel=1e-9), f
                        compared += 1
                assert compared >= 6
    finally:
        raw.close()
        rolled.close()


def test_live_pool_reader_neither_misses_nor_double_counts_across_a_rollup(db_url):
    """A reader following the pool tick by tick, as the daemon does (ids above a lookback
    window, fetching the unseen), sees every fresh row once and no rolled-up row."""
    rows = history(3, hours=3, every_s=300.0)
    mine = [r for r in rows if r.server == B]
    with Storage(db_url) as st:
        st.record_tick(servers=[ServerSeen(s, ARMS, T0, pool="p") for s in (A, B)])
        seen: set[int] = set()
        read: list[ObservationRecord] = []

        def follow() -> None:
            ids = st.pool_observation_ids("p", after_id=0, exclude=[A])
            fresh = st.pool_observations("p", ids=[i for i in ids if i not in seen])
            seen.update(i for i, _ in fresh)
            read.extend(r for _, r in fresh)

        by_tick: dict[float, list[ObservationRecord]] = {}
        for r in rows:
            by_tick.setdefault(r.ts, []).append(r)
        for i, (ts, tick_rows) in enumerate(sorted(by_tick.items())):
            st.record_tick(observations=tick_rows)
            follow()
            if i % 7 == 6:  # roll up everything older than an hour, now and then
                st.rollup(older_than=ts - HOUR, bin_s=HOUR)
        follow()
        assert st.count_observations() < len(rows)
        assert sorted(read, key=lambda r: (r.ts, r.b, r.k)) == sorted(
            mine, key=lambda r: (r.ts, r.b, r.k))
        # Rolled-up rows never show to a pool reader, whatever its cursor.
        everything = st.pool_observations("p", after_id=0)
        assert 0 < len(everything) < st.count_observations()
        assert all(o in rows for _, o in everything)
        assert st.pool_observation_ids("p") == [i for i, _ in everything]


def test_warm_start_after_rollup_replays_the_same_totals(db_url):
    rows = history(4, hours=3)
    with fill(db_url, rows) as st:
        st.rollup(older_than=T0 + 2 * HOUR, bin_s=HOUR)
        replay = st.warm_start(A, arms=ARMS)
        assert len(replay) < sum(1 for r in rows if r.server == A)
        assert [r.ts for r in replay] == sorted(r.ts for r in replay)  # oldest first
        for field in ("decode_steps", "emitted_tokens", "accepted_drafts", "drafted_tokens"):
            assert sum(getattr(r, field) for r in replay) == sum(
                getattr(r, field) for r in rows if r.server == A)
        pooled = st.warm_start(A, arms=ARMS, pool="p")
        assert sum(r.decode_steps for r in pooled) == sum(r.decode_steps for r in rows)


# --- migration (a file written with schema v1) ---------------------------------------------------

V1_DDL = (
    ("CREATE TABLE schema_version (id INTEGER NOT NULL, version INTEGER NOT NULL, "
     "created_at FLOAT NOT NULL, PRIMARY KEY (id))"),
    ("CREATE TABLE servers (id INTEGER NOT NULL, address VARCHAR(255) NOT NULL, "
     "arms_json TEXT NOT NULL, first_seen FLOAT NOT NULL, last_seen FLOAT NOT NULL, "
     "started_at FLOAT, start_times_json TEXT NOT NULL, pool VARCHAR(255), PRIMARY KEY (id), "
     "UNIQUE (address))"),
    ("CREATE TABLE observations (id INTEGER NOT NULL, server_id INTEGER NOT NULL, "
     "ts FLOAT NOT NULL, b INTEGER NOT NULL, k INTEGER NOT NULL, decode_steps BIGINT NOT NULL, "
     "emitted_tokens BIGINT NOT NULL, accepted_drafts BIGINT NOT NULL, "
     "drafted_tokens BIGINT NOT NULL, busy_s FLOAT NOT NULL, PRIMARY KEY (id), "
     "FOREIGN KEY(server_id) REFERENCES servers (id) ON DELETE CASCADE)"),
    "CREATE INDEX ix_observations_server_ts ON observations (server_id, ts)",
)


def test_a_v1_file_migrates_on_open_and_rolls_up(tmp_path):
    path = tmp_path / "v1.db"
    rows = [r for r in history(5, hours=2) if r.server == A]
    con = sqlite3.connect(path)
    for ddl in V1_DDL:
        con.execute(ddl)
    con.execute("INSERT INTO schema_version VALUES (1, 1, 0.0)")
    con.execute("INSERT INTO servers VALUES (1, ?, '[0, 1, 3]', 0, 0, NULL, '[]', NULL)", (A,))
    con.executemany(
        "INSERT INTO observations (server_id, ts, b, k, decode_steps, emitted_tokens, "
        "accepted_drafts, drafted_tokens, busy_s) VALUES (1, ?, ?, ?, ?, ?, ?, ?, ?)",
        [(r.ts, r.b, r.k, r.decode_steps, r.emitted_tokens, r.accepted_drafts,
          r.drafted_tokens, r.busy_s) for r in rows])
    con.commit()
    con.close()
    url = f"sqlite:///{path}"
    # A reader (report) of the unmigrated file gets the numbers, and changes nothing.
    with Storage(url, read_only=True) as ro:
        assert ro.schema_version == 1
        assert [(x.address, x.model) for x in ro.servers()] == [(A, None)]  # no such column
        assert ro.warm_start_acceptance(A, arms=(0, 1, 3)) == ([], [])  # no such table
        v1_moments, v1_totals = moments(ro), totals(ro)
        assert sum(v[0] for v in v1_totals.values()) == len(rows)
    with Storage(url) as st:
        assert st.schema_version == SCHEMA_VERSION == 4
        assert st.observations() == sorted(rows, key=lambda r: r.ts)
        assert_moments_equal(moments(st), v1_moments)
        assert st.rollup(older_than=T0 + 2 * HOUR, bin_s=HOUR) > 0
        assert totals(st) == v1_totals
        assert_moments_equal(moments(st), v1_moments)
        st.record_tick(observations=[rows[0]])  # the daemon keeps writing
    cols = {r[1] for r in sqlite3.connect(path).execute("PRAGMA table_info(observations)")}
    assert {"n_intervals", "emitted_sq", "emitted_busy", "busy_sq", "rollup_bin_s"} <= cols
    cols = {r[1] for r in sqlite3.connect(path).execute("PRAGMA table_info(servers)")}
    assert {"model", "model_since"} <= cols
    tables = {r[0] for r in sqlite3.connect(path).execute(
        "SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"band_observations", "depth_counts"} <= tables  # v4
    with Storage(url) as again:  # opening a migrated file again is a no-op
        assert again.schema_version == SCHEMA_VERSION


# --- configuration and the daemon ----------------------------------------------------------------


def test_config_rollup_flags_env_and_validation():
    c = TunerConfig.from_sources({}, {})
    assert (c.rollup_after_s, c.rollup_bin_s) == (7 * 86400.0, HOUR)
    c = TunerConfig.from_sources({"rollup_after_s": "2d", "rollup_bin_s": "15m"},
                                 {"DYNSPEC_ROLLUP_AFTER": "9d"})
    assert (c.rollup_after_s, c.rollup_bin_s) == (2 * 86400.0, 900.0)
    c = TunerConfig.from_sources({}, {"DYNSPEC_ROLLUP_AFTER": "off", "DYNSPEC_ROLLUP_BIN": "7200"})
    assert (c.rollup_after_s, c.rollup_bin_s) == (None, 7200.0)
    with pytest.raises(ConfigError, match="DYNSPEC_ROLLUP_AFTER='soon'"):
        TunerConfig.from_sources({}, {"DYNSPEC_ROLLUP_AFTER": "soon"})
    with pytest.raises(ConfigError, match="--rollup-bin 'off'"):
        TunerConfig.from_sources({"rollup_bin_s": "off"}, {})
    with pytest.raises(ConfigError, match="rollup after"):
        TunerConfig(rollup_after_s=60.0)  # younger than an hour: pool-mates may not have read it
    with pytest.raises(ConfigError, match="rollup bin"):
        TunerConfig(rollup_bin_s=0.5)  # shorter than the 1 s interval


def test_daemon_rolls_up_on_schedule_and_survives_a_failing_rollup(tmp_path, caplog):
    db = tmp_path / "h.db"
    srv, clock = FakeServer(), FakeClock(T0)
    # A day and a half of history, 11 days old, already there (one row a minute).
    with Storage(f"sqlite:///{db}") as st:
        st.record_tick(
            servers=[ServerSeen(SRV, ARMS, T0)],
            observations=[ObservationRecord(SRV, T0 - 11 * 86400 + 60.0 * i, 4, 1, 10, 60, 20,
                                            40, 0.2) for i in range(15 * 1440 // 10)])
        n0 = st.count_observations()
    d = make_daemon({SRV: srv}, tmp_path, clock=clock, rollup_after_s=7 * 86400.0)
    d.run_once()  # the first tick rolls up what is older than a week
    assert d.rollups == 1
    n1 = d.storage.count_observations()
    assert n1 < n0 / 10
    assert sum(o.decode_steps for o in d.storage.observations()) == 10 * (15 * 1440 // 10)
    for _ in range(5):  # not on every tick
        srv.decode(4, 20)
        tick(d, clock, 60.0)
    assert d.rollups == 1
    # A database locked by someone else: the tick's write and the roll-up fail, the daemon
    # goes on, and says so once however many hourly slots fail.
    lock = sqlite3.connect(db, timeout=0.01)
    lock.execute("BEGIN EXCLUSIVE")
    with caplog.at_level(logging.WARNING, logger="tuner.daemon"):
        for _ in range(3):
            srv.decode(4, 20)
            tick(d, clock, HOUR)
    assert d.rollups_failed == 3 and d.rollups == 1
    assert len([r for r in caplog.records if "roll-up failed" in r.getMessage()]) == 1
    lock.rollback()
    lock.close()
    tick(d, clock, HOUR)
    assert d.rollups == 2 and d.status().storage_ok
    # Daily history kept rolling: nothing older than a week stays raw, nothing is lost.
    clock.advance(8 * 86400.0)
    srv.decode(4, 20)
    d.run_once()
    assert d.rollups == 3
    d.shutdown()
    raw_old = sqlite3.connect(db).execute(
        "SELECT count(*) FROM observations WHERE rollup_bin_s IS NULL AND ts < ?",
        (math.floor((clock() - 7 * 86400) / HOUR) * HOUR,)).fetchone()[0]
    assert raw_old == 0
    off = make_daemon({SRV: FakeServer()}, tmp_path, clock=clock, rollup_after_s=None)
    off.run_once()
    assert off.rollups == 0
    off.shutdown()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--rollup-after", "soon"], "--rollup-after 'soon': 'soon': expected a duration"),
        (["--rollup-after", "10m"], "rollup after (600 s) must be >= 1 h"),
        (["--rollup-bin", "off"], "--rollup-bin 'off': a duration is needed"),
        (["--rollup-after", "1h", "--rollup-bin", "2h"], "and >= the rollup bin (7200 s)"),
    ],
)
def test_run_rollup_flags_exit_2_with_one_line(capsys, argv, needle):
    from tuner.cli import main

    try:
        rc = main(["run", *argv])
    except SystemExit as exc:
        rc = int(exc.code)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and needle in err and len(err.splitlines()) == 1
