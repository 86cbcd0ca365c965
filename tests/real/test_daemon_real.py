"""The daemon against real SGLang servers: it learns and pushes, every push is applied and
versions never go back; a SIGKILLed server restarted on its port; the admin API key."""

from __future__ import annotations

import signal
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _drive import Load, Tuner, pushed_versions, tuner_args
from _server import ARMS, RealServer, http, readout, wait_for

from tuner.protocol import encode_update

ADMIN_KEY = "real-tier-admin-key"
# Real time given to the daemon after the event under test, to show it does not repeat itself.
QUIET_S = 8.0


def history(db: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(db) as c:
        return c.execute(sql).fetchall()


def test_daemon_learns_and_every_push_is_applied(learned, history_db):
    start, end, log = learned["start"], learned["end"], learned["log"]
    versions = pushed_versions(log)
    assert versions == sorted(set(versions)) and versions[0] > start["policy_version"], versions
    assert learned["seen"] == sorted(learned["seen"]), f"the version went back: {learned['seen']}"
    # Every push applied: the plugin counted each one (and the greedy table left at stop).
    assert end["updates_rejected"] == start["updates_rejected"]
    assert end["updates_applied"] - start["updates_applied"] >= len(versions)
    assert end["policy_version"] >= versions[-1]
    assert "refused" not in log and "Traceback" not in log, log[-3000:]
    rows = history(history_db, "SELECT outcome, version FROM policy_versions ORDER BY id")
    assert rows and all(o != "rejected" for o, _ in rows)
    applied = [v for o, v in rows if o == "applied"]
    assert applied == sorted(applied)


@pytest.fixture(scope="session", autouse=True)
def _launch_keyed(servers) -> None:
    """Launched before this module's first test, so that it starts while that test's shared
    server starts and learns (session scope: pytest sets those fixtures up first)."""
    servers.spawn("keyed", admin_api_key=ADMIN_KEY, alpha=0.5)


@pytest.fixture(scope="module")
def keyed_server(servers) -> Iterator[RealServer]:
    """A server that takes table updates only with the admin key (reads stay open); it stops
    with this module (it was launched by a session fixture)."""
    server = servers("keyed")
    yield server
    server.kill()


def test_admin_key_from_a_file_pushes(keyed_server, workdir):
    key_file = workdir / "admin.key"
    key_file.write_text(ADMIN_KEY + "\n")
    db = workdir / "keyed.db"
    start = readout(keyed_server.url)
    with Load(keyed_server.url, 2, seed=2), Tuner(
        tuner_args(keyed_server, db, "--api-key-file", str(key_file)), workdir / "keyed.log"
    ) as tuner:
        wait_for(lambda: pushed_versions(tuner.log()), 150, "a push with the admin key")
    end = readout(keyed_server.url)
    assert end["updates_applied"] > start["updates_applied"]
    assert end["updates_rejected"] == start["updates_rejected"]


def test_a_wrong_key_is_refused_and_said_once(keyed_server, workdir):
    key_file = workdir / "wrong.key"
    key_file.write_text("not-the-admin-key\n")
    start = readout(keyed_server.url)
    with Load(keyed_server.url, 2, seed=3), Tuner(
        tuner_args(keyed_server, workdir / "wrong.db", "--api-key-file", str(key_file)),
        workdir / "wrong.log",
    ) as tuner:
        wait_for(lambda: "API key" in tuner.log(), 150, "the refusal in the daemon's log")
        time.sleep(QUIET_S)  # several more decision periods: no repetition
    # While it runs (its stop, which tries to leave the greedy table, says so on its own).
    running = tuner.log().split("SIGTERM")[0]
    said = [line for line in running.splitlines() if "API key is missing or refused" in line]
    assert len(said) == 1, "\n".join(said)
    assert "HTTP 401" in said[0] or "HTTP 403" in said[0]
    assert readout(keyed_server.url)["policy_version"] == start["policy_version"]


def test_key_replies_match_the_simulator(keyed_server):
    """The honesty test's wrong-key part: status and body of an update without the admin
    key, with a wrong one and with the right one, and of a read with a wrong key."""
    from tuner.sim.server import SimServer

    def answers(url: str) -> list:
        version = readout(url)["policy_version"] + 1
        update = {"server_args": encode_update(((None, 0),), version)}
        out = [http(url, "/set_internal_state", update, key=key) for key in (None, "wrong")]
        out.append(http(url, "/server_info", key="wrong")[0])
        out.append(http(url, "/set_internal_state", update, key=ADMIN_KEY))
        return out

    with SimServer(arms=ARMS, load="none", admin_api_key=ADMIN_KEY) as sim:
        simulated = answers(sim.url)
    real = answers(keyed_server.url)
    assert real[:3] == [(401, {"error": "Unauthorized"})] * 2 + [200], real
    assert simulated == real


def test_sigkill_and_restart_on_the_same_port(keyed_server, workdir):
    key_file = workdir / "admin.key"
    key_file.write_text(ADMIN_KEY + "\n")
    db = workdir / "restart.db"
    url = keyed_server.url
    with Load(url, 2, seed=4), Tuner(
        tuner_args(keyed_server, db, "--api-key-file", str(key_file)), workdir / "restart.log"
    ) as tuner:
        wait_for(lambda: pushed_versions(tuner.log()), 150, "a push before the restart")
        keyed_server.kill(signal.SIGKILL)
        keyed_server.start()
        wait_for(lambda: "server restarted" in tuner.log(), 120, "the daemon noticing the restart")
        pushes_before = len(pushed_versions(tuner.log().split("server restarted")[0]))
        wait_for(lambda: readout(url)["policy_version"] > 0, 120, "a re-push after the restart")
        time.sleep(QUIET_S)
    log = tuner.log()
    assert log.count("server restarted") == 1, log[-3000:]
    assert len(pushed_versions(log)) > pushes_before
    assert readout(url)["updates_rejected"] == 0
    negative = history(db, "SELECT COUNT(*) FROM observations WHERE decode_steps < 0 OR "
                           "emitted_tokens < 0 OR accepted_drafts < 0 OR drafted_tokens < 0 "
                           "OR busy_s < 0")[0][0]  # fmt: skip
    assert negative == 0
    assert history(db, "SELECT COUNT(*) FROM events WHERE kind = 'restart'")[0][0] == 1
