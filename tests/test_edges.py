"""Edges a new user hit: ports, addresses, paths and URLs given on the command line fail in
one line with exit 2; servers that never answer, or are not SGLang, say so; status lines tell
the truth; /healthz; JSON logs."""

from __future__ import annotations

import io
import json
import logging
import math
import socket

import httpx
import pytest

from policies import Buckets, PolicySnapshot
from storage import Storage
from tuner.cli import main
from tuner.client import SGLangClient
from tuner.daemon import DaemonStatus, ServerStatus
from tuner.errors import ConfigError, MalformedReplyError
from tuner.logging_setup import configure_logging
from tuner.status import exit_lines, status_lines
from tuner.tuner_metrics import TunerMetrics


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        rc = main(list(argv))
    except SystemExit as exc:
        rc = int(exc.code)
    out, err = capsys.readouterr()
    return rc, out, err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize(("flags", "needle"), [
    (["--metrics-port", "99999"], "a port is 0..65535"),
    (["--metrics-port", "-1"], "a port is 0..65535"),
    (["--metrics-port", "0", "--metrics-addr", "nonsense"], "cannot listen there"),
    # TEST-NET-1: never on this machine; binding fails at once, nothing is sent anywhere.
    (["--metrics-port", "0", "--metrics-addr", "192.0.2.1"], "cannot listen there"),
    (["--metrics-addr", "127.0.0.1"], "--metrics-addr needs --metrics-port"),
])
def test_bad_metrics_port_or_address_is_one_line_exit_2(capsys, tmp_path, flags, needle):
    rc, _, err = cli(capsys, "run", "--server", "127.0.0.1:1", "--db",
                     f"sqlite:///{tmp_path / 'h.db'}", *flags)
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def test_a_metrics_port_in_use_is_one_line_exit_2(capsys, tmp_path, busy_port):
    rc, _, err = cli(capsys, "run", "--server", "127.0.0.1:1", "--metrics-port",
                     str(busy_port), "--db", f"sqlite:///{tmp_path / 'h.db'}")
    assert rc == 2 and f"--metrics-port {busy_port}" in err and "in use" in err
    assert len(err.strip().splitlines()) == 1


def test_a_server_never_reached_says_so_and_exits_1(capsys, tmp_path):
    rc, out, _ = cli(capsys, "run", "--server", f"127.0.0.1:{_free_port()}", "--duration",
                     "0.2", "--interval", "0.1", "--decision-period", "0.1", "--db",
                     f"sqlite:///{tmp_path / 'h.db'}")
    assert rc == 1
    assert "never answered as an SGLang server" in out and "nothing learned or pushed" in out
    assert "left on v0 ?" not in out


def test_a_web_page_is_named_not_pasted():
    page = "<!doctype html><html><head><title>Grafana</title></head><body>" + "x" * 500
    client = SGLangClient("h:1", transport=httpx.MockTransport(
        lambda r: httpx.Response(404, text=page, headers={"content-type": "text/html"})))
    with pytest.raises(MalformedReplyError) as info:
        client.server_info()
    msg = str(info.value)
    assert "an HTML page titled 'Grafana', not SGLang's API" in msg and "<" not in msg


@pytest.mark.parametrize("argv", [
    ["run", "--server", "127.0.0.1:1", "--db", "/var/tmp/x.db"],
    ["report", "--db", "/var/tmp/x.db"],
])
def test_a_db_path_gets_a_url_hint(capsys, argv):
    rc, _, err = cli(capsys, *argv)
    assert rc == 2 and "write sqlite:////var/tmp/x.db" in err


def test_report_out_in_a_missing_folder_is_refused_and_nothing_is_created(capsys, tmp_path):
    db = f"sqlite:///{tmp_path / 'h.db'}"
    Storage(db).close()
    target = tmp_path / "missing" / "deeper" / "r.html"
    rc, _, err = cli(capsys, "report", "--db", db, "--format", "html", "--out", str(target))
    assert rc == 2 and "does not exist" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "missing").exists()


def test_bare_command_lists_the_commands(capsys):
    rc, _, err = cli(capsys)
    assert rc == 2
    for command in ("run", "report", "export", "sweep", "sglang-args"):
        assert f"\n    {command} " in err


def test_debug_log_level_and_format_work_after_the_command(capsys):
    with pytest.raises(ConfigError):  # --debug after the command: the traceback is shown
        main(["report", "--db", "nonsense", "--debug"])
    rc, _, err = cli(capsys, "report", "--db", "nonsense", "--log-format", "json",
                     "--log-level", "warning")
    assert rc == 2 and err.startswith("dynspec-tuner report: error:")


def test_negative_arm_lists_reach_the_flag_check(capsys):
    rc, _, err = cli(capsys, "sim", "--arms", "-1,3")
    assert rc == 2 and "--arms must be integers in 0..64, got (-1, 3)" in err


def test_json_logs_carry_no_traceback_without_debug():
    buf = io.StringIO()
    configure_logging(level="info", fmt="json", stream=buf)
    log = logging.getLogger("tuner.test")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("it failed")
    log.debug("hidden")
    lines = [json.loads(x) for x in buf.getvalue().splitlines()]
    assert [(d["level"], d["message"]) for d in lines] == [("error", "it failed")]
    assert lines[0]["error"] == "RuntimeError('boom')" and "exc" not in lines[0]
    buf2 = io.StringIO()
    configure_logging(level=None, fmt="json", debug=True, stream=buf2)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("again")
    assert "Traceback" in json.loads(buf2.getvalue().splitlines()[-1])["exc"]
    configure_logging(level="info", fmt="text")
    with pytest.raises(ValueError, match="log level"):
        configure_logging(level="loud")


class _Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


def test_healthz_starting_ok_then_stale():
    clock = _Clock()
    m = TunerMetrics(stale_after_s=30, clock=clock)
    with m.serve(port=0) as srv:
        url = srv.url.replace("/metrics", "/healthz")
        r = httpx.get(url)
        assert r.status_code == 503 and r.json()["status"] == "starting"
        m.set_up("a:1", True)
        m.record_tick()
        clock.t += 10
        r = httpx.get(url)
        assert r.status_code == 200
        assert r.json() == {"status": "ok", "last_tick_age_s": 10.0, "servers_up": 1,
                            "servers": 1, "history_ok": True}
        assert "dynspec_last_tick_age_seconds 10.0" in httpx.get(srv.url).text
        clock.t += 25
        r = httpx.get(url)
        assert r.status_code == 503 and r.json()["status"] == "stale"


def _status(*servers: ServerStatus) -> DaemonStatus:
    return DaemonStatus(ts=0.0, ticks=3, policy="model", dry_run=False, servers=servers,
                        storage_ok=True, buffered_rows=0, dropped_rows=0)


def _server(**kw) -> ServerStatus:
    base = dict(address="a:1", mode="plugin", up=True, arms=(0, 1, 3), version=7,
                server_table=((None, 3),), snapshot=None, last_push=None, last_error=None,
                down_since=None, observations=0, decode_steps=0, interval_goodput=math.nan,
                pushes=0, restarts=1, server_version=0)
    base.update(kw)
    return ServerStatus(**base)


def test_status_lines_show_the_servers_version_and_metrics_only_plainly():
    snap = PolicySnapshot("model", Buckets((4,)), (0, 3), (3, 0), ())
    plugin, metrics_only = status_lines(_status(
        _server(),
        _server(address="b:1", mode="metrics-only", server_table=None, snapshot=snap,
                server_version=None),
    ))
    assert plugin.startswith("a:1 plugin runs v0 rest:k3 |")  # not the daemon's v7
    assert "no decode steps this interval" in plugin and "- tok/s" not in plugin
    assert metrics_only.startswith("b:1 metrics-only (no plugin; nothing pushed) | best so far "
                                   "b<=4:k3 rest:k0 |")
    assert "v0" not in metrics_only and "?" not in metrics_only


def test_exit_lines_flag_never_reached_and_unclean_servers():
    lines, never = exit_lines(
        _status(_server(), _server(address="c:1", mode="connecting", up=False,
                                   server_table=None, last_error="refused")),
        {"a:1": "could not leave ..."},
    )
    assert never == ["c:1"]
    assert "NOT LEFT ON THE GREEDY TABLE" in lines[0]
    assert lines[1] == ("c:1: never answered as an SGLang server (refused); nothing learned or "
                        "pushed")
