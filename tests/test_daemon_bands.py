"""The daemon learns and pushes per acceptance band (protocol v2) on the loopback simulator:
banded tables to a v2 plugin, band-agnostic ones to a v1 plugin."""

from __future__ import annotations

import json

from storage import Storage
from tests._fakes import FakeClock, LoopbackSim
from tuner.config import TunerConfig
from tuner.daemon import Daemon
from tuner.daemon._tables import show_table
from tuner.plugin.core import PluginCore
from tuner.protocol import is_uniform


class Sim(LoopbackSim):
    """One request of the ``diverse`` workload (acceptance differs a lot between requests),
    recording every update the server received."""

    def __init__(self, plugin_protocol: int = 2) -> None:
        super().__init__(profile="seed-kimi-pcie", workload="diverse", load="1", seed=3)
        if plugin_protocol == 1:  # a server still on the previous plugin
            old = self.server.engine.core
            self.server.engine.core = PluginCore(old.arms, started_at=old.started_at,
                                                 default_arm=old.table[-1][1], protocol=1)
        self.posts: list[dict] = []
        self.server.interceptors.insert(0, self._record)

    def _record(self, req, call_next):
        if req.path == "/set_internal_state":
            self.posts.append(json.loads(req.body)["server_args"])
        return call_next(req)


def _run(sim: Sim, tmp_path, ticks: int) -> Daemon:
    clock = FakeClock()
    config = TunerConfig(servers=(sim.addr,), interval_s=1.0, decision_period_s=5.0,
                         policy="model", seed=1, db_url=f"sqlite:///{tmp_path / 'h.db'}")
    d = Daemon(config, storage=Storage(config.db_url), clock=clock)
    d.run_once()
    for _ in range(ticks):
        sim.step()
        clock.advance(1.0)
        d.run_once()
    return d


def _banded_posts(posts: list[dict]) -> list[dict]:
    return [p for p in posts if any(key.endswith("_k1") for key in p)]


def test_a_v2_server_learns_per_band_and_ends_on_a_banded_table(tmp_path):
    with Sim() as sim:
        d = _run(sim, tmp_path, 150)
        status = d.status().servers[0]
        d.shutdown()
        with sim.server.lock:
            core = sim.server.core
            final, version, refused = core.band_table, core.version, core.updates_rejected
    assert refused == 0 and version >= 2 and status.pushes >= 2
    assert {p["dynspec_protocol"] for p in sim.posts} == {2}
    assert _banded_posts(sim.posts), "no banded table was pushed"
    # Left on the greedy banded table: bands differ somewhere, and the status says so.
    assert not is_uniform(final)
    assert d.greedy_table(sim.addr) == final
    with Storage(f"sqlite:///{tmp_path / 'h.db'}", read_only=True) as st:
        applied = [v for v in st.policy_versions(server=sim.addr) if v.outcome == "applied"]
    last = applied[-1]
    # The history keeps the banded table whole, and its band-agnostic view for v1 readers.
    assert last.version == version and last.bands == final
    assert last.table == tuple((b, ks[0]) for b, ks in final)
    assert "/" in show_table(last.bands)  # k<unknown>/<band 1..4> where the bands differ


def test_a_v1_server_gets_only_band_agnostic_tables(tmp_path):
    with Sim(plugin_protocol=1) as sim:
        d = _run(sim, tmp_path, 60)
        d.shutdown()
        with sim.server.lock:
            core = sim.server.core
            final, version, refused = core.band_table, core.version, core.updates_rejected
    assert refused == 0 and version >= 1
    assert sim.posts and {p["dynspec_protocol"] for p in sim.posts} == {1}
    assert _banded_posts(sim.posts) == []
    assert is_uniform(final)
    with Storage(f"sqlite:///{tmp_path / 'h.db'}", read_only=True) as st:
        assert all(v.bands is None for v in st.policy_versions(server=sim.addr))


def test_a_banded_starting_table_is_read_back_band_agnostic_for_the_gain():
    from tuner.report_gain import parse_table_text

    text = show_table(((8, (3, 1, 3, 3, 5)), (None, (1, 1, 1, 1, 1))))
    assert text == "b<=8:k3/1,3,3,5 rest:k1"
    assert parse_table_text(text) == ((8, 3), (None, 1))
