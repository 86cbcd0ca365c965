"""The loop: :class:`Daemon`'s lifecycle, one tick over every server, and its status."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

from policies import BasePolicy, Buckets, make_policy
from storage import EventRecord, Storage
from tuner.client import SGLangClient
from tuner.config import TunerConfig
from tuner.daemon._book import _PolicyBook, _PoolPolicy
from tuner.daemon._history import _Buffer, _HistoryWriter
from tuner.daemon._holdout import HoldoutState, _Holdout
from tuner.daemon._push import _Pusher
from tuner.daemon._records import (
    DEFAULT_MAX_BUFFERED_ROWS,
    DEFAULT_ROLLUP_EVERY_S,
    DaemonStatus,
    PolicyFactory,
    ServerStatus,
    TickSummary,
    _PoolKey,
    _Server,
)
from tuner.daemon._session import _Session
from tuner.errors import ConfigError
from tuner.daemon._tables import AnyTable, flat, show_table

__all__ = ["Daemon"]

log = logging.getLogger("tuner.daemon")  # one logger name for the whole loop


class Daemon(_Session, _Pusher, _PolicyBook, _HistoryWriter, _Holdout):
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
        if config.holdout is not None:
            from tuner.switchback import Schedule

            for i, srv in enumerate(self._servers):  # servers' schedules differ, seeded
                srv.holdout = HoldoutState(Schedule(config.holdout, config.holdout_window_s,
                                                    seed=config.seed * 1000 + i))
        self._buffer = _Buffer(max_buffered_rows)
        # One worker per server when there are several: each read has its own timeout and a
        # slow server holds only its own worker.
        self._executor = (
            ThreadPoolExecutor(max_workers=len(self._servers), thread_name_prefix="dynspec-srv")
            if len(self._servers) > 1
            else None
        )
        # by (model, arms): replicas of one model share; another model learns apart
        self._pool_policies: dict[_PoolKey, _PoolPolicy] = {}
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
            self._holdout_stop(srv, now)  # a baseline window ends here, like any table
            greedy = self._proposal(srv, greedy=True)
            if greedy == srv.server_table and not srv.probing:
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

    def _unclean_stop(self, srv: _Server, greedy: AnyTable, now: float) -> None:
        """The greedy table could not be pushed at stop: the server may keep exploring."""
        runs = (f"v{srv.server_version} {show_table(srv.server_table)}"
                if srv.server_table is not None else "a table this daemon cannot confirm")
        why = srv.last_error or "the push was refused"
        detail = (f"could not leave the greedy table {show_table(greedy)} at stop ({why}); "
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
                tuned = srv.server_table
                if srv.holdout is not None and srv.holdout.active and srv.desired is not None:
                    tuned = srv.desired  # the gain is the tuned table's, not the holdout's
                # The gain reads v1 tables: a banded one by its unknown band's arms.
                self.metrics.set_tables(
                    srv.address, start=None if srv.start_table is None else flat(srv.start_table),
                    current=None if tuned is None else flat(tuned))
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
                    switchback=srv.holdout.result if srv.holdout is not None else None,
                    holdout_active=srv.holdout is not None and srv.holdout.active,
                    probes=srv.probes,
                )
            )
            if self.metrics is not None and srv.holdout is not None:
                self.metrics.set_switchback(srv.address, servers[-1].switchback,
                                            active=servers[-1].holdout_active)
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

    def greedy_table(self, address: str) -> AnyTable | None:
        """The table the daemon leaves a server on at stop: its policy's greedy one, banded
        for a banding server (None until it has a policy)."""
        for srv in self._servers:
            if srv.address == address:
                return None if srv.policy is None else self._proposal(srv, greedy=True)
        raise KeyError(address)

    def policy_of(self, address: str) -> BasePolicy | None:
        """The live policy of a server (None until it has been read)."""
        for srv in self._servers:
            if srv.address == address:
                p = srv.policy
                return p.policy if isinstance(p, _PoolPolicy) else p
        raise KeyError(address)
