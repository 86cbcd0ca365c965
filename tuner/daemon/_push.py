"""Learning and deciding for one server: observations to the policy, a table each
decision period, the push and what a refusal means."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from policies import Observation, split_probes
from storage import BandObservationRecord, DepthCountsRecord, ObservationRecord
from tuner.config import TunerConfig
from tuner.daemon._records import _Server
from tuner.errors import ServerError, ServerUnavailableError
from tuner.daemon._tables import AnyTable, canon, flat, show_table, validate_any
from tuner.protocol import DEPTH_EVERY, ProtocolError

log = logging.getLogger("tuner.daemon")  # one logger name for the whole loop


class _Pusher:
    """The :class:`~tuner.daemon.Daemon`'s learning, decisions and pushes."""

    config: TunerConfig
    metrics: object

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
        if srv.bands and srv.policy is not None:
            for bo in srv.band_obs:
                srv.policy.update_bands(bo)
        update_depths = getattr(srv.policy, "update_depths", None)
        if callable(update_depths):
            for d in srv.depth_obs:
                update_depths(d.k, d.counts, DEPTH_EVERY)
        # The acceptance evidence too, so a restarted daemon's policy starts where this one is.
        self._buffer.add_observations([
            *records,
            *(BandObservationRecord(srv.address, now, bo.band, bo.k, bo.decode_steps,
                                    bo.request_steps, bo.accepted_drafts, bo.first_counted,
                                    bo.first_rejected) for bo in srv.band_obs),
            *(DepthCountsRecord(srv.address, now, d.k, tuple(d.counts), DEPTH_EVERY)
              for d in srv.depth_obs),
        ])
        srv.band_obs, srv.depth_obs = [], []
        srv.observations += used
        srv.decode_steps += int(steps)
        srv.interval_goodput = emitted / busy if busy > 0 else math.nan
        if self.metrics is not None and records:
            self.metrics.record_observations(srv.address, len(records))
            self.metrics.record_sums(srv.address, observations, now)  # the gain's jackknife
        self._holdout_observe(srv, observations, now)
        return used

    def _decide(self, srv: _Server, now: float) -> int:
        if srv.mode != "plugin" or srv.policy is None or srv.read_only:
            return 0
        held = self._holdout_decide(srv, now)  # a baseline window: the experiment decides
        if held is not None:
            return held
        due = srv.last_decision is None or now - srv.last_decision >= self.config.decision_period_s
        if not due and not srv.needs_push:
            return 0
        repush, srv.repush = srv.repush and srv.needs_push, False
        before = srv.desired
        if due:
            srv.last_decision = now
            proposal = self._proposal(srv, greedy=False)
            try:
                proposal = validate_any(proposal, srv.arms)
            except ProtocolError as exc:  # a policy bug must never reach a server
                log.error("%s: policy %s proposed an invalid table (%s); keeping %s",
                          srv.address, self.config.policy, exc,
                          show_table(srv.server_table) if srv.server_table else "the table")
                return 0
            greedy = self._proposal(srv, greedy=True)
            reason = "greedy" if proposal == greedy else "explore"
            if repush and proposal == before:
                reason = "re-push after restart"
            srv.desired = proposal
        else:
            proposal = srv.desired
            if proposal is not None and not srv.bands:
                proposal = flat(proposal)  # never a banded table to a v1 plugin
            reason = "re-push after restart" if repush else "re-push: replicas disagree"
            greedy = self._proposal(srv, greedy=True) if srv.bands else None
        if proposal is None:
            srv.needs_push = False
            return 0
        if self.config.dry_run:
            if proposal != srv.dry_last:
                srv.dry_last = proposal
                srv.version += 1
                self._record_version(srv, now, srv.version, proposal, reason, "dry_run")
                log.info("%s: would push v%d %s (%s; dry run)", srv.address, srv.version,
                         show_table(proposal), reason)
            return 0
        if proposal == srv.server_table and not srv.probing:
            if repush:
                log.info("%s: the restarted server already runs %s; nothing to re-push",
                         srv.address, show_table(proposal))
            srv.needs_push = False
            return 0
        if proposal == srv.rejected_table and now - srv.rejected_at < self.config.backoff_max_s:
            # Refused by every replica already: the same table would be refused again.
            srv.needs_push = False
            log.debug("%s: not pushing %s again (refused)", srv.address, show_table(proposal))
            return 0
        return self._push(srv, proposal, reason, now, over=greedy)

    def _proposal(self, srv: _Server, *, greedy: bool) -> AnyTable:
        """The policy's next table (``greedy``: its greedy one) for this server, in the
        daemon's form: banded for a banding server (``_Server.bands``), else band-agnostic."""
        policy = srv.policy
        assert policy is not None
        if srv.bands:
            table = policy.greedy_bands() if greedy else policy.propose_bands()
            if table is not None:
                return canon(table)
        return policy.greedy() if greedy else policy.propose()

    def _push(self, srv: _Server, table: AnyTable, reason: str, now: float,
              over: AnyTable | None = None) -> int:
        """Push ``table``; ``over``: the greedy table, when ``table`` is the policy's proposal,
        whose exploring rows a banding server then takes as probes over it. Any other table
        (a baseline window's, the greedy one at stop) goes whole, and ends the probes sent
        before."""
        version = srv.version + 1
        # A probe runs its arm for a few steps and the server goes back to the greedy table by
        # itself (policies/_probes.py). The history keeps the proposal as before; the server
        # reports the greedy table while a probe runs.
        sent, probes = table, ()
        if over is not None and srv.bands:
            base, probes = split_probes(table, over)
            sent = canon(base)
        try:
            reply = srv.client.push(sent, version, probes)
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
            # A cause that stays (a wrong API key refuses every table) is said once.
            say = log.warning if str(exc) != srv.last_refusal else log.debug
            say("%s: push of v%d refused: %s", srv.address, version, exc)
            srv.last_refusal = str(exc)
            if self.metrics is not None:
                self.metrics.record_rejected_update(srv.address)
            return 0
        # The version is spent either way: a replica that refused it compares the next one.
        srv.version = version
        if any(reply):
            srv.sent_version = max(srv.sent_version, version)
        if all(reply):
            # A probe re-sent over an unchanged table is routine: said at debug level.
            say = log.info if sent != srv.server_table or not probes else log.debug
            srv.server_table = sent
            srv.probing = bool(probes)
            srv.probes = tuple(probes)
            srv.server_version = version
            srv.needs_push = False
            srv.rejected_table = None
            srv.last_refusal = None
            srv.pushes += 1
            self._record_version(srv, now, version, table, reason, "applied")
            say("%s: pushed v%d %s (%s)%s", srv.address, version, show_table(sent), reason,
                "".join(f"; probe b {lo}..{'' if hi is None else hi}: k{k} for {n} steps"
                        for lo, hi, k, n in probes))
            if self.metrics is not None:
                self.metrics.record_push(srv.address, version)
            return 1
        refused = [i for i, ok in enumerate(reply) if not ok]
        # Partly applied: replicas now disagree; the next decision pushes to all again.
        srv.server_table = None if len(refused) < len(reply) else srv.server_table
        srv.needs_push = False
        if len(refused) == len(reply):
            srv.rejected_table, srv.rejected_at = table, now
        srv.pending_rejection = f"v{version} {show_table(table)} refused by replica(s) {refused}"
        self._record_version(srv, now, version, table, reason, "rejected")
        log.warning("%s: v%d refused by replica(s) %s; their reason follows on the next reading",
                    srv.address, version, refused)
        return 0
