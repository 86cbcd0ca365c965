"""Protocol v1/v2 interop on the loopback simulator: the daemon reads and writes each plugin
in the protocol its readout speaks (a fleet upgrades one server at a time), and the
counters it stores per (b, k) add up whichever version reported them."""

from __future__ import annotations

import json

import pytest

from storage import Storage
from tests._fakes import FakeClock, LoopbackSim
from tuner.client import SGLangClient
from tuner.config import TunerConfig
from tuner.daemon import Daemon
from tuner.plugin.core import PluginCore
from tuner.protocol import DynspecState, ProtocolError, class_of

NEVER = ((None, 0),)  # what the "never" policy pushes


class Sim(LoopbackSim):
    """Records every readout it answered and every update it received."""

    def __init__(self, plugin_protocol: int) -> None:
        super().__init__(load="8", seed=1)
        if plugin_protocol == 1:  # a server still on the previous plugin
            old = self.server.engine.core
            self.server.engine.core = PluginCore(old.arms, started_at=old.started_at,
                                                 default_arm=old.table[-1][1], protocol=1)
        self.readouts: list[dict] = []
        self.posts: list[dict] = []
        self.server.interceptors.insert(0, self._record)

    def _record(self, req, call_next):
        if req.path == "/set_internal_state":
            self.posts.append(json.loads(req.body)["server_args"])
        resp = call_next(req)
        if req.path == "/server_info" and resp is not None and resp.status == 200:
            self.readouts.append(json.loads(resp.body)["internal_states"][0]["dynspec"])
        return resp


@pytest.mark.parametrize("plugin_protocol", [1, 2])
def test_the_daemon_speaks_each_plugin_its_own_protocol_and_its_counters_add_up(
    tmp_path, plugin_protocol
):
    clock = FakeClock()
    with Sim(plugin_protocol) as sim:
        config = TunerConfig(servers=(sim.addr,), interval_s=1.0, decision_period_s=2.0,
                             policy="never", db_url=f"sqlite:///{tmp_path / 'h.db'}")
        d = Daemon(config, storage=Storage(config.db_url), clock=clock)
        d.run_once()
        for _ in range(12):
            sim.step()
            clock.advance(1.0)
            d.run_once()
        stored = sum(o.decode_steps for o in d.storage.observations(server=sim.addr))
        d.shutdown()
        with sim.server.lock:
            core = sim.server.core
            assert (core.table, core.updates_rejected) == (NEVER, 0) and core.version >= 1
    # Every update went out in the plugin's own protocol, and was applied.
    assert sim.posts and {p["dynspec_protocol"] for p in sim.posts} == {plugin_protocol}
    assert {r["protocol"] for r in sim.readouts} == {plugin_protocol}
    states = [DynspecState.from_json(r) for r in sim.readouts]
    # What the daemon stored is what the plugin counted after its first reading.
    counted = [sum(c.decode_steps for c in s.counters) for s in states]
    assert stored == counted[-1] - counted[0] > 0
    if plugin_protocol == 2:
        last = states[-1]
        per_class: dict[tuple[int, int], int] = {}
        for c in last.counters:
            key = (class_of(c.b), c.k)
            per_class[key] = per_class.get(key, 0) + c.decode_steps
        per_band: dict[tuple[int, int], int] = {}
        for c in last.bands:
            per_band[(c.cls, c.k)] = per_band.get((c.cls, c.k), 0) + c.decode_steps
        assert per_band == per_class  # the band counters split the same steps


def test_a_banded_table_is_never_sent_to_a_v1_plugin():
    with Sim(1) as sim, SGLangClient(sim.addr) as client:
        assert client.read_state()[0].protocol == 1 and client.protocol == 1
        with pytest.raises(ProtocolError, match="v1 plugin"):
            client.push(((None, (3, 1, 3, 3, 3)),), 1)
        assert sim.posts == []
        assert client.push(((8, 3), (None, 1)), 1) == [True]  # band-agnostic: v1 keys
        assert sim.posts[-1]["dynspec_protocol"] == 1


def test_a_banded_table_reaches_a_v2_plugin_and_reads_back():
    banded = ((8, (3, 1, 3, 3, 5)), (None, (1, 0, 1, 1, 1)))
    with Sim(2) as sim, SGLangClient(sim.addr) as client:
        client.read_state()
        assert client.push(banded, 1) == [True]
        state = client.read_state()[0]
    assert sim.posts[-1]["dynspec_protocol"] == 2 and sim.posts[-1]["dynspec_r0_k4"] == 5
    assert state.band_table == banded and state.table == ((8, 3), (None, 1))


def test_a_server_upgraded_in_place_is_re_pushed_in_its_new_protocol(tmp_path):
    """v1 plugin, then the server restarts on the v2 plugin: the daemon notices the restart,
    re-pushes its table, and writes it in v2 from then on."""
    clock = FakeClock()
    with Sim(1) as sim:
        config = TunerConfig(servers=(sim.addr,), interval_s=1.0, decision_period_s=2.0,
                             policy="never", db_url=f"sqlite:///{tmp_path / 'h.db'}")
        d = Daemon(config, storage=Storage(config.db_url), clock=clock)
        d.run_once()

        def ticks(n: int) -> None:
            for _ in range(n):
                sim.step()
                clock.advance(1.0)
                d.run_once()

        ticks(6)
        assert sim.posts and {p["dynspec_protocol"] for p in sim.posts} == {1}
        n_before = len(sim.posts)
        with sim.server.lock:  # the upgrade: a new process, a v2 plugin on the default table
            old = sim.server.engine.core
            sim.server.engine.core = PluginCore(old.arms, started_at=old.started_at + 60.0,
                                                default_arm=3)
        ticks(6)
        d.shutdown()
        with sim.server.lock:
            core = sim.server.core
            assert (core.protocol, core.table, core.updates_rejected) == (2, NEVER, 0)
    assert [p["dynspec_protocol"] for p in sim.posts[n_before:]][:1] == [2]
    assert d.status().servers[0].restarts == 1
