"""Storage on real SQLite files in tmp_path; tests taking ``db_url`` (tests/conftest.py) run
on PostgreSQL too: the storage contract."""

from __future__ import annotations

import sqlite3

import pytest

import storage
from storage import (
    BandObservationRecord,
    DepthCountsRecord,
    EventRecord,
    ObservationRecord,
    PolicyVersionRecord,
    ServerSeen,
    Storage,
    redact_url,
)
from tuner.errors import StorageError

A = "10.0.0.1:30000"
B = "10.0.0.2:30000"


def obs(server: str, ts: float, b: int, k: int, steps: int = 10, busy: float = 0.1):
    return ObservationRecord(server, ts, b, k, steps, steps * b * 2, steps * b, steps * b * k, busy)


@pytest.fixture
def url(tmp_path):
    return f"sqlite:///{tmp_path / 'h.db'}"


def test_exported_names_match_all():
    public = {n for n in dir(storage) if not n.startswith("_")}
    modules = {"annotations"} | {n for n in public if type(getattr(storage, n)).__name__ == "module"}
    assert set(storage.__all__) == public - modules


def test_round_trip(db_url):
    url = db_url
    with Storage(url) as st:
        st.record_tick(
            servers=[ServerSeen(A, (0, 1, 3), seen_at=100.0, started_at=50.0, pool="p1")],
            observations=[obs(A, 100.0, 4, 3), obs(A, 100.0, 4, 1)],
            policy_versions=[
                PolicyVersionRecord(A, 100.0, 7, ((8, 3), (None, 1)), "thompson", "explore")
            ],
            events=[EventRecord(A, 100.0, "restart", "counters went backwards")],
        )
    # A second Storage on the same file sees everything (it was committed).
    with Storage(url) as st:
        (srv,) = st.servers()
        assert (srv.address, srv.arms, srv.pool, srv.start_times) == (A, (0, 1, 3), "p1", (50.0,))
        got = st.observations(server=A)
        assert sorted(got, key=lambda o: o.k) == [obs(A, 100.0, 4, 1), obs(A, 100.0, 4, 3)]
        (pv,) = st.policy_versions(server=A)
        assert pv.table == ((8, 3), (None, 1)) and pv.version == 7 and pv.outcome == "applied"
        assert st.latest_policy_version(A) == pv
        assert st.events(server=A) == [EventRecord(A, 100.0, "restart", "counters went backwards")]
        assert st.schema_version == storage.SCHEMA_VERSION


def test_server_sightings_update_last_seen_and_start_times(db_url):
    url = db_url
    with Storage(url) as st:
        st.record_tick(servers=[ServerSeen(A, (0, 1), seen_at=1.0, started_at=0.5)])
        st.record_tick(servers=[ServerSeen(A, (0, 1), seen_at=2.0, started_at=0.5)])
        st.record_tick(servers=[ServerSeen(A, (0, 1, 2), seen_at=3.0, started_at=2.5)])
        srv = st.server(A)
        assert srv is not None
        assert (srv.first_seen, srv.last_seen) == (1.0, 3.0)
        assert srv.start_times == (0.5, 2.5) and srv.started_at == 2.5
        assert srv.arms == (0, 1, 2)
        assert st.server("nobody:1") is None


def test_filters_and_aggregate_in_sql(db_url):
    url = db_url
    with Storage(url) as st:
        st.record_tick(
            observations=[obs(A, 1.0, 4, 3), obs(A, 2.0, 4, 3, steps=30, busy=0.2), obs(B, 1.0, 4, 3)]
        )
        st.record_tick(observations=[obs(A, 3.0, 8, 1)])
        assert [o.ts for o in st.observations(server=A, since=2.0)] == [2.0, 3.0]
        assert [o.ts for o in st.observations(server=A, until=2.0)] == [1.0]
        assert len(st.observations(limit=2)) == 2
        assert st.count_observations() == 4 and st.count_observations(server=B) == 1
        aggs = st.aggregate(server=A)
        assert [(a.b, a.k, a.rows, a.decode_steps) for a in aggs] == [(4, 3, 2, 40), (8, 1, 1, 10)]
        a43 = aggs[0]
        assert a43.emitted_tokens == 40 * 4 * 2
        assert a43.busy_s == pytest.approx(0.3)
        assert a43.goodput == pytest.approx(320 / 0.3)
        assert a43.acceptance == pytest.approx(1 / 3)
        assert (a43.first_ts, a43.last_ts) == (1.0, 2.0)
        assert len(st.aggregate()) == 3
        assert [a.rows for a in st.aggregate(server=A, since=2.0)] == [1, 1]


def test_warm_start_returns_latest_rows_of_the_arms_oldest_first(db_url):
    url = db_url
    with Storage(url) as st:
        st.record_tick(
            observations=[obs(A, float(t), 4, t % 3) for t in range(10)] + [obs(B, 5.0, 4, 0)]
        )
        rows = st.warm_start(A, arms=(0, 1), limit=4)
        assert [(o.ts, o.k) for o in rows] == [(4.0, 1), (6.0, 0), (7.0, 1), (9.0, 0)]
        assert all(o.server == A for o in st.warm_start(A, arms=(0, 1, 2)))
        assert st.warm_start("nobody:1", arms=(0,)) == []


def test_acceptance_evidence_is_kept_for_warm_starts_oldest_first(db_url):
    """Band observations and depth counts (protocol v2) round-trip, filtered as observations
    are (server, arms, since, pool), and the roll-up drops the old ones."""
    def band(server, ts, k=3, band=2):
        return BandObservationRecord(server, ts, band, k, 10, 40, 70, 40, 9)

    with Storage(db_url) as st:
        st.record_tick(
            servers=[ServerSeen(A, (0, 1, 3), 0.0, pool="p"), ServerSeen(B, (0, 1, 3), 0.0,
                                                                       pool="p")],
            observations=[obs(A, 1.0, 4, 3)],
            bands=[band(A, float(t), k=3 if t % 2 else 1) for t in range(1, 7)] + [band(B, 3.5)],
            depths=[DepthCountsRecord(A, 2.0, 3, (5, 4, 3, 28), 8),
                    DepthCountsRecord(B, 3.0, 3, (1, 0, 0, 9), 8)],
        )
        bands, depths = st.warm_start_acceptance(A, arms=(0, 3), since=2.0)
        assert [(r.ts, r.k) for r in bands] == [(3.0, 3), (5.0, 3)]
        assert bands[0] == band(A, 3.0)
        assert depths == [DepthCountsRecord(A, 2.0, 3, (5, 4, 3, 28), 8)]
        bands, depths = st.warm_start_acceptance(A, arms=(3,), pool="p", limit=2)
        assert [(r.server, r.ts) for r in bands] == [(B, 3.5), (A, 5.0)]
        assert [r.server for r in depths] == [A, B]
        assert st.warm_start_acceptance("nobody:1", arms=(3,)) == ([], [])
        st.rollup(older_than=4.0, bin_s=1.0)
        bands, depths = st.warm_start_acceptance(A, arms=(1, 3), pool="p")
        assert [r.ts for r in bands] == [4.0, 5.0, 6.0] and depths == []
    with pytest.raises(ValueError, match="depth counts"):
        DepthCountsRecord(A, 1.0, 3, (1, 2, 3), 8)


def test_acceptance_at_reads_the_rows_of_given_ticks(db_url):
    """What a live pool reader takes with the observations it read: exactly those ticks."""
    with Storage(db_url) as st:
        st.record_tick(
            bands=[BandObservationRecord(s, t, 1, 3, 5, 10, 12, 10, 2)
                   for s in (A, B) for t in (1.5, 2.5, 3.5)],
            depths=[DepthCountsRecord(s, t, 3, (1, 1, 1, 7), 8)
                    for s in (A, B) for t in (1.5, 2.5)],
        )
        bands, depths = st.acceptance_at([(A, 2.5), (B, 1.5), (B, 3.5)])
        assert [(r.server, r.ts) for r in bands] == [(A, 2.5), (B, 1.5), (B, 3.5)]  # id order
        assert [(r.server, r.ts) for r in depths] == [(A, 2.5), (B, 1.5)]
        assert st.acceptance_at([]) == ([], [])


def test_events_filters_include_daemon_events(db_url):
    url = db_url
    with Storage(url) as st:
        st.record_tick(
            events=[
                EventRecord(A, 1.0, "outage", "connection refused"),
                EventRecord(None, 2.0, "storage_recovered", "after 3 s"),
                EventRecord(A, 3.0, "recovered"),
            ]
        )
        assert [e.kind for e in st.events()] == ["outage", "storage_recovered", "recovered"]
        assert [e.kind for e in st.events(server=A, kinds=["recovered"])] == ["recovered"]
        assert st.events(since=2.0)[0].server is None


def test_event_kind_is_checked():
    with pytest.raises(ValueError, match="event kind"):
        EventRecord(A, 1.0, "")


def test_sqlite_file_runs_in_wal_mode(url, tmp_path):
    Storage(url).close()
    con = sqlite3.connect(tmp_path / "h.db")
    try:
        assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        con.close()


def test_locked_database_raises_storage_error_and_writes_nothing(url, tmp_path):
    with Storage(url, busy_timeout_s=0.01) as st:
        other = sqlite3.connect(tmp_path / "h.db", isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")  # another writer holds the write lock
            with pytest.raises(StorageError, match="locked") as info:
                st.record_tick(observations=[obs(A, 1.0, 4, 3)])
            assert str(tmp_path / "h.db") in str(info.value)
            # Readers are not blocked by the writer (WAL).
            assert st.count_observations() == 0
            other.execute("ROLLBACK")
        finally:
            other.close()
        st.record_tick(observations=[obs(A, 1.0, 4, 3)])  # the retry goes through
        assert st.count_observations() == 1


def test_locked_database_at_open_is_a_clear_error(url, tmp_path):
    Storage(url).close()
    other = sqlite3.connect(tmp_path / "h.db", isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        with pytest.raises(StorageError, match="locked"):
            Storage(url, busy_timeout_s=0.01)
    finally:
        other.execute("ROLLBACK")
        other.close()


def test_read_only_file_is_a_clear_error(url, tmp_path):
    Storage(url).close()
    ro = f"sqlite:///file:{tmp_path / 'h.db'}?mode=ro&uri=true"
    with pytest.raises(StorageError, match="read-only"):
        Storage(ro)
    # Reports may still read it.
    with Storage(ro, read_only=True) as st:
        assert st.servers() == []
        with pytest.raises(StorageError, match="read-only"):
            st.record_tick(observations=[obs(A, 1.0, 4, 3)])


def test_unopenable_url_names_it(tmp_path):
    with pytest.raises(StorageError, match="cannot open") as info:
        Storage(f"sqlite:///{tmp_path / 'missing-dir' / 'h.db'}")
    assert "missing-dir" in str(info.value)
    with pytest.raises(StorageError, match="not a database URL"):
        Storage("definitely not a url")


def test_password_is_redacted_everywhere():
    url = "postgresql+psycopg://tuner:s3cret@127.0.0.1:1/dynspec"
    assert "s3cret" not in redact_url(url) and "***" in redact_url(url)
    assert "s3cret" not in redact_url("weird://u:s3cret@h:/x y")
    with pytest.raises(StorageError) as info:
        Storage(url, busy_timeout_s=0.1)
    assert "s3cret" not in str(info.value) and "127.0.0.1" in str(info.value)


def test_newer_schema_is_refused(url, tmp_path):
    Storage(url).close()
    con = sqlite3.connect(tmp_path / "h.db")
    con.execute("UPDATE schema_version SET version = 99")
    con.commit()
    con.close()
    with pytest.raises(StorageError, match="schema v99"):
        Storage(url)


def test_read_only_open_of_an_empty_file_says_no_history(tmp_path):
    (tmp_path / "empty.db").touch()
    with pytest.raises(StorageError, match="no dynspec history"):
        Storage(f"sqlite:///{tmp_path / 'empty.db'}", read_only=True)


def test_a_banded_table_round_trips_with_its_band_agnostic_view(db_url):
    banded = ((8, (3, 1, 3, 3, 5)), (64, (3, 3, 3, 3, 3)), (None, (1, 0, 1, 1, 3)))
    with Storage(db_url) as st:
        st.record_tick(
            servers=[ServerSeen(A, (0, 1, 3, 5), seen_at=100.0, started_at=50.0)],
            policy_versions=[
                PolicyVersionRecord(A, 100.0, 7, ((8, 3), (64, 3), (None, 1)), "model",
                                    "greedy", "applied", banded),
                PolicyVersionRecord(A, 101.0, 8, ((None, 3),), "model", "explore"),
            ],
        )
        first, second = st.policy_versions(server=A)
    assert first.bands == banded and first.table == ((8, 3), (64, 3), (None, 1))
    assert second.bands is None and second.table == ((None, 3),)
