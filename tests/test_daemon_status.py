"""What `run` shows: the live view and the plain lines, from real daemon ticks."""

from __future__ import annotations

import logging

import httpx
from rich.console import Console

from policies import Buckets
from tuner.client import SGLangClient
from tuner.config import TunerConfig
from tuner.daemon import Daemon
from tuner.status import ProcessStats, StatusView, render_status, status_lines

from tests.test_daemon import A, FakeClock, FakeServer

STATS = ProcessStats(cpu_percent=0.7, rss_mb=61.0)


def ticked_daemon():
    srv, clock = FakeServer(), FakeClock()
    cfg = TunerConfig(servers=(A,), interval_s=1.0, decision_period_s=2.0, buckets=(4, 16))
    d = Daemon(cfg, storage=None, clients={A: SGLangClient(A, transport=httpx.MockTransport(srv))},
               clock=clock)
    d.run_once()
    for b in (2, 8, 2, 8, 2, 8):
        srv.decode(b, 200)
        clock.advance(1.0)
        d.run_once()
    return d, srv


def test_live_view_shows_buckets_arms_estimates_push_and_own_footprint():
    d, srv = ticked_daemon()
    console = Console(width=160, record=True, force_terminal=False)
    console.print(render_status(d.status(), STATS))
    text = console.export_text()
    assert A in text and "plugin" in text and "arms 0,1,3" in text
    assert "daemon cpu 0.7%" in text and "rss 61 MB" in text
    assert "last push v" in text
    buckets = Buckets((4, 16))
    # A row per bucket that saw traffic, with an estimate for the arms that ran there.
    assert buckets.label(0) + " " in text or f" {buckets.label(0)} " in text
    assert "k=0 tok/s (steps)" in text and "k=3 tok/s (steps)" in text
    assert "±" in text
    assert ">16" not in text  # no traffic there, no row


def test_plain_lines_and_their_spacing(caplog):
    d, _ = ticked_daemon()
    (line,) = status_lines(d.status(), STATS)
    assert line.startswith(f"{A} plugin runs v") and "greedy" in line and "steps" in line
    view = StatusView(Console(record=True), live=False, plain_every_s=10.0,
                      stats=lambda: STATS)
    status = d.status()
    with caplog.at_level(logging.INFO, logger="tuner.status"), view:
        view.update(status)
        view.update(status)  # same daemon time: not again
    assert len([r for r in caplog.records if r.name == "tuner.status"]) == 1


def test_down_server_line_names_the_error():
    srv, clock = FakeServer(), FakeClock()
    srv.down = True
    cfg = TunerConfig(servers=(A,))
    d = Daemon(cfg, storage=None, clients={A: SGLangClient(A, transport=httpx.MockTransport(srv))},
               clock=clock)
    d.run_once()
    (line,) = status_lines(d.status())
    assert "DOWN" in line and "cannot reach the server" in line
    console = Console(width=160, record=True)
    console.print(render_status(d.status()))
    assert "DOWN" in console.export_text()
