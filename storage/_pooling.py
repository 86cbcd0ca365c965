"""Pooling reads: the warm start of a restarted daemon and the live reads through which
daemons sharing one database follow what their pool-mates record."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import func, or_, select

from storage._engine import StorageCore
from storage._models import ObservationModel, ServerModel
from storage._records import ObservationRecord
from storage._sql import obs_query

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
        q = obs_query(None if pool is not None else server, since, None, arms)
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
