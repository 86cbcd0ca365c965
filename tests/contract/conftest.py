"""Contract tests: the plugin against SGLang 0.5.23's own classes (CPU).

They need the contract environment (``scripts/contract-env.sh`` builds it and prints its
path). Elsewhere they skip, saying so; with ``DYNSPEC_REQUIRE_CONTRACT=1`` (CI) any skip or
collection skip in this directory is a failure, and so is a run in which none passed.

The session loads the plugin the way every SGLang process does, through
``sglang.srt.plugins.load_plugins()`` and the installed entry point, so the tests below meet
the classes exactly as a server patches them.
"""

from __future__ import annotations

import os

import pytest

REQUIRE = os.environ.get("DYNSPEC_REQUIRE_CONTRACT") == "1"
HERE = os.path.dirname(os.path.abspath(__file__))


def _ours(path: object) -> bool:
    return str(path).startswith(HERE)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if REQUIRE and report.skipped and _ours(item.path):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped under DYNSPEC_REQUIRE_CONTRACT=1: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    # A module-level importorskip skips at collection, before any test report exists.
    if REQUIRE and report.skipped and _ours(getattr(collector, "path", "")):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped under DYNSPEC_REQUIRE_CONTRACT=1: {reason}"


def pytest_sessionfinish(session, exitstatus):
    if not REQUIRE or exitstatus != 0:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    root = session.config.rootpath
    passed = [
        r
        for r in (reporter.stats.get("passed", []) if reporter else [])
        if _ours(root / r.nodeid.split("::")[0])
    ]
    if not passed:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if reporter:
            reporter.write_line("DYNSPEC_REQUIRE_CONTRACT=1 but no contract test passed", red=True)


@pytest.fixture(scope="session")
def sglang_plugin():
    """SGLang's ``load_plugins()`` run once, as every SGLang process runs it first thing."""
    from _contract_env import need

    need()
    from sglang.srt.plugins import load_plugins

    from tuner.plugin import _sglang

    load_plugins()
    assert _sglang._RT.registered, f"the dynspec entry point did not run: {_sglang._RT}"
    return _sglang


@pytest.fixture
def published():
    """A published SGLang config (what a scheduler process has), restored afterwards."""
    from _contract_env import publish

    with publish() as server_args:
        yield server_args
