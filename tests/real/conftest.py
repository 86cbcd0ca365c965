"""The real-server tier: SGLang 0.5.23's own server on CPU, our plugin and the daemon.

Run it with ``scripts/real-sglang.sh`` (builds the environment, runs this folder). Elsewhere
these tests skip, saying how to run them; with ``DYNSPEC_REQUIRE_REAL=1`` (the script, CI)
any skip or collection skip here is a failure, and so is a run in which none passed.

Servers are expensive (about 40 CPU-seconds to start), so tests share them: one session-wide
plugin server (:func:`plugin_server`) for everything that does not need its own flags; the
others are started by :func:`servers` (``servers.spawn`` launches one without waiting, so a
module can start two at once) and all of them are killed (process group, SIGKILL) when their
module or the session ends, whatever happened. The session ends with a summary line: server
starts, the seconds spent waiting for them, and CPU seconds (servers, tests, daemons).
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from _server import HERE, RealServer, ServerSpec, need_server_env  # this folder is on sys.path

from tests._no_skip import NoSkips

# Where the tier writes its figures: $DYNSPEC_RESULTS_DIR, or a fresh folder under pytest's
# temporary directory; never the checkout (copy the ones to keep into benchmarks/results/).
_RESULTS: list[Path] = []


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
    """Servers a module started for itself stop when it ends (about 2.6 GB each; idle, with
    ``--sleep-on-idle``, they cost no CPU)."""
    before = len(_STARTED)
    yield
    for name, server in _STARTED[before:]:
        if name not in _SHARED:
            server.kill()


class Servers:
    """``servers(name, **spec fields) -> RealServer`` started and healthy;
    ``servers.spawn(name, **fields)`` launches it without waiting, and a later
    ``servers(name)`` waits for that one. Every server is killed at session end (the shared
    ones) or at the end of the module that launched it (the others)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self._spawned: dict[str, RealServer] = {}

    def spawn(self, name: str, **fields) -> RealServer:
        server = RealServer(ServerSpec(workdir=self.workdir / name, **fields))
        _STARTED.append((name, server))
        self._spawned[name] = server.spawn()
        return server

    def __call__(self, name: str, **fields) -> RealServer:
        server = self._spawned.pop(name, None)
        if server is None or server.proc is None:  # not launched, or its module ended
            server = self.spawn(name, **fields)
            self._spawned.pop(name)
        elif fields:
            raise ValueError(f"server {name!r} was spawned already; fields go to spawn()")
        return server.wait_ready()


@pytest.fixture(scope="session")
def servers(workdir) -> Iterator[Servers]:
    need_server_env()
    first = len(_STARTED)
    try:
        yield Servers(workdir)
    finally:
        for _, server in _STARTED[first:]:
            server.kill()


def pytest_terminal_summary(terminalreporter):
    """What the tier cost: server starts, time waiting for them, CPU seconds."""
    import _server

    for folder in _RESULTS:
        terminalreporter.write_line(f"real-server figures written to {folder}")
    if not _server.STARTED:
        return
    for server in _server.STARTED:  # all dead by now (their fixtures ended): a no-op
        server.kill()
    starts = [s for server in _server.STARTED for s in server.start_s]
    server_cpu = sum(server.cpu_s for server in _server.STARTED)
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)  # daemons, CLI runs, server leaders
    rest = (own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
            - sum(server.leader_cpu_s for server in _server.STARTED))
    names = ", ".join(f"{s.spec.workdir.name} x{len(s.start_s)}" for s in _server.STARTED)
    terminalreporter.write_line(
        f"real servers: {len(starts)} starts ({names}); {sum(starts):.0f} s from launch to "
        f"healthy or, if launched ahead, to first use, summed (longest "
        f"{max(starts, default=0):.0f} s); CPU {server_cpu:.0f} s "
        f"in servers + {rest:.0f} s in tests, daemons and CLI runs"
    )


@pytest.fixture(scope="session")
def plugin_server(servers) -> RealServer:
    """The shared server: plugin loaded, arms 0/1/3, per-position acceptance 0.5."""
    return servers("plugin", alpha=0.5)


@pytest.fixture(scope="session")
def results_dir(tmp_path_factory) -> Path:
    env = os.environ.get("DYNSPEC_RESULTS_DIR")
    folder = Path(env) if env else tmp_path_factory.mktemp("results")
    folder.mkdir(parents=True, exist_ok=True)
    _RESULTS.append(folder)
    return folder


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
