"""Shared fixtures: a fresh history database on every backend the storage contract covers."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

POSTGRES_ENV = "DYNSPEC_TEST_POSTGRES_URL"


def postgres_base_url() -> str | None:
    """The test PostgreSQL URL; None (skip) on a developer machine without one. Under CI
    (``CI`` set) a missing server is a failure: PostgreSQL tests never silently skip there."""
    base = os.environ.get(POSTGRES_ENV)
    if base:
        return base
    if os.environ.get("CI"):
        pytest.fail(f"{POSTGRES_ENV} is not set under CI: start one with "
                    'eval "$(scripts/ci-postgres.sh)"')
    pytest.skip(f"{POSTGRES_ENV} is not set (CI runs these: scripts/ci-postgres.sh)")
    return None  # pragma: no cover


def postgres_schema_url(base: str, schema: str) -> str:
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}options=-csearch_path%3D{schema}"


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A URL to an empty schema of the test PostgreSQL server, dropped afterwards."""
    base = postgres_base_url()
    assert base is not None
    from sqlalchemy import create_engine, text

    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base)
    try:
        with admin.begin() as c:
            c.execute(text(f"CREATE SCHEMA {schema}"))
        yield postgres_schema_url(base, schema)
        with admin.begin() as c:
            c.execute(text(f"DROP SCHEMA {schema} CASCADE"))
    finally:
        admin.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty history database: an SQLite file in tmp_path, then a PostgreSQL schema.
    Tests taking it are the storage contract: they must pass on both."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'h.db'}"
    else:
        yield request.getfixturevalue("postgres_url")


@pytest.fixture(autouse=True)
def _restore_root_logging() -> Iterator[None]:
    """``main()`` configures logging for the process (level, handlers); in process, a test
    calling it must not change what later tests' caplog sees."""
    import logging

    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
    root.setLevel(level)
