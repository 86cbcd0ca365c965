"""Writing the history: one tick's servers, observations, policy versions and events in a
single transaction."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import insert

from storage._models import (
    BandObservationModel,
    DepthCountsModel,
    EventModel,
    ObservationModel,
    PolicyVersionModel,
)
from storage._records import (
    BandObservationRecord,
    DepthCountsRecord,
    EventRecord,
    ObservationRecord,
    PolicyVersionRecord,
    ServerSeen,
)
from storage._servers import ServersMixin

__all__ = ["WritesMixin"]


class WritesMixin(ServersMixin):
    """:meth:`record_tick`."""

    def record_tick(
        self,
        *,
        servers: Sequence[ServerSeen] = (),
        observations: Sequence[ObservationRecord] = (),
        policy_versions: Sequence[PolicyVersionRecord] = (),
        events: Sequence[EventRecord] = (),
        bands: Sequence[BandObservationRecord] = (),
        depths: Sequence[DepthCountsRecord] = (),
    ) -> None:
        """Write everything one tick produced in a single transaction (all or nothing):
        ``bands`` and ``depths`` are the acceptance evidence of protocol v2 servers, kept
        for warm starts (:meth:`warm_start_acceptance`).

        Raises:
            StorageError: nothing was written; the caller may retry the same rows later.
        """
        if not (servers or observations or policy_versions or events or bands or depths):
            return
        self._refuse_if_read_only("record")
        addresses = (
            {o.server for o in observations}
            | {r.server for r in bands}
            | {r.server for r in depths}
            | {p.server for p in policy_versions}
            | {e.server for e in events if e.server is not None}
        )
        with self._session_scope("recording a tick") as s:
            ids = self._server_ids(s, addresses, servers)
            obs_rows = [_columns(o, ids) for o in observations]
            version_rows = [_columns(p, ids, drop=("table", "bands"),
                                     table_json=json.dumps(_table_rows(p)))
                            for p in policy_versions]
            event_rows = [_columns(e, ids) for e in events]
            band_rows = [_columns(r, ids) for r in bands]
            depth_rows = [_columns(r, ids, drop=("counts",),
                                   counts_json=json.dumps(list(r.counts))) for r in depths]
            for model, rows in (
                (ObservationModel, obs_rows),
                (BandObservationModel, band_rows),
                (DepthCountsModel, depth_rows),
                (PolicyVersionModel, version_rows),
                (EventModel, event_rows),
            ):
                if rows:  # an empty executemany is an error
                    s.execute(insert(model), rows)


def _columns(record: Any, ids: dict[str, int], *, drop: tuple[str, ...] = (),
             **columns: object) -> dict[str, object]:
    """A record's fields as its table's columns (less ``drop``, plus ``columns``), its
    ``server`` as that server's id (None: the daemon's own event)."""
    fields = {f.name: getattr(record, f.name) for f in dataclasses.fields(record)
              if f.name not in drop}
    server = fields.pop("server")
    return {"server_id": None if server is None else ids[server], **fields, **columns}


def _table_rows(p: PolicyVersionRecord) -> list[list[int | None]]:
    """``[bound, k]`` rows; a banded row whose bands differ as ``[bound, k_unknown, k1..]``
    (the first ``k`` is the band-agnostic one either way)."""
    if p.bands is None:
        return [[b, k] for b, k in p.table]
    return [[b, ks[0]] if len(set(ks)) == 1 else [b, *ks] for b, ks in p.bands]
