"""A test tier that must not skip (CI): with its environment variable set to 1, a skip or a
collection skip of a test in the tier's folder is a failure, and so is a run in which none of
its tests passed. The tier's conftest registers one :class:`NoSkips` in ``pytest_configure``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


class NoSkips:
    """Args:
    folder: the tier's folder; only its tests are held to this.
    env: the variable that turns it on (``env=1``).
    what: the tier's tests in words, for the no-test-passed line.
    let_xfail: let an xfail through (a reported known failure, not a skip).
    """

    def __init__(self, folder: str | Path, env: str, what: str, *, let_xfail: bool) -> None:
        self.folder = str(folder)
        self.env = env
        self.what = what
        self.let_xfail = let_xfail
        self.on = os.environ.get(env) == "1"

    def _ours(self, path: object) -> bool:
        return str(path).startswith(self.folder)

    def _fail_skip(self, report, where: object) -> None:
        if not (self.on and report.skipped and self._ours(where)):
            return
        if self.let_xfail and hasattr(report, "wasxfail"):
            return
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped under {self.env}=1: {reason}"

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        self._fail_skip(outcome.get_result(), item.path)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_make_collect_report(self, collector):
        outcome = yield
        # A module-level importorskip skips at collection, before any test report exists.
        self._fail_skip(outcome.get_result(), getattr(collector, "path", ""))

    def pytest_sessionfinish(self, session, exitstatus):
        if not self.on or exitstatus != 0:
            return
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        root = session.config.rootpath
        passed = [
            r
            for r in (reporter.stats.get("passed", []) if reporter else [])
            if self._ours(root / r.nodeid.split("::")[0])
        ]
        if not passed:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
            if reporter:
                reporter.write_line(f"{self.env}=1 but no {self.what} passed", red=True)
