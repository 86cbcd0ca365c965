"""The server registry: every server the history has seen, with its arms, restarts, pool and
model. Writes register servers as a tick names them; readers get :class:`ServerRecord` s."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence

from sqlalchemy import Select, select
from sqlalchemy.orm import Session, undefer

from storage._engine import StorageCore
from storage._models import ServerModel
from storage._records import ServerRecord, ServerSeen

__all__ = ["ServersMixin"]


class ServersMixin(StorageCore):
    """:meth:`servers`, :meth:`server` and the registration :meth:`record_tick` uses."""

    def servers(self) -> list[ServerRecord]:
        """Every server ever recorded, by address."""
        with self._session_scope("reading servers") as s:
            return [
                _server_record(m, self._v3)
                for m in s.scalars(_servers_query(self._v3).order_by(ServerModel.address))
            ]

    def server(self, address: str) -> ServerRecord | None:
        with self._session_scope("reading a server") as s:
            m = s.scalars(_servers_query(self._v3).where(ServerModel.address == address)).first()
            return None if m is None else _server_record(m, self._v3)

    def _server_ids(
        self, s: Session, addresses: Iterable[str], seen: Sequence[ServerSeen]
    ) -> dict[str, int]:
        wanted = set(addresses) | {x.address for x in seen}
        if not wanted:
            return {}
        rows = {
            m.address: m
            for m in s.scalars(_servers_query(self._v3).where(ServerModel.address.in_(wanted)))
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


def _servers_query(v3: bool) -> Select[tuple[ServerModel]]:
    q = select(ServerModel)
    if v3:
        q = q.options(undefer(ServerModel.model), undefer(ServerModel.model_since))
    return q


def _server_record(m: ServerModel, v3: bool) -> ServerRecord:
    return ServerRecord(
        address=m.address,
        arms=tuple(json.loads(m.arms_json or "[]")),
        first_seen=m.first_seen,
        last_seen=m.last_seen,
        started_at=m.started_at,
        start_times=tuple(json.loads(m.start_times_json or "[]")),
        pool=m.pool,
        # An unmigrated history read read-only has no model columns.
        model=m.model if v3 else None,
        model_since=m.model_since if v3 else None,
    )
