"""The storage contract for fleets, on SQLite and PostgreSQL alike (``db_url``, conftest.py):
several writers on one database, pools of identical replicas, live pool reads."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy.engine import make_url

from storage import EventRecord, ObservationRecord, PolicyVersionRecord, ServerSeen, Storage
from tuner.errors import StorageError

A, B, C = "10.0.0.1:30000", "10.0.0.2:30000", "10.0.0.3:30000"


def obs(server: str, ts: float, b: int = 4, k: int = 1, steps: int = 10) -> ObservationRecord:
    return ObservationRecord(server, ts, b, k, steps, 2 * b * steps, b * steps, k * b * steps, 0.1)


def test_two_writers_one_database_lose_nothing(db_url):
    """Two daemons (one Storage each) write ticks at once, each for its own servers."""
    Storage(db_url).close()  # schema first, as the first daemon to start does
    errors: list[BaseException] = []

    def daemon(server: str) -> None:
        try:
            with Storage(db_url) as st:
                for t in range(25):
                    st.record_tick(
                        servers=[ServerSeen(server, (0, 1), float(t), 1.0, pool="h200")],
                        observations=[obs(server, float(t), b) for b in (1, 4, 16)],
                        events=[EventRecord(server, float(t), "recovered")] if t == 3 else [],
                    )
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=daemon, args=(s,)) for s in (A, B)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with Storage(db_url, read_only=True) as st:
        assert st.count_observations(server=A) == st.count_observations(server=B) == 75
        assert [s.pool for s in st.servers()] == ["h200", "h200"]
        assert len(st.events(kinds=["recovered"])) == 2


def test_a_servers_model_and_since_when_are_kept(db_url):
    with Storage(db_url) as st:
        st.record_tick(servers=[ServerSeen(A, (0, 1), 1.0, 0.5)], observations=[obs(A, 1.0)])
        assert st.server(A).model is None  # never said
        st.record_tick(servers=[ServerSeen(A, (0, 1), 2.0, 0.5, model="llama")])
        # The first model named owns the rows before it.
        assert (st.server(A).model, st.server(A).model_since) == ("llama", None)
        st.record_tick(servers=[ServerSeen(A, (0, 1), 3.0, 0.5, model="llama")])
        st.record_tick(servers=[ServerSeen(A, (0, 1), 9.0, 8.0, model="qwen")])
        assert (st.server(A).model, st.server(A).model_since) == ("qwen", 9.0)
        st.record_tick(servers=[ServerSeen(A, (0, 1), 10.0, 8.0)])  # a reading without one
        assert (st.server(A).model, st.server(A).model_since) == ("qwen", 9.0)


def test_pool_warm_start_leaves_out_mates_of_another_model(db_url):
    with Storage(db_url) as st:
        st.record_tick(
            servers=[ServerSeen(A, (0, 1), 1.0, pool="p", model="llama"),
                     ServerSeen(B, (0, 1), 1.0, pool="p", model="qwen"),
                     ServerSeen(C, (0, 1), 1.0, pool="p")],
            observations=[obs(x, 1.0) for x in (A, B, C)],
        )
        got = {r.server for r in st.warm_start(A, arms=(0, 1), pool="p", model="llama")}
        assert got == {A, C}  # C never said which model it runs
        got = {r.server for r in st.warm_start(A, arms=(0, 1), pool="p")}
        assert got == {A, B, C}


def test_the_same_server_from_two_writers_is_one_server(db_url):
    with Storage(db_url) as one, Storage(db_url) as two:
        one.record_tick(servers=[ServerSeen(A, (0, 1), 1.0, 0.5)], observations=[obs(A, 1.0)])
        two.record_tick(servers=[ServerSeen(A, (0, 1), 2.0, 0.5)], observations=[obs(A, 2.0)])
        (srv,) = one.servers()
        assert (srv.first_seen, srv.last_seen) == (1.0, 2.0)
        assert one.count_observations(server=A) == 2


def test_pool_warm_start_reads_every_replica_of_the_pool(db_url):
    with Storage(db_url) as st:
        st.record_tick(
            servers=[ServerSeen(A, (0, 1), 1.0, pool="p"), ServerSeen(B, (0, 1), 1.0, pool="p"),
                     ServerSeen(C, (0, 1), 1.0, pool="other")],
            observations=[obs(A, 1.0), obs(B, 2.0), obs(C, 3.0), obs(B, 4.0, k=5)],
        )
        assert [o.server for o in st.warm_start(A, arms=(0, 1))] == [A]
        assert [o.server for o in st.warm_start(A, arms=(0, 1), pool="p")] == [A, B]
        # A server new to the pool (not yet recorded) learns from the pool at once.
        assert [o.server for o in st.warm_start("new:1", arms=(0, 1), pool="p")] == [A, B]
        assert [o.ts for o in st.warm_start(A, arms=(0, 1), pool="p", limit=1)] == [2.0]


def test_pool_observations_follow_pool_mates_by_id(db_url):
    with Storage(db_url) as st:
        assert st.last_observation_id() == 0
        st.record_tick(
            servers=[ServerSeen(A, (0, 1), 1.0, pool="p"), ServerSeen(B, (0, 1), 1.0, pool="p")],
            observations=[obs(A, 1.0), obs(B, 1.0)],
        )
        start = st.last_observation_id()
        st.record_tick(observations=[obs(B, 2.0), obs(A, 2.0), obs(B, 2.0, k=3)])
        got = st.pool_observations("p", after_id=start, exclude=[A], arms=(0, 1))
        assert [(o.server, o.ts, o.k) for _, o in got] == [(B, 2.0, 1)]
        ids = [i for i, _ in got]
        assert ids == sorted(ids) and ids[0] > start
        assert st.pool_observations("p", after_id=ids[-1], exclude=[A]) == [
            pair for pair in st.pool_observations("p", after_id=start, exclude=[A])
            if pair[0] > ids[-1]
        ]
        assert st.pool_observations("nobody", after_id=0) == []
        assert st.pool_observation_ids("p", after_id=start) == sorted(
            i for i, _ in st.pool_observations("p", after_id=start))
        picked = st.pool_observations("p", ids=[ids[0], 10**9])
        assert [i for i, _ in picked] == [ids[0]]
        assert st.pool_observations("p", ids=[]) == []
        everything = st.pool_observations("p", after_id=0)
        assert len(everything) == 5 and st.last_observation_id() == everything[-1][0]


def test_policy_versions_and_latest_per_server(db_url):
    with Storage(db_url) as st:
        st.record_tick(policy_versions=[
            PolicyVersionRecord(A, 1.0, 3, ((8, 1), (None, 0)), "ucb", "explore"),
            PolicyVersionRecord(B, 1.0, 9, ((None, 0),), "ucb", "greedy", "rejected"),
            PolicyVersionRecord(A, 2.0, 4, ((None, 1),), "ucb", "greedy"),
        ])
        assert st.latest_policy_version(A).version == 4
        assert st.latest_policy_version(B).outcome == "rejected"
        assert [v.version for v in st.policy_versions(server=A)] == [3, 4]


def test_an_out_of_range_row_is_a_storage_error_and_writes_nothing(db_url):
    """Never an exception the daemon does not expect: it would end the loop."""
    with Storage(db_url) as st:
        with pytest.raises(StorageError):
            st.record_tick(observations=[obs(A, 1.0), obs(A, 2.0, steps=2**70)])
        assert st.count_observations() == 0
        st.record_tick(observations=[obs(A, 1.0)])
        assert st.count_observations() == 1


def test_bare_postgresql_url_uses_the_installed_driver(postgres_url):
    bare = make_url(postgres_url).set(drivername="postgresql").render_as_string(
        hide_password=False)
    with Storage(bare) as st:
        st.record_tick(observations=[obs(A, 1.0)])
        assert st.count_observations() == 1


def test_a_wrong_postgres_password_is_a_clear_error_without_it(postgres_url):
    url = make_url(postgres_url)
    # The test server trusts loopback; a missing database is the refusal we can provoke.
    bad = url.set(password="hunter2-secret", database="no_such_db_dynspec")
    with pytest.raises(StorageError) as info:
        Storage(bad.render_as_string(hide_password=False))
    assert "hunter2-secret" not in str(info.value)
    assert "***" in str(info.value) and "no_such_db_dynspec" in str(info.value)
