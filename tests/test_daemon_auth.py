"""A wrong admin key: every push is refused, and the daemon says so once (the real-server
tier checks the same against SGLang; here the simulator gates updates as SGLang does)."""

from __future__ import annotations

import logging

from tests._fakes import FakeClock
from tuner.config import TunerConfig
from tuner.daemon import Daemon
from tuner.sim.server import SimServer


def test_a_wrong_key_is_said_once_however_many_tables_are_refused(caplog):
    sim_clock, clock = FakeClock(0.0), FakeClock()
    with SimServer(load="8", speed=1.0, clock=sim_clock, seed=1, admin_api_key="right") as sim:
        posts = []

        def record(req, call_next):
            if req.path == "/set_internal_state":
                posts.append(req.headers.get("authorization"))
            return call_next(req)

        sim.interceptors.insert(0, record)
        config = TunerConfig(servers=(f"127.0.0.1:{sim.port}",), interval_s=1.0,
                             decision_period_s=2.0, policy="thompson", seed=0,
                             db_url="sqlite:///unused.db", api_key="wrong")  # fmt: skip
        d = Daemon(config, storage=None, clock=clock)
        with caplog.at_level(logging.WARNING, logger="tuner.daemon"):
            for _ in range(120):  # two minutes: new tables, and the backoff passes twice
                sim_clock.t += 1.0
                with sim.lock:
                    sim.engine.run_until(sim.virtual_now())
                clock.t += 1.0
                d.run_once()
        d.shutdown()
    said = [r.getMessage() for r in caplog.records
            if "API key" in r.getMessage() and "refused" in r.getMessage()
            and "could not leave" not in r.getMessage()]  # fmt: skip
    refused_while_running = len(posts) - 1  # the last one is the stop's greedy table
    assert refused_while_running >= 2, posts
    assert len([m for m in said if "push of" in m]) == 1, said
    assert "HTTP 401" in said[0]
