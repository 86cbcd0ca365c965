"""Fleets: several daemons on one database (SQLite and PostgreSQL), pools of identical replicas
learning from each other (live and at warm start), one daemon watching many servers."""

from __future__ import annotations

import logging

import pytest

from storage import Storage
from tests._fakes import FakeClock, LoopbackSim
from tuner.config import TunerConfig
from tuner.daemon import Daemon
from tuner.errors import ConfigError


class Sim(LoopbackSim):
    """A simulated server whose virtual time moves only by :meth:`step`."""

    def __init__(self, seed: int, model: str = "sim/llama-3.1-8b-instruct") -> None:
        super().__init__(load="16", seed=seed, model_name=model)


def daemon(addrs, url: str, clock: FakeClock, **cfg) -> Daemon:
    config = TunerConfig(servers=tuple(addrs), db_url=url, interval_s=1.0,
                         decision_period_s=2.0, policy="thompson", **cfg)
    return Daemon(config, storage=Storage(url), clock=clock)


def rounds(n: int, clock: FakeClock, sims, daemons) -> None:
    for _ in range(n):
        for s in sims:
            s.step()
        clock.t += 1.0
        for d in daemons:
            d.run_once()


def steps_known(d: Daemon) -> float:
    snap = d.status().servers[0].snapshot
    return sum(e.n for e in snap.estimates)


def test_pool_mates_on_one_database_learn_from_each_other(db_url, caplog):
    clock = FakeClock()
    with Sim(1) as s1, Sim(2) as s2, Sim(3) as s3:
        a = daemon([s1.addr], db_url, clock, pool="h200-llama8b")
        b = daemon([s2.addr], db_url, clock, pool="h200-llama8b")
        loner = daemon([s3.addr], db_url, clock)  # same database, no pool
        rounds(12, clock, [s1, s2, s3], [a, b, loner])
        final_ts = clock.t
        with Storage(db_url, read_only=True) as st:
            # Every row carries its server; the pool is recorded with the server.
            assert {s.address: s.pool for s in st.servers()} == {
                s1.addr: "h200-llama8b", s2.addr: "h200-llama8b", s3.addr: None}
            # a ticks before b: a has b's rows up to the last round, b has all of a's.
            b_rows = [o for o in st.observations(server=s2.addr) if o.ts < final_ts]
            a_rows = st.observations(server=s1.addr)
        # Live: each tick, a's policy got b's new rows, and back.
        assert 0.9 * len(b_rows) <= a.status().servers[0].pooled <= len(b_rows)
        assert 0.9 * len(a_rows) <= b.status().servers[0].pooled <= len(a_rows)
        assert loner.status().servers[0].pooled == 0
        assert steps_known(a) > 1.5 * steps_known(loner)
        # Each daemon pushes only to its own server.
        for d, sim in ((a, s1), (b, s2)):
            (st_,) = d.status().servers
            assert st_.address == sim.addr and st_.pushes >= 1
        # Warm start: a new replica of the pool starts from everything the pool recorded.
        with Sim(4) as s4, caplog.at_level(logging.INFO, logger="tuner.daemon"):
            c = daemon([s4.addr], db_url, clock, pool="h200-llama8b")
            c.run_once()
            assert any("warm start from" in m and "(pool h200-llama8b)" in m
                       for m in caplog.messages)
            assert steps_known(c) > 0.5 * (steps_known(a) + steps_known(b)) / 2
            c.shutdown()
        for d in (a, b, loner):
            d.shutdown()


def test_replicas_of_a_pool_under_one_daemon_share_one_policy(tmp_path):
    clock = FakeClock()
    url = f"sqlite:///{tmp_path / 'h.db'}"
    with Sim(1) as s1, Sim(2) as s2, Sim(1) as s3, Sim(2) as s4:  # s3, s4: twins, no pool
        d = daemon([s1.addr, s2.addr], url, clock, pool="p")
        alone = daemon([s3.addr, s4.addr], f"sqlite:///{tmp_path / 'other.db'}", clock)
        rounds(6, clock, [s1, s2, s3, s4], [d, alone])
        assert d.policy_of(s1.addr) is d.policy_of(s2.addr)
        assert alone.policy_of(s3.addr) is not alone.policy_of(s4.addr)
        # The shared policy knows both servers' steps; each lone one only its own.
        both = sum(e.n for e in d.status().servers[0].snapshot.estimates)
        one = [sum(e.n for e in st.snapshot.estimates) for st in alone.status().servers]
        assert both == pytest.approx(sum(one), rel=0.2) and both > 1.5 * max(one)
        assert all(st.pooled == 0 for st in d.status().servers)  # no other daemon in it
        for x in (d, alone):
            x.shutdown()


def test_servers_of_a_pool_that_run_different_models_learn_apart(tmp_path, caplog):
    clock = FakeClock()
    url = f"sqlite:///{tmp_path / 'h.db'}"
    with Sim(1) as s1, Sim(2) as s2, Sim(3, model="sim/qwen2.5-32b") as s3:
        d = daemon([s1.addr, s2.addr, s3.addr], url, clock, pool="p")
        with caplog.at_level(logging.WARNING, logger="tuner.daemon"):
            rounds(4, clock, [s1, s2, s3], [d])
        assert d.policy_of(s1.addr) is d.policy_of(s2.addr)
        assert d.policy_of(s3.addr) is not d.policy_of(s1.addr)
        warned = [m for m in caplog.messages if "learn apart" in m]
        assert len(warned) == 1 and "sim/qwen2.5-32b" in warned[0]
        assert "sim/llama-3.1-8b-instruct" in warned[0]
        d.shutdown()


def test_a_server_back_with_another_model_starts_a_fresh_policy(tmp_path, caplog):
    clock = FakeClock()
    url = f"sqlite:///{tmp_path / 'h.db'}"
    with Sim(1) as s1:
        d = daemon([s1.addr], url, clock)
        rounds(6, clock, [s1], [d])
        before = d.policy_of(s1.addr)
        assert steps_known(d) > 0
        s1.server.model_name = "sim/qwen2.5-32b"  # redeployed with another model
        with caplog.at_level(logging.WARNING, logger="tuner.daemon"):
            rounds(1, clock, [s1], [d])
        assert d.policy_of(s1.addr) is not before
        assert steps_known(d) == 0  # nothing of the old model's history carried over
        assert any("now runs sim/qwen2.5-32b" in m for m in caplog.messages)
        d.shutdown()
        with Storage(url, read_only=True) as st:
            kinds = [e.kind for e in st.events(server=s1.addr)]
        assert "model_changed" in kinds


def test_a_restarted_daemon_warm_starts_only_from_the_model_the_server_runs(tmp_path, caplog):
    clock = FakeClock()
    url = f"sqlite:///{tmp_path / 'h.db'}"
    with Sim(1) as s1:
        first = daemon([s1.addr], url, clock)
        rounds(6, clock, [s1], [first])
        first.shutdown()
        # Same model: the next daemon starts from the history.
        again = daemon([s1.addr], url, clock)
        again.run_once()
        llama_steps = steps_known(again)
        assert llama_steps > 0
        again.shutdown()
        # Redeployed with another model while no daemon watched: nothing carries over.
        s1.server.model_name = "sim/qwen2.5-32b"
        with caplog.at_level(logging.WARNING, logger="tuner.daemon"):
            fresh = daemon([s1.addr], url, clock)
            fresh.run_once()
        assert steps_known(fresh) == 0
        assert any("the history says sim/llama-3.1-8b-instruct" in m for m in caplog.messages)
        rounds(3, clock, [s1], [fresh])
        fresh.shutdown()
        # From now on the history's qwen stretch is what a daemon starts from.
        later = daemon([s1.addr], url, clock)
        later.run_once()
        assert 0 < steps_known(later) < llama_steps
        later.shutdown()
        with Storage(url, read_only=True) as st:
            assert st.server(s1.addr).model == "sim/qwen2.5-32b"
            assert [e.kind for e in st.events(server=s1.addr)].count("model_changed") == 1


def test_a_pool_mates_transaction_committing_late_is_still_read(tmp_path):
    """Ids are handed out at insert, not at commit: rows below the cursor can appear later."""
    import sqlite3

    from storage import ObservationRecord, ServerSeen

    url = f"sqlite:///{tmp_path / 'h.db'}"
    mate = "10.0.0.9:30000"

    def row(ts: float) -> ObservationRecord:
        return ObservationRecord(mate, ts, 4, 1, 50, 400, 200, 200, 0.5)

    clock = FakeClock()
    with Sim(1) as s1, Storage(url) as other:
        other.record_tick(servers=[ServerSeen(mate, (0, 1, 3, 5), 1.0, pool="p")])
        d = daemon([s1.addr], url, clock, pool="p")
        rounds(2, clock, [s1], [d])
        other.record_tick(observations=[row(1.0), row(2.0), row(3.0)])
        with sqlite3.connect(tmp_path / "h.db") as con:
            (late_id,) = con.execute("SELECT MIN(id) FROM observations WHERE ts = 2.0").fetchone()
            late = con.execute("SELECT * FROM observations WHERE id = ?", (late_id,)).fetchone()
            con.execute("DELETE FROM observations WHERE id = ?", (late_id,))  # not committed yet
        rounds(1, clock, [s1], [d])
        assert d.status().servers[0].pooled == 2
        with sqlite3.connect(tmp_path / "h.db") as con:  # ... and now it is
            con.execute(f"INSERT INTO observations VALUES ({','.join('?' * len(late))})", late)
        rounds(2, clock, [s1], [d])
        assert d.status().servers[0].pooled == 3  # read once, not again
        d.shutdown()


def test_one_daemon_many_servers_from_a_file_each_on_its_own(tmp_path):
    clock = FakeClock()
    with Sim(1) as s1, Sim(2) as s2, Sim(3) as s3:
        listing = tmp_path / "servers.txt"
        listing.write_text(f"# rack 7\n{s1.addr}\n\n{s2.addr}  # the odd one\n")
        config = TunerConfig.from_sources(
            {"servers_file": str(listing), "servers": (s3.addr,), "policy": "never",
             "db_url": f"sqlite:///{tmp_path / 'h.db'}", "decision_period_s": 2.0}, env={})
        assert config.servers == (s3.addr, s1.addr, s2.addr)
        s2.server.faults.add("503:/server_info")  # one server keeps failing
        d = Daemon(config, storage=Storage(config.db_url), clock=clock)
        d.run_once()
        rounds(10, clock, [s1, s2, s3], [d])
        by_addr = {s.address: s for s in d.status().servers}
        assert not by_addr[s2.addr].up and by_addr[s2.addr].errors >= 4
        for sim in (s1, s3):
            st = by_addr[sim.addr]
            assert st.up and st.observations > 0 and st.pushes == 1
        d.shutdown()
        assert {s.address for s in d.storage.servers()} >= {s1.addr, s3.addr}


def test_servers_file_and_pool_errors_name_the_file_line_and_value(tmp_path):
    bad = tmp_path / "servers.txt"
    bad.write_text("gpu-1:30000\ngpu-2\n")
    with pytest.raises(ConfigError, match=r"servers.txt' line 2: server 'gpu-2' must be"):
        TunerConfig.from_sources({"servers_file": str(bad)}, env={})
    (tmp_path / "empty.txt").write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match="lists no server"):
        TunerConfig.from_sources({}, env={"DYNSPEC_SERVERS_FILE": str(tmp_path / "empty.txt")})
    with pytest.raises(ConfigError, match="pool 'two words'"):
        TunerConfig(pool="two words")
    assert TunerConfig.from_sources({}, env={"DYNSPEC_POOL": "h200"}).pool == "h200"
