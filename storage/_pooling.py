"""Pooling reads: the warm start of a restarted daemon and the live reads through which
daemons sharing one database follow what their pool-mates record."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from sqlalchemy import func, or_, select

from storage._engine import StorageCore
from storage._models import BandObservationModel, DepthCountsModel, ObservationModel, ServerModel
from storage._records import BandObservationRecord, DepthCountsRecord, ObservationRecord
from storage._sql import in_window, obs_query

__all__ = ["DEFAULT_WARM_START_ROWS", "PoolingMixin"]

# Warm start replays at most this many of a server's latest observations: with a discounted
# policy older evidence weighs next to nothing, and the replay stays well under a second.
DEFAULT_WARM_START_ROWS = 50_000


class PoolingMixin(StorageCore):
    """:meth:`warm_start` and the live pool readers."""

    def _fresh_only(self, q: Any) -> Any:
        """``q`` without rolled-up rows (live pool readers: their content was read fresh)."""
        return q.where(ObservationModel.rollup_bin_s.is_(None)) if self._v2 else q

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
        q = self._of_server(obs_query(None, since, None, arms), server, pool, model)
        q = (
            q.order_by(ObservationModel.ts.desc(), ObservationModel.id.desc())
            .limit(limit)
        )
        with self._session_scope("reading observations for a warm start") as s:
            rows = [ObservationRecord(*row) for row in s.execute(q)]
        rows.reverse()
        return rows

    def warm_start_acceptance(
        self,
        server: str,
        *,
        arms: Iterable[int],
        since: float | None = None,
        limit: int = DEFAULT_WARM_START_ROWS,
        pool: str | None = None,
        model: str | None = None,
    ) -> tuple[list[BandObservationRecord], list[DepthCountsRecord]]:
        """The latest ``limit`` band observations and depth counts of ``server`` at one of
        ``arms`` since ``since``, each oldest first: the acceptance evidence a restarted
        daemon replays beside :meth:`warm_start`'s observations (pass the first replayed
        observation's time as ``since`` so both cover one span). ``pool`` and ``model`` as
        there. Empty on a history from before schema v4, or rows older than the roll-up age
        (they are dropped, not merged: :meth:`rollup`)."""
        if not self._v4:  # a read-only look at an older history
            return [], []
        wanted = sorted({int(a) for a in arms})
        out = []
        with self._session_scope("reading acceptance evidence for a warm start") as s:
            for model_cls, q in _acceptance_selects():
                q = in_window(self._of_server(q, server, pool, model), model_cls.ts, since, None)
                q = (q.where(model_cls.k.in_(wanted))
                     .order_by(model_cls.ts.desc(), model_cls.id.desc()).limit(limit))
                out.append(list(s.execute(q))[::-1])
        return _acceptance_records(*out)

    def acceptance_at(
        self, ticks: Iterable[tuple[str, float]]
    ) -> tuple[list[BandObservationRecord], list[DepthCountsRecord]]:
        """The band observations and depth counts recorded with the given ``(server, ts)``
        ticks, each in id order: a live pool reader takes them with the observations it
        read (a tick's rows are written in one transaction, so they are visible together)."""
        wanted = {(a, float(t)) for a, t in ticks}
        if not wanted or not self._v4:
            return [], []
        addresses, times = sorted({a for a, _ in wanted}), sorted({t for _, t in wanted})
        out = []
        with self._session_scope("reading the pool's acceptance evidence") as s:
            for model_cls, q in _acceptance_selects():
                q = (q.where(ServerModel.address.in_(addresses), model_cls.ts.in_(times))
                     .order_by(model_cls.id))
                out.append([row for row in s.execute(q) if (row[0], row[1]) in wanted])
        return _acceptance_records(*out)

    def _of_server(self, q: Any, server: str, pool: str | None, model: str | None) -> Any:
        """``q`` over ``server``'s rows and, with ``pool``, its pool-mates' (with ``model``:
        those last seen running it, or never seen saying)."""
        if pool is None:
            return q.where(ServerModel.address == server)
        mates = ServerModel.pool == pool
        if model is not None and self._v3:
            mates &= or_(ServerModel.model.is_(None), ServerModel.model == model)
        return q.where(or_(ServerModel.address == server, mates))

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
            obs_query(None, None, None, arms)
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
        q = _excluding(q, exclude)
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
        q = _excluding(q, exclude)
        with self._session_scope("reading the pool's observation ids") as s:
            return [int(i) for i in s.scalars(q)]


def _excluding(q: Any, exclude: Iterable[str]) -> Any:
    skip = sorted(set(exclude))
    return q.where(ServerModel.address.not_in(skip)) if skip else q


def _acceptance_selects() -> tuple[tuple[Any, Any], ...]:
    """Band observation and depth count rows with their server's address, in their
    records' field order (the JSON counts still to decode): (model, select) each."""
    b, d = BandObservationModel, DepthCountsModel
    return tuple(
        (m, select(ServerModel.address, *cols).join(ServerModel, m.server_id == ServerModel.id))
        for m, cols in (
            (b, (b.ts, b.band, b.k, b.decode_steps, b.request_steps, b.accepted_drafts,
                 b.first_counted, b.first_rejected)),
            (d, (d.ts, d.k, d.counts_json, d.every)),
        )
    )


def _acceptance_records(
    bands: Iterable[Any], depths: Iterable[Any]
) -> tuple[list[BandObservationRecord], list[DepthCountsRecord]]:
    """Rows of :func:`_acceptance_selects` as records; a hand-edited depth row that is not
    depth counts is left out (a warm start goes without it)."""
    out = []
    for addr, ts, k, counts, every in depths:
        try:
            out.append(DepthCountsRecord(addr, ts, k, tuple(json.loads(counts)), every))
        except (ValueError, TypeError):
            continue
    return [BandObservationRecord(*row) for row in bands], out
