"""Schema set-up for :class:`~storage.Storage`: creating the tables, checking the version,
and migrating an older history in place."""

from __future__ import annotations

import time

from sqlalchemy import inspect, select, text
from sqlalchemy.exc import SQLAlchemyError

from storage._binned import COVERING_INDEX, COVERING_INDEX_DDL
from storage._engine import StorageCore, log
from storage._models import (
    OBSERVATION_V2_COLUMNS,
    SCHEMA_VERSION,
    SERVER_V3_COLUMNS,
    Base,
    ObservationModel,
    SchemaVersionModel,
    ServerModel,
)
from tuner.errors import StorageError

__all__ = ["SchemaMixin"]


class SchemaMixin(StorageCore):
    """Creates, checks and migrates the history tables when a :class:`Storage` opens."""

    def _prepare(self) -> None:
        self._v2 = self._v3 = self._v4 = True
        if self.read_only:
            with self._session_scope("reading the schema version") as s:
                try:
                    row = s.get(SchemaVersionModel, 1)
                except SQLAlchemyError as exc:
                    raise self._error("no dynspec history here", exc) from exc
                self._check_version(row)
                # A read-only reader of an older history computes the same numbers from
                # the columns it has.
                self._v2 = row is None or row.version >= 2
                self._v3 = row is None or row.version >= 3
                self._v4 = row is None or row.version >= 4
            return
        try:
            Base.metadata.create_all(self._engine)
        except SQLAlchemyError as exc:
            raise self._error("cannot create the history tables", exc) from exc
        with self._session_scope("checking the database is writable") as s:
            row = s.get(SchemaVersionModel, 1)
            self._check_version(row)
            old = None if row is None else row.version
            if row is None:
                s.add(SchemaVersionModel(id=1, version=SCHEMA_VERSION, created_at=time.time()))
            else:
                # A no-op write: fails now, with a clear message, on a read-only or locked
                # file instead of on the daemon's first tick.
                s.execute(
                    SchemaVersionModel.__table__.update()
                    .where(SchemaVersionModel.id == 1)
                    .values(version=row.version)
                )
        if old is not None and old < SCHEMA_VERSION:
            self._migrate(old)
        if self._engine.dialect.name == "sqlite":
            self._ensure_covering_index()

    def _ensure_covering_index(self) -> None:
        """SQLite: the index :meth:`moments` reads time bins from without sorting (see
        ``storage._binned``). Built once, when a writer first opens a history without it:
        seconds on a million rows. Failing to build it (another writer holds the lock past
        the busy timeout) only slows reports down, so it is logged, not raised."""
        try:
            with self._engine.begin() as conn:
                exists = conn.execute(
                    text("SELECT 1 FROM sqlite_master WHERE type = 'index' AND name = :n"),
                    {"n": COVERING_INDEX},
                ).first()
                if exists is None:
                    start = time.monotonic()
                    conn.execute(text(COVERING_INDEX_DDL))
                    secs = time.monotonic() - start
                    if secs > 1.0:
                        log.info("%s: built the report index %s in %.1f s", self.url,
                                 COVERING_INDEX, secs)
        except SQLAlchemyError as exc:
            log.warning("%s: cannot build the report index %s (%s); reports will sort "
                        "instead", self.url, COVERING_INDEX, exc)

    def _migrate(self, old: int) -> None:
        """Bring a history of an older schema up to :data:`SCHEMA_VERSION` in place.

        v1 -> v2 adds observations' moment columns and roll-up marker (NULL moments mean
        "the row's own values", so no row is rewritten: instant on any size); v2 -> v3 adds
        the servers' model and since when (NULL: not known, all rows count); v3 -> v4 adds
        only tables (band observations, depth counts), which ``create_all`` made already.
        Safe against a second daemon migrating at the same time: PostgreSQL serialises on the
        version row; on SQLite a column the other one added first is seen on the retry.
        """
        for attempt in range(2):
            try:
                with self._engine.begin() as conn:
                    version = conn.scalar(
                        select(SchemaVersionModel.version)
                        .where(SchemaVersionModel.id == 1)
                        .with_for_update()  # ignored by SQLite, whose writers queue anyway
                    )
                    if version is None or version >= SCHEMA_VERSION:
                        return
                    for table, columns in (
                        (ObservationModel.__tablename__, OBSERVATION_V2_COLUMNS),
                        (ServerModel.__tablename__, SERVER_V3_COLUMNS),
                    ):
                        have = {c["name"] for c in inspect(conn).get_columns(table)}
                        for name, ddl in columns:
                            if name not in have:
                                conn.execute(
                                    text(f"ALTER TABLE {table} ADD COLUMN {name} {ddl}")
                                )
                    conn.execute(
                        SchemaVersionModel.__table__.update()
                        .where(SchemaVersionModel.id == 1)
                        .values(version=SCHEMA_VERSION)
                    )
                log.info("%s: history migrated from schema v%d to v%d", self.url, old,
                         SCHEMA_VERSION)
                return
            except SQLAlchemyError as exc:
                if attempt:
                    raise self._error(
                        f"cannot migrate the history from schema v{old} to v{SCHEMA_VERSION}",
                        exc,
                    ) from exc

    def _check_version(self, row: SchemaVersionModel | None) -> None:
        if row is not None and row.version > SCHEMA_VERSION:
            raise StorageError(
                f"{self.url}: the history uses schema v{row.version}, newer than this "
                f"dynspec-tuner understands (v{SCHEMA_VERSION}); upgrade dynspec-tuner"
            )

    @property
    def schema_version(self) -> int:
        with self._session_scope("reading the schema version") as s:
            row = s.get(SchemaVersionModel, 1)
            return SCHEMA_VERSION if row is None else row.version
