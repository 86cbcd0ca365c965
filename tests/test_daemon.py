"""Daemon ticks against a fake SGLang (the plugin's real core behind httpx.MockTransport),
with a fake clock and real SQLite history in tmp_path."""

from __future__ import annotations

import json
import logging
import sqlite3

import httpx
import pytest

from policies import BasePolicy, Buckets, Observation, PolicySnapshot, make_policy
from storage import Storage
from tests._fakes import FakeClock
from tuner.client import SGLangClient
from tuner.config import TunerConfig
from tuner.daemon import Daemon
from tuner.errors import ConfigError
from tuner.plugin.core import PluginCore

A = "gpu1:30000"
B = "gpu2:30000"
ARMS = (0, 1, 3)


class FakeServer:
    """SGLang with the plugin: /server_info and /set_internal_state over PluginCore(s)."""

    def __init__(self, replicas: int = 1, started_at: float = 500.0) -> None:
        self.cores = [PluginCore(ARMS, started_at=started_at) for _ in range(replicas)]
        self.down = False
        self.plugin = True
        self.posts: list[dict] = []
        self.on_post = None
        self._iter = 0
        self._ts = 0.0

    def restart(self, started_at: float) -> None:
        self.cores = [PluginCore(ARMS, started_at=started_at) for _ in self.cores]
        self._iter = 0

    def decode(self, b: int, steps: int, *, k: int | None = None, dt: float = 0.01) -> None:
        """``steps`` contiguous decode steps at batch size ``b`` under the live table (or a
        forced ``k``); each emits 2 tokens per request, one of them an accepted draft."""
        for core in self.cores:
            it, ts = self._iter, self._ts
            for _ in range(steps + 1):  # +1: a step is committed when the next one launches
                kk = core.steps_for_batch(b) if k is None else k
                it += 1
                ts += dt
                core.record_decode(b, kk, 2 * b, b if kk else 0, ts, it)
            # A prefill breaks contiguity: the trailing step stays untimed.
            core.record_decode(b, 0, 0, 0, ts + 10, it + 5)
        self._iter += steps + 10
        self._ts += steps * dt + 20

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        if request.url.path == "/server_info":
            states = [{"dynspec": c.readout()} if self.plugin else {} for c in self.cores]
            return httpx.Response(200, json={"internal_states": states})
        if request.url.path == "/set_internal_state":
            args = json.loads(request.content)["server_args"]
            self.posts.append(args)
            if self.on_post is not None:
                self.on_post()
            return httpx.Response(200, json=[c.apply_update(args)[0] for c in self.cores])
        if request.url.path == "/metrics":
            return httpx.Response(200, text="")
        return httpx.Response(404)


class ScriptedPolicy(BasePolicy):
    """Proposes whatever the test sets; remembers what it was fed."""

    name = "scripted"

    def __init__(self, *, arms, buckets=None, seed=0):
        super().__init__(arms=arms, buckets=buckets, seed=seed)
        self.fed: list[Observation] = []
        self.next: tuple = ((None, self.arms[-1]),)
        self.best: tuple = ((None, self.arms[0]),)

    def _update(self, bucket, obs):
        self.fed.append(obs)

    def propose(self):
        return self.next

    def greedy(self):
        return self.best

    def snapshot(self):
        arms = self.buckets.arms_of(self.best)
        return PolicySnapshot(self.name, self.buckets, self.arms, arms, ())


def make_daemon(servers: dict, tmp_path=None, *, storage=None, policy="scripted", clock=None,
                **cfg):
    clock = clock or FakeClock()
    config = TunerConfig(servers=tuple(servers), interval_s=1.0, decision_period_s=5.0,
                         policy=policy, **cfg)
    clients = {a: SGLangClient(a, transport=httpx.MockTransport(f)) for a, f in servers.items()}
    if storage is None and tmp_path is not None:
        storage = Storage(f"sqlite:///{tmp_path / 'h.db'}", busy_timeout_s=0.01)
    factory = (lambda arms, buckets: ScriptedPolicy(arms=arms, buckets=buckets)) \
        if policy == "scripted" else None
    return Daemon(config, storage=storage, clients=clients, policy_factory=factory, clock=clock)


def tick(d: Daemon, clock: FakeClock, s: float = 1.0):
    clock.advance(s)
    return d.run_once()


def test_counter_deltas_become_observations_and_history(tmp_path):
    srv, clock = FakeServer(), FakeClock()
    srv.decode(4, 50)  # before the daemon: baseline only, never an observation
    d = make_daemon({A: srv}, tmp_path, clock=clock)
    assert d.run_once().observations == 0
    srv.decode(4, 100)
    srv.decode(16, 20)
    summary = tick(d, clock)
    assert summary.observations == 2 and summary.stored
    fed = d.policy_of(A).fed
    assert [(o.b, o.k, o.decode_steps, o.emitted_tokens, o.accepted_drafts, o.drafted_tokens)
            for o in fed] == [(4, 3, 100, 800, 400, 1200), (16, 3, 20, 640, 320, 960)]
    assert fed[0].busy_s == pytest.approx(1.0)
    assert tick(d, clock).observations == 0  # nothing new, nothing fed
    rows = d.storage.observations(server=A)
    assert [(r.b, r.decode_steps, r.ts) for r in rows] == [(4, 100, 1001.0), (16, 20, 1001.0)]
    (s,) = d.storage.servers()
    assert s.arms == ARMS and s.start_times == (500.0,)


def test_dp_replicas_are_summed(tmp_path):
    srv, clock = FakeServer(replicas=2), FakeClock()
    d = make_daemon({A: srv}, tmp_path, clock=clock)
    d.run_once()
    srv.decode(8, 10)
    tick(d, clock)
    (o,) = d.policy_of(A).fed
    assert (o.b, o.decode_steps, o.emitted_tokens) == (8, 20, 320)


def test_decision_period_pushes_growing_versions_above_the_server(tmp_path):
    srv, clock = FakeServer(), FakeClock()
    srv.cores[0].install(((None, 3),), 41)  # someone pushed up to v41 before us
    d = make_daemon({A: srv}, tmp_path, clock=clock)
    d.run_once()
    pol = d.policy_of(A)
    pol.next = ((8, 3), (None, 1))
    for _ in range(4):
        tick(d, clock)
    assert srv.posts == []  # the first decision waits one period
    tick(d, clock)
    assert srv.cores[0].table == ((8, 3), (None, 1)) and srv.cores[0].version == 42
    for _ in range(5):
        tick(d, clock)
    assert len(srv.posts) == 1  # same proposal: nothing pushed
    pol.next = ((None, 0),)
    for _ in range(5):
        tick(d, clock)
    assert srv.cores[0].version == 43 and srv.cores[0].table == ((None, 0),)
    versions = d.storage.policy_versions(server=A)
    assert [(v.version, v.outcome, v.reason) for v in versions] == [
        (42, "applied", "explore"), (43, "applied", "greedy")]


def test_versions_continue_above_the_history_after_a_daemon_restart(tmp_path):
    srv, clock = FakeServer(), FakeClock()
    d = make_daemon({A: srv}, tmp_path, clock=clock)
    d.run_once()
    d.policy_of(A).next = ((None, 1),)
    tick(d, clock, 5)
    d.shutdown()  # leaves the greedy table: v2
    srv.restart(started_at=900.0)  # the server forgot its version; the history did not
    d2 = make_daemon({A: srv}, tmp_path, clock=clock)
    d2.run_once()
    d2.policy_of(A).next = ((4, 1), (None, 3))
    tick(d2, clock, 5)
    assert [v.version for v in d2.storage.policy_versions()] == [1, 2, 3]
    assert srv.cores[0].version == 3


def test_restart_no_negative_deltas_repush_and_event(tmp_path, caplog):
    srv, clock = FakeServer(), FakeClock()
    d = make_daemon({A: srv}, tmp_path, clock=clock)
    d.run_once()
    d.policy_of(A).next = ((4, 3), (None, 0))
    tick(d, clock, 5)
    assert srv.cores[0].version == 1
    srv.decode(2, 100)
    tick(d, clock)
    fed_before = len(d.policy_of(A).fed)
    # The server restarts: default table, version 0, counters from zero.
    srv.restart(started_at=2_000.0)
    srv.decode(2, 7)
    with caplog.at_level(logging.WARNING, logger="tuner.daemon"):
        tick(d, clock)
    core = srv.cores[0]
    assert core.table == ((4, 3), (None, 0)) and core.version == 2  # re-pushed at once
    new = d.policy_of(A).fed[fed_before:]
    assert [(o.b, o.decode_steps) for o in new] == [(2, 7)]  # since the restart, no negatives
    assert all(o.decode_steps > 0 and o.busy_s > 0 for o in d.policy_of(A).fed)
    assert [e.kind for e in d.storage.events(server=A, kinds=["restart"])] == ["restart"]
    # The table the server started on, each time: the report's baseline.
    assert [e.detail for e in d.storage.events(server=A, kinds=["initial_table"])] == [
        "v0 rest:k3", "v0 rest:k3"]
    assert "restarted" in caplog.text
    assert "re-pushing" not in caplog.text
    assert d.storage.policy_versions()[-1].reason == "re-push after restart"
    assert d.storage.server(A).start_times == (500.0, 2000.0)


def test_counters_going_backwards_without_new_start_give_nothing(tmp_path):
    srv, clock = FakeServer(), FakeClock()
    srv.decode(4, 100)
    d = make_daemon({A: srv}, tmp_path, clock=clock)
    d.run_once()
    srv.cores = [PluginCore(ARMS, started_at=500.0)]  # same start time, counters reset
    srv.decode(4, 5)
    assert tick(d, clock).observations == 0
    srv.decode(4, 5)
    assert tick(d, clock).observations == 1  # the new baseline works
    assert d.status().servers[0].restarts == 1


def test_dry_run_learns_and_records_but_never_pushes(tmp_path):
    srv, clock = FakeServer(), FakeClock()
    d = make_daemon({A: srv}, tmp_path, clock=clock, dry_run=True)
    d.run_once()
    d.policy_of(A).next = ((None, 0),)
    srv.decode(4, 10)
    for _ in range(12):
        tick(d, clock)
    srv.restart(started_at=3_000.0)
    tick(d, clock)
    d.shutdown()
    assert srv.posts == []
    assert d.policy_of(A).fed
    (v,) = d.storage.policy_versions()
    assert v.outcome == "dry_run" and v.table == ((None, 0),)
    # The decision took a version of its own; the server still runs the one it reported.
    st = d.status().servers[0]
    assert st.version == v.version and st.server_version == srv.cores[0].version < v.version


def test_server_down_at_start_backs_off_warns_once_and_recovers(tmp_path, caplog):
    down, up, clock = FakeServer(), FakeServer(), FakeClock()
    down.down = True
    d = make_daemon({A: down, B: up}, tmp_path, clock=clock)
    with caplog.at_level(logging.WARNING, logger="tuner.daemon"):
        d.run_once()
        for _ in range(30):
            up.decode(4, 10)
            tick(d, clock)
    warnings = [r for r in caplog.records if A in r.getMessage()]
    assert len(warnings) == 1 and "unreachable" in warnings[0].getMessage()  # once, not per tick
    assert d.status().servers[1].observations == 30  # the healthy server never stalled
    assert d.status().servers[0].up is False
    down.down = False
    for _ in range(31):  # backoff is capped at 30 s: it is back within the cap
        tick(d, clock)
    assert d.status().servers[0].up is True
    assert [e.kind for e in d.storage.events(server=A, kinds=["outage", "recovered"])] == [
        "outage", "recovered"]


def test_backoff_spaces_out_attempts():
    clock = FakeClock()
    attempts = []

    def counting(request):
        attempts.append(clock())
        raise httpx.ConnectError("refused", request=request)

    d = make_daemon({A: counting}, clock=clock)
    d.run_once()
    for _ in range(100):
        tick(d, clock)
    gaps = [b - a for a, b in zip(attempts, attempts[1:])]
    assert gaps[:6] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0] and max(gaps) == 30.0


def test_database_outage_keeps_learning_and_loses_nothing(tmp_path, caplog):
    srv, clock = FakeServer(), FakeClock()
    d = make_daemon({A: srv}, tmp_path, clock=clock)
    d.run_once()
    other = sqlite3.connect(tmp_path / "h.db", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another writer holds the database
    with caplog.at_level(logging.WARNING, logger="tuner.daemon"):
        for i in range(5):
            srv.decode(4, 10 + i)
            assert not tick(d, clock).stored
    assert len([r for r in caplog.records if "history unavailable" in r.getMessage()]) == 1
    assert len(d.policy_of(A).fed) == 5  # learning went on
    assert d.status().buffered_rows >= 5 and not d.status().storage_ok
    other.execute("ROLLBACK")
    other.close()
    assert tick(d, clock).stored
    assert [o.decode_steps for o in d.storage.observations(server=A)] == [10, 11, 12, 13, 14]
    kinds = [e.kind for e in d.storage.events(kinds=["storage_outage", "storage_recovered"])]
    assert kinds == ["storage_outage", "storage_recovered"]  # the outage is on record too


def test_stop_pushes_greedy_flushes_and_returns_0(tmp_path):
    srv, clock = FakeServer(), FakeClock()
    config = TunerConfig(servers=(A,), interval_s=1.0, decision_period_s=2.0)
    storage = Storage(f"sqlite:///{tmp_path / 'h.db'}")
    policies_made = []

    def factory(arms, buckets):
        p = ScriptedPolicy(arms=arms, buckets=buckets)
        p.next, p.best = ((None, 3),), ((8, 3), (None, 0))
        policies_made.append(p)
        return p

    ticks = []

    def on_tick(status):
        ticks.append(status)
        srv.decode(4, 10)
        if len(ticks) == 6:
            d.request_stop()  # what the SIGTERM/SIGINT handler does

    def fake_wait(seconds):
        clock.advance(seconds)
        return d.stopping

    client = SGLangClient(A, transport=httpx.MockTransport(srv))
    d = Daemon(config, storage=storage, clients={A: client}, policy_factory=factory,
               clock=clock, wait=fake_wait, on_tick=on_tick)
    assert d.run() == 0
    assert len(ticks) == 7  # six ticks and the picture after the greedy push
    core = srv.cores[0]
    assert core.table == ((8, 3), (None, 0))  # greedy, not the exploration table
    assert ticks[-1].servers[0].server_table == core.table
    last = storage.policy_versions()[-1]
    assert last.reason == "shutdown: greedy table" and last.outcome == "applied"
    assert [e.kind for e in storage.events(kinds=["start", "stop"])] == ["start", "stop"]
    assert storage.count_observations() == 5


def test_run_ends_after_duration_with_fake_clock(tmp_path):
    srv, clock = FakeServer(), FakeClock()
    config = TunerConfig(servers=(A,), interval_s=1.0, decision_period_s=2.0, duration_s=10.0)
    client = SGLangClient(A, transport=httpx.MockTransport(srv))

    def fake_wait(seconds):
        clock.advance(seconds)
        return False

    d = Daemon(config, storage=None, clients={A: client}, clock=clock, wait=fake_wait)
    assert d.run() == 0
    assert clock() == pytest.approx(1_010.0) and d.status().ticks == 11


def test_warm_start_rebuilds_the_policy_from_history(tmp_path):
    srv, clock = FakeServer(), FakeClock()
    buckets = Buckets((4, 16))
    d = make_daemon({A: srv}, tmp_path, clock=clock, policy="thompson", buckets=(4, 16))
    d.run_once()
    for b in (2, 8, 32):
        srv.decode(b, 300)
        tick(d, clock)
    before = d.policy_of(A).snapshot()
    d.shutdown()
    d2 = make_daemon({A: srv}, tmp_path, clock=clock, policy="thompson", buckets=(4, 16))
    d2.run_once()
    after = d2.policy_of(A).snapshot()
    assert after.buckets == buckets
    assert [(e.bucket, e.arm, e.n, round(e.estimate, 6)) for e in after.estimates] == [
        (e.bucket, e.arm, e.n, round(e.estimate, 6)) for e in before.estimates]
    assert any(e.n > 0 for e in after.estimates)
    # Another server's history is not used.
    other = make_daemon({B: FakeServer()}, tmp_path, clock=clock, policy="thompson",
                        buckets=(4, 16))
    other.run_once()
    assert all(e.n == 0 for e in other.policy_of(B).snapshot().estimates)
    reference = make_policy("thompson", arms=ARMS, buckets=buckets)
    assert after.chosen != () and len(after.chosen) == len(reference.snapshot().chosen)


def test_plugin_missing_switches_to_metrics_only_once_and_never_pushes(tmp_path, caplog):
    srv, clock = FakeServer(), FakeClock()
    srv.plugin = False
    d = make_daemon({A: srv}, tmp_path, clock=clock)
    with caplog.at_level(logging.WARNING):
        for _ in range(8):
            tick(d, clock)
    assert d.status().servers[0].mode == "metrics-only"
    assert len([r for r in caplog.records if "no \"dynspec\" section" in r.getMessage()]) == 1
    assert srv.posts == []
    assert [e.kind for e in d.storage.events(server=A)] == ["plugin_missing", "malformed_reply"]


def test_unknown_policy_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown policy 'nope'"):
        Daemon(TunerConfig(servers=(A,), policy="nope"), storage=None)


def test_partial_rejection_repushes_to_all_replicas(tmp_path):
    srv, clock = FakeServer(replicas=2), FakeClock()
    d = make_daemon({A: srv}, tmp_path, clock=clock)
    d.run_once()
    # Between our reading and our push, replica 1 takes our version number with another table
    # (a version above ours would be another tuner's: see test_faults): it refuses our push.
    srv.on_post = lambda: srv.cores[1].install(((None, 3),), 1) if not srv.posts[1:] else None
    d.policy_of(A).next = ((None, 1),)
    tick(d, clock, 5)
    assert [c.table for c in srv.cores] == [((None, 1),), ((None, 3),)]
    tick(d, clock, 5)
    assert [c.table for c in srv.cores] == [((None, 1),), ((None, 1),)]
    assert srv.cores[1].version == 2
    assert "update_rejected" in [e.kind for e in d.storage.events(server=A)]


# --- stops that cannot leave the greedy table, restarts, said truthfully ---------------------


def _exploring(tmp_path, clock):
    """A daemon whose server runs an exploration table (rest:k3) while greedy is rest:k0."""
    srv = FakeServer()
    d = make_daemon({A: srv}, tmp_path, clock=clock)
    d.run_once()
    d.policy_of(A).next = ((None, 3),)
    tick(d, clock, 5)
    assert srv.cores[0].table == ((None, 3),)
    return srv, d


@pytest.mark.parametrize("trouble", ["hangs", "down"])
def test_a_stop_that_cannot_leave_the_greedy_table_says_so_records_it_and_exits_1(
        tmp_path, caplog, trouble):
    clock = FakeClock()
    srv, d = _exploring(tmp_path, clock)
    if trouble == "down":
        srv.down = True
        tick(d, clock)  # the outage is seen before the stop
    else:
        def hang():
            raise httpx.ReadTimeout("timed out")
        srv.on_post = hang
    d.request_stop()
    with caplog.at_level(logging.ERROR, logger="tuner.daemon"):
        assert d.run() == 1
    assert srv.cores[0].table == ((None, 3),)  # still exploring: that is what is reported
    assert A in d.unclean and "rest:k3" in d.unclean[A]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("could not leave the greedy table rest:k0" in m for m in errors)
    events = d.storage.events(server=A, kinds=["stop_unclean"])
    assert len(events) == 1 and "exploration" in events[0].detail


def test_a_clean_stop_returns_0_and_records_no_unclean_stop(tmp_path):
    clock = FakeClock()
    srv, d = _exploring(tmp_path, clock)
    d.request_stop()
    assert d.run() == 0
    assert srv.cores[0].table == ((None, 0),) and d.unclean == {}
    assert d.storage.events(kinds=["stop_unclean"]) == []


def test_restart_onto_the_current_table_pushes_nothing_and_says_so(tmp_path, caplog):
    srv, clock = FakeServer(), FakeClock()
    d = make_daemon({A: srv}, tmp_path, clock=clock)
    d.run_once()
    d.policy_of(A).next = ((None, 3),)  # the server's own default: nothing to push
    tick(d, clock, 5)
    pushes = len(srv.posts)
    srv.restart(started_at=2_000.0)
    with caplog.at_level(logging.INFO, logger="tuner.daemon"):
        tick(d, clock)
    assert len(srv.posts) == pushes
    assert "re-pushing" not in caplog.text
    assert "already runs rest:k3; nothing to re-push" in caplog.text
    st = d.status().servers[0]
    assert st.server_version == 0  # what the restarted server reports, not an old version


# --- tree servers ---------------------------------------------------------------------------


def test_a_tree_server_s_policy_learns_how_many_tokens_its_arm_verifies(tmp_path):
    """The readout's tree reaches the policy before its first observation (a model policy
    prices the arm at 16 verified tokens, not as a 2-deep chain); another tree on the same
    arms after a restart builds a new policy."""
    from tuner.protocol import TreeShape

    srv, clock = FakeServer(), FakeClock()
    tree16, tree8 = TreeShape(topk=4, steps=2, draft_tokens=16), TreeShape(4, 2, 8)
    srv.cores = [PluginCore((0, 2), started_at=500.0, tree=tree16)]
    calls = []

    class Recording(ScriptedPolicy):
        def set_verify_tokens(self, tokens):
            super().set_verify_tokens(tokens)
            calls.append((dict(tokens), len(self.fed)))

    config = TunerConfig(servers=(A,), interval_s=1.0, decision_period_s=5.0)
    client = SGLangClient(A, transport=httpx.MockTransport(srv))
    d = Daemon(config, storage=Storage(f"sqlite:///{tmp_path / 'h.db'}"), clients={A: client},
               policy_factory=lambda arms, buckets: Recording(arms=arms, buckets=buckets),
               clock=clock)
    d.run_once()
    srv.decode(4, 10)
    tick(d, clock)
    assert calls == [({2: 16}, 0)] and d.policy_of(A).fed
    srv.cores = [PluginCore((0, 2), started_at=900.0, tree=tree8)]
    tick(d, clock)
    assert calls[-1] == ({2: 8}, 0)
    (ev,) = d.storage.events(server=A, kinds=["arms_changed"])
    assert ev.detail == "(0, 2) (tree 4x2x16) -> (0, 2) (tree 4x2x8)"


def test_a_tree_s_verified_tokens_are_checked():
    pol = make_policy("model", arms=(0, 2))
    for bad in ({0: 4}, {3: 16}, {2: 2}):
        with pytest.raises(ValueError, match="cannot verify"):
            pol.set_verify_tokens(bad)
    pol.set_verify_tokens({2: 16})
    make_policy("thompson", arms=(0, 2)).set_verify_tokens({2: 16})  # a bandit ignores it
