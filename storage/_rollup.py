"""Rolling up old observations so the history stays bounded without changing any total."""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import BigInteger, Double, cast, delete, func, insert, literal, or_, select, text

from storage._engine import StorageCore, log
from storage._models import (
    BandObservationModel,
    DepthCountsModel,
    ObservationModel,
    SchemaVersionModel,
    ServerModel,
)
from storage._sql import counter_sums, row_moments, time_bin

__all__ = ["RollupMixin"]

# The columns a merged row fills, in the order of the SELECT that computes them.
_MERGED_COLUMNS = (
    "server_id", "ts", "b", "k", "decode_steps", "emitted_tokens", "accepted_drafts",
    "drafted_tokens", "busy_s", "n_intervals", "emitted_sq", "emitted_busy", "busy_sq",
    "rollup_bin_s",
)  # fmt: skip


class RollupMixin(StorageCore):
    """:meth:`rollup`."""

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

        The acceptance evidence of protocol v2 servers (band observations and depth counts,
        which serve warm starts only) older than the same cutoff is dropped, not merged:
        a policy's acceptance memory has long forgotten it.

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
        self._refuse_if_read_only("roll up")
        bin_s = float(bin_s)
        cutoff = math.floor(older_than / bin_s) * bin_s
        o = ObservationModel
        bin_expr: Any = time_bin(o.ts / bin_s, self._engine.dialect.name, BigInteger)
        n, ee, et, tt = (func.sum(x) for x in row_moments(self._v2))
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
            dropped = 0
            for model in (BandObservationModel, DepthCountsModel):
                dropped += s.execute(
                    delete(model.__table__).where(model.server_id.in_(server_ids),
                                                  model.ts < cutoff)
                ).rowcount
            if dropped:
                log.info("%s: dropped %d band and depth rows before %.0f", self.url, dropped,
                         cutoff)
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
                        *counter_sums(),
                        n, ee, et, tt,
                        cast(literal(bin_s), Double),
                    )
                    .where(*old)
                    .group_by(o.server_id, bin_expr, o.b, o.k)
                )
                # Core statements on the table: nothing for the ORM to synchronise.
                table = o.__table__
                s.execute(insert(table).from_select(_MERGED_COLUMNS, merged))
                deleted += s.execute(delete(table).where(*old)).rowcount
            # Counted, not taken from the INSERT's rowcount (-1 for INSERT ... SELECT on
            # PostgreSQL through SQLAlchemy); everything above ``top`` is ours (table lock /
            # SQLite's single writer).
            inserted = int(s.scalar(select(func.count()).select_from(o).where(o.id > top)) or 0)
        if deleted:
            log.info("%s: rolled up %d observations before %.0f into %d rows of %g s",
                     self.url, deleted, cutoff, inserted, bin_s)
        return deleted - inserted
