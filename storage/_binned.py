"""Time-binned moments on SQLite without sorting a million rows.

SQLite has no hash aggregate: ``GROUP BY server, bin, b, k`` over the observations feeds
every row, with every column it sums, through a sorter, which costs several times one
full scan (2.5-3 CPU-s of the report's 5.7 on 1 M rows). A covering index on
``(server_id, b, k, ts, <summed columns>)`` keeps each ``(server, b, k)`` in time order, so
the rows of one ``(server, b, k, time bin)`` are one contiguous range of the index: one
plain aggregate per group over its range reads each row once and sorts nothing.
PostgreSQL hashes the grouped query and never comes here; nor does a SQLite history too
small, or binned too finely, for the per-group queries to pay (:func:`binned_moments`).

The index is SQLite's only (:data:`COVERING_INDEX_DDL`): a writer creates it when it
opens a history without it (``SchemaMixin._ensure_covering_index``), a few seconds once
on a million rows. Its price: the history grows by three quarters on disk (200 k rows:
13.6 MB without it, 23.7 MB with it), and each stored row updates one more B-tree (bulk
inserts of 200 k rows took about as long with it, within the shared machine's noise).
"""

from __future__ import annotations

import math
import os
import sqlite3
import sys
import threading
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Integer, and_, bindparam, func, or_, select, text, tuple_
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from storage._models import ObservationModel
from storage._sql import counter_sums, in_window, row_moments, server_spans, time_bin

__all__ = ["COVERING_INDEX", "COVERING_INDEX_DDL", "binned_moments", "has_covering_index"]

COVERING_INDEX = "ix_observations_server_bk_ts"
# Every column moments() reads, after the grouping columns and the time: the index alone
# answers the per-group queries (no lookup into the table per row).
COVERING_INDEX_DDL = (
    f"CREATE INDEX IF NOT EXISTS {COVERING_INDEX} ON observations (server_id, b, k, ts, "
    "n_intervals, decode_steps, emitted_tokens, accepted_drafts, drafted_tokens, busy_s, "
    "emitted_sq, emitted_busy, busy_sq)"
)

# The per-group queries run when the window holds at least this many rows per query on
# average; below that their fixed cost (tens of microseconds each) exceeds the sort they
# save (about 2 microseconds a row).
MIN_ROWS_PER_QUERY = 32


def has_covering_index(s: Session) -> bool:
    return s.execute(
        text("SELECT 1 FROM sqlite_master WHERE type = 'index' AND name = :n"),
        {"n": COVERING_INDEX},
    ).first() is not None


def _bin_of(ts: float, origin: float, bin_s: float) -> int:
    """The bin SQLite's :func:`~storage._sql.time_bin` gives ``ts`` (same IEEE operations,
    so the same integer)."""
    return int((ts - origin) / bin_s + (1 << 30)) - (1 << 30)


def binned_moments(
    s: Session,
    server_ids: Sequence[int],
    *,
    since: float | None,
    until: float | None,
    bin_s: float,
    origin: float,
) -> list[tuple[Any, ...]] | None:
    """The grouped moments query's rows ``(server_id, bin, b, k, intervals, 5 counter sums,
    Σe², Σe·t, Σt², min ts, max ts)`` by one aggregate per ``(server, b, k, bin)`` over the
    covering index; None when that would not pay (the caller runs the grouped query).

    Needs the covering index and schema v2 columns; SQLite only. A row's bin is decided by
    the same SQL expression as the grouped query's (the time range of each query is only a
    padded superset for the index), so every row lands in the same group.
    """
    o = ObservationModel
    driver = s.connection().connection.driver_connection
    if not driver.in_transaction:  # type: ignore[union-attr]
        # One snapshot for the many reads below (the grouped query is one statement); the
        # session's commit ends it.
        driver.execute("BEGIN")  # type: ignore[union-attr]
    count = in_window(select(func.count()), o.ts, since, until)
    spans = {r[0]: (r[1], r[2]) for r in s.execute(server_spans(since, until))}
    servers = []  # (server id, first bin, last bin)
    rows = bins = 0
    largest = abs(origin)
    for sid in server_ids:
        first, last = spans.get(sid, (None, None))
        if first is None:
            continue
        rows += s.scalar(count.where(o.server_id == sid)) or 0
        lo, hi = _bin_of(first, origin, bin_s), _bin_of(last, origin, bin_s)
        servers.append((sid, lo, hi))
        bins += hi - lo + 1
        largest = max(largest, abs(first), abs(last))
    # Stop listing (b, k) pairs as soon as the queries could no longer pay.
    budget = rows // MIN_ROWS_PER_QUERY - bins if MIN_ROWS_PER_QUERY > 0 else sys.maxsize
    if budget < 0:
        return None
    plans = []
    for sid, lo, hi in servers:
        arms = _distinct_bk(s, sid, limit=1 + budget // (hi - lo + 1))
        budget -= (len(arms) - 1) * (hi - lo + 1)
        if budget < 0:
            return None
        plans.append((sid, arms, lo, hi))
    bin_expr = time_bin((o.ts - origin) / bin_s, "sqlite", Integer)
    n_, ee, et, tt = (func.sum(x) for x in row_moments(True))
    q = select(n_, *counter_sums(), ee, et, tt, func.min(o.ts), func.max(o.ts)).where(
        o.server_id == bindparam("sid"),
        o.b == bindparam("b"),
        o.k == bindparam("k"),
        o.ts >= bindparam("lo"),
        o.ts < bindparam("hi"),
        # Rows clear of the bin's edges by the pad are in it: the bin expression (the
        # costlier test) is evaluated only near the edges.
        or_(and_(o.ts >= bindparam("inner_lo"), o.ts < bindparam("inner_hi")),
            bin_expr == bindparam("bin")),
    )
    q = in_window(q, o.ts, since, until)
    # Compiled once and run on the driver's cursor: thousands of executions through the
    # ORM session would cost more than the sort this saves.
    compiled = q.compile(dialect=s.get_bind().dialect)
    sql, names, values = str(compiled), compiled.positiontup or [], dict(compiled.params)
    # A row of bin i lies in [origin + i*bin_s, origin + (i+1)*bin_s) up to rounding (of
    # the bin expression, about 1e-7 bin; of the bounds, an ulp of the time): the pad
    # covers it many times over. Within a pad of an edge the bin expression decides.
    pad = 0.01 * bin_s + 8 * math.ulp(largest + bin_s)
    tasks = []
    for sid, arms, lo, hi in plans:
        for b, k in arms:
            for i in range(lo, hi + 1):
                start, end = origin + i * bin_s, origin + (i + 1) * bin_s
                values.update(sid=sid, b=b, k=k, bin=i, lo=start - pad, hi=end + pad,
                              inner_lo=start + pad, inner_hi=end - pad)
                tasks.append(((sid, i, b, k), [values[n] for n in names]))
    try:
        return _run_split(s, driver, sql, tasks)
    except sqlite3.Error as exc:  # the driver's own: the session scope translates these
        raise DBAPIError(sql, None, exc) from exc


# Below this many per-group queries one connection does them all; above, two (one in a
# thread: SQLite releases Python's lock while it reads, so they use two cores).
PARALLEL_MIN_QUERIES = 2000


def _run_split(
    s: Session, driver: Any, sql: str, tasks: list[tuple[tuple[int, int, int, int], list]]
) -> list[tuple[Any, ...]]:
    """Every per-group query of ``tasks`` (``(group key, parameters)``), half of them on a
    second connection in a thread when there are many and it reads the same snapshot."""
    if len(tasks) < PARALLEL_MIN_QUERIES or (os.cpu_count() or 1) < 2:
        return _run(driver, sql, tasks)
    other = s.get_bind().raw_connection()  # type: ignore[union-attr]
    try:
        second = other.driver_connection
        second.execute("BEGIN")  # type: ignore[union-attr]
        # The same snapshot: observations only grow by inserts, and a roll-up inserts its
        # merged rows above every id it deletes, so any commit to them between the two
        # connections' first reads raises the highest id one of them sees.
        top = "SELECT MAX(id) FROM observations"
        if (driver.execute(top).fetchone()[0]
                != second.execute(top).fetchone()[0]):  # type: ignore[union-attr]
            return _run(driver, sql, tasks)
        half = len(tasks) // 2
        result: list[Any] = []
        worker = threading.Thread(
            target=lambda: result.append(_try(lambda: _run(second, sql, tasks[half:]))),
            name="moments-reader", daemon=True,
        )
        worker.start()
        try:
            mine = _run(driver, sql, tasks[:half])
        finally:
            worker.join()
        if isinstance(result[0], BaseException):
            raise result[0]
        return mine + result[0]
    finally:
        other.close()  # back to the pool, its read transaction rolled back


def _try(fn: Any) -> Any:
    try:
        return fn()
    except BaseException as exc:  # handed to the caller's thread
        return exc


def _run(conn: Any, sql: str, tasks: list[tuple[tuple[int, int, int, int], list]]) -> list:
    out: list[tuple[Any, ...]] = []
    cur = conn.cursor()
    try:
        for key, params in tasks:
            r = cur.execute(sql, params).fetchone()
            if r[0] is not None:
                out.append((*key, *r))
    finally:
        cur.close()
    return out


def _distinct_bk(s: Session, sid: int, *, limit: int) -> list[tuple[int, int]]:
    """The ``(b, k)`` pairs stored for one server, by seeks on the covering index (one per
    pair, not a scan of every row); ``limit + 1`` pairs at most (more than ``limit``: too
    many)."""
    o = ObservationModel
    first = select(o.b, o.k).where(o.server_id == sid).order_by(o.b, o.k).limit(1)
    out: list[tuple[int, int]] = []
    row = s.execute(first).first()
    while row is not None and len(out) <= limit:
        b, k = int(row[0]), int(row[1])
        out.append((b, k))
        row = s.execute(first.where(tuple_(o.b, o.k) > tuple_(b, k))).first()
    return out
