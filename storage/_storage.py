"""The one storage class: SQLAlchemy 2 over SQLite (default) or PostgreSQL."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from sqlalchemy import (
    BigInteger,
    Double,
    Engine,
    Integer,
    Select,
    cast,
    create_engine,
    delete,
    event,
    func,
    insert,
    inspect,
    literal,
    or_,
    select,
    text,
)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker, undefer

from storage._models import (
    OBSERVATION_V2_COLUMNS,
    SCHEMA_VERSION,
    SERVER_V3_COLUMNS,
    Base,
    EventModel,
    ObservationModel,
    PolicyVersionModel,
    SchemaVersionModel,
    ServerModel,
)
from storage._records import (
    EventRecord,
    ObservationAggregate,
    ObservationMoments,
    ObservationRecord,
    PolicyVersionRecord,
    ServerRecord,
    ServerSeen,
    Table,
)
from tuner.errors import StorageError

__all__ = [
    "DEFAULT_BUSY_TIMEOUT_S",
    "DEFAULT_URL",
    "DEFAULT_WARM_START_ROWS",
    "Storage",
    "redact_url",
]

_log = logging.getLogger(__name__)

DEFAULT_URL = "sqlite:///dynspec.db"
# How long a SQLite writer waits for another one before the write fails as "locked".
DEFAULT_BUSY_TIMEOUT_S = 5.0
# Warm start replays at most this many of a server's latest observations: with a discounted
# policy older evidence weighs next to nothing, and the replay stays well under a second.
DEFAULT_WARM_START_ROWS = 50_000

# Storage.moments on SQLite: floor(x) = CAST(x + shift AS INTEGER) - shift for x > -shift.
_BIN_SHIFT = 1 << 30

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


class Storage:
    """History of servers, observations, policy versions and events.

    Thread-safe: every method opens and closes its own session. Records returned are frozen
    and never change after later writes. Every database failure surfaces as
    :class:`~tuner.errors.StorageError` naming the URL with its password redacted.

    Args:
        url: an SQLAlchemy URL; SQLite files run in WAL mode so readers (reports) never
            block the daemon's writes.
        busy_timeout_s: how long a SQLite write waits for a competing writer.
        read_only: for readers (reports, export): neither creates tables nor checks that
            the database is writable.

    Raises:
        StorageError: the URL cannot be parsed or opened, its driver is missing, the file
            is read-only or locked (unless ``read_only``), or its schema is newer than ours.
    """

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S,
        read_only: bool = False,
        echo: bool = False,
    ) -> None:
        self._raw_url = url
        self.url = redact_url(url)
        self.read_only = read_only
        self._engine = self._create_engine(url, busy_timeout_s, echo)
        self._sessions = sessionmaker(self._engine, expire_on_commit=False)
        try:
            self._prepare()
        except BaseException:
            self._engine.dispose()
            raise

    # --- plumbing ---------------------------------------------------------------------------

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

    def _prepare(self) -> None:
        # Whether observations have schema v2's columns (moments, roll-up marker); a
        # read-only reader of a v1 history computes the same numbers from v1's columns.
        self._v2 = self._v3 = True
        if self.read_only:
            with self._session_scope("reading the schema version") as s:
                try:
                    row = s.get(SchemaVersionModel, 1)
                except SQLAlchemyError as exc:
                    raise self._error("no dynspec history here", exc) from exc
                self._check_version(row)
                self._v2 = row is None or row.version >= 2
                self._v3 = row is None or row.version >= 3
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

    def _migrate(self, old: int) -> None:
        """Bring a history of an older schema up to :data:`SCHEMA_VERSION` in place.

        v1 -> v2 adds observations' moment columns and roll-up marker (NULL moments mean
        "the row's own values", so no row is rewritten: instant on any size); v2 -> v3 adds
        the servers' model and since when (NULL: not known, all rows count). Safe against
        a second daemon migrating at the same time: PostgreSQL serialises on the version
        row; on SQLite a column the other one added first is seen on the retry.
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
                _log.info("%s: history migrated from schema v%d to v%d", self.url, old,
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

    def __enter__(self) -> Storage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    def _row_moments(self) -> tuple[Any, Any, Any, Any]:
        """SQL for one stored row's ``(intervals, Σe², Σe·t, Σt²)``, to be summed.

        A fresh row is one interval whose moments are its own values (its columns are
        NULL); a rolled-up row carries the sums of the rows it merged.
        """
        o = ObservationModel
        # Products as doubles: SQLite's integer SUM raises on overflow.
        e = cast(o.emitted_tokens, Double)
        t = o.busy_s
        if not self._v2:  # read-only over a v1 history: nothing was ever rolled up
            return cast(1, BigInteger), e * e, e * t, t * t
        return (
            o.n_intervals,
            func.coalesce(o.emitted_sq, e * e),
            func.coalesce(o.emitted_busy, e * t),
            func.coalesce(o.busy_sq, t * t),
        )

    def _fresh_only(self, q: Any) -> Any:
        """``q`` without rolled-up rows (live pool readers: their content was read fresh)."""
        return q.where(ObservationModel.rollup_bin_s.is_(None)) if self._v2 else q

    @property
    def schema_version(self) -> int:
        with self._session_scope("reading the schema version") as s:
            row = s.get(SchemaVersionModel, 1)
            return SCHEMA_VERSION if row is None else row.version

    # --- writing ----------------------------------------------------------------------------

    def _server_ids(
        self, s: Session, addresses: Iterable[str], seen: Sequence[ServerSeen]
    ) -> dict[str, int]:
        wanted = set(addresses) | {x.address for x in seen}
        if not wanted:
            return {}
        rows = {
            m.address: m
            for m in s.scalars(self._servers_query().where(ServerModel.address.in_(wanted)))
        }
        for x in seen:
            m = rows.get(x.address)
            arms = json.dumps(sorted(int(a) for a in x.arms))
            if m is None:
                m = ServerModel(
                    address=x.address,
                    arms_json=arms,
                    first_seen=x.seen_at,
                    last_seen=x.seen_at,
                    started_at=x.started_at,
                    start_times_json=json.dumps([] if x.started_at is None else [x.started_at]),
                    pool=x.pool,
                    model=x.model,
                )
                s.add(m)
                rows[x.address] = m
                continue
            m.last_seen = max(m.last_seen, x.seen_at)
            m.arms_json = arms
            if x.pool is not None:
                m.pool = x.pool
            if x.model is not None and x.model != m.model:
                # A model first named keeps the rows before it (they are taken to be its);
                # another model starts its own stretch of history.
                if m.model is not None:
                    m.model_since = x.seen_at
                m.model = x.model
            if x.started_at is not None and x.started_at != m.started_at:
                starts = json.loads(m.start_times_json or "[]")
                if x.started_at not in starts:
                    starts.append(x.started_at)
                    m.start_times_json = json.dumps(starts)
                m.started_at = x.started_at
        for address in wanted - rows.keys():
            # Rows about a server never announced with a ServerSeen: register it bare.
            m = ServerModel(
                address=address,
                arms_json="[]",
                first_seen=time.time(),
                last_seen=time.time(),
                start_times_json="[]",
            )
            s.add(m)
            rows[address] = m
        s.flush()
        return {a: m.id for a, m in rows.items()}

    def record_tick(
        self,
        *,
        servers: Sequence[ServerSeen] = (),
        observations: Sequence[ObservationRecord] = (),
        policy_versions: Sequence[PolicyVersionRecord] = (),
        events: Sequence[EventRecord] = (),
    ) -> None:
        """Write everything one tick produced in a single transaction (all or nothing).

        Raises:
            StorageError: nothing was written; the caller may retry the same rows later.
        """
        if not (servers or observations or policy_versions or events):
            return
        if self.read_only:
            raise StorageError(f"{self.url}: opened read-only, cannot record")
        addresses = (
            {o.server for o in observations}
            | {p.server for p in policy_versions}
            | {e.server for e in events if e.server is not None}
        )
        with self._session_scope("recording a tick") as s:
            ids = self._server_ids(s, addresses, servers)
            if observations:
                s.execute(
                    insert(ObservationModel),
                    [
                        {
                            "server_id": ids[o.server],
                            "ts": o.ts,
                            "b": o.b,
                            "k": o.k,
                            "decode_steps": o.decode_steps,
                            "emitted_tokens": o.emitted_tokens,
                            "accepted_drafts": o.accepted_drafts,
                            "drafted_tokens": o.drafted_tokens,
                            "busy_s": o.busy_s,
                        }
                        for o in observations
                    ],
                )
            if policy_versions:
                s.execute(
                    insert(PolicyVersionModel),
                    [
                        {
                            "server_id": ids[p.server],
                            "ts": p.ts,
                            "version": p.version,
                            "table_json": json.dumps([[b, k] for b, k in p.table]),
                            "policy": p.policy,
                            "reason": p.reason,
                            "outcome": p.outcome,
                        }
                        for p in policy_versions
                    ],
                )
            if events:
                s.execute(
                    insert(EventModel),
                    [
                        {
                            "server_id": None if e.server is None else ids[e.server],
                            "ts": e.ts,
                            "kind": e.kind,
                            "detail": e.detail,
                        }
                        for e in events
                    ],
                )

    def rollup(self, *, older_than: float, bin_s: float, server: str | None = None) -> int:
        """Merge old observations so the history stays bounded; returns the rows removed
        (the table's net shrink).

        Rows recorded before ``older_than`` (epoch seconds, rounded down to a multiple of
        ``bin_s`` so only whole bins are merged) become one row per ``(server, time bin,
        b, k)`` with bins ``floor(ts / bin_s)`` (hours of UTC for 3600): counters and busy
        seconds summed, stamped with the time of the last interval merged, and carrying the
        interval count and the sums ``Σe²``, ``Σe·t``, ``Σt²`` over the intervals merged.
        Every total, and every figure :meth:`aggregate` and :meth:`moments` give over
        windows that do not cut a bin, is therefore exactly what the raw rows gave (so are
        the report's estimates and 95 % intervals). Rows rolled up into a smaller bin are
        merged again into ``bin_s`` bins; rows already at ``bin_s`` or coarser stay as
        they are, so calling it again is cheap and changes nothing.

        One transaction, in SQL (``INSERT ... SELECT ... GROUP BY``, then ``DELETE``), per
        server so it uses the ``(server, ts)`` index. Readers never block; on PostgreSQL
        writers of observations wait for it (a table lock: a row committed while it runs
        is neither lost nor merged twice, and two daemons rolling up at once serialise).

        Live pool readers (:meth:`pool_observations`) skip rolled-up rows, which get new
        ids: a reader that has read the merged rows counts nothing twice. It must have read
        them before they were rolled up, which a reader following a pool tick by tick has
        (rows reach the database within the tick that observed them) unless ``older_than``
        is within a tick of now - or rows were held back by a history outage longer than
        the age they are rolled up at.

        Raises:
            ValueError: ``bin_s`` not a positive number or ``older_than`` not finite.
            StorageError: the history is read-only or the write failed (nothing changed).
        """
        if not (isinstance(bin_s, (int, float)) and math.isfinite(bin_s) and bin_s > 0):
            raise ValueError(f"bin_s must be a positive number of seconds, got {bin_s!r}")
        if not (isinstance(older_than, (int, float)) and math.isfinite(older_than)):
            raise ValueError(f"older_than must be a finite epoch time, got {older_than!r}")
        if self.read_only:
            raise StorageError(f"{self.url}: opened read-only, cannot roll up")
        bin_s = float(bin_s)
        cutoff = math.floor(older_than / bin_s) * bin_s
        o = ObservationModel
        if self._engine.dialect.name == "sqlite":
            bin_expr: Any = cast(o.ts / bin_s + _BIN_SHIFT, BigInteger) - _BIN_SHIFT
        else:
            bin_expr = cast(func.floor(o.ts / bin_s), BigInteger)
        intervals, ee, et, tt = self._row_moments()
        columns = (
            "server_id", "ts", "b", "k", "decode_steps", "emitted_tokens", "accepted_drafts",
            "drafted_tokens", "busy_s", "n_intervals", "emitted_sq", "emitted_busy", "busy_sq",
            "rollup_bin_s",
        )
        inserted = deleted = 0
        with self._session_scope("rolling up old observations") as s:
            if self._engine.dialect.name == "postgresql":
                # Conflicts with inserts and with itself, not with readers.
                s.execute(text(f"LOCK TABLE {o.__tablename__} IN SHARE ROW EXCLUSIVE MODE"))
            else:
                # SQLite: take the single writer's lock first (a no-op write), so nothing
                # commits between reading ``top`` and the merge.
                s.execute(
                    SchemaVersionModel.__table__.update()
                    .where(SchemaVersionModel.id == 1)
                    .values(version=SchemaVersionModel.version)
                )
            ids = select(ServerModel.id).order_by(ServerModel.id)
            if server is not None:
                ids = ids.where(ServerModel.address == server)
            server_ids = list(s.scalars(ids))
            # Rows above this id (SQLite: committed after it was read) wait for the next
            # roll-up; the merged rows, inserted above it, are never deleted below.
            top = s.scalar(select(func.max(o.id)))
            if top is None:
                return 0
            for sid in server_ids:
                old = (
                    o.server_id == sid,
                    o.ts < cutoff,
                    o.id <= top,
                    or_(o.rollup_bin_s.is_(None), o.rollup_bin_s < bin_s),
                )
                merged = (
                    select(
                        o.server_id,
                        func.max(o.ts),
                        o.b,
                        o.k,
                        func.sum(o.decode_steps),
                        func.sum(o.emitted_tokens),
                        func.sum(o.accepted_drafts),
                        func.sum(o.drafted_tokens),
                        func.sum(o.busy_s),
                        func.sum(intervals),
                        func.sum(ee),
                        func.sum(et),
                        func.sum(tt),
                        cast(literal(bin_s), Double),
                    )
                    .where(*old)
                    .group_by(o.server_id, bin_expr, o.b, o.k)
                )
                # Core statements on the table: nothing for the ORM to synchronise.
                table = o.__table__
                s.execute(insert(table).from_select(columns, merged))
                deleted += s.execute(delete(table).where(*old)).rowcount
            # Counted, not taken from the INSERT's rowcount (-1 for INSERT ... SELECT on
            # PostgreSQL through SQLAlchemy); everything above ``top`` is ours (table lock /
            # SQLite's single writer).
            inserted = int(s.scalar(select(func.count()).select_from(o).where(o.id > top)) or 0)
        if deleted:
            _log.info("%s: rolled up %d observations before %.0f into %d rows of %g s",
                      self.url, deleted, cutoff, inserted, bin_s)
        return deleted - inserted

    # --- reading ----------------------------------------------------------------------------

    def _server_record(self, m: ServerModel) -> ServerRecord:
        v3 = self._v3  # an unmigrated history read read-only has no model columns
        return ServerRecord(
            address=m.address,
            arms=tuple(json.loads(m.arms_json or "[]")),
            first_seen=m.first_seen,
            last_seen=m.last_seen,
            started_at=m.started_at,
            start_times=tuple(json.loads(m.start_times_json or "[]")),
            pool=m.pool,
            model=m.model if v3 else None,
            model_since=m.model_since if v3 else None,
        )

    def servers(self) -> list[ServerRecord]:
        """Every server ever recorded, by address."""
        with self._session_scope("reading servers") as s:
            return [
                self._server_record(m)
                for m in s.scalars(self._servers_query().order_by(ServerModel.address))
            ]

    def server(self, address: str) -> ServerRecord | None:
        with self._session_scope("reading a server") as s:
            m = s.scalars(self._servers_query().where(ServerModel.address == address)).first()
            return None if m is None else self._server_record(m)

    def _servers_query(self) -> Select[tuple[ServerModel]]:
        q = select(ServerModel)
        if self._v3:
            q = q.options(undefer(ServerModel.model), undefer(ServerModel.model_since))
        return q

    @staticmethod
    def _obs_query(
        server: str | None,
        since: float | None,
        until: float | None,
        arms: Iterable[int] | None,
    ) -> Any:
        q = select(
            ServerModel.address,
            ObservationModel.ts,
            ObservationModel.b,
            ObservationModel.k,
            ObservationModel.decode_steps,
            ObservationModel.emitted_tokens,
            ObservationModel.accepted_drafts,
            ObservationModel.drafted_tokens,
            ObservationModel.busy_s,
        ).join(ServerModel, ObservationModel.server_id == ServerModel.id)
        if server is not None:
            q = q.where(ServerModel.address == server)
        if since is not None:
            q = q.where(ObservationModel.ts >= since)
        if until is not None:
            q = q.where(ObservationModel.ts < until)
        if arms is not None:
            q = q.where(ObservationModel.k.in_(sorted(set(int(a) for a in arms))))
        return q

    def observations(
        self,
        *,
        server: str | None = None,
        since: float | None = None,
        until: float | None = None,
        limit: int | None = None,
    ) -> list[ObservationRecord]:
        """Stored observations in time order, optionally of one server and a time window
        ``[since, until)``; ``limit`` keeps the first rows."""
        q = self._obs_query(server, since, until, None).order_by(
            ObservationModel.ts, ObservationModel.id
        )
        if limit is not None:
            q = q.limit(limit)
        with self._session_scope("reading observations") as s:
            return [ObservationRecord(*row) for row in s.execute(q)]

    def count_observations(self, *, server: str | None = None) -> int:
        q = select(func.count(ObservationModel.id))
        if server is not None:
            q = q.join(ServerModel, ObservationModel.server_id == ServerModel.id).where(
                ServerModel.address == server
            )
        with self._session_scope("counting observations") as s:
            return int(s.scalar(q) or 0)

    def aggregate(
        self,
        *,
        server: str | None = None,
        since: float | None = None,
        until: float | None = None,
    ) -> list[ObservationAggregate]:
        """Sums per ``(server, b, k)``, computed by the database (fast on millions of rows),
        ordered by server, b, k. ``rows`` counts sampling intervals: a rolled-up row counts
        for every interval it merged, so the figures do not change with a roll-up."""
        o = ObservationModel
        intervals = self._row_moments()[0]
        q = (
            select(
                ServerModel.address,
                o.b,
                o.k,
                func.sum(intervals),
                func.sum(o.decode_steps),
                func.sum(o.emitted_tokens),
                func.sum(o.accepted_drafts),
                func.sum(o.drafted_tokens),
                func.sum(o.busy_s),
                func.min(o.ts),
                func.max(o.ts),
            )
            .join(ServerModel, o.server_id == ServerModel.id)
            .group_by(ServerModel.address, o.b, o.k)
            .order_by(ServerModel.address, o.b, o.k)
        )
        if server is not None:
            q = q.where(ServerModel.address == server)
        if since is not None:
            q = q.where(o.ts >= since)
        if until is not None:
            q = q.where(o.ts < until)
        with self._session_scope("aggregating observations") as s:
            return [
                ObservationAggregate(
                    server=r[0],
                    b=int(r[1]),
                    k=int(r[2]),
                    rows=int(r[3]),
                    decode_steps=int(r[4]),
                    emitted_tokens=int(r[5]),
                    accepted_drafts=int(r[6]),
                    drafted_tokens=int(r[7]),
                    busy_s=float(r[8]),
                    first_ts=float(r[9]),
                    last_ts=float(r[10]),
                )
                for r in s.execute(q)
            ]

    def observation_span(
        self,
        *,
        server: str | None = None,
        since: float | None = None,
        until: float | None = None,
    ) -> tuple[float, float] | None:
        """``(first ts, last ts)`` of the stored observations in the window, None if none."""
        o = ObservationModel
        q = select(func.min(o.ts), func.max(o.ts))
        if server is not None:
            q = q.join(ServerModel, o.server_id == ServerModel.id).where(
                ServerModel.address == server
            )
        if since is not None:
            q = q.where(o.ts >= since)
        if until is not None:
            q = q.where(o.ts < until)
        with self._session_scope("reading the observation time span") as s:
            row = s.execute(q).first()
        if row is None or row[0] is None:
            return None
        return float(row[0]), float(row[1])

    def moments(
        self,
        *,
        server: str | None = None,
        since: float | None = None,
        until: float | None = None,
        bin_s: float | None = None,
        origin: float = 0.0,
    ) -> list[ObservationMoments]:
        """Sums and sums of squares per ``(server, time bin, b, k)``, computed by the database.

        For reports: confidence intervals of goodput and time series without moving rows
        into Python. ``bin_s`` None puts every row in bin 0; otherwise a row at ``ts`` falls
        in bin ``floor((ts - origin) / bin_s)``. Ordered by server, bin, b, k.

        ``rows`` counts sampling intervals and the sums of squares run over intervals, also
        through rolled-up rows (:meth:`rollup`), which carry the moments of what they
        merged: the numbers are those of the raw rows, except that a rolled-up row sits
        whole at its time stamp (the last interval it merged) for ``bin_s``, ``since`` and
        ``until``.
        """
        if bin_s is not None and not bin_s > 0:
            raise ValueError(f"bin_s must be > 0, got {bin_s}")
        o = ObservationModel
        if bin_s is None:
            bin_expr: Any = cast(0, Integer)
        elif self._engine.dialect.name == "sqlite":
            # floor(): SQLite's CAST truncates toward zero, wrong below the origin, and its
            # floor() exists only in builds with math functions; shifted by 2^30 bins first.
            bin_expr = cast((o.ts - origin) / bin_s + _BIN_SHIFT, Integer) - _BIN_SHIFT
        else:
            bin_expr = cast(func.floor((o.ts - origin) / bin_s), Integer)
        bin_col = bin_expr.label("bin")
        intervals, ee, et, tt = self._row_moments()
        # Grouped by the server's id, named afterwards: no join over a million rows.
        q = select(
            o.server_id,
            bin_col,
            o.b,
            o.k,
            func.sum(intervals),
            func.sum(o.decode_steps),
            func.sum(o.emitted_tokens),
            func.sum(o.accepted_drafts),
            func.sum(o.drafted_tokens),
            func.sum(o.busy_s),
            func.sum(ee),
            func.sum(et),
            func.sum(tt),
            func.min(o.ts),
            func.max(o.ts),
        ).group_by(o.server_id, bin_col, o.b, o.k)
        if server is not None:
            q = q.where(
                o.server_id.in_(
                    select(ServerModel.id).where(ServerModel.address == server).scalar_subquery()
                )
            )
        if since is not None:
            q = q.where(o.ts >= since)
        if until is not None:
            q = q.where(o.ts < until)
        with self._session_scope("aggregating observation moments") as s:
            names = dict(s.execute(select(ServerModel.id, ServerModel.address)).all())
            out = [
                ObservationMoments(
                    server=names[r[0]],
                    bin=int(r[1]),
                    b=int(r[2]),
                    k=int(r[3]),
                    rows=int(r[4]),
                    decode_steps=int(r[5]),
                    emitted_tokens=int(r[6]),
                    accepted_drafts=int(r[7]),
                    drafted_tokens=int(r[8]),
                    busy_s=float(r[9]),
                    emitted_sq=float(r[10]),
                    emitted_busy=float(r[11]),
                    busy_sq=float(r[12]),
                    first_ts=float(r[13]),
                    last_ts=float(r[14]),
                )
                for r in s.execute(q)
            ]
        out.sort(key=lambda m: (m.server, m.bin, m.b, m.k))
        return out

    def warm_start(
        self,
        server: str,
        *,
        arms: Iterable[int],
        since: float | None = None,
        limit: int = DEFAULT_WARM_START_ROWS,
        pool: str | None = None,
        model: str | None = None,
    ) -> list[ObservationRecord]:
        """The latest ``limit`` observations of ``server`` at one of ``arms``, oldest first:
        what a restarted daemon replays into a fresh policy. Buckets need no filter:
        observations keep the raw batch size, so any bucketing can be rebuilt from them.

        With ``pool``, the rows of every server recorded in that pool (identical replicas,
        ``run --pool``) count as well as the server's own; with ``model`` too, only those of
        pool-mates last seen running that model (or never seen saying)."""
        q = self._obs_query(None if pool is not None else server, since, None, arms)
        if pool is not None:
            mates = ServerModel.pool == pool
            if model is not None and self._v3:
                mates &= or_(ServerModel.model.is_(None), ServerModel.model == model)
            q = q.where(or_(ServerModel.address == server, mates))
        q = (
            q.order_by(ObservationModel.ts.desc(), ObservationModel.id.desc())
            .limit(limit)
        )
        with self._session_scope("reading observations for a warm start") as s:
            rows = [ObservationRecord(*row) for row in s.execute(q)]
        rows.reverse()
        return rows

    def last_observation_id(self) -> int:
        """The highest observation id stored (0 when none): where a pool reader starts."""
        with self._session_scope("reading the last observation id") as s:
            return int(s.scalar(select(func.max(ObservationModel.id))) or 0)

    def pool_observations(
        self,
        pool: str,
        *,
        after_id: int = 0,
        ids: Iterable[int] | None = None,
        arms: Iterable[int] | None = None,
        exclude: Iterable[str] = (),
        limit: int = DEFAULT_WARM_START_ROWS,
    ) -> list[tuple[int, ObservationRecord]]:
        """Observations of the servers in ``pool`` but not in ``exclude``, with an id above
        ``after_id`` (and among ``ids`` when given), in id order and paired with their id:
        how a daemon follows what its pool-mates record (live pooling across daemons sharing
        one database).

        Ids grow with every insert, but a transaction that commits late may hold ids below
        rows already read; a reader that must miss nothing looks at the ids of a window below
        its cursor (:meth:`pool_observation_ids`, cheap) and fetches those it has not seen.

        Rolled-up rows (:meth:`rollup`) are never returned: they repackage rows a live reader
        read when they were fresh, under new ids."""
        q = self._fresh_only(
            self._obs_query(None, None, None, arms)
            .add_columns(ObservationModel.id)
            .where(ServerModel.pool == pool, ObservationModel.id > after_id)
            .order_by(ObservationModel.id)
            .limit(limit)
        )
        if ids is not None:
            wanted = sorted({int(i) for i in ids})
            if not wanted:
                return []
            q = q.where(ObservationModel.id.in_(wanted))
        skip = sorted(set(exclude))
        if skip:
            q = q.where(ServerModel.address.not_in(skip))
        with self._session_scope("reading the pool's observations") as s:
            return [(int(row[-1]), ObservationRecord(*row[:-1])) for row in s.execute(q)]

    def pool_observation_ids(
        self, pool: str, *, after_id: int = 0, exclude: Iterable[str] = ()
    ) -> list[int]:
        """Ids of the observations above ``after_id`` of the servers in ``pool`` but not in
        ``exclude``, ascending (ids only: cheap; rolled-up rows left out, as there)."""
        q = self._fresh_only(
            select(ObservationModel.id)
            .join(ServerModel, ObservationModel.server_id == ServerModel.id)
            .where(ServerModel.pool == pool, ObservationModel.id > after_id)
            .order_by(ObservationModel.id)
        )
        skip = sorted(set(exclude))
        if skip:
            q = q.where(ServerModel.address.not_in(skip))
        with self._session_scope("reading the pool's observation ids") as s:
            return [int(i) for i in s.scalars(q)]

    @staticmethod
    def _version_record(address: str, m: PolicyVersionModel) -> PolicyVersionRecord:
        table: Table = tuple((None if b is None else int(b), int(k)) for b, k in json.loads(m.table_json))
        return PolicyVersionRecord(
            server=address,
            ts=m.ts,
            version=m.version,
            table=table,
            policy=m.policy,
            reason=m.reason,
            outcome=m.outcome,
        )

    def policy_versions(
        self,
        *,
        server: str | None = None,
        since: float | None = None,
        limit: int | None = None,
    ) -> list[PolicyVersionRecord]:
        """Recorded tables in time order (``limit`` keeps the first rows)."""
        q = (
            select(ServerModel.address, PolicyVersionModel)
            .join(ServerModel, PolicyVersionModel.server_id == ServerModel.id)
            .order_by(PolicyVersionModel.ts, PolicyVersionModel.id)
        )
        if server is not None:
            q = q.where(ServerModel.address == server)
        if since is not None:
            q = q.where(PolicyVersionModel.ts >= since)
        if limit is not None:
            q = q.limit(limit)
        with self._session_scope("reading policy versions") as s:
            return [self._version_record(a, m) for a, m in s.execute(q)]

    def latest_policy_version(self, server: str) -> PolicyVersionRecord | None:
        """The highest-numbered version recorded for ``server`` (None if none)."""
        q = (
            select(ServerModel.address, PolicyVersionModel)
            .join(ServerModel, PolicyVersionModel.server_id == ServerModel.id)
            .where(ServerModel.address == server)
            .order_by(PolicyVersionModel.version.desc(), PolicyVersionModel.id.desc())
            .limit(1)
        )
        with self._session_scope("reading the latest policy version") as s:
            row = s.execute(q).first()
            return None if row is None else self._version_record(row[0], row[1])

    def events(
        self,
        *,
        server: str | None = None,
        kinds: Iterable[str] | None = None,
        since: float | None = None,
        limit: int | None = None,
    ) -> list[EventRecord]:
        """Recorded events in time order; ``server=None`` means all, including the
        daemon's own (whose ``server`` is None)."""
        q = (
            select(ServerModel.address, EventModel.ts, EventModel.kind, EventModel.detail)
            .select_from(EventModel)
            .outerjoin(ServerModel, EventModel.server_id == ServerModel.id)
            .order_by(EventModel.ts, EventModel.id)
        )
        if server is not None:
            q = q.where(ServerModel.address == server)
        if kinds is not None:
            q = q.where(EventModel.kind.in_(list(kinds)))
        if since is not None:
            q = q.where(EventModel.ts >= since)
        if limit is not None:
            q = q.limit(limit)
        with self._session_scope("reading events") as s:
            return [EventRecord(*row) for row in s.execute(q)]
