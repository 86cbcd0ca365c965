"""The daemon learns and pushes per acceptance band (protocol v2) on the loopback simulator:
banded tables to a v2 plugin, band-agnostic ones to a v1 plugin."""

from __future__ import annotations

import json

import httpx

from storage import Storage
from tests._fakes import FakeClock, LoopbackSim
from tuner.client import SGLangClient
from tuner.config import TunerConfig
from tuner.daemon import Daemon
from tuner.daemon._tables import show_table
from tuner.plugin.core import PluginCore
from tuner.protocol import (
    BAND_EDGES,
    N_BANDS,
    BandIndex,
    DynspecState,
    TreeShape,
    band_counter_deltas,
    decode_update,
    is_uniform,
)


class Sim(LoopbackSim):
    """One request of the ``diverse`` workload (acceptance differs a lot between requests),
    recording every update the server received."""

    def __init__(self, plugin_protocol: int = 2, seed: int = 3, load: str = "1") -> None:
        super().__init__(profile="seed-kimi-pcie", workload="diverse", load=load, seed=seed)
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


def _run(sims: Sim | list[Sim], tmp_path, ticks: int, **cfg) -> Daemon:
    sims = sims if isinstance(sims, list) else [sims]
    clock = FakeClock()
    config = TunerConfig(servers=tuple(s.addr for s in sims), interval_s=1.0,
                         decision_period_s=5.0, policy="model", seed=1,
                         db_url=f"sqlite:///{tmp_path / 'h.db'}", **cfg)
    d = Daemon(config, storage=Storage(config.db_url), clock=clock)
    d.run_once()
    _ticks(d, sims, clock, ticks)
    return d


def _ticks(d: Daemon, sims: list[Sim], clock: FakeClock, n: int) -> None:
    for _ in range(n):
        for s in sims:
            s.step()
        clock.advance(1.0)
        d.run_once()


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


def test_a_banding_server_gets_exploring_rows_as_probes_over_the_greedy_table(tmp_path):
    with Sim(load="32") as sim:
        d = _run(sim, tmp_path, 150)
        with sim.server.lock:
            core = sim.server.core
            live_version = core.version
        d.shutdown()
        with sim.server.lock:
            left, refused = core.probes, core.updates_rejected
    probing = [p for p in sim.posts if p.get("dynspec_probes")]
    assert probing and refused == 0
    with Storage(f"sqlite:///{tmp_path / 'h.db'}", read_only=True) as st:
        versions = {v.version: v for v in st.policy_versions(server=sim.addr)}
    for post in probing:
        # The history keeps the exploring proposal; the server got the greedy rows and the
        # exploring rows' arms as probes of at least the policy's dwell.
        record = versions[post["dynspec_version"]]
        assert record.reason == "explore" and record.outcome == "applied"
        sent, _ = decode_update(post, arms=core.arms, current_version=0)
        for j in range(post["dynspec_probes"]):
            lo, k = post[f"dynspec_p{j}_min_bs"], post[f"dynspec_p{j}_k"]
            assert post[f"dynspec_p{j}_steps"] >= 8
            assert lookup_arm(record.table, lo) == k
            assert BandIndex(sent).ks_for(lo) != (k,) * N_BANDS  # not the exploring row
    assert live_version in versions and versions[live_version].outcome == "applied"
    assert left == []  # the stop's greedy table ends any live probe


def lookup_arm(table, b):
    for bound, k in table:
        if bound is None or b <= bound:
            return k
    return table[-1][1]


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
    assert not any("dynspec_probes" in p for p in sim.posts)
    assert is_uniform(final)
    with Storage(f"sqlite:///{tmp_path / 'h.db'}", read_only=True) as st:
        assert all(v.bands is None for v in st.policy_versions(server=sim.addr))


def test_a_banded_starting_table_is_read_back_band_agnostic_for_the_gain():
    from tuner.report_gain import parse_table_text

    text = show_table(((8, (3, 1, 3, 3, 5)), (None, (1, 1, 1, 1, 1))))
    assert text == "b<=8:k3/1,3,3,5 rest:k1"
    assert parse_table_text(text) == ((8, 3), (None, 1))


def test_a_pool_of_v1_and_v2_servers_shares_bands_but_sends_none_to_v1(tmp_path):
    """A fleet half-way through an upgrade: one pooled policy learns bands from the v2
    server; the v1 server still gets only band-agnostic tables."""
    with Sim(plugin_protocol=1, seed=4) as old, Sim(seed=5) as new:
        d = _run([old, new], tmp_path, 150, pool="kimi")
        assert d.policy_of(old.addr) is d.policy_of(new.addr)  # one policy for both
        d.shutdown()
        with old.server.lock, new.server.lock:
            refused = old.server.core.updates_rejected + new.server.core.updates_rejected
            final_old, final_new = old.server.core.band_table, new.server.core.band_table
    assert refused == 0
    assert old.posts and _banded_posts(old.posts) == [] and is_uniform(final_old)
    assert {p["dynspec_protocol"] for p in old.posts} == {1}
    assert _banded_posts(new.posts) and not is_uniform(final_new)


def test_band_counters_are_never_fed_across_a_restart(tmp_path):
    """The server restarts without a new start time (its counters go backwards): the (b, k)
    deltas of that reading are dropped, and so are the band counters'."""
    fed: list[int] = []  # per tick: band observations the policy was fed
    with Sim() as sim:
        d = _run(sim, tmp_path, 20)
        policy = d.policy_of(sim.addr)
        inner = policy.update_bands

        def spy(obs):
            fed[-1] += 1
            return inner(obs)

        policy.update_bands = spy
        clock = FakeClock(d.clock() + 1.0)
        d.clock = clock
        fed.append(0)
        _ticks(d, [sim], clock, 1)
        assert fed[-1] > 0  # a normal reading feeds the bands
        with sim.server.lock:  # same start time, counters from zero
            old = sim.server.engine.core
            sim.server.engine.core = PluginCore(old.arms, started_at=old.started_at,
                                                default_arm=3)
        sim.step()
        fed.append(0)
        _ticks(d, [sim], clock, 1)
        restarts = d.status().servers[0].restarts
        fed.append(0)
        _ticks(d, [sim], clock, 1)
        d.shutdown()
    assert restarts == 1 and fed[1] == 0  # nothing across the restart
    assert fed[2] > 0  # the next reading, of one run again, feeds them


def test_a_server_upgraded_to_v2_in_place_starts_getting_banded_tables(tmp_path):
    """v1 plugin, then the server restarts on the v2 plugin: the policy keeps what it learnt
    per (b, k), starts learning bands, and the new plugin is given banded tables."""
    with Sim(plugin_protocol=1) as sim:
        d = _run(sim, tmp_path, 40)
        n_v1 = len(sim.posts)
        assert n_v1 and _banded_posts(sim.posts) == []
        with sim.server.lock:  # the upgrade: a new process, a v2 plugin on the default table
            old = sim.server.engine.core
            sim.server.engine.core = PluginCore(old.arms, started_at=old.started_at + 60.0,
                                                default_arm=3)
        clock = FakeClock(d.clock() + 1.0)
        d.clock = clock
        _ticks(d, [sim], clock, 110)
        d.shutdown()
        with sim.server.lock:
            core = sim.server.core
            final, refused = core.band_table, core.updates_rejected
    assert refused == 0 and d.status().servers[0].restarts == 1
    assert {p["dynspec_protocol"] for p in sim.posts[n_v1:]} == {2}
    assert _banded_posts(sim.posts[n_v1:]) and not is_uniform(final)


# --- the band plumbing against the plugin's core (a fake SGLang, scripted policy) ----------


def _scripted_bands():
    from tests.test_daemon import ScriptedPolicy

    class Banding(ScriptedPolicy):
        """Proposes a banded table; records every band call."""

        def __init__(self, **kw):
            super().__init__(**kw)
            self.edges: list[tuple[float, ...]] = []
            self.band_fed: list = []
            self.banded = ((8, (3, 1, 3, 3, 3)), (None, (1, 0, 1, 1, 3)))

        def set_bands(self, edges):
            self.edges.append(tuple(edges))

        def update_bands(self, obs):
            self.band_fed.append(obs)
            return True

        def propose_bands(self):
            return self.banded

        def greedy_bands(self):
            return self.banded

    return Banding


def _fake_server():
    from tests.test_daemon import FakeServer

    class Measuring(FakeServer):
        """Each step also folds its verify result (one accepted draft per request) into the
        plugin's acceptance estimate, which picks the step's band."""

        def decode(self, b, steps, *, k=None, dt=0.01):
            for core in self.cores:
                it, ts = self._iter, self._ts
                for _ in range(steps + 1):
                    kk = core.steps_for_batch(b) if k is None else k
                    band = core.observe(kk, [1] * b) if kk else None
                    it += 1
                    ts += dt
                    core.record_decode(b, kk, 2 * b, b if kk else 0, ts, it, band=band)
                core.record_decode(b, 0, 0, 0, ts + 10, it + 5)
            self._iter += steps + 10
            self._ts += steps * dt + 20

    return Measuring()


def _fake_daemon(srv, tmp_path, clock):
    Banding = _scripted_bands()
    config = TunerConfig(servers=("gpu:1",), interval_s=1.0, decision_period_s=5.0)
    client = SGLangClient("gpu:1", transport=httpx.MockTransport(srv))
    return Daemon(config, storage=Storage(f"sqlite:///{tmp_path / 'h.db'}"),
                  clients={"gpu:1": client}, clock=clock,
                  policy_factory=lambda arms, buckets: Banding(arms=arms, buckets=buckets))


def test_band_counter_deltas_reach_the_policy_and_its_banded_table_the_server(tmp_path):
    srv, clock = _fake_server(), FakeClock()
    d = _fake_daemon(srv, tmp_path, clock)
    d.run_once()
    policy = d.policy_of("gpu:1")
    before = srv.cores[0].readout()
    for b in (1, 4, 16):
        srv.decode(b, 40)
    after = srv.cores[0].readout()
    clock.advance(1.0)
    d.run_once()
    assert policy.edges == [BAND_EDGES]  # once, with the protocol's edges
    deltas = band_counter_deltas(DynspecState.from_json(before).bands,
                                 DynspecState.from_json(after).bands)
    want = sorted((c.band, c.k, c.decode_steps, c.requests, c.accepted_drafts)
                  for c in deltas if c.band > 0 and c.k > 0)
    got = sorted((o.band, o.k, o.decode_steps, o.request_steps, o.accepted_drafts)
                 for o in policy.band_fed)
    assert got == want and want  # known bands and drafting arms only, as counted
    for _ in range(5):
        clock.advance(1.0)
        d.run_once()
    assert policy.edges == [BAND_EDGES]  # never again: it would forget the bands
    assert srv.cores[0].band_table == policy.banded and srv.cores[0].updates_rejected == 0
    assert srv.posts[-1]["dynspec_r1_k4"] == 3
    st = d.status().servers[0]
    assert st.server_table == policy.banded and st.last_push.table == policy.banded
    d.shutdown()


def test_a_tree_server_gets_no_bands(tmp_path):
    srv, clock = _fake_server(), FakeClock()
    srv.cores = [PluginCore((0, 2), started_at=500.0, tree=TreeShape(4, 2, 16))]
    d = _fake_daemon(srv, tmp_path, clock)
    d.run_once()
    for _ in range(7):
        srv.decode(4, 20)
        clock.advance(1.0)
        d.run_once()
    policy = d.policy_of("gpu:1")
    d.shutdown()
    assert policy.edges == [] and policy.band_fed == []
    assert srv.posts and _banded_posts(srv.posts) == []
    assert srv.posts[0]["dynspec_protocol"] == 2


def test_the_report_shows_a_banded_version_whole(tmp_path):
    from storage import ObservationRecord, PolicyVersionRecord, ServerSeen
    from tuner.report import build_report, render_html, render_text, report_to_json

    banded = ((8, (3, 1, 3, 3, 5)), (None, (1, 0, 1, 1, 3)))
    url = f"sqlite:///{tmp_path / 'h.db'}"
    with Storage(url) as st:
        st.record_tick(
            servers=[ServerSeen("gpu:1", (0, 1, 3, 5), seen_at=100.0, started_at=50.0)],
            observations=[ObservationRecord("gpu:1", 100.0, 4, 3, 10, 80, 40, 120, 0.1)],
            policy_versions=[PolicyVersionRecord("gpu:1", 100.0, 7, ((8, 3), (None, 1)),
                                                 "model", "greedy", "applied", banded)],
        )
        report = build_report(st)
    text = render_text(report)
    assert "b<=8:k3/1,3,3,5 rest:k1/0,1,1,3" in text
    assert "b&lt;=8:k3/1,3,3,5 rest:k1/0,1,1,3" in render_html(report)
    (version,) = report_to_json(report)["servers"][0]["versions"]
    assert version["table"] == [[8, 3], [None, 1]]  # what a v1 reader runs
    assert version["bands"] == [[8, 3, 1, 3, 3, 5], [None, 1, 0, 1, 1, 3]]


def test_probes_go_out_while_the_proposal_explores_and_a_greedy_proposal_ends_them(tmp_path):
    srv, clock = _fake_server(), FakeClock()
    d = _fake_daemon(srv, tmp_path, clock)
    d.run_once()
    policy = d.policy_of("gpu:1")
    greedy = policy.banded
    exploring = ((8, (3, 1, 3, 3, 3)), (None, (0,) * 5))  # b > 8 tries k = 0 in every band
    policy.propose_bands = lambda: exploring

    def decide():
        before = len(srv.posts)
        clock.advance(5.0)
        d.run_once()
        return srv.posts[before:]

    for _ in range(2):  # every decision that explores sends the probe again
        (post,) = decide()
        assert post["dynspec_probes"] == 1
        assert (post["dynspec_p0_min_bs"], post["dynspec_p0_max_bs"]) == (9, -1)
        assert (post["dynspec_p0_k"], post["dynspec_p0_steps"]) == (0, 114)
        assert srv.cores[0].band_table == greedy  # the table stays the greedy one
        assert srv.cores[0].probes == [[9, 2**62, 0, 114]]
    policy.propose_bands = lambda: greedy
    (post,) = decide()  # the same table, no probes: the live ones end
    assert "dynspec_probes" not in post and srv.cores[0].probes == []
    assert decide() == []  # and then nothing to send
    d.shutdown()


def test_the_stop_ends_a_live_probe_even_where_the_table_is_already_greedy(tmp_path):
    srv, clock = _fake_server(), FakeClock()
    d = _fake_daemon(srv, tmp_path, clock)
    d.run_once()
    policy = d.policy_of("gpu:1")
    policy.propose_bands = lambda: ((8, (3, 1, 3, 3, 3)), (None, (0,) * 5))
    clock.advance(5.0)
    d.run_once()
    assert srv.posts[-1]["dynspec_probes"] == 1 and srv.cores[0].probes
    assert srv.cores[0].band_table == policy.banded  # already the greedy table ...
    d.shutdown()
    assert "dynspec_probes" not in srv.posts[-1]  # ... and still sent, to end the probe
    assert srv.cores[0].probes == [] and d.unclean == {}


def test_the_status_shows_a_live_probe_until_the_server_reports_it_spent(tmp_path):
    from rich.console import Console

    from tuner.status import render_status, status_lines

    srv, clock = _fake_server(), FakeClock()
    d = _fake_daemon(srv, tmp_path, clock)
    d.run_once()
    policy = d.policy_of("gpu:1")
    greedy = policy.banded
    policy.propose_bands = lambda: ((8, (3, 1, 3, 3, 3)), (None, (0,) * 5))
    clock.advance(5.0)
    d.run_once()
    (st,) = d.status().servers
    assert st.probes == ((9, None, 0, 114),)  # as sent
    (line,) = status_lines(d.status())
    assert "probing b 9.. k=0 (114 steps left)" in line
    console = Console(width=160, record=True, force_terminal=False)
    console.print(render_status(d.status()))
    assert "probing b 9.. k=0 (114 steps left)" in console.export_text()
    srv.decode(16, 40)  # the probe runs: the next reading says what is left of it
    clock.advance(1.0)
    d.run_once()
    ((lo, hi, k, left),) = d.status().servers[0].probes
    assert (lo, hi, k) == (9, None, 0) and 114 - 41 <= left < 114
    policy.propose_bands = lambda: greedy
    clock.advance(4.0)
    d.run_once()  # the greedy proposal ends it, and the server's next readout agrees
    clock.advance(1.0)
    d.run_once()
    assert d.status().servers[0].probes == ()
    assert "probing" not in status_lines(d.status())[0]
    d.shutdown()


def _without(db, *tables: str) -> None:
    import sqlite3

    con = sqlite3.connect(db)
    for t in tables:
        con.execute(f"DELETE FROM {t}")
    con.commit()
    con.close()


def test_a_restarted_daemon_starts_on_the_banded_table_it_left(tmp_path):
    """The band and depth evidence is kept in the history: a restarted daemon's policy
    replays it with the observations, and its first greedy table is the one the first
    daemon left. Without those rows it starts over on the bands (the control)."""
    import shutil

    with Sim() as sim:
        d = _run(sim, tmp_path, 150)
        left = d.greedy_table(sim.addr)
        d.shutdown()
        with Storage(f"sqlite:///{tmp_path / 'h.db'}", read_only=True) as st:
            bands, depths = st.warm_start_acceptance(sim.addr, arms=(0, 1, 3, 5, 7))
        shutil.copy(tmp_path / "h.db", tmp_path / "bare.db")
        _without(tmp_path / "bare.db", "band_observations", "depth_counts")
        tables = {}
        for db in ("h.db", "bare.db"):
            config = TunerConfig(servers=(sim.addr,), interval_s=1.0, decision_period_s=5.0,
                                 policy="model", seed=1, db_url=f"sqlite:///{tmp_path / db}",
                                 dry_run=True)
            again = Daemon(config, storage=Storage(config.db_url), clock=FakeClock(10_000.0))
            again.run_once()  # the first reading builds the policy from the history
            tables[db] = again.greedy_table(sim.addr)
            again.shutdown()
    assert not is_uniform(left)
    assert len(bands) > 100 and {r.band for r in bands} >= {1, 2, 3} and depths
    assert tables["h.db"] == left
    assert tables["bare.db"] != left


def test_pool_mates_under_other_daemons_feed_each_other_their_band_rows(tmp_path):
    """Live pooling carries a v2 pool-mate's band and depth rows with its observations: each
    daemon's policy learns the bands from both servers."""
    db = f"sqlite:///{tmp_path / 'h.db'}"
    clock = FakeClock()
    with Sim(seed=4) as s1, Sim(seed=5) as s2:
        daemons = []
        for sim in (s1, s2):
            config = TunerConfig(servers=(sim.addr,), interval_s=1.0, decision_period_s=5.0,
                                 policy="model", seed=1, db_url=db, pool="kimi")
            daemons.append(Daemon(config, storage=Storage(db), clock=clock))
        fed = {}
        for d, sim in zip(daemons, (s1, s2)):
            d.run_once()
            inner = d.policy_of(sim.addr)
            fed[sim.addr] = {"bands": 0, "depths": 0}

            def spy(name, real, counts=fed[sim.addr]):
                def call(*args):
                    took = real(*args)
                    counts[name] += bool(took)
                    return took
                return call

            inner.update_bands = spy("bands", inner.update_bands)
            inner.update_depths = spy("depths", inner.update_depths)
        for _ in range(60):
            for sim in (s1, s2):
                sim.step()
            clock.advance(1.0)
            for d in daemons:
                d.run_once()
        last = clock.t
        for d in daemons:
            d.shutdown()
    with Storage(db, read_only=True) as st:
        own = {a: st.warm_start_acceptance(a, arms=(0, 1, 3, 5, 7)) for a in (s1.addr, s2.addr)}
    n = {a: (len(b), len(dp)) for a, (b, dp) in own.items()}
    # s1's daemon ticks first: it has s2's rows but the last tick's; s2's daemon all of s1's.
    late = {a: sum(1 for r in own[a][0] if r.ts == last) for a in own}
    assert min(min(v) for v in n.values()) > 0
    assert fed[s1.addr]["bands"] == n[s1.addr][0] + n[s2.addr][0] - late[s2.addr]
    assert fed[s2.addr]["bands"] == n[s1.addr][0] + n[s2.addr][0]
    assert fed[s1.addr]["depths"] > n[s1.addr][1] and fed[s2.addr]["depths"] > n[s2.addr][1]
