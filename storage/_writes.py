"""Writing the history: one tick's servers, observations, policy versions and events in a
single transaction."""

from __future__ import annotations

import json
from collections.abc import Sequence

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
            obs_rows = [
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
            ]
            version_rows = [
                {
                    "server_id": ids[p.server],
                    "ts": p.ts,
                    "version": p.version,
                    "table_json": json.dumps(_table_rows(p)),
                    "policy": p.policy,
                    "reason": p.reason,
                    "outcome": p.outcome,
                }
                for p in policy_versions
            ]
            event_rows = [
                {
                    "server_id": None if e.server is None else ids[e.server],
                    "ts": e.ts,
                    "kind": e.kind,
                    "detail": e.detail,
                }
                for e in events
            ]
            band_rows = [
                {
                    "server_id": ids[r.server],
                    "ts": r.ts,
                    "band": r.band,
                    "k": r.k,
                    "decode_steps": r.decode_steps,
                    "request_steps": r.request_steps,
                    "accepted_drafts": r.accepted_drafts,
                    "first_counted": r.first_counted,
                    "first_rejected": r.first_rejected,
                }
                for r in bands
            ]
            depth_rows = [
                {
                    "server_id": ids[r.server],
                    "ts": r.ts,
                    "k": r.k,
                    "counts_json": json.dumps(list(r.counts)),
                    "every": r.every,
                }
                for r in depths
            ]
            for model, rows in (
                (ObservationModel, obs_rows),
                (BandObservationModel, band_rows),
                (DepthCountsModel, depth_rows),
                (PolicyVersionModel, version_rows),
                (EventModel, event_rows),
            ):
                if rows:  # an empty executemany is an error
                    s.execute(insert(model), rows)


def _table_rows(p: PolicyVersionRecord) -> list[list[int | None]]:
    """``[bound, k]`` rows; a banded row whose bands differ as ``[bound, k_unknown, k1..]``
    (the first ``k`` is the band-agnostic one either way)."""
    if p.bands is None:
        return [[b, k] for b, k in p.table]
    return [[b, ks[0]] if len(set(ks)) == 1 else [b, *ks] for b, ks in p.bands]
