"""Frozen records going into and coming out of :class:`storage.Storage`.

Servers are named by address everywhere (``host:port``); ids stay inside storage/.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "EVENT_KINDS",
    "BandObservationRecord",
    "DepthCountsRecord",
    "EventRecord",
    "ObservationAggregate",
    "ObservationMoments",
    "ObservationRecord",
    "PolicyVersionRecord",
    "ServerRecord",
    "ServerSeen",
]

Table = tuple[tuple[int | None, int], ...]
# A protocol v2 table: per row the k of the unknown band, then of each acceptance band.
BandTable = tuple[tuple[int | None, tuple[int, ...]], ...]

# Kinds the daemon writes. The column is free text (a later kind needs no migration);
# ``EventRecord`` only checks the length.
EVENT_KINDS = (
    "start",
    "stop",
    "restart",
    "outage",
    "recovered",
    "plugin_missing",
    "malformed_reply",
    "update_rejected",
    "arms_changed",
    "storage_outage",
    "storage_recovered",
    "foreign_push",
)
_MAX_KIND_LEN = 32


@dataclass(frozen=True, slots=True)
class ServerSeen:
    """One sighting of a server, written with a tick: keeps ``servers`` up to date.

    A ``started_at`` not seen before is appended to the server's start times.
    """

    address: str
    arms: tuple[int, ...]
    seen_at: float
    started_at: float | None = None
    pool: str | None = None
    model: str | None = None  # what the server reports it runs, when it says


@dataclass(frozen=True, slots=True)
class ServerRecord:
    address: str
    arms: tuple[int, ...]
    first_seen: float
    last_seen: float
    started_at: float | None
    start_times: tuple[float, ...]
    pool: str | None
    model: str | None = None
    model_since: float | None = None  # rows from then on are this model's (None: all)


@dataclass(frozen=True, slots=True)
class ObservationRecord:
    """What ``server`` did at one ``(b, k)`` over the interval ending at ``ts``."""

    server: str
    ts: float
    b: int
    k: int
    decode_steps: int
    emitted_tokens: int
    accepted_drafts: int
    drafted_tokens: int
    busy_s: float

    @property
    def goodput(self) -> float:
        return self.emitted_tokens / self.busy_s if self.busy_s > 0 else math.nan


@dataclass(frozen=True, slots=True)
class BandObservationRecord:
    """Drafting of ``server`` in acceptance band ``band`` (1..) at arm ``k`` over the interval
    ending at ``ts``, on batches of one batch-size class (a protocol v2 band counter's delta;
    the class shows as ``request_steps / decode_steps``): of its request-steps,
    ``first_rejected`` of the ``first_counted`` looked at accepted no draft."""

    server: str
    ts: float
    band: int
    k: int
    decode_steps: int
    request_steps: int
    accepted_drafts: int
    first_counted: int = 0
    first_rejected: int = 0


@dataclass(frozen=True, slots=True)
class DepthCountsRecord:
    """How many of the requests sampled at chain arm ``k`` of ``server`` over the interval
    ending at ``ts`` accepted each of ``0..k`` drafts (``counts``), sampling one decode step
    in ``every`` (a protocol v2 depth counter's delta)."""

    server: str
    ts: float
    k: int
    counts: tuple[int, ...]
    every: int = 1

    def __post_init__(self) -> None:
        if self.k < 1 or len(self.counts) != self.k + 1 or min(self.counts) < 0 or self.every < 1:
            raise ValueError(f"depth counts must be k + 1 non-negative counts at k >= 1, "
                             f"every >= 1: k={self.k} counts={self.counts} every={self.every}")


@dataclass(frozen=True, slots=True)
class ObservationAggregate:
    """Sums over all stored observations of one ``(server, b, k)``, computed in SQL.

    ``rows`` counts sampling intervals (a rolled-up row counts every interval it merged)."""

    server: str
    b: int
    k: int
    rows: int
    decode_steps: int
    emitted_tokens: int
    accepted_drafts: int
    drafted_tokens: int
    busy_s: float
    first_ts: float
    last_ts: float

    @property
    def goodput(self) -> float:
        """Emitted tokens per busy second."""
        return self.emitted_tokens / self.busy_s if self.busy_s > 0 else math.nan

    @property
    def acceptance(self) -> float:
        """Accepted drafts per drafted token (NaN when nothing was drafted)."""
        return self.accepted_drafts / self.drafted_tokens if self.drafted_tokens else math.nan


@dataclass(frozen=True, slots=True)
class ObservationMoments:
    """Sums and sums of squares over the stored rows of one ``(server, time bin, b, k)``.

    ``rows`` counts sampling intervals; ``emitted_sq``, ``emitted_busy`` and ``busy_sq`` sum
    ``e*e``, ``e*t`` and ``t*t`` over intervals (``e`` emitted tokens, ``t`` busy seconds),
    which is what a confidence interval of the ratio ``Σe/Σt`` (goodput) needs. A fresh
    stored row is one interval; a rolled-up one carries these sums for the intervals it
    merged. Every field is additive, so moments of coarser groups are plain sums of these.
    """

    server: str
    bin: int  # floor((ts - origin) / bin_s); 0 when not binned
    b: int
    k: int
    rows: int
    decode_steps: int
    emitted_tokens: int
    accepted_drafts: int
    drafted_tokens: int
    busy_s: float
    emitted_sq: float
    emitted_busy: float
    busy_sq: float
    first_ts: float
    last_ts: float


@dataclass(frozen=True, slots=True)
class PolicyVersionRecord:
    """A table the daemon decided on for ``server``.

    ``outcome``: ``applied`` (every replica said yes), ``rejected``, ``dry_run`` (never
    sent), ``unsent`` (the server was unreachable). ``table`` is band-agnostic (what a v1
    reader runs: each row's unknown-band ``k``); ``bands`` is the whole banded table when
    its bands differ (protocol v2), else None.
    """

    server: str
    ts: float
    version: int
    table: Table
    policy: str
    reason: str
    outcome: str = "applied"
    bands: BandTable | None = None


@dataclass(frozen=True, slots=True)
class EventRecord:
    """Something worth remembering: a restart, an outage, a rejected update ...

    ``server`` is None for events of the daemon itself.
    """

    server: str | None
    ts: float
    kind: str
    detail: str = ""

    def __post_init__(self) -> None:
        if not self.kind or len(self.kind) > _MAX_KIND_LEN:
            raise ValueError(f"event kind must be 1..{_MAX_KIND_LEN} characters: {self.kind!r}")
