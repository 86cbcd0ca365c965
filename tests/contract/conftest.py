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

from tests._no_skip import NoSkips

HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_configure(config):
    config.pluginmanager.register(
        NoSkips(HERE, "DYNSPEC_REQUIRE_CONTRACT", "contract test", let_xfail=False),
        "dynspec-no-skips-contract",
    )


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
