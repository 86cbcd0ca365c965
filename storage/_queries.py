"""Reading the history: observations and their sums, policy versions, events.
Every method returns frozen records; the sums are computed by the database."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import Integer, cast, func, select

from storage._binned import binned_moments, has_covering_index
from storage._engine import StorageCore
from storage._models import EventModel, ObservationModel, PolicyVersionModel, ServerModel
from storage._records import (
    EventRecord,
    ObservationAggregate,
    ObservationMoments,
    ObservationRecord,
    PolicyVersionRecord,
)
from storage._sql import (
    counter_fields,
    counter_sums,
    in_window,
    obs_query,
    row_moments,
    server_spans,
    time_bin,
    version_record,
)

__all__ = ["QueriesMixin"]


class QueriesMixin(StorageCore):
    """The readers reports, export and the daemon's status use."""

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
        q = obs_query(server, since, until, None).order_by(
            ObservationModel.ts, ObservationModel.id
        )
        if limit is not None:
            q = q.limit(limit)
        with self._session_scope("reading observations") as s:
            return [ObservationRecord(*row) for row in s.execute(q)]

    def count_observations(self, *, server: str | None = None) -> int:
        q = _of_server(select(func.count(ObservationModel.id)), server)
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
        intervals = row_moments(self._v2)[0]
        q = (
            select(
                ServerModel.address,
                o.b,
                o.k,
                func.sum(intervals),
                *counter_sums(),
                func.min(o.ts),
                func.max(o.ts),
            )
            .join(ServerModel, o.server_id == ServerModel.id)
            .group_by(ServerModel.address, o.b, o.k)
            .order_by(ServerModel.address, o.b, o.k)
        )
        if server is not None:
            q = q.where(ServerModel.address == server)
        q = in_window(q, o.ts, since, until)
        with self._session_scope("aggregating observations") as s:
            return [
                ObservationAggregate(
                    server=r[0],
                    b=int(r[1]),
                    k=int(r[2]),
                    rows=int(r[3]),
                    **counter_fields(r[4:9]),
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
        spans = server_spans(since, until)
        if server is not None:
            spans = spans.where(ServerModel.address == server)
        spans = spans.subquery()
        q = select(func.min(spans.c.first), func.max(spans.c.last))
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
        else:
            bin_expr = time_bin((o.ts - origin) / bin_s, self._engine.dialect.name, Integer)
        bin_col = bin_expr.label("bin")
        n, ee, et, tt = (func.sum(x) for x in row_moments(self._v2))
        # Grouped by the server's id, named afterwards: no join over a million rows.
        q = select(
            o.server_id, bin_col, o.b, o.k, n, *counter_sums(), ee, et, tt,
            func.min(o.ts), func.max(o.ts),
        ).group_by(o.server_id, bin_col, o.b, o.k)
        if server is not None:
            q = q.where(
                o.server_id.in_(
                    select(ServerModel.id).where(ServerModel.address == server).scalar_subquery()
                )
            )
        q = in_window(q, o.ts, since, until)
        with self._session_scope("aggregating observation moments") as s:
            names = dict(s.execute(select(ServerModel.id, ServerModel.address)).all())
            rows: Any = None
            if (bin_s is not None and self._v2 and self._engine.dialect.name == "sqlite"
                    and has_covering_index(s)):
                ids = sorted(i for i, a in names.items() if server is None or a == server)
                rows = binned_moments(s, ids, since=since, until=until, bin_s=bin_s,
                                      origin=origin)
            if rows is None:
                rows = s.execute(q)
            out = [
                ObservationMoments(
                    server=names[r[0]],
                    bin=int(r[1]),
                    b=int(r[2]),
                    k=int(r[3]),
                    rows=int(r[4]),
                    **counter_fields(r[5:10]),
                    emitted_sq=float(r[10]),
                    emitted_busy=float(r[11]),
                    busy_sq=float(r[12]),
                    first_ts=float(r[13]),
                    last_ts=float(r[14]),
                )
                for r in rows
            ]
        out.sort(key=lambda m: (m.server, m.bin, m.b, m.k))
        return out

    def policy_versions(
        self,
        *,
        server: str | None = None,
        since: float | None = None,
        limit: int | None = None,
    ) -> list[PolicyVersionRecord]:
        """Recorded tables in time order (``limit`` keeps the first rows)."""
        q = _versions_query().order_by(PolicyVersionModel.ts, PolicyVersionModel.id)
        if server is not None:
            q = q.where(ServerModel.address == server)
        if since is not None:
            q = q.where(PolicyVersionModel.ts >= since)
        if limit is not None:
            q = q.limit(limit)
        with self._session_scope("reading policy versions") as s:
            return [version_record(a, m) for a, m in s.execute(q)]

    def latest_policy_version(self, server: str) -> PolicyVersionRecord | None:
        """The highest-numbered version recorded for ``server`` (None if none)."""
        q = (
            _versions_query()
            .where(ServerModel.address == server)
            .order_by(PolicyVersionModel.version.desc(), PolicyVersionModel.id.desc())
            .limit(1)
        )
        with self._session_scope("reading the latest policy version") as s:
            row = s.execute(q).first()
            return None if row is None else version_record(row[0], row[1])

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


def _of_server(q: Any, server: str | None) -> Any:
    """``q`` over observations, restricted to one server's (joined only when needed)."""
    if server is None:
        return q
    return q.join(ServerModel, ObservationModel.server_id == ServerModel.id).where(
        ServerModel.address == server
    )


def _versions_query() -> Any:
    return select(ServerModel.address, PolicyVersionModel).join(
        ServerModel, PolicyVersionModel.server_id == ServerModel.id
    )
