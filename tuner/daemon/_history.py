"""The history writer: rows buffered while the database is away, one write per tick, and
the hourly roll-up."""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Iterable

from storage import (
    BandObservationRecord,
    DepthCountsRecord,
    EventRecord,
    ObservationRecord,
    PolicyVersionRecord,
    ServerSeen,
    Storage,
)
from tuner.config import TunerConfig
from tuner.daemon._records import LearningRow, PushInfo, _Server
from tuner.errors import StorageError
from tuner.daemon._tables import AnyTable, flat, is_banded

log = logging.getLogger("tuner.daemon")  # one logger name for the whole loop


class _Snapshot:
    """Buffer contents taken for one write (or given back when the write failed)."""

    __slots__ = ("servers", "observations", "versions", "events")

    def __init__(self, servers, observations, versions, events) -> None:  # noqa: ANN001
        self.servers: dict[tuple[str, float | None], ServerSeen] = servers
        self.observations: collections.deque[LearningRow] = observations
        self.versions: list[PolicyVersionRecord] = versions
        self.events: list[EventRecord] = events


class _Buffer:
    """Rows waiting for the database: everything since the last successful write.

    Thread-safe: server workers add rows while the main thread writes them.
    """

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self.lock = threading.Lock()
        self.servers: dict[tuple[str, float | None], ServerSeen] = {}
        self.observations: collections.deque[LearningRow] = collections.deque()
        self.versions: list[PolicyVersionRecord] = []
        self.events: list[EventRecord] = []
        self.dropped = 0

    def __len__(self) -> int:
        return len(self.observations) + len(self.versions) + len(self.events)

    def _trim(self) -> None:
        excess = len(self) - self.max_rows
        while excess > 0 and self.observations:
            self.observations.popleft()
            self.dropped += 1
            excess -= 1

    def add_observations(self, rows: Iterable[LearningRow]) -> None:
        with self.lock:
            self.observations.extend(rows)
            self._trim()

    def add_version(self, row: PolicyVersionRecord) -> None:
        with self.lock:
            self.versions.append(row)

    def add_event(self, row: EventRecord) -> None:
        with self.lock:
            self.events.append(row)

    def seen(self, row: ServerSeen) -> None:
        with self.lock:
            self.servers[(row.address, row.started_at)] = row

    def pending(self, server: str) -> list[LearningRow]:
        with self.lock:
            return [o for o in self.observations if o.server == server]

    def take(self) -> _Snapshot:
        """Everything buffered, leaving the buffer empty."""
        with self.lock:
            snap = _Snapshot(self.servers, self.observations, self.versions, self.events)
            self.servers, self.observations = {}, collections.deque()
            self.versions, self.events = [], []
            return snap

    def give_back(self, snap: _Snapshot) -> None:
        """Put rows whose write failed back in front of anything added since."""
        with self.lock:
            self.servers = {**snap.servers, **self.servers}
            snap.observations.extend(self.observations)
            self.observations = snap.observations
            self.versions = snap.versions + self.versions
            self.events = snap.events + self.events
            self._trim()

    def clear(self) -> None:
        self.take()


class _HistoryWriter:
    """The :class:`~tuner.daemon.Daemon`'s history: events, versions, flush and roll-up."""

    config: TunerConfig
    storage: Storage | None
    metrics: object
    _buffer: _Buffer
    _storage_down_since: float | None
    _next_rollup: float | None
    _rollup_failing: bool
    rollup_every_s: float
    rollups: int
    rollups_failed: int

    def _event(self, server: str | None, now: float, kind: str, detail: str) -> None:
        self._buffer.add_event(EventRecord(server, now, kind, detail[:2000]))

    def _record_version(
        self, srv: _Server, now: float, version: int, table: AnyTable, reason: str,
        outcome: str,
    ) -> None:
        self._buffer.add_version(
            PolicyVersionRecord(srv.address, now, version, flat(table), self.config.policy,
                                reason, outcome,
                                table if is_banded(table) else None)  # type: ignore[arg-type]
        )
        srv.last_push = PushInfo(now, version, table, reason, outcome)
        if self.metrics is not None and outcome == "applied":
            self.metrics.set_policy_version(srv.address, version)

    def _flush(self, now: float) -> bool:
        """Write every buffered row in one transaction; keep them for the next try if not."""
        buf = self._buffer
        # Taken out whole: workers of slow servers may add rows while this one is written.
        snap = buf.take()
        if self.storage is None:
            return True
        rows = len(snap.observations) + len(snap.versions) + len(snap.events)
        if not rows and not snap.servers:
            return True
        recovered = None
        if self._storage_down_since is not None:
            lasted = now - self._storage_down_since
            recovered = EventRecord(
                None, now, "storage_recovered",
                f"after {lasted:.1f} s, {rows} rows buffered, {buf.dropped} dropped")
        try:
            rows_of = {kind: [r for r in snap.observations if type(r) is kind]
                       for kind in (ObservationRecord, BandObservationRecord, DepthCountsRecord)}
            self.storage.record_tick(
                servers=list(snap.servers.values()),
                observations=rows_of[ObservationRecord],
                bands=rows_of[BandObservationRecord],  # type: ignore[arg-type]
                depths=rows_of[DepthCountsRecord],  # type: ignore[arg-type]
                policy_versions=snap.versions,
                events=snap.events if recovered is None else [*snap.events, recovered],
            )
        except Exception as exc:  # StorageError, or a bug: the rows stay, the loop goes on
            buf.give_back(snap)
            if not isinstance(exc, StorageError):
                log.exception("history: unexpected error while writing")
            if self._storage_down_since is None:
                self._storage_down_since = now
                # Written with the buffered rows once the history is back.
                buf.add_event(EventRecord(None, now, "storage_outage", str(exc)[:2000]))
                log.warning("history unavailable: %s; learning goes on in memory and the "
                            "write is retried every tick (said once until it recovers)", exc)
            return False
        if self._storage_down_since is not None:
            log.info("history writable again: %d buffered rows written", rows)
            self._storage_down_since = None
        return True

    # --- history roll-up --------------------------------------------------------------------

    def _maybe_rollup(self, now: float) -> None:
        """Roll up observations older than ``rollup_after_s`` when due (first tick, then
        every ``rollup_every_s``). A failure is logged once per streak, retried at the next
        slot (not every tick: the history may just be busy), and never stops the loop."""
        after = self.config.rollup_after_s
        if self.storage is None or after is None:
            return
        if self._next_rollup is not None and now < self._next_rollup:
            return
        self._next_rollup = now + self.rollup_every_s
        try:
            removed = self.storage.rollup(older_than=now - after, bin_s=self.config.rollup_bin_s)
        except Exception as exc:  # StorageError, or a bug: the loop goes on either way
            self.rollups_failed += 1
            if not self._rollup_failing:
                self._rollup_failing = True
                log.warning("history roll-up failed: %s; retried every %g s (said once until "
                            "it works)", exc, self.rollup_every_s,
                            exc_info=not isinstance(exc, StorageError))
            return
        if self._rollup_failing:
            log.info("history roll-up works again")
            self._rollup_failing = False
        self.rollups += 1
        if removed:
            log.info("history: observations older than %g s rolled up into %g s bins, %d rows "
                     "fewer", after, self.config.rollup_bin_s, removed)
