"""What the daemon reports (status records) and what it keeps per server (``_Server``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from policies import BandObservation, BasePolicy, Buckets, PolicySnapshot
from storage import BandObservationRecord, DepthCountsRecord, ObservationRecord
from tuner.client import SGLangClient
from tuner.daemon._tables import AnyTable
from tuner.protocol import DepthCounter, DynspecState, Probe, TreeShape

# Rows kept in memory while the database is unavailable (about 100 bytes each). Beyond this
# the oldest observations are dropped, and counted, rather than exhausting memory.
DEFAULT_MAX_BUFFERED_ROWS = 200_000
# A server in metrics-only mode is asked again for the plugin's section this often, so a
# server restarted with the plugin is picked up without restarting the daemon.
DEFAULT_PLUGIN_RECHECK_S = 60.0
# Live pooling re-reads this many observation ids below its cursor: another daemon's
# transaction may commit after rows with higher ids were read (PostgreSQL allocates ids at
# insert, not at commit). A few ticks of a large fleet fit in it.
DEFAULT_POOL_LOOKBACK_IDS = 2_000
# History roll-up (Storage.rollup): at the first tick, then this often (daemon clock). The
# cutoff moves by this much between runs, so each run merges about an hour of raw rows.
DEFAULT_ROLLUP_EVERY_S = 3600.0

# What a server's readings leave to learn from, in the order they came: observations per
# (b, k), and a protocol v2 server's band observations and depth counts. Stored, they are
# what a restarted daemon replays.
LearningRow = ObservationRecord | BandObservationRecord | DepthCountsRecord

PolicyFactory = Callable[[tuple[int, ...], Buckets], BasePolicy]


@dataclass(frozen=True, slots=True)
class PushInfo:
    """The last table decided for a server (banded where its bands differ)."""

    ts: float
    version: int
    table: AnyTable
    reason: str
    outcome: str  # applied / rejected / dry_run / unsent


@dataclass(frozen=True)
class ServerStatus:
    """What the daemon knows about one server, as of the end of a tick."""

    address: str
    mode: str  # connecting / plugin / metrics-only
    up: bool | None
    arms: tuple[int, ...]
    version: int
    # What the server runs (as last read or pushed); banded where its bands differ.
    server_table: AnyTable | None
    snapshot: PolicySnapshot | None
    last_push: PushInfo | None
    last_error: str | None
    down_since: float | None
    observations: int  # fed to the policy since the daemon started
    decode_steps: int
    interval_goodput: float  # emitted tokens per busy second over the last tick (NaN: none)
    pushes: int
    restarts: int
    errors: int = 0  # failed readings and pushes (every one, though each streak logs once)
    read_only: bool = False  # another tuner pushes to this server: observe, never push
    pooled: int = 0  # pool-mates' observations fed to the policy
    # The version the server itself runs (last read or applied); ``version`` also counts
    # decisions a dry run only recorded.
    server_version: int | None = None
    # The switchback (run --holdout): the measured gain so far, and whether the server runs
    # its baseline table now.
    switchback: Any = None
    holdout_active: bool = False
    # Live probes, as last read (steps left) or just sent: (min_bs, max_bs, k, steps).
    probes: tuple[Probe, ...] = ()


@dataclass(frozen=True)
class DaemonStatus:
    """A consistent picture of the daemon after a tick, for status lines and tests."""

    ts: float
    ticks: int
    policy: str
    dry_run: bool
    servers: tuple[ServerStatus, ...]
    storage_ok: bool
    buffered_rows: int
    dropped_rows: int


@dataclass(frozen=True)
class TickSummary:
    """What one tick did (returned by :meth:`Daemon.run_once`)."""

    ts: float
    observations: int
    pushes: int
    stored: bool  # the tick's rows (and any buffered ones) reached the database


# A pool shares one policy among servers of one model, arms and draft tree.
_PoolKey = tuple[str | None, tuple[int, ...], TreeShape | None]


@dataclass
class _Server:
    """Per-server state of the loop (private, mutable)."""

    address: str
    client: SGLangClient
    mode: str = "connecting"
    arms: tuple[int, ...] = ()
    tree: TreeShape | None = None  # the draft tree of a top-k > 1 server (its readout says)
    model: str | None = None  # served_model_name / model_path from /server_info
    fresh_history: bool = False  # the model changed: the next policy starts without history
    policy: BasePolicy | None = None
    # Banded tables for this server (protocol v2, no tree, a policy with set_bands); and
    # whether set_bands was called on its own (unpooled) policy.
    bands: bool = False
    bands_set: bool = False
    band_obs: list[BandObservation] = field(default_factory=list)  # this reading's
    depth_obs: list[DepthCounter] = field(default_factory=list)  # ... and depth counts
    prev: list[DynspecState] | None = None
    version: int = 0  # highest version known to be used (ours, the server's, the history's)
    server_table: AnyTable | None = None
    server_version: int | None = None  # as last read or applied
    desired: AnyTable | None = None  # what we want the server to run (re-pushed after restarts)
    needs_push: bool = False
    probing: bool = False  # the last applied push sent probes (a greedy proposal ends them)
    probes: tuple[Probe, ...] = ()  # live probes, as last read or applied
    repush: bool = False  # needs_push because the server restarted (the reason recorded)
    start_table: AnyTable | None = None  # what the server ran before any push (gain baseline)
    last_decision: float | None = None
    dry_last: AnyTable | None = None
    started_at: float | None = None
    # Trouble (outage, malformed replies) is reported once per streak.
    down_since: float | None = None
    trouble_kind: str | None = None
    next_attempt: float = -math.inf
    backoff: float = 0.0
    last_error: str | None = None
    last_push: PushInfo | None = None
    sampler: Any = None  # MetricsSampler in metrics-only mode
    plugin_checked: float = -math.inf
    observations: int = 0
    decode_steps: int = 0
    interval_goodput: float = math.nan
    pushes: int = 0
    restarts: int = 0
    rejected_seen: list[int] = field(default_factory=list)
    errors: int = 0
    # Versions: the server's at the first reading (or after a restart), and the highest one
    # this daemon sent that may have been applied. A server version above both is foreign.
    baseline_version: int = 0
    sent_version: int = 0
    read_only: bool = False
    # Refused by every replica: not pushed again before backoff_max_s (it would be refused
    # again unless the server changed; a restart clears it).
    rejected_table: AnyTable | None = None
    rejected_at: float = -math.inf
    pending_rejection: str | None = None  # a refusal to record if the plugin gives no reason
    last_refusal: str | None = None  # why the last push was refused (said once per cause)
    pool_from_id: int = 0  # the pool's rows up to this id are in the warm start
    policy_error: str | None = None
    future: Future | None = None  # the worker reading this server, while it runs
    status: ServerStatus | None = None  # as last published
    holdout: Any = None  # the switchback's HoldoutState (run --holdout), else None

