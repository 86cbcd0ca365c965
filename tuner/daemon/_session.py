"""One server's session: reading it (plugin or metrics-only), turning counters into
observations, restarts, foreign pushes, and trouble with back-off."""

from __future__ import annotations

import logging
import math

from policies import Buckets, Observation, band_observations, sum_by_arm
from storage import ServerSeen
from tuner.config import TunerConfig
from tuner.daemon._book import _model_of, _PoolPolicy
from tuner.daemon._records import DEFAULT_PLUGIN_RECHECK_S, _Server
from tuner.daemon._tables import AnyTable, canon, show_table
from tuner.errors import (
    MalformedReplyError,
    PluginMissingError,
    ServerError,
    ServerUnavailableError,
)
from tuner.protocol import (
    BAND_EDGES,
    BandCounter,
    CounterRow,
    DepthCounter,
    DynspecState,
    TreeShape,
    band_counter_deltas,
    counter_deltas,
    depth_counter_deltas,
)

log = logging.getLogger("tuner.daemon")  # one logger name for the whole loop


class _Session:
    """The :class:`~tuner.daemon.Daemon`'s per-server tick up to the observations; then
    ``_learn`` and ``_decide`` (:mod:`._push`)."""

    config: TunerConfig
    buckets: Buckets
    metrics: object

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
        tree = states[0].tree
        if srv.policy is None or arms != srv.arms or tree != srv.tree:
            if srv.policy is not None:
                was, now_is = _arms_text(srv.arms, srv.tree), _arms_text(arms, tree)
                self._event(srv.address, now, "arms_changed", f"{was} -> {now_is}")
                log.warning("%s: arms changed %s -> %s; rebuilding the policy",
                            srv.address, was, now_is)
            srv.tree = tree
            self._build_policy(srv, arms,
                               banded=tree is None and min(s.protocol for s in states) >= 2)
            srv.prev = None
            # Start the first decision one period from now, after seeing the server's own
            # table at work; a restart re-push still goes out at once.
            srv.last_decision = now
        self._set_banding(srv, states)
        first = srv.prev is None
        restarts = srv.restarts
        srv.version = max(srv.version, *(s.policy_version for s in states))
        tables = {_state_table(s) for s in states}
        srv.server_table = _state_table(states[0]) if len(tables) == 1 else None
        srv.probes = states[0].probes
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
                            f"v{server_version} {show_table(srv.server_table)}")
        elif server_version > max(srv.baseline_version, srv.sent_version):
            top = max(states, key=lambda st: st.policy_version)
            self._foreign_push(srv, now, server_version, _state_table(top))
        return observations

    def _set_banding(self, srv: _Server, states: list[DynspecState]) -> None:
        """Bands for a server whose every replica speaks protocol v2, without a draft tree,
        under a policy that learns per band (``set_bands``, called once per policy: a pooled
        one is shared). Anything else is given band-agnostic tables."""
        policy = srv.policy
        inner = policy.policy if isinstance(policy, _PoolPolicy) else policy
        srv.bands = (
            inner is not None
            and srv.tree is None
            and min(s.protocol for s in states) >= 2
            and callable(getattr(inner, "set_bands", None))
        )
        if not srv.bands:
            return
        holder = policy if isinstance(policy, _PoolPolicy) else srv
        if not holder.bands_set:
            policy.set_bands(BAND_EDGES)
            holder.bands_set = True

    def _foreign_push(self, srv: _Server, now: float, version: int, table: AnyTable) -> None:
        """Someone else pushed a table: two tuners on one server would fight over it."""
        srv.baseline_version = version
        if srv.read_only or self.config.dry_run:
            return
        srv.read_only = True
        srv.needs_push = False
        ours = f"v{srv.sent_version}" if srv.sent_version else "nothing yet"
        detail = (
            f"the server runs v{version} {show_table(table)}, which this daemon did not "
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
            srv.band_obs, srv.depth_obs = [], []
            return []
        if len(prev) != len(states):
            self._restart(srv, now, f"DP replicas {len(prev)} -> {len(states)}")
            srv.rejected_seen = [s.updates_rejected for s in states]
            srv.band_obs, srv.depth_obs = [], []
            return []
        new: list[CounterRow] = []  # every DP replica's, summed per (b, k) below
        bands: list[BandCounter] = []  # and their band counters' deltas, as they come
        depths: list[DepthCounter] = []  # ... and depth counters' deltas
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
                    new.extend(s.counters)
                    bands.extend(s.bands)
                    depths.extend(s.depths)
                continue
            deltas = counter_deltas(p.counters, s.counters)
            if deltas is None:
                self._restart(srv, now, f"replica {i}: counters went backwards")
                continue
            new.extend(deltas)
            # Band counters that went backwards alone are not a restart the (b, k) ones
            # missed; they are dropped, never fed across it.
            bands.extend(band_counter_deltas(p.bands, s.bands) or ())
            depths.extend(depth_counter_deltas(p.depths, s.depths) or ())
        srv.rejected_seen = [s.updates_rejected for s in states]
        srv.band_obs = band_observations(bands) if srv.bands else []
        srv.depth_obs = depths
        return sum_by_arm(new)

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


def _state_table(state: DynspecState) -> AnyTable:
    """What a replica runs, in the daemon's form (a banded table only where bands differ)."""
    return canon(state.band_table) if state.band_table is not None else state.table


def _arms_text(arms: tuple[int, ...], tree: TreeShape | None) -> str:
    """``(0, 2)``, or ``(0, 2) (tree 4x2x16)`` on a tree server."""
    if tree is None:
        return str(arms)
    return f"{arms} (tree {tree.topk}x{tree.steps}x{tree.draft_tokens})"
