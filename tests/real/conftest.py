"""The real-server tier: SGLang 0.5.23's own server on CPU, our plugin and the daemon.

Run it with ``scripts/real-sglang.sh`` (builds the environment, runs this folder). Elsewhere
these tests skip, saying how to run them; with ``DYNSPEC_REQUIRE_REAL=1`` (the script, CI)
any skip or collection skip here is a failure, and so is a run in which none passed.

Servers are expensive (about 40 s to start on 2 cores), so tests share them: one session-wide
plugin server (:func:`plugin_server`) for everything that does not need its own flags; the
others are started by :func:`servers` and all of them are killed (process group, SIGKILL)
when the session ends, whatever happened.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from _server import HERE, RealServer, ServerSpec, need_server_env  # this folder is on sys.path

from tests._no_skip import NoSkips

RESULTS = Path(os.environ.get("DYNSPEC_REAL_RESULTS", HERE.parents[1] / "benchmarks" / "results"))


def pytest_configure(config):
    # An xfail is a reported known failure, not a skip: it stays visible as one.
    config.pluginmanager.register(
        NoSkips(HERE, "DYNSPEC_REQUIRE_REAL", "real-server test", let_xfail=True),
        "dynspec-no-skips-real",
    )


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("real")


# (name, server) for every server the session started, in order.
_STARTED: list[tuple[str, RealServer]] = []
_SHARED = {"plugin"}  # session-wide servers; any other belongs to the module that started it


@pytest.fixture(scope="module", autouse=True)
def _module_servers() -> Iterator[None]:
    """Servers a module started for itself stop when it ends: an idle SGLang scheduler still
    keeps a core busy, and two cores cannot carry four of them while later modules measure."""
    before = len(_STARTED)
    yield
    for name, server in _STARTED[before:]:
        if name not in _SHARED:
            server.kill()


@pytest.fixture(scope="session")
def servers(workdir) -> Iterator[Callable[..., RealServer]]:
    """``start(name, **spec fields) -> RealServer``; every server is killed at session end
    (the shared ones) or at the end of the module that started it (the others)."""
    need_server_env()
    first = len(_STARTED)

    def start(name: str, **fields) -> RealServer:
        server = RealServer(ServerSpec(workdir=workdir / name, **fields))
        _STARTED.append((name, server))
        return server.start()

    try:
        yield start
    finally:
        for _, server in _STARTED[first:]:
            server.kill()


@pytest.fixture(scope="session")
def plugin_server(servers) -> RealServer:
    """The shared server: plugin loaded, arms 0/1/3, per-position acceptance 0.5."""
    return servers("plugin", alpha=0.5)


@pytest.fixture(scope="session")
def results_dir() -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    return RESULTS


@pytest.fixture(scope="session")
def history_db(workdir) -> Path:
    """The history the tier's shared daemon run writes (export and report read it)."""
    return workdir / "history.db"


@pytest.fixture(scope="session")
def learned(plugin_server, history_db, workdir) -> dict:
    """The daemon run against the shared server under load until it has pushed three tables:
    its log, the server's readout before and after, and the versions seen meanwhile."""
    from _drive import Load, Tuner, pushed_versions, tuner_args, watch_versions
    from _server import readout, wait_for

    url = plugin_server.url
    start = readout(url)
    log_path = workdir / "daemon-learn.log"
    with Load(url, 3, seed=1), Tuner(tuner_args(plugin_server, history_db), log_path) as tuner:
        wait_for(lambda: len(pushed_versions(tuner.log())) >= 3, 150, "three pushes")
        seen = watch_versions(url, 6)
        tuner.stop()
    return {"start": start, "end": readout(url), "seen": seen, "log": tuner.log()}
