"""SQL shapes and row conversions shared by the history's writes, queries, roll-up and pool
readers. Pure: nothing here opens a session."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from sqlalchemy import BigInteger, Double, Integer, cast, func, select

from storage._models import ObservationModel, PolicyVersionModel, ServerModel
from storage._records import BandTable, PolicyVersionRecord, Table

__all__ = [
    "counter_fields",
    "counter_sums",
    "in_window",
    "obs_query",
    "row_moments",
    "server_spans",
    "time_bin",
    "version_record",
]

# floor(x) on SQLite: CAST(x + shift AS INTEGER) - shift for x > -shift.
_BIN_SHIFT = 1 << 30


def time_bin(x: Any, dialect: str, int_type: type[Integer] | type[BigInteger]) -> Any:
    """SQL for ``floor(x)`` as an integer of ``int_type``, for binning times.

    SQLite's CAST truncates toward zero, wrong below zero, and its floor() exists only in
    builds with math functions; so there the value is shifted by 2^30 bins first."""
    if dialect == "sqlite":
        return cast(x + _BIN_SHIFT, int_type) - _BIN_SHIFT
    return cast(func.floor(x), int_type)


def row_moments(v2: bool) -> tuple[Any, Any, Any, Any]:
    """SQL for one stored row's ``(intervals, Σe², Σe·t, Σt²)``, to be summed.

    A fresh row is one interval whose moments are its own values (its columns are NULL); a
    rolled-up row carries the sums of the rows it merged. ``v2`` False: a read-only look at
    a v1 history, where nothing was ever rolled up.
    """
    o = ObservationModel
    # Products as doubles: SQLite's integer SUM raises on overflow.
    e = cast(o.emitted_tokens, Double)
    t = o.busy_s
    if not v2:
        return cast(1, BigInteger), e * e, e * t, t * t
    return (
        o.n_intervals,
        func.coalesce(o.emitted_sq, e * e),
        func.coalesce(o.emitted_busy, e * t),
        func.coalesce(o.busy_sq, t * t),
    )


def counter_sums() -> tuple[Any, ...]:
    """SQL for the sums of an observation's counters and busy seconds, in
    :class:`ObservationRecord`'s order (``decode_steps`` ... ``busy_s``)."""
    o = ObservationModel
    return (
        func.sum(o.decode_steps),
        func.sum(o.emitted_tokens),
        func.sum(o.accepted_drafts),
        func.sum(o.drafted_tokens),
        func.sum(o.busy_s),
    )


def counter_fields(values: Any) -> dict[str, Any]:
    """The values :func:`counter_sums` selected, as record fields."""
    steps, emitted, accepted, drafted, busy = values
    return {
        "decode_steps": int(steps),
        "emitted_tokens": int(emitted),
        "accepted_drafts": int(accepted),
        "drafted_tokens": int(drafted),
        "busy_s": float(busy),
    }


def in_window(q: Any, ts: Any, since: float | None, until: float | None) -> Any:
    """``q`` restricted to ``since <= ts < until`` (either bound optional)."""
    if since is not None:
        q = q.where(ts >= since)
    if until is not None:
        q = q.where(ts < until)
    return q


def server_spans(since: float | None, until: float | None) -> Any:
    """SQL for ``(server id, first ts, last ts)`` of each server's observations in the window
    (NULLs for a server without any): two seeks per server on the ``(server_id, ts)``
    index, where ``MIN(ts)`` over the whole table would read every row."""
    o = ObservationModel

    def edge(fn: Any) -> Any:
        q = in_window(select(fn(o.ts)).where(o.server_id == ServerModel.id), o.ts, since, until)
        return q.scalar_subquery().correlate(ServerModel)

    return select(ServerModel.id, edge(func.min).label("first"), edge(func.max).label("last"))


def obs_query(
    server: str | None,
    since: float | None,
    until: float | None,
    arms: Iterable[int] | None,
) -> Any:
    """Observation rows as :class:`ObservationRecord` fields, joined to their server."""
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
    q = in_window(q, ObservationModel.ts, since, until)
    if arms is not None:
        q = q.where(ObservationModel.k.in_(sorted(set(int(a) for a in arms))))
    return q


def version_record(address: str, m: PolicyVersionModel) -> PolicyVersionRecord:
    rows = json.loads(m.table_json)
    bounds = [None if r[0] is None else int(r[0]) for r in rows]
    table: Table = tuple((b, int(r[1])) for b, r in zip(bounds, rows, strict=True))
    width = max(len(r) for r in rows) - 1 if rows else 1
    bands: BandTable | None = None
    if width > 1:  # a banded table: a row of one k runs it in every band
        bands = tuple((b, tuple(int(k) for k in r[1:]) if len(r) > 2 else (int(r[1]),) * width)
                      for b, r in zip(bounds, rows, strict=True))
    return PolicyVersionRecord(
        server=address,
        ts=m.ts,
        version=m.version,
        table=table,
        policy=m.policy,
        reason=m.reason,
        outcome=m.outcome,
        bands=bands,
    )
