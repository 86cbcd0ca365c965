"""The fault matrix: each fault injected for real into a simulated SGLang server on loopback
(``tuner/sim/faults.py``) or into the history database, against the real daemon and client.

The simulator's virtual time moves only when a test steps it (fake clock), the daemon runs on
its own fake clock, so every tick is deterministic; the only real waits are the client
timeouts of the slow-server tests (fractions of a second). Nothing-lost checks compare the
history with what the server reported: counters are cumulative, so the observations stored
over a server lifetime must add up to its last reading minus the daemon's first one.

Faults 8 (SIGTERM) and 9 (SIGKILL) run the CLI as a subprocess; 8 is
tests/test_cli.py::test_sigterm_leaves_the_greedy_table_flushes_and_exits_0, 9 is here.
Fault 11 (hostile updates) is tests/test_hostile.py.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from policies import make_policy
from storage import Storage
from tests._cli_proc import cli_process, sigterm
from tests._fakes import FakeClock, LoopbackSim
from tuner.cli import main
from tuner.config import TunerConfig
from tuner.daemon import Daemon
from tuner.protocol import DynspecState, encode_update
from tuner.sim.faults import Fault
from tuner.sim.server import SimServer

NEVER = ((None, 0),)  # the "never" policy's table
DEFAULT = ((None, 3),)  # what a fresh simulated server runs (SGLang's startup step)


class Sim(LoopbackSim):
    """A simulated SGLang server on a free loopback port; virtual time moves by :meth:`step`.

    Records every ``/server_info`` reading it answered (start time, total decode steps) and
    every update it received, for nothing-lost and no-loop checks.
    """

    def __init__(self, *, port: int = 0, load: str = "8") -> None:
        super().__init__(load=load, port=port, seed=1)
        self.answered: list[tuple[float, int]] = []
        self.posts: list[dict] = []
        self.versions: list[int] = []  # the server's version after each update
        # First in line, before the faults: it sees what the client sees.
        self.server.interceptors.insert(0, self._record)

    def _record(self, req, call_next):
        if req.path == "/set_internal_state":
            self.posts.append(json.loads(req.body))
        resp = call_next(req)
        if req.path == "/server_info" and resp is not None and resp.status == 200:
            try:  # a reading the client can parse (a malformed one is not)
                (state,) = json.loads(resp.body)["internal_states"]
                d = DynspecState.from_json(state["dynspec"])
                self.answered.append((d.started_at, sum(c.decode_steps for c in d.counters)))
            except (ValueError, KeyError):
                pass
        elif req.path == "/set_internal_state":
            with self.server.lock:
                self.versions.append(self.server.core.version)
        return resp

    @property
    def faults(self):
        return self.server.faults

    def table(self):
        with self.server.lock:
            return self.server.core.table, self.server.core.version

    def expected_steps(self) -> int:
        """Decode steps the history must hold: per server lifetime, last reading minus the
        baseline (the daemon's first reading, or zero after a restart)."""
        total, lifetimes = 0, {}
        for started, steps in self.answered:
            lifetimes.setdefault(started, []).append(steps)
        for i, steps in enumerate(lifetimes.values()):
            total += steps[-1] - (steps[0] if i == 0 else 0)
        return total


def stored_steps(storage: Storage, addr: str) -> int:
    return sum(o.decode_steps for o in storage.observations(server=addr))


def make_daemon(servers, tmp_path: Path | None, clock: FakeClock, *, policy: str = "never",
                factory=None, db: str | None = None, **cfg) -> Daemon:
    url = db or (f"sqlite:///{tmp_path / 'h.db'}" if tmp_path is not None else None)
    config = TunerConfig(servers=tuple(servers), interval_s=1.0, decision_period_s=2.0,
                         policy=policy, db_url=url or "sqlite:///unused.db", **cfg)
    storage = Storage(url, busy_timeout_s=0.05) if url else None
    return Daemon(config, storage=storage, clock=clock, policy_factory=factory)


def run_ticks(d: Daemon, clock: FakeClock, n: int, *sims: Sim) -> None:
    for _ in range(n):
        for sim in sims:
            sim.step()
        clock.advance(1.0)
        d.run_once()


def messages(caplog, needle: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if needle in r.getMessage()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- 1. server down at daemon start ---------------------------------------------------------


def test_1_server_down_at_start_backs_off_then_learns_when_it_appears(tmp_path, caplog):
    port, clock = free_port(), FakeClock()
    d = make_daemon([f"127.0.0.1:{port}"], tmp_path, clock)
    with caplog.at_level(logging.WARNING, logger="tuner.daemon"):
        d.run_once()
        run_ticks(d, clock, 60)
    (st,) = d.status().servers
    assert st.up is False and st.observations == 0
    # Connection refused at t = 0, 1, 3, 7, 15, 31 s: backoff (capped at 30 s), not every tick.
    assert st.errors == 6
    (warning,) = messages(caplog, "unreachable")
    assert "cannot reach the server" in warning and "said once" in warning
    with Sim(port=port) as sim:
        run_ticks(d, clock, 1, sim)  # the next attempt is due within the 30 s cap
        assert d.status().servers[0].up is True
        run_ticks(d, clock, 5, sim)
        assert d.status().servers[0].observations > 0
        assert sim.table() == (NEVER, 1)  # it decided and pushed once it could
        d.shutdown()
        assert stored_steps(d.storage, sim.addr) == sim.expected_steps() > 0
    kinds = [e.kind for e in d.storage.events(server=sim.addr) if e.kind != "initial_table"]
    assert kinds[:2] == ["outage", "recovered"]


# --- 2. server restarts mid-run ---------------------------------------------------------------


def test_2_restart_is_detected_no_negative_deltas_table_repushed(tmp_path, caplog):
    clock = FakeClock()
    with Sim() as sim:
        d = make_daemon([sim.addr], tmp_path, clock)
        d.run_once()
        run_ticks(d, clock, 4, sim)  # pushed at the first decision (2 s); next one at 6 s
        assert sim.table() == (NEVER, 1)
        sim.faults.add("restart:/server_info:1")  # the next reading finds a fresh server
        with caplog.at_level(logging.INFO, logger="tuner.daemon"):
            run_ticks(d, clock, 1, sim)
        assert sim.table() == (NEVER, 2)  # re-pushed in the same tick, above the old version
        run_ticks(d, clock, 4, sim)
        d.shutdown()
        rows = d.storage.observations(server=sim.addr)
        assert rows and all(
            min(r.decode_steps, r.emitted_tokens, r.accepted_drafts, r.drafted_tokens) >= 0
            and r.decode_steps > 0 and r.busy_s >= 0 for r in rows
        )
        assert len({started for started, _ in sim.answered}) == 2
        assert stored_steps(d.storage, sim.addr) == sim.expected_steps()
    assert d.status().servers[0].restarts == 1
    assert "restart" in [e.kind for e in d.storage.events(server=sim.addr)]
    assert [v.reason for v in d.storage.policy_versions()][:2] == ["greedy",
                                                                   "re-push after restart"]
    assert messages(caplog, "(re-push after restart)")
    assert not messages(caplog, "re-pushing")  # said only when a push really goes out


# --- 3. slow server ---------------------------------------------------------------------------


def test_3_slow_server_times_out_warns_once_and_never_stalls_the_others(tmp_path, caplog):
    clock = FakeClock()
    with Sim() as slow, Sim() as fast:
        d = make_daemon([slow.addr, fast.addr], tmp_path, clock, timeout_s=0.2)
        d.run_once()
        slow.faults.add(Fault(kind="stall", paths=("/server_info",), stall_s=30.0))
        with caplog.at_level(logging.WARNING, logger="tuner.daemon"):
            run_ticks(d, clock, 40, slow, fast)
        st_slow, st_fast = d.status().servers
        assert st_slow.up is False and st_fast.up is True
        # Asked at 1, 2, 4, 8, 16 and 32 s into the outage: no request every tick.
        assert slow.faults.hits["stall"] == 6 == st_slow.errors
        (warning,) = messages(caplog, f"{slow.addr} unreachable")
        assert "timed out" in warning
        assert not messages(caplog, fast.addr)
        assert len(fast.answered) >= 40  # read every tick (41 unless the machine is swamped)
        slow.faults.clear()
        run_ticks(d, clock, 35, slow, fast)
        assert d.status().servers[0].up is True
        d.shutdown()
        for sim in (slow, fast):
            assert stored_steps(d.storage, sim.addr) == sim.expected_steps() > 0


def test_3_a_reading_still_out_is_not_sent_again(tmp_path):
    """A reply slower than the tick: the next ticks skip that server (one request out at a
    time) while the others go on."""
    clock = FakeClock()
    with Sim() as slow, Sim() as fast:
        config = TunerConfig(servers=(slow.addr, fast.addr), interval_s=0.2,
                             decision_period_s=0.4, policy="never", timeout_s=2.0)
        d = Daemon(config, storage=None, clock=clock)
        d.run_once()
        slow.faults.add(Fault(kind="stall", paths=("/server_info",), stall_s=30.0))
        for _ in range(4):  # 0.8 s of real waiting, well under the 2 s timeout
            fast.step()
            clock.advance(0.2)
            d.run_once()
        assert slow.faults.hits["stall"] == 1 and slow.faults.stalled_now == 1
        slow.faults.clear()
        d.shutdown()  # waits for the outstanding reading, then ends
        assert len(fast.answered) >= 4


# --- 4. 5xx and malformed replies -----------------------------------------------------------


def test_4_5xx_and_malformed_replies_are_counted_and_logged_once_per_burst(tmp_path, caplog):
    clock = FakeClock()
    with Sim() as sim:
        d = make_daemon([sim.addr], tmp_path, clock)
        d.run_once()
        with caplog.at_level(logging.WARNING, logger="tuner.daemon"):
            sim.faults.add("503:/server_info:5")
            run_ticks(d, clock, 40, sim)
            assert d.status().servers[0].errors == 5 and d.status().servers[0].up
            sim.faults.add("malformed:/server_info:5")
            run_ticks(d, clock, 40, sim)
            assert d.status().servers[0].errors == 10 and d.status().servers[0].up
        assert len(messages(caplog, "answered HTTP 503")) == 1
        assert len(messages(caplog, "did not answer JSON")) == 1
        d.shutdown()
        assert stored_steps(d.storage, sim.addr) == sim.expected_steps() > 0
    kinds = [e.kind for e in d.storage.events(server=sim.addr)
             if e.kind in ("outage", "malformed_reply", "recovered")]
    assert kinds == ["outage", "recovered", "malformed_reply", "recovered"]


def test_4_malformed_prometheus_text_in_metrics_only_mode(tmp_path, caplog):
    clock = FakeClock()
    with Sim() as sim:
        sim.faults.add("stock:/server_info")  # no plugin: the daemon falls back to /metrics
        d = make_daemon([sim.addr], tmp_path, clock, policy="thompson")
        d.run_once()
        run_ticks(d, clock, 5, sim)
        assert d.status().servers[0].mode == "metrics-only"
        before = d.status().servers[0].observations
        with caplog.at_level(logging.WARNING, logger="tuner.daemon"):
            sim.faults.add("malformed:/metrics:3")
            run_ticks(d, clock, 20, sim)
        st = d.status().servers[0]
        assert st.errors == 3 and st.up and st.mode == "metrics-only"
        assert st.observations > before  # learning resumed after the burst
        assert len(messages(caplog, "not Prometheus text")) == 1
        assert sim.posts == []  # metrics-only never pushes
        d.shutdown()


def test_4_a_policy_that_cannot_use_the_arms_says_so_once_and_records(tmp_path, caplog):
    """Metrics-only mode knows only the arm the server runs (3); "never" needs arm 0."""
    clock = FakeClock()
    with Sim() as sim:
        sim.faults.add("stock:/server_info")
        d = make_daemon([sim.addr], tmp_path, clock, policy="never")
        with caplog.at_level(logging.WARNING):
            d.run_once()
            run_ticks(d, clock, 10, sim)
        st = d.status().servers[0]
        assert st.up and st.errors == 0 and st.snapshot is None
        (msg,) = messages(caplog, "cannot work with arms")
        assert "policy never" in msg and "[3]" in msg
        d.shutdown()
        assert d.storage.count_observations(server=sim.addr) > 0  # the history still fills


# --- 5. update rejected -----------------------------------------------------------------------


@pytest.mark.parametrize(("fault", "reason"), [
    ("reject", "injected fault: updates refused"),  # the plugin says updated=false
    ("422:/set_internal_state", "HTTP 422"),  # SGLang's request validation says no
])
def test_5_rejected_update_is_an_event_rereads_and_does_not_loop(tmp_path, caplog, fault, reason):
    clock = FakeClock()
    with Sim() as sim:
        sim.faults.add(fault)
        d = make_daemon([sim.addr], tmp_path, clock)
        d.run_once()
        with caplog.at_level(logging.WARNING, logger="tuner.daemon"):
            run_ticks(d, clock, 25, sim)
        assert len(sim.posts) == 1  # twelve decision periods, one push
        assert sim.table() == (DEFAULT, 0)
        assert d.status().servers[0].server_table == DEFAULT  # what the server really runs
        (event,) = d.storage.events(server=sim.addr, kinds=["update_rejected"])
        assert reason in event.detail
        sim.faults.clear()
        run_ticks(d, clock, 10, sim)  # retried once the backoff (30 s) has passed
        assert sim.table() == (NEVER, 2)
        assert len(sim.posts) == 2
        d.shutdown()
    assert [v.outcome for v in d.storage.policy_versions()] == ["rejected", "applied"]


# --- 6. two daemons on one server -------------------------------------------------------------


def _fixed(name: str, **params):
    return lambda arms, buckets: make_policy(name, arms=arms, buckets=buckets, **params)


@pytest.mark.parametrize("late", [False, True])
def test_6_two_daemons_on_one_server_one_yields_and_versions_never_go_back(
    tmp_path, caplog, late
):
    """Both start together: the first push is foreign to the other, which stops pushing.
    The second starts late, after the first settled: it pushes, and the first one yields."""
    clock = FakeClock()
    with Sim() as sim:
        one = make_daemon([sim.addr], None, clock, factory=_fixed("never"),
                          db=f"sqlite:///{tmp_path / 'one.db'}")
        two = make_daemon([sim.addr], None, clock, factory=_fixed("always", k=3),
                          db=f"sqlite:///{tmp_path / 'two.db'}")
        with caplog.at_level(logging.ERROR, logger="tuner.daemon"):
            one.run_once()
            if not late:
                two.run_once()
            for i in range(12):
                sim.step()
                clock.advance(1.0)
                one.run_once()
                if not late or i >= 1:  # late: starts right after one's first push
                    two.run_once()
        yielded, kept = (one, two) if late else (two, one)
        assert yielded.status().servers[0].read_only
        assert yielded.status().servers[0].mode == "read-only"
        assert not kept.status().servers[0].read_only
        (msg,) = messages(caplog, "another tuner")
        assert "stops pushing" in msg and ("sent v1" if late else "sent nothing") in msg
        assert sim.versions == sorted(sim.versions) and len(sim.versions) == 1 + late
        for d in (one, two):
            d.shutdown()  # the one that yielded leaves no greedy table behind either
        assert sim.table() == ((((None, 3),), 2) if late else (NEVER, 1))
    if not late:
        assert yielded.storage.policy_versions() == []
    assert [e.kind for e in yielded.storage.events(kinds=["foreign_push"])] == ["foreign_push"]


# --- 7. database locked / read-only / full ----------------------------------------------------


@pytest.fixture
def tiny_fs(tmp_path):
    """A 2 MiB filesystem of its own (needs root), so it can be filled or made read-only."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tiny filesystem here (needs root): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


class _Lock:
    def __init__(self, db: Path) -> None:
        self.db = db

    def on(self, storage: Storage) -> None:
        self.con = sqlite3.connect(self.db, isolation_level=None)
        self.con.execute("BEGIN IMMEDIATE")  # another writer holds the database

    def off(self) -> None:
        self.con.execute("ROLLBACK")
        self.con.close()


class _ReadOnly:
    def __init__(self, db: Path) -> None:
        self.mnt = db.parent

    def on(self, storage: Storage) -> None:
        storage.close()  # let go of the file, as a reconnect after a failover does
        subprocess.run(["mount", "-o", "remount,ro", str(self.mnt)], check=True)

    def off(self) -> None:
        subprocess.run(["mount", "-o", "remount,rw", str(self.mnt)], check=True)


class _Full:
    def __init__(self, db: Path) -> None:
        self.filler = db.parent / "filler"

    def on(self, storage: Storage) -> None:
        with open(self.filler, "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass

    def off(self) -> None:
        self.filler.unlink()


@pytest.mark.parametrize(("mode", "needle"), [
    (_Lock, "locked"), (_ReadOnly, "read-only"), (_Full, "disk is full")])
def test_7_database_unwritable_learning_goes_on_nothing_lost(request, tmp_path, caplog,
                                                             mode, needle):
    where = tmp_path if mode is _Lock else request.getfixturevalue("tiny_fs")
    db = where / "h.db"
    clock = FakeClock()
    with Sim() as sim:
        d = make_daemon([sim.addr], None, clock, db=f"sqlite:///{db}")
        d.run_once()
        run_ticks(d, clock, 2, sim)
        fault = mode(db)
        fault.on(d.storage)
        try:
            with caplog.at_level(logging.WARNING, logger="tuner.daemon"):
                run_ticks(d, clock, 5, sim)
            status = d.status()
            assert not status.storage_ok and status.buffered_rows > 0
            assert status.servers[0].observations > 0 and status.servers[0].up
        finally:
            fault.off()
        (warning,) = messages(caplog, "history unavailable")
        assert needle in warning and str(db) in warning
        run_ticks(d, clock, 2, sim)
        assert d.status().storage_ok and d.status().buffered_rows == 0
        d.shutdown()
        assert stored_steps(d.storage, sim.addr) == sim.expected_steps() > 0
    assert "storage_recovered" in [e.kind for e in d.storage.events()]


def test_7_postgres_connections_killed_mid_run_lose_nothing(postgres_url, caplog):
    """PostgreSQL restarted or failed over: every connection of the daemon dies at once."""
    from sqlalchemy import create_engine, text

    clock = FakeClock()
    admin = create_engine(postgres_url)
    url = f"{postgres_url}&application_name=dynspec_fault7"
    try:
        with Sim() as sim:
            d = make_daemon([sim.addr], None, clock, db=url)
            d.run_once()
            run_ticks(d, clock, 3, sim)
            with admin.begin() as c:
                killed = c.execute(text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE application_name = 'dynspec_fault7'")).scalar()
            assert killed >= 1
            run_ticks(d, clock, 3, sim)
            assert d.status().storage_ok
            d.shutdown()
            assert stored_steps(d.storage, sim.addr) == sim.expected_steps() > 0
    finally:
        admin.dispose()


# --- 9. SIGKILL mid-write ---------------------------------------------------------------------


def _start_daemon(port: int, db: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tuner.cli", "run", "--server", f"127.0.0.1:{port}",
         "--db", f"sqlite:///{db}", "--interval", "0.01", "--decision-period", "0.05"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def test_9_sigkill_mid_write_loses_at_most_one_interval_and_warm_starts(tmp_path):
    """The daemon is killed (-9) a few readings in, at a random moment of its tick, twice.
    Each time the history opens cleanly and holds exactly the readings up to the last or the
    one before (never a partial tick); the next daemon warm-starts from it."""
    db = tmp_path / "h.db"
    with Sim(load="64") as sim:
        lock = threading.Lock()
        run: dict = {}

        def kill_after_readings(req, call_next):
            # Each reading moves the server one virtual second on; after `n` of them the
            # daemon gets a SIGKILL at a random point of the tick that follows.
            if req.path == "/server_info":
                sim.step()
            resp = call_next(req)
            if req.path == "/server_info":
                with lock:
                    run["n"] = run.get("n", 0) + 1
                    if run["n"] == run["kill_at"]:
                        delay = int.from_bytes(os.urandom(1), "big") / 255 * 0.01
                        threading.Timer(delay, run["proc"].kill).start()
            return resp

        sim.server.interceptors.insert(1, kill_after_readings)
        for cycle in range(2):
            with lock:
                run.update(n=0, kill_at=8 + 3 * cycle)
                first = len(sim.answered)
                run["proc"] = proc = _start_daemon(sim.server.port, db)
            try:
                _, err = proc.communicate(timeout=120)
            finally:
                if proc.poll() is None:
                    proc.kill()
            assert proc.returncode == -signal.SIGKILL, err
            if cycle:
                assert "warm start from" in err
            mine = sim.answered[first:]
            con = sqlite3.connect(db)
            try:
                assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            finally:
                con.close()
            with Storage(f"sqlite:///{db}") as st:  # opens cleanly, writable
                since = run.get("since", 0)
                stored = sum(o.decode_steps for o in st.observations()) - since
                run["since"] = since + stored
            # Complete ticks only, up to the last reading or the one before it.
            assert stored in {mine[-1][1] - mine[0][1], mine[-2][1] - mine[0][1]}, (stored, mine)
        with cli_process("run", "--server", sim.addr, "--db", f"sqlite:///{db}",
                         "--interval", "0.01") as proc:
            for line in proc.stderr:  # blocks until the warm start is logged
                if "warm start from" in line:
                    break
            sigterm(proc)
        assert proc.returncode == 0


# --- 10. bad config, profile and policy files -------------------------------------------------


def _cli(capsys, *argv: str) -> tuple[int, str]:
    try:
        rc = main(list(argv))
    except SystemExit as exc:
        rc = int(exc.code)
    return rc, capsys.readouterr().err.strip()


def test_10_bad_files_exit_2_naming_file_and_field_and_apply_nothing(tmp_path, capsys,
                                                                      monkeypatch):
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "h.db"
    servers = tmp_path / "servers.txt"
    empty_key = tmp_path / "key"
    empty_key.write_text("\n")
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"format": "dynspec-policy", "format_version": 1, "protocol": 1,
                                  "arms": [0, 1, 3, 5], "policy_version": 3,
                                  "table": [[8, 7], [None, 1]]}))
    profile = tmp_path / "gpu.json"
    good = json.loads((Path(__file__).parents[1] / "tuner/sim/profiles/seed-kimi-pcie.json")
                      .read_text())
    profile.write_text(json.dumps({**good, "expert_frac": 3.0}))
    with Sim() as sim:
        servers.write_text(f"# the fleet\n{sim.addr}\ngpu-2:notaport\n")
        cases = [
            (["run", "--servers-file", str(servers)], [str(servers), "line 3", "gpu-2:notaport"]),
            (["run", "--servers-file", str(tmp_path / "nope.txt")], ["nope.txt", "cannot read"]),
            (["run", "--server", sim.addr, "--api-key-file", str(empty_key)],
             [str(empty_key), "is empty"]),
            (["run", "--simulate", "--profile", str(profile)], [str(profile), "expert_frac"]),
            (["sim", "--profile", str(profile)], [str(profile), "expert_frac"]),
            (["sim", "--fault", "teapot"], ["--fault", "teapot", "fault kind"]),
            (["sim", "--policy-file", str(policy)], [str(policy), "row 0", "k=7"]),
        ]
        for argv, needles in cases:
            rc, err = _cli(capsys, *argv, *(["--db", f"sqlite:///{db}"] if "run" in argv else []))
            assert rc == 2, (argv, err)
            assert all(n in err for n in needles), (argv, err)
            assert len(err.splitlines()) == 1
        assert sim.answered == [] and sim.posts == []  # nothing read, nothing applied
    assert not db.exists() and not (tmp_path / "dynspec-sim.db").exists()


# --- 12. protocol version mismatch ------------------------------------------------------------


def test_12_protocol_mismatch_is_refused_on_both_sides_naming_both_versions(tmp_path, caplog):
    clock = FakeClock()
    with Sim() as sim:
        # Daemon side: the server's plugin speaks v3 (this side reads v1 and v2).
        sim.faults.add("protocol3:/server_info")
        d = make_daemon([sim.addr], tmp_path, clock)
        with caplog.at_level(logging.WARNING, logger="tuner.daemon"):
            d.run_once()
            run_ticks(d, clock, 10, sim)
        (msg,) = messages(caplog, "protocol version mismatch")
        assert "server speaks v3" in msg and "this side reads v1/v2" in msg
        assert sim.posts == [] and d.status().servers[0].observations == 0
        d.shutdown()
        # Plugin side: an update in protocol v3 changes nothing and says why.
        sim.faults.clear()
        update = {**encode_update(((8, 1), (None, 0)), 1), "dynspec_protocol": 3}
        with httpx.Client(base_url=sim.server.url) as c:
            assert c.post("/set_internal_state", json={"server_args": update}).json() == [False]
        with sim.server.lock:
            core = sim.server.core
            assert (core.table, core.version, core.updates_rejected) == (DEFAULT, 0, 1)
            assert "update speaks v3, this side speaks v1/v2" in core.last_rejection


# --- security: the admin key and database passwords never show -------------------------------


def test_admin_key_is_sent_as_bearer_and_never_logged(tmp_path, caplog, monkeypatch):
    key = "sk-admin-7c41d9e2"
    seen: list[str | None] = []
    clock = FakeClock()
    with Sim() as sim:
        def check_key(req, call_next):
            seen.append(req.headers.get("authorization"))
            return call_next(req)

        sim.server.interceptors.insert(1, check_key)
        monkeypatch.setenv("DYNSPEC_API_KEY", key)
        config = TunerConfig.from_sources({"servers": (sim.addr,), "policy": "never",
                                           "db_url": f"sqlite:///{tmp_path / 'h.db'}",
                                           "decision_period_s": 2.0})
        assert key not in repr(config)
        d = Daemon(config, storage=Storage(config.db_url), clock=clock)
        with caplog.at_level(logging.DEBUG):
            d.run_once()
            run_ticks(d, clock, 3, sim)
            sim.faults.add("401:/server_info:2")  # SGLang refusing the key
            run_ticks(d, clock, 5, sim)
            d.shutdown()
        assert sim.posts and set(seen) == {f"Bearer {key}"}
        assert "API key is missing or refused" in caplog.text
    assert key not in caplog.text
    assert all(key not in e.detail for e in d.storage.events())
    assert key not in repr(d.status())


def test_database_password_is_redacted_in_logs_and_output(postgres_url, caplog, capsys):
    from sqlalchemy.engine import make_url

    secret = "pg-s3cret-91f0"
    url = make_url(postgres_url).set(username="postgres", password=secret)
    full = url.render_as_string(hide_password=False)  # trust auth: any password connects
    with Sim() as sim:
        with caplog.at_level(logging.DEBUG):
            rc, err = _cli(capsys, "run", "--server", sim.addr, "--db", full, "--duration",
                           "0.05", "--interval", "0.01")
        out = capsys.readouterr().out
    assert rc == 0, err
    assert secret not in caplog.text + out + err
    assert "***" in caplog.text


# --- the fault switchboard itself -------------------------------------------------------------


def test_fault_specs_and_the_admin_endpoint():
    assert Fault.parse("503:/server_info:5") == Fault(kind="status", status=503,
                                                      paths=("/server_info",), count=5)
    assert Fault.parse("stall2.5:/a,/b") == Fault(kind="stall", stall_s=2.5, paths=("/a", "/b"))
    assert Fault.parse("protocol3") == Fault(kind="protocol", version=3)
    assert Fault.parse("reject").applies_to("/set_internal_state")
    assert not Fault.parse("reject").applies_to("/server_info")
    for bad, why in [("teapot", "fault kind"), ("99", "400..599"), ("stallx", "not a number"),
                     ("refuse:server_info", "start with '/'"), ("refuse:/a:0", "count")]:
        with pytest.raises(ValueError, match=why):
            Fault.parse(bad)
    with SimServer(load="none") as sim, httpx.Client(base_url=sim.url, timeout=5) as c:
        r = c.post("/_sim/faults", json={"kind": "status", "status": 500, "count": 2,
                                         "paths": ["/health"]})
        assert r.status_code == 200 and r.json()["id"] == 1
        assert c.post("/_sim/faults", json="refuse:/metrics").json()["kind"] == "refuse"
        assert c.post("/_sim/faults", json={"kind": "nope"}).status_code == 422
        assert [c.get("/health").status_code for _ in range(3)] == [500, 500, 200]
        listed = c.get("/_sim/faults").json()
        assert [f["kind"] for f in listed["faults"]] == ["refuse"]  # the 500s were used up
        assert listed["hits"] == {"status": 2}
        assert c.delete("/_sim/faults").json() == {"cleared": True}
        assert c.get("/metrics").status_code == 200
        before = c.get("/server_info").json()["internal_states"][0]["dynspec"]["started_at"]
        assert c.post("/_sim/restart").json()["started_at"] > before
        assert c.get("/_sim/restart").status_code == 405
