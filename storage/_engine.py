"""The database connection behind :class:`~storage.Storage`: URL handling, the engine and
its SQLite pragmas, the one transaction scope, and failures turned into
:class:`~tuner.errors.StorageError`."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Self

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from tuner.errors import StorageError

__all__ = ["DEFAULT_BUSY_TIMEOUT_S", "DEFAULT_URL", "StorageCore", "redact_url"]

# One logger for the whole history package, as before it was split into modules.
log = logging.getLogger("storage._storage")

DEFAULT_URL = "sqlite:///dynspec.db"
# How long a SQLite writer waits for another one before the write fails as "locked".
DEFAULT_BUSY_TIMEOUT_S = 5.0

_PASSWORD_IN_URL = re.compile(r"(://[^:/@]*:)[^@]*(@)")


def redact_url(url: str) -> str:
    """The URL with any password replaced by ``***`` (safe for logs and errors)."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # an unparsable URL still must not leak what looks like a password
        return _PASSWORD_IN_URL.sub(r"\1***\2", url)


def _explain(exc: BaseException) -> str:
    """A short, human reason for a database failure (first line of the driver's message)."""
    orig = getattr(exc, "orig", None) or exc
    text = str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__
    low = text.lower()
    if "locked" in low or "could not obtain lock" in low:
        return f"the database is locked by another writer ({text})"
    if "readonly" in low or "read-only" in low or "read only" in low:
        # SQLite also needs to write its -wal/-journal files beside the database.
        return (f"the database, or the folder it is in, is read-only for this user ({text}); "
                "make both writable or point --db elsewhere")
    if "unable to open" in low:
        return (f"cannot open the database file ({text}): its folder must exist and be "
                "writable by this user")
    return text


class StorageCore:
    """What every part of :class:`~storage.Storage` stands on: the engine, sessions, the
    schema flags and error translation. Private; the concerns are mixins over it."""

    _raw_url: str
    url: str
    read_only: bool
    _engine: Engine
    _sessions: sessionmaker[Session]
    # Whether the history has schema v2's observation columns (moments, roll-up marker) and
    # v3's server columns (model) and v4's acceptance tables; only a read-only look at an
    # older history lacks them.
    _v2: bool
    _v3: bool
    _v4: bool

    def _open(self, url: str, *, busy_timeout_s: float, read_only: bool, echo: bool) -> None:
        self._raw_url = url
        self.url = redact_url(url)
        self.read_only = read_only
        self._engine = self._create_engine(url, busy_timeout_s, echo)
        self._sessions = sessionmaker(self._engine, expire_on_commit=False)

    def _error(self, what: str, exc: BaseException) -> StorageError:
        msg = f"{self.url}: {what}: {_explain(exc)}"
        path = self._sqlite_path()
        if path and "unable to open" in msg and os.path.exists(path) and not os.access(
            path, os.W_OK
        ):
            # SQLite says "unable to open" when WAL's side files cannot be created.
            msg += " - the file or its filesystem is read-only"
        password = None
        try:
            password = make_url(self._raw_url).password
        except Exception:
            pass
        if password:
            msg = msg.replace(str(password), "***")
        return StorageError(msg)

    def _create_engine(self, url: str, busy_timeout_s: float, echo: bool) -> Engine:
        try:
            parsed = make_url(url)
        except ArgumentError as exc:
            raise StorageError(f"{self.url}: not a database URL ({exc})") from exc
        is_sqlite = parsed.get_backend_name() == "sqlite"
        if parsed.drivername == "postgresql":
            # A bare postgresql:// means psycopg2 to SQLAlchemy; our `postgres` extra installs
            # psycopg 3, so use it unless psycopg2 is there.
            try:
                import psycopg2  # noqa: F401
            except ImportError:
                parsed = parsed.set(drivername="postgresql+psycopg")
        kwargs: dict[str, Any] = {"echo": echo}
        if is_sqlite:
            kwargs["connect_args"] = {"timeout": busy_timeout_s}
        else:
            kwargs["pool_pre_ping"] = True
        try:
            engine = create_engine(parsed, **kwargs)
        except (SQLAlchemyError, ImportError) as exc:
            raise self._error("cannot use this database (is its driver installed?)", exc) from exc
        if is_sqlite:
            busy_ms = int(busy_timeout_s * 1000)

            @event.listens_for(engine, "connect")
            def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
                cur = dbapi_conn.cursor()
                try:
                    cur.execute(f"PRAGMA busy_timeout={busy_ms}")
                    cur.execute("PRAGMA foreign_keys=ON")
                    if parsed.database and parsed.database != ":memory:":
                        # WAL: readers and one writer never block each other.
                        cur.execute("PRAGMA journal_mode=WAL")
                        cur.execute("PRAGMA synchronous=NORMAL")
                finally:
                    cur.close()

        return engine

    @contextmanager
    def _session_scope(self, what: str) -> Iterator[Session]:
        """One transaction: commit on success, roll back and raise StorageError on failure."""
        session = self._sessions()
        try:
            yield session
            session.commit()
        except (SQLAlchemyError, OverflowError) as exc:  # sqlite3 raises the latter raw
            try:
                session.rollback()
            except SQLAlchemyError:
                pass
            raise self._error(what, exc) from exc
        except BaseException:
            try:
                session.rollback()
            except SQLAlchemyError:
                pass
            raise
        finally:
            session.close()

    def _refuse_if_read_only(self, what: str) -> None:
        if self.read_only:
            raise StorageError(f"{self.url}: opened read-only, cannot {what}")

    def _sqlite_path(self) -> str | None:
        try:
            parsed = make_url(self._raw_url)
        except Exception:
            return None
        if parsed.get_backend_name() != "sqlite" or not parsed.database:
            return None
        db = parsed.database
        return None if db == ":memory:" or db.startswith("file:") else db

    def close(self) -> None:
        """Release the connection pool."""
        self._engine.dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
