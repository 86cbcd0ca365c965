"""The loop: read servers -> observations -> storage -> policy -> push table.

One :class:`Daemon` drives every server of a :class:`~tuner.config.TunerConfig`. Each tick
(:meth:`Daemon.run_once`), for each server independently:

1. read the plugin's state (``/server_info``; ``/metrics`` for stock SGLang);
2. turn counter deltas into observations (a restart - new start time, counters going
   backwards - gives no negative deltas and schedules a re-push of the current table);
3. feed the policy;
4. each decision period, ask the policy for a table and push it when it differs, with a
   version above anything the server or the history has seen;

then write everything the tick produced in one transaction. With several servers each is
read on its own worker thread with its own timeout, so a slow or failing server never stalls
the others (and is not asked again while its last request is still out). A failing server is
retried with backoff and reported once per outage; a failing database is retried every tick
with the rows kept in memory. A table the server refused is not pushed again for a backoff
period. A version the server reports above anything this daemon sent means another tuner (or
an operator) is pushing: the daemon then stops pushing to that server and only observes.
With a ``pool``, this daemon's servers with the same model and arms share one policy
(identical replicas learn as one, for the price of one), warm-started from the whole pool's
history, and each tick also feeds it what the pool's servers under other daemons recorded;
servers of one pool that report different models learn apart, and the daemon says so. A
server that comes back with another model gets a fresh policy. On stop, each
server gets its greedy table (never an exploration table) and the history is flushed.

Time and waiting are injected (``clock``, ``wait``) so tests drive ticks with a fake clock.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

from policies import BasePolicy, Buckets, Observation, PolicySnapshot, make_policy
from storage import (
    EventRecord,
    ObservationRecord,
    PolicyVersionRecord,
    ServerSeen,
    Storage,
)
from tuner.client import SGLangClient
from tuner.config import TunerConfig
from tuner.errors import (
    ConfigError,
    MalformedReplyError,
    PluginMissingError,
    ServerError,
    ServerUnavailableError,
    StorageError,
)
from tuner.protocol import (
    CounterRow,
    DynspecState,
    ProtocolError,
    Table,
    counter_deltas,
    format_table,
    validate_table,
)

__all__ = [
    "DEFAULT_MAX_BUFFERED_ROWS",
    "DEFAULT_PLUGIN_RECHECK_S",
    "DEFAULT_POOL_LOOKBACK_IDS",
    "DEFAULT_ROLLUP_EVERY_S",
    "Daemon",
    "DaemonStatus",
    "PushInfo",
    "ServerStatus",
    "TickSummary",
]

log = logging.getLogger(__name__)

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

PolicyFactory = Callable[[tuple[int, ...], Buckets], BasePolicy]


@dataclass(frozen=True, slots=True)
class PushInfo:
    """The last table decided for a server."""

    ts: float
    version: int
    table: Table
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
    server_table: Table | None  # what the server runs (as last read or pushed)
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


@dataclass
class _Server:
    """Per-server state of the loop (private, mutable)."""

    address: str
    client: SGLangClient
    mode: str = "connecting"
    arms: tuple[int, ...] = ()
    model: str | None = None  # served_model_name / model_path from /server_info
    fresh_history: bool = False  # the model changed: the next policy starts without history
    policy: BasePolicy | None = None
    prev: list[DynspecState] | None = None
    version: int = 0  # highest version known to be used (ours, the server's, the history's)
    server_table: Table | None = None
    server_version: int | None = None  # as last read or applied
    desired: Table | None = None  # what we want the server to run (re-pushed after restarts)
    needs_push: bool = False
    repush: bool = False  # needs_push because the server restarted (the reason recorded)
    start_table: Table | None = None  # what the server ran before any push (gain baseline)
    last_decision: float | None = None
    dry_last: Table | None = None
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
    rejected_table: Table | None = None
    rejected_at: float = -math.inf
    pending_rejection: str | None = None  # a refusal to record if the plugin gives no reason
    pool_from_id: int = 0  # the pool's rows up to this id are in the warm start
    policy_error: str | None = None
    future: Future | None = None  # the worker reading this server, while it runs
    status: ServerStatus | None = None  # as last published


def _model_of(info: dict[str, Any]) -> str | None:
    """The model a server reports in ``/server_info`` (SGLang's server args), if any."""
    for key in ("served_model_name", "model_path"):
        value = info.get(key)
        if isinstance(value, str) and value:
            return value
    return None


class _PoolPolicy:
    """One policy shared by this daemon's servers of a pool that run one model with one set
    of arms.

    Identical replicas then learn from each other's observations as they arrive, at the cost
    of one policy; each server still draws its own proposal. Thread-safe: the workers of
    several servers use it at once.
    """

    def __init__(self, policy: BasePolicy, from_id: int) -> None:
        self.policy = policy
        self.lock = threading.Lock()
        self.from_id = from_id  # the pool's rows up to this id are in the warm start
        self.pooled = 0  # rows of pool-mates under other daemons fed to it

    def update(self, obs: Observation) -> bool:
        with self.lock:
            return self.policy.update(obs)

    def propose(self) -> Table:
        with self.lock:
            return self.policy.propose()

    def greedy(self) -> Table:
        with self.lock:
            return self.policy.greedy()

    def snapshot(self) -> PolicySnapshot:
        with self.lock:
            return self.policy.snapshot()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.policy, name)


class _Snapshot:
    """Buffer contents taken for one write (or given back when the write failed)."""

    __slots__ = ("servers", "observations", "versions", "events")

    def __init__(self, servers, observations, versions, events) -> None:  # noqa: ANN001
        self.servers: dict[tuple[str, float | None], ServerSeen] = servers
        self.observations: collections.deque[ObservationRecord] = observations
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
        self.observations: collections.deque[ObservationRecord] = collections.deque()
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

    def add_observations(self, rows: Iterable[ObservationRecord]) -> None:
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

    def pending(self, server: str) -> list[ObservationRecord]:
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


class Daemon:
    """Runs the tuning loop for every server of ``config``.

    Args:
        config: the built configuration.
        storage: the history; None keeps everything in memory only (tests, experiments).
        clients: one :class:`SGLangClient` per server address; built from ``config`` (and
            ``transport``) when None. The daemon closes the clients it built.
        transport: an httpx transport for the clients it builds (tests).
        policy_factory: ``(arms, buckets) -> policy``; defaults to
            ``policies.make_policy(config.policy, ...)``.
        metrics: a ``tuner.tuner_metrics.TunerMetrics`` to keep up to date, or None.
        clock: seconds (wall-clock epoch by default; recorded in the history).
        wait: ``wait(seconds) -> stopped`` between ticks; defaults to waiting on the stop
            event, so :meth:`request_stop` (e.g. from a signal handler) ends a wait at once.
        on_tick: called with a :class:`DaemonStatus` after every tick (live status).
        stop_event: set it (e.g. from a signal handler) to stop :meth:`run`; one is created
            when None (see :meth:`request_stop`).
        max_buffered_rows: rows kept in memory while the history is unavailable.
        rollup_every_s: how often old observations are rolled up (``config.rollup_after_s``
            and ``rollup_bin_s`` say which and how; never when that is None).

    Raises:
        ConfigError: an unknown policy or bad policy parameters.
    """

    def __init__(
        self,
        config: TunerConfig,
        *,
        storage: Storage | None,
        clients: Mapping[str, SGLangClient] | None = None,
        transport: Any = None,
        policy_factory: PolicyFactory | None = None,
        metrics: Any = None,
        clock: Callable[[], float] = time.time,
        wait: Callable[[float], bool] | None = None,
        on_tick: Callable[[DaemonStatus], None] | None = None,
        stop_event: threading.Event | None = None,
        max_buffered_rows: int = DEFAULT_MAX_BUFFERED_ROWS,
        rollup_every_s: float = DEFAULT_ROLLUP_EVERY_S,
    ) -> None:
        self.config = config
        self.storage = storage
        self.buckets = Buckets(config.buckets) if config.buckets else Buckets()
        self._policy_factory = policy_factory or self._default_factory(config)
        self.metrics = metrics
        self.clock = clock
        self._stop = stop_event if stop_event is not None else threading.Event()
        self._wait = wait or self._stop.wait
        self.on_tick = on_tick
        self._own_clients = clients is None
        if clients is None:
            clients = {
                s: SGLangClient(
                    s, api_key=config.api_key, timeout=config.timeout_s, transport=transport
                )
                for s in config.servers
            }
        missing = [s for s in config.servers if s not in clients]
        if missing:
            raise ConfigError(f"no client for server {missing[0]}")
        self._servers = [_Server(address=s, client=clients[s]) for s in config.servers]
        self._buffer = _Buffer(max_buffered_rows)
        # One worker per server when there are several: each read has its own timeout and a
        # slow server holds only its own worker.
        self._executor = (
            ThreadPoolExecutor(max_workers=len(self._servers), thread_name_prefix="dynspec-srv")
            if len(self._servers) > 1
            else None
        )
        # by (model, arms): replicas of one model share; another model learns apart
        self._pool_policies: dict[tuple[str | None, tuple[int, ...]], _PoolPolicy] = {}
        self._pool_models: dict[str, str | None] = {}  # address -> model, to warn once
        self._pool_lock = threading.Lock()
        self._pool_cursor: int | None = None  # live pooling: last observation id read
        self._pool_floor = 0  # ids up to here predate the daemon (warm start covers them)
        self._pool_seen: set[int] = set()
        self._storage_down_since: float | None = None
        self._ticks = 0
        self._started = False
        self._closed = False
        self._status: DaemonStatus | None = None
        # History roll-up: due at the first tick, then every rollup_every_s.
        self.rollup_every_s = rollup_every_s
        self._next_rollup: float | None = None
        self._rollup_failing = False
        self.rollups = 0  # roll-ups that ran (tests, status)
        self.rollups_failed = 0
        # Servers shutdown could not leave on their greedy table: address -> why.
        self.unclean: dict[str, str] = {}

    @staticmethod
    def _default_factory(config: TunerConfig) -> PolicyFactory:
        name, seed = config.policy, config.seed
        try:  # fail now, naming the policy, not at the first server reading
            make_policy(name, arms=(0, 1), seed=seed)
        except ValueError as exc:
            raise ConfigError(f"policy: {exc}") from exc
        return lambda arms, buckets: make_policy(name, arms=arms, buckets=buckets, seed=seed)

    # --- lifecycle --------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Ask :meth:`run` to finish after the current tick (safe from signal handlers)."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def run(self) -> int:
        """Tick every ``interval_s`` until stopped or ``duration_s`` has passed, then
        :meth:`shutdown`. Returns the process exit status: 0, or 1 when a server could not
        be left on its greedy table (see :attr:`unclean`)."""
        cfg = self.config
        start = self.clock()
        deadline = None if cfg.duration_s is None else start + cfg.duration_s
        next_tick = start
        try:
            while not self._stop.is_set():
                self.run_once()
                now = self.clock()
                if deadline is not None and now >= deadline:
                    break
                next_tick += cfg.interval_s
                if next_tick < now:  # a slow tick: skip the missed slots, do not burst
                    next_tick = now
                until = next_tick if deadline is None else min(next_tick, deadline)
                if self._wait(max(0.0, until - now)):
                    break
        finally:
            self.shutdown()
        return 1 if self.unclean else 0

    def _start(self) -> None:
        self._started = True
        mode = "dry run (no pushes)" if self.config.dry_run else "pushing tables"
        log.info(
            "tuning %s with policy %s, %s; buckets %s; history in %s",
            ", ".join(self.config.servers),
            self.config.policy,
            mode,
            ",".join(map(str, self.buckets.edges)),
            self.storage.url if self.storage else "memory only",
        )
        self._buffer.add_event(
            EventRecord(None, self.clock(), "start", f"policy={self.config.policy} {mode}")
        )
        if self.config.pool is not None and self.storage is not None:
            log.info("pool %s: learning from every server recorded in it", self.config.pool)

    def shutdown(self) -> None:
        """Leave every reachable server on its greedy table, flush the history, close."""
        if self._closed:
            return
        self._closed = True
        # Readings still out end within their own timeout; then nothing runs concurrently.
        for srv in self._servers:
            if srv.future is not None:
                wait_futures([srv.future])
                srv.future = None
        now = self.clock()
        for srv in self._servers:
            if (
                self.config.dry_run
                or srv.read_only
                or srv.mode != "plugin"
                or srv.policy is None
            ):
                continue
            greedy = srv.policy.greedy()
            if greedy == srv.server_table:
                continue
            if srv.down_since is None and self._push(srv, greedy, "shutdown: greedy table", now):
                continue
            self._unclean_stop(srv, greedy, now)
        # A last picture, so what is shown at exit is the table the servers were left on.
        self._publish(now)
        self._buffer.add_event(EventRecord(None, now, "stop", ""))
        if not self._flush(now) and self.storage is not None:
            log.error(
                "history: %d rows could not be written to %s and are lost",
                len(self._buffer),
                self.storage.url,
            )
        if self._own_clients:
            for srv in self._servers:
                srv.client.close()
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    def _unclean_stop(self, srv: _Server, greedy: Table, now: float) -> None:
        """The greedy table could not be pushed at stop: the server may keep exploring."""
        runs = (f"v{srv.server_version} {format_table(srv.server_table)}"
                if srv.server_table is not None else "a table this daemon cannot confirm")
        why = srv.last_error or "the push was refused"
        detail = (f"could not leave the greedy table {format_table(greedy)} at stop ({why}); "
                  f"the server may still run {runs}, possibly an exploration table: push it "
                  "again (restart the tuner) or restart the server")
        log.error("%s: %s", srv.address, detail)
        self._event(srv.address, now, "stop_unclean", detail)
        self.unclean[srv.address] = detail

    # --- one tick ---------------------------------------------------------------------------

    def run_once(self) -> TickSummary:
        """One tick over every server, then one write to the history."""
        if not self._started:
            self._start()
        now = self.clock()
        self._read_pool()
        n_obs = n_push = 0
        due = [s for s in self._servers if now >= s.next_attempt and s.future is None]
        if self._executor is None:
            for srv in due:
                o, p = self._tick_guarded(srv, now)
                n_obs += o
                n_push += p
        else:
            for srv in due:
                srv.future = self._executor.submit(self._tick_guarded, srv, now)
            # Wait for the tick's readings, but never longer than an interval: a server that
            # is slower keeps its worker and is skipped until it answers or times out.
            running = [s.future for s in self._servers if s.future is not None]
            wait_futures(running, timeout=self.config.interval_s)
            for srv in self._servers:
                if srv.future is not None and srv.future.done():
                    o, p = srv.future.result()
                    srv.future = None
                    if srv in due:
                        n_obs += o
                        n_push += p
        stored = self._flush(now)
        self._maybe_rollup(now)  # history roll-up: about hourly, never every tick
        self._ticks += 1
        self._publish(now)
        return TickSummary(ts=now, observations=n_obs, pushes=n_push, stored=stored)

    def _tick_guarded(self, srv: _Server, now: float) -> tuple[int, int]:
        try:
            return self._tick_server(srv, now)
        except Exception as exc:  # a bug for one server must not stop the others
            log.exception("%s: unexpected error in the tick", srv.address)
            self._trouble(srv, now, "malformed_reply", f"internal error: {exc!r}")
            return 0, 0

    def _tick_server(self, srv: _Server, now: float) -> tuple[int, int]:
        try:
            if srv.mode == "metrics-only":
                observations = self._read_metrics_only(srv, now)
            else:
                observations = self._read_plugin(srv, now)
        except PluginMissingError as exc:
            self._enter_metrics_only(srv, now, exc)
            return 0, 0
        except ServerUnavailableError as exc:
            self._trouble(srv, now, "outage", str(exc))
            return 0, 0
        except ServerError as exc:  # malformed replies, refused API key ...
            self._trouble(srv, now, "malformed_reply", str(exc))
            return 0, 0
        self._recovered(srv, now)
        used = self._learn(srv, observations, now)
        pushes = self._decide(srv, now)
        return used, pushes

    # --- reading ----------------------------------------------------------------------------

    def _read_plugin(self, srv: _Server, now: float) -> list[Observation]:
        info = srv.client.server_info()
        self._note_model(srv, _model_of(info), now)  # metrics-only mode reads it here too
        states = srv.client.parse_state(info)
        arms = states[0].arms
        if any(s.arms != arms for s in states):
            raise MalformedReplyError(
                srv.address, f"DP replicas report different arms: {[s.arms for s in states]}"
            )
        if srv.mode != "plugin":
            if srv.mode == "metrics-only":
                log.info("%s: the dynspec plugin is loaded now; leaving metrics-only mode",
                         srv.address)
            srv.mode = "plugin"
            srv.sampler = None
            if self.metrics is not None:
                self.metrics.set_plugin_loaded(srv.address, True)
        if srv.policy is None or arms != srv.arms:
            if srv.policy is not None:
                self._event(srv.address, now, "arms_changed", f"{srv.arms} -> {arms}")
                log.warning("%s: arms changed %s -> %s; rebuilding the policy",
                            srv.address, srv.arms, arms)
            self._build_policy(srv, arms)
            srv.prev = None
            # Start the first decision one period from now, after seeing the server's own
            # table at work; a restart re-push still goes out at once.
            srv.last_decision = now
        first = srv.prev is None
        restarts = srv.restarts
        srv.version = max(srv.version, *(s.policy_version for s in states))
        tables = {s.table for s in states}
        srv.server_table = states[0].table if len(tables) == 1 else None
        if len(tables) > 1 and srv.desired is not None:
            srv.needs_push = True  # replicas disagree: bring them back in step
        srv.started_at = states[0].started_at
        self._buffer.seen(ServerSeen(srv.address, arms, now, srv.started_at, self.config.pool,
                                     srv.model))
        observations = self._deltas(srv, states, now)
        srv.prev = states
        server_version = max(s.policy_version for s in states)
        srv.server_version = server_version
        if first or srv.restarts != restarts:
            # Whatever the server runs now (its default, a table installed at start) is the
            # baseline; only versions above it and above ours are someone else's.
            srv.baseline_version, srv.sent_version = server_version, 0
            if srv.server_table is not None:  # the baseline of report's gain figures
                srv.start_table = srv.server_table
                self._event(srv.address, now, "initial_table",
                            f"v{server_version} {format_table(srv.server_table)}")
        elif server_version > max(srv.baseline_version, srv.sent_version):
            top = max(states, key=lambda st: st.policy_version)
            self._foreign_push(srv, now, server_version, top.table)
        return observations

    def _foreign_push(self, srv: _Server, now: float, version: int, table: Table) -> None:
        """Someone else pushed a table: two tuners on one server would fight over it."""
        srv.baseline_version = version
        if srv.read_only or self.config.dry_run:
            return
        srv.read_only = True
        srv.needs_push = False
        ours = f"v{srv.sent_version}" if srv.sent_version else "nothing yet"
        detail = (
            f"the server runs v{version} {format_table(table)}, which this daemon did not "
            f"send (it sent {ours}): another tuner or an operator is pushing tables. This "
            "daemon stops pushing to it and only observes (learning and history go on); "
            "stop the other one, or run one of them with --dry-run, then restart this one"
        )
        log.error("%s: %s", srv.address, detail)
        self._event(srv.address, now, "foreign_push", detail)

    def _deltas(self, srv: _Server, states: list[DynspecState], now: float) -> list[Observation]:
        prev = srv.prev
        if prev is None:
            # First reading: counters since the server started, under tables we did not
            # choose, possibly already in the history. A baseline, not an observation.
            srv.rejected_seen = [s.updates_rejected for s in states]
            return []
        if len(prev) != len(states):
            self._restart(srv, now, f"DP replicas {len(prev)} -> {len(states)}")
            srv.rejected_seen = [s.updates_rejected for s in states]
            return []
        merged: dict[tuple[int, int], list[float]] = {}
        pending, srv.pending_rejection = srv.pending_rejection, None
        if pending is not None and not any(
            s.updates_rejected > (srv.rejected_seen[i] if i < len(srv.rejected_seen)
                                  else p.updates_rejected)
            for i, (p, s) in enumerate(zip(prev, states, strict=True))
        ):
            # SGLang said no but the plugin counted nothing: SGLang itself refused the keys.
            self._event(srv.address, now, "update_rejected", pending)
            if self.metrics is not None:
                self.metrics.record_rejected_update(srv.address)
        for i, (p, s) in enumerate(zip(prev, states)):
            seen = srv.rejected_seen[i] if i < len(srv.rejected_seen) else p.updates_rejected
            if s.updates_rejected > seen:
                detail = f"replica {i}: {s.last_rejection or 'no reason given'}"
                self._event(srv.address, now, "update_rejected", detail)
                log.warning("%s: an update was refused (%s)", srv.address, detail)
                if self.metrics is not None:
                    self.metrics.record_rejected_update(srv.address)
            if s.started_at != p.started_at:
                self._restart(srv, now, f"replica {i}: started_at {p.started_at} -> {s.started_at}")
                if s.started_at > p.started_at:
                    # Counters of a restarted server count from zero: all of it is new.
                    for c in s.counters:
                        _add(merged, c)
                continue
            deltas = counter_deltas(p.counters, s.counters)
            if deltas is None:
                self._restart(srv, now, f"replica {i}: counters went backwards")
                continue
            for d in deltas:
                _add(merged, d)
        srv.rejected_seen = [s.updates_rejected for s in states]
        return [
            Observation(b, k, int(v[0]), int(v[1]), int(v[2]), int(v[3]), float(v[4]))
            for (b, k), v in sorted(merged.items())
            if v[0] > 0
        ]

    def _restart(self, srv: _Server, now: float, detail: str) -> None:
        srv.restarts += 1
        srv.rejected_table = None
        self._event(srv.address, now, "restart", detail)
        if self.metrics is not None:
            self.metrics.record_restart(srv.address)
        if srv.desired is not None and not self.config.dry_run:
            srv.needs_push = True
            srv.repush = True
        log.warning("%s: server restarted (%s)", srv.address, detail)

    def _enter_metrics_only(self, srv: _Server, now: float, exc: PluginMissingError) -> None:
        from tuner.metrics_only import MetricsSampler, metrics_only_notice

        self._recovered(srv, now)
        if srv.mode != "metrics-only":
            log.warning("%s", metrics_only_notice(srv.address))
            self._event(srv.address, now, "plugin_missing", str(exc))
            srv.mode = "metrics-only"
            srv.sampler = MetricsSampler(server=srv.address, buckets=self.buckets)
            srv.prev = None
            srv.plugin_checked = now
            if self.metrics is not None:
                self.metrics.set_plugin_loaded(srv.address, False)

    def _read_metrics_only(self, srv: _Server, now: float) -> list[Observation]:
        from tuner.metrics_only import LOADS_PATH

        if now - srv.plugin_checked >= DEFAULT_PLUGIN_RECHECK_S:
            srv.plugin_checked = now
            try:
                return self._read_plugin(srv, now)
            except PluginMissingError:
                pass
        text = srv.client.metrics_text()
        loads = srv.client.loads(LOADS_PATH)
        observations = srv.sampler.observe(text, loads, now=now)
        ks = {o.k for o in observations}
        if srv.policy is None or not ks <= set(srv.arms):
            arms = tuple(sorted(set(srv.arms) | ks)) or ()
            if arms:
                self._build_policy(srv, arms)
        self._buffer.seen(ServerSeen(srv.address, srv.arms, now, None, self.config.pool,
                                     srv.model))
        return observations

    def _note_model(self, srv: _Server, model: str | None, now: float) -> None:
        """Keep the model the server reports. Another one than before drops the policy (what
        it learnt is about the old model's acceptance and step times): the next reading
        builds a fresh one, without a warm start. A reading that names none changes nothing."""
        if model is None or model == srv.model:
            return
        was, srv.model = srv.model, model
        if was is None or srv.policy is None:
            return
        self._event(srv.address, now, "model_changed", f"{was} -> {model}")
        log.warning("%s: the server now runs %s (was %s); starting a fresh policy",
                    srv.address, model, was)
        srv.policy = None
        srv.fresh_history = True
        srv.desired, srv.needs_push, srv.rejected_table = None, False, None

    # --- learning and deciding --------------------------------------------------------------

    def _build_policy(self, srv: _Server, arms: tuple[int, ...]) -> None:
        """A fresh policy for ``arms``, warm-started from this server's history (with a pool:
        the pool's shared policy for this model and these arms, built and warm-started once);
        not warm-started right after the server changed model (``fresh_history``)."""
        warm, srv.fresh_history = not srv.fresh_history, False
        srv.arms = arms
        if self.storage is not None:
            try:  # new tables are numbered above every version recorded for this server
                latest = self.storage.latest_policy_version(srv.address)
                if latest is not None:
                    srv.version = max(srv.version, latest.version)
            except StorageError as exc:
                log.warning("%s: the history is unavailable: %s", srv.address, exc)
        if self.config.pool is None:
            self._new_policy(srv, arms, warm=warm)
            return
        with self._pool_lock:  # two replicas read for the first time at once build one
            self._check_pool_models(srv)
            key = (srv.model, arms)
            shared = self._pool_policies.get(key)
            if shared is None:
                self._new_policy(srv, arms, warm=warm)
                if srv.policy is not None:
                    shared = _PoolPolicy(srv.policy, srv.pool_from_id)
                    self._pool_policies[key] = shared
            srv.policy = shared

    def _history_of_this_model(self, srv: _Server) -> tuple[bool, float | None]:
        """Whether the stored history of ``srv`` is about the model it runs now, and from
        when (None: all of it). Not when it names another model: the server was redeployed
        while this daemon was away, which is then recorded."""
        assert self.storage is not None
        rec = self.storage.server(srv.address)
        if rec is None or rec.model is None or srv.model is None:
            return True, None
        if rec.model == srv.model:
            return True, rec.model_since
        now = self.clock()
        detail = f"{rec.model} -> {srv.model} (while this daemon was not watching)"
        self._event(srv.address, now, "model_changed", detail)
        log.warning("%s: the server now runs %s, the history says %s; starting a fresh "
                    "policy", srv.address, srv.model, rec.model)
        return False, None

    def _check_pool_models(self, srv: _Server) -> None:
        """Warn once per model that joins a pool whose servers run another model."""
        if self._pool_models.get(srv.address, "") == srv.model:
            return
        known = {a: m for a, m in self._pool_models.items() if a != srv.address}
        self._pool_models[srv.address] = srv.model
        if known and srv.model not in known.values():
            log.warning(
                "pool %s: %s runs %s, but %s; servers of different models learn apart "
                "(a pool is for replicas of one model)", self.config.pool, srv.address,
                srv.model or "an unnamed model",
                ", ".join(f"{a} runs {m or 'an unnamed model'}" for a, m in sorted(known.items())),
            )

    def _new_policy(self, srv: _Server, arms: tuple[int, ...], *, warm: bool = True) -> None:
        try:
            policy = self._policy_factory(arms, self.buckets)
        except ValueError as exc:
            # e.g. a static table naming an arm this server lacks (metrics-only mode knows
            # only the arm the server runs): say so once, keep reading, decide nothing.
            srv.policy = None
            if srv.policy_error != str(exc):
                srv.policy_error = str(exc)
                log.error("%s: policy %s cannot work with arms %s (%s); reading and recording "
                          "only", srv.address, self.config.policy, list(arms), exc)
            return
        srv.policy_error = None
        rows: list[ObservationRecord] = []
        if self.storage is not None and warm:
            try:
                if self.config.pool is not None:
                    srv.pool_from_id = self.storage.last_observation_id()
                warm, since = self._history_of_this_model(srv)
                if warm:
                    rows = self.storage.warm_start(srv.address, arms=arms, since=since,
                                                   pool=self.config.pool, model=srv.model)
            except StorageError as exc:
                log.warning("%s: no warm start, the history is unavailable: %s",
                            srv.address, exc)
        allowed = set(arms)
        pending = self._buffer.pending(srv.address) if warm else []
        used = steps = 0
        for r in [*rows, *pending]:
            if r.k not in allowed:
                continue
            if policy.update(
                Observation(r.b, r.k, r.decode_steps, r.emitted_tokens, r.accepted_drafts,
                            r.drafted_tokens, r.busy_s)
            ):
                used += 1
                steps += r.decode_steps
        if used:
            pooled = f" (pool {self.config.pool})" if self.config.pool is not None else ""
            log.info("%s: warm start from %d stored observations%s (%d decode steps)",
                     srv.address, used, pooled, steps)
        srv.policy = policy

    def _learn(self, srv: _Server, observations: Sequence[Observation], now: float) -> int:
        records = []
        used = steps = emitted = 0
        busy = 0.0
        for o in observations:
            records.append(
                ObservationRecord(srv.address, now, o.b, o.k, int(o.decode_steps),
                                  int(round(o.emitted_tokens)), int(round(o.accepted_drafts)),
                                  int(round(o.drafted_tokens)), float(o.busy_s))
            )
            # Without a policy (it could not be built) the history still gets every row.
            if srv.policy is not None and srv.policy.update(o):
                used += 1
                steps += o.decode_steps
                emitted += o.emitted_tokens
                busy += o.busy_s
            elif srv.policy is not None:
                log.debug("%s: observation not used: %s", srv.address, o.problem() or "arm")
        self._buffer.add_observations(records)
        srv.observations += used
        srv.decode_steps += int(steps)
        srv.interval_goodput = emitted / busy if busy > 0 else math.nan
        if self.metrics is not None and records:
            self.metrics.record_observations(srv.address, len(records))
        return used

    def _decide(self, srv: _Server, now: float) -> int:
        if srv.mode != "plugin" or srv.policy is None or srv.read_only:
            return 0
        due = srv.last_decision is None or now - srv.last_decision >= self.config.decision_period_s
        if not due and not srv.needs_push:
            return 0
        repush, srv.repush = srv.repush and srv.needs_push, False
        before = srv.desired
        if due:
            srv.last_decision = now
            proposal = srv.policy.propose()
            reason = "greedy" if proposal == srv.policy.greedy() else "explore"
            if repush and proposal == before:
                reason = "re-push after restart"
            try:
                proposal = validate_table(proposal, srv.arms)
            except ProtocolError as exc:  # a policy bug must never reach a server
                log.error("%s: policy %s proposed an invalid table (%s); keeping %s",
                          srv.address, self.config.policy, exc,
                          format_table(srv.server_table) if srv.server_table else "the table")
                return 0
            srv.desired = proposal
        else:
            proposal = srv.desired
            reason = "re-push after restart" if repush else "re-push: replicas disagree"
        if proposal is None:
            srv.needs_push = False
            return 0
        if self.config.dry_run:
            if proposal != srv.dry_last:
                srv.dry_last = proposal
                srv.version += 1
                self._record_version(srv, now, srv.version, proposal, reason, "dry_run")
                log.info("%s: would push v%d %s (%s; dry run)", srv.address, srv.version,
                         format_table(proposal), reason)
            return 0
        if proposal == srv.server_table:
            if repush:
                log.info("%s: the restarted server already runs %s; nothing to re-push",
                         srv.address, format_table(proposal))
            srv.needs_push = False
            return 0
        if proposal == srv.rejected_table and now - srv.rejected_at < self.config.backoff_max_s:
            # Refused by every replica already: the same table would be refused again.
            srv.needs_push = False
            log.debug("%s: not pushing %s again (refused)", srv.address, format_table(proposal))
            return 0
        return self._push(srv, proposal, reason, now)

    def _push(self, srv: _Server, table: Table, reason: str, now: float) -> int:
        version = srv.version + 1
        try:
            reply = srv.client.push(table, version)
        except ServerUnavailableError as exc:
            # It may have been applied before the connection broke: never call it foreign.
            srv.sent_version = max(srv.sent_version, version)
            self._record_version(srv, now, version, table, reason, "unsent")
            self._trouble(srv, now, "outage", str(exc))
            return 0
        except (ServerError, ProtocolError) as exc:
            srv.version = version
            srv.needs_push = False
            srv.rejected_table, srv.rejected_at = table, now
            srv.errors += 1
            self._record_version(srv, now, version, table, reason, "rejected")
            self._event(srv.address, now, "update_rejected", str(exc))
            log.warning("%s: push of v%d refused: %s", srv.address, version, exc)
            if self.metrics is not None:
                self.metrics.record_rejected_update(srv.address)
            return 0
        # The version is spent either way: a replica that refused it compares the next one.
        srv.version = version
        if any(reply):
            srv.sent_version = max(srv.sent_version, version)
        if all(reply):
            srv.server_table = table
            srv.server_version = version
            srv.needs_push = False
            srv.rejected_table = None
            srv.pushes += 1
            self._record_version(srv, now, version, table, reason, "applied")
            log.info("%s: pushed v%d %s (%s)", srv.address, version, format_table(table), reason)
            if self.metrics is not None:
                self.metrics.record_push(srv.address, version)
            return 1
        refused = [i for i, ok in enumerate(reply) if not ok]
        # Partly applied: replicas now disagree; the next decision pushes to all again.
        srv.server_table = None if len(refused) < len(reply) else srv.server_table
        srv.needs_push = False
        if len(refused) == len(reply):
            srv.rejected_table, srv.rejected_at = table, now
        srv.pending_rejection = f"v{version} {format_table(table)} refused by replica(s) {refused}"
        self._record_version(srv, now, version, table, reason, "rejected")
        log.warning("%s: v%d refused by replica(s) %s; their reason follows on the next reading",
                    srv.address, version, refused)
        return 0

    # --- trouble ----------------------------------------------------------------------------

    def _trouble(self, srv: _Server, now: float, kind: str, message: str) -> None:
        """A failed reading or push: back off, and say so once per streak."""
        srv.last_error = message
        srv.errors += 1
        first = srv.down_since is None
        if first:
            srv.down_since = now
            srv.backoff = self.config.interval_s
        else:
            srv.backoff = min(srv.backoff * 2, self.config.backoff_max_s)
        if first or kind != srv.trouble_kind:
            srv.trouble_kind = kind
            what = "unreachable" if kind == "outage" else "answering unexpectedly"
            detail = message.removeprefix(f"{srv.address}: ")
            log.warning("%s %s: %s (retrying with backoff up to %g s; said once until it "
                        "recovers)", srv.address, what, detail, self.config.backoff_max_s)
            self._event(srv.address, now, kind, message)
            if self.metrics is not None and kind == "outage":
                self.metrics.record_outage(srv.address)
        if self.metrics is not None:
            self.metrics.set_up(srv.address, False)
        srv.next_attempt = now + srv.backoff

    def _recovered(self, srv: _Server, now: float) -> None:
        if srv.down_since is not None:
            lasted = now - srv.down_since
            log.info("%s: back after %.0f s", srv.address, lasted)
            self._event(srv.address, now, "recovered", f"after {lasted:.1f} s")
        srv.down_since = None
        srv.trouble_kind = None
        srv.last_error = None
        srv.backoff = 0.0
        srv.next_attempt = -math.inf
        if self.metrics is not None:
            self.metrics.set_up(srv.address, True)

    # --- history ----------------------------------------------------------------------------

    def _event(self, server: str | None, now: float, kind: str, detail: str) -> None:
        self._buffer.add_event(EventRecord(server, now, kind, detail[:2000]))

    def _record_version(
        self, srv: _Server, now: float, version: int, table: Table, reason: str, outcome: str
    ) -> None:
        self._buffer.add_version(
            PolicyVersionRecord(srv.address, now, version, table, self.config.policy, reason,
                                outcome)
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
            self.storage.record_tick(
                servers=list(snap.servers.values()),
                observations=list(snap.observations),
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

    def _read_pool(self) -> None:
        """Live pooling: hand each server what its pool-mates recorded since the last tick."""
        pool = self.config.pool
        if pool is None or self.storage is None:
            return
        try:
            if self._pool_cursor is None:
                self._pool_cursor = self._pool_floor = self.storage.last_observation_id()
                return
            # Ids of the window below the cursor and above it; rows only for the unseen ones
            # (new rows, and now and then a transaction that committed late).
            lookback = max(0, self._pool_cursor - DEFAULT_POOL_LOOKBACK_IDS)
            # Rows of this daemon's own servers reach the shared policy directly.
            ids = self.storage.pool_observation_ids(
                pool, after_id=max(lookback, self._pool_floor), exclude=self.config.servers)
            unseen = [i for i in ids if i not in self._pool_seen]
            fresh = self.storage.pool_observations(pool, ids=unseen) if unseen else []
        except StorageError as exc:
            log.debug("pool %s: not read this tick: %s", pool, exc)
            return
        if not fresh:
            return
        self._pool_seen.update(i for i, _ in fresh)
        self._pool_cursor = max(self._pool_cursor, *(i for i, _ in fresh))
        floor = self._pool_cursor - DEFAULT_POOL_LOOKBACK_IDS
        self._pool_seen = {i for i in self._pool_seen if i > floor}
        with self._pool_lock:
            shared = list(self._pool_policies.items())
        mates: dict[str, str | None] = {}
        if any(key[0] is not None for key, _ in shared):  # a model to tell mates apart by
            try:
                mates = {rec.address: rec.model for rec in self.storage.servers()}
            except StorageError as exc:
                log.debug("pool %s: pool-mates' models not read this tick: %s", pool, exc)
        for (model, arms), policy in shared:
            allowed = set(arms)
            # A pool-mate known to run another model teaches this policy nothing.
            obs = [(i, Observation(r.b, r.k, r.decode_steps, r.emitted_tokens,
                                   r.accepted_drafts, r.drafted_tokens, r.busy_s))
                   for i, r in fresh if i > policy.from_id and r.k in allowed
                   and (model is None or mates.get(r.server) in (None, model))]
            with policy.lock:  # a worker of a slow server may hold it: fed as one batch
                policy.pooled += sum(1 for _, o in obs if policy.policy.update(o))

    # --- status -----------------------------------------------------------------------------

    def _publish(self, now: float) -> None:
        servers = []
        for srv in self._servers:
            busy = srv.future is not None  # its worker is still out (a slow server)
            if busy and srv.status is not None:
                servers.append(srv.status)  # the last consistent picture
                continue
            snap = srv.policy.snapshot() if srv.policy is not None and not busy else None
            if snap is not None and self.metrics is not None:
                self.metrics.set_snapshot(srv.address, snap)
                self.metrics.set_tables(srv.address, start=srv.start_table,
                                        current=srv.server_table)
            servers.append(
                ServerStatus(
                    address=srv.address,
                    mode="read-only" if srv.read_only else srv.mode,
                    up=None if srv.mode == "connecting" and srv.down_since is None
                    else srv.down_since is None,
                    arms=srv.arms,
                    version=srv.version,
                    server_table=srv.server_table,
                    snapshot=snap,
                    last_push=srv.last_push,
                    last_error=srv.last_error,
                    down_since=srv.down_since,
                    observations=srv.observations,
                    decode_steps=srv.decode_steps,
                    interval_goodput=srv.interval_goodput,
                    pushes=srv.pushes,
                    restarts=srv.restarts,
                    errors=srv.errors,
                    read_only=srv.read_only,
                    pooled=srv.policy.pooled if isinstance(srv.policy, _PoolPolicy) else 0,
                    server_version=srv.server_version,
                )
            )
            srv.status = servers[-1]
        self._status = DaemonStatus(
            ts=now,
            ticks=self._ticks,
            policy=self.config.policy,
            dry_run=self.config.dry_run,
            servers=tuple(servers),
            storage_ok=self._storage_down_since is None,
            buffered_rows=len(self._buffer),
            dropped_rows=self._buffer.dropped,
        )
        if self.metrics is not None:
            self.metrics.record_tick(history_ok=self._status.storage_ok)
        if self.on_tick is not None:
            self.on_tick(self._status)

    def status(self) -> DaemonStatus | None:
        """The picture after the last tick (None before the first)."""
        return self._status

    def policy_of(self, address: str) -> BasePolicy | None:
        """The live policy of a server (None until it has been read)."""
        for srv in self._servers:
            if srv.address == address:
                p = srv.policy
                return p.policy if isinstance(p, _PoolPolicy) else p
        raise KeyError(address)


def _add(merged: dict[tuple[int, int], list[float]], c: CounterRow) -> None:
    """Sum DP replicas' counters of one ``(b, k)``."""
    row = merged.setdefault((c.b, c.k), [0, 0, 0, 0, 0.0])
    row[0] += c.decode_steps
    row[1] += c.emitted_tokens
    row[2] += c.accepted_drafts
    row[3] += c.drafted_tokens
    row[4] += c.busy_s
