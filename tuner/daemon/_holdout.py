"""The switchback experiment in the loop (``run --holdout``; :mod:`tuner.switchback`).

Per server: the schedule says, at each tick, whether the server should run its baseline
table (the one it started on) or the tuned one. Switching in is a push of the baseline;
switching out hands the decision back to the policy at once. Observations are attributed to
the window that was in effect while they were counted (the role set at the previous tick).
A pair with a gap in its readings, a restart, a failed switch or replicas out of step is
dropped (``holdout_void``), never mixed in. The token budget (:class:`~tuner.switchback.Budget`)
skips a drawn pair the banked tokens cannot pay for (``holdout_skip``) and cuts a baseline
window short before an interval could overdraw them; the rest of a cut window runs the tuned
table and belongs to neither window. Events: ``holdout_start`` / ``holdout_end`` per baseline
window and ``holdout_pair`` per usable pair, whose detail carries the pair's sums (JSON) so
``report`` reads the experiment back without raw observations (which roll up).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from policies import Buckets, Observation
from tuner.config import TunerConfig
from tuner.daemon._records import _Server
from tuner.daemon._tables import AnyTable, show_table
from tuner.protocol import Table, sglang_start_arm
from tuner.switchback import Budget, Pair, Schedule, SwitchbackGain, Window, estimate

log = logging.getLogger("tuner.daemon")  # one logger name for the whole loop

HOLDOUT_REASON = "holdout: baseline window"


def stratum(buckets: Buckets, b: int) -> str:
    """A bucket's key in the pair sums: its upper bound, ``rest`` for the last."""
    high = buckets.bounds(buckets.index(b))[1]
    return "rest" if high is None else str(high)


@dataclass
class HoldoutState:
    schedule: Schedule
    t0: float | None = None
    base: AnyTable | None = None
    slot: tuple[int, str] | None = None  # (block, role) the server ran since the last tick
    block: int | None = None  # the pair being collected
    windows: dict[str, Window] = field(default_factory=dict)
    void: str | None = None  # why the current pair cannot be used
    last_tick: float | None = None
    restarts: int = 0
    pairs: list[Pair] = field(default_factory=list)
    voided: int = 0
    tokens: float = 0.0  # since t0, for the cost
    busy_s: float = 0.0
    result: SwitchbackGain | None = None
    budget: Budget | None = None
    window: int = -1  # the schedule's window the readings now fall in, and their tokens
    window_tokens: float = 0.0
    last_window_tokens: float = math.inf  # the last whole window's: the next one's forecast
    tick_tokens: float = math.inf  # the last reading's: the next one's forecast

    @property
    def active(self) -> bool:
        """The server runs (or should run) its baseline table now."""
        return self.slot is not None and self.slot[1] == "base"


def startup_table(arms: Sequence[int]) -> Table:
    """SGLang's startup step everywhere: the middle candidate, ``union[len // 2]``."""
    return ((None, sglang_start_arm(arms)),)


class _Holdout:
    """The :class:`~tuner.daemon.Daemon`'s switchback: schedule, attribution, estimate."""

    config: TunerConfig
    buckets: Buckets
    metrics: object

    def _holdout_observe(self, srv: _Server, observations: Sequence[Observation],
                         now: float) -> None:
        h = srv.holdout
        if h is None or h.t0 is None:
            return
        if h.last_tick is not None and now - h.last_tick > 1.5 * self.config.interval_s:
            self._holdout_spoil(h, "a gap in the readings")
        h.last_tick = now
        if srv.restarts != h.restarts:
            h.restarts = srv.restarts
            self._holdout_spoil(h, "the server restarted")
        role = h.slot[1] if h.slot is not None else "tuned"
        if role == "base" and srv.server_table != h.base:
            self._holdout_spoil(h, "the server did not run the baseline table")
        elif role == "control" and srv.server_table is None:
            self._holdout_spoil(h, "replicas ran different tables")
        window = h.windows.get(role)
        tokens = busy = 0.0
        for o in observations:
            tokens += o.emitted_tokens
            busy += o.busy_s
            if window is not None:
                window.add(stratum(self.buckets, o.b), o.emitted_tokens, o.busy_s)
        h.tokens += tokens
        h.busy_s += busy
        h.budget.add(tokens, busy, base=role == "base")
        h.window_tokens += tokens
        h.tick_tokens = tokens

    @staticmethod
    def _holdout_spoil(h: HoldoutState, why: str) -> None:
        if h.block is not None and h.void is None:
            h.void = why

    def _holdout_decide(self, srv: _Server, now: float) -> int | None:
        """Run the schedule; an int when this tick's decision is the experiment's (pushes
        made), None to let the policy decide as usual."""
        h = srv.holdout
        if h is None or srv.read_only or self.config.dry_run:
            return None
        if h.t0 is None:
            h.t0, h.last_tick, h.restarts = now, now, srv.restarts
            h.budget = Budget(h.schedule.fraction)
            h.base = self._holdout_baseline(srv)
            log.info("%s: switchback on: the baseline %s runs %.1f%% of the time in %g s "
                     "windows, each paired with an adjacent tuned one", srv.address,
                     show_table(h.base), 100 * h.schedule.share, h.schedule.window_s)
        block, drawn = h.schedule.at(now - h.t0)
        window = math.floor(max(0.0, now - h.t0) / h.schedule.window_s + 1e-9)
        if window != h.window:
            if h.window >= 0:  # a whole window read (the first tick starts window 0)
                h.last_window_tokens = h.window_tokens
            h.window, h.window_tokens = window, 0.0
        if h.block is not None and (block != h.block or drawn == "tuned"):
            self._holdout_close_pair(srv, now)
        role = self._holdout_budget(srv, block, drawn, now)
        was_base = h.active
        if role in ("base", "control") and h.block is None:
            h.block, h.void = block, None
            h.windows = {"base": Window(), "control": Window()}
        if role in h.windows and h.windows[role].start is None:
            h.windows[role].start = now
        for r, w in h.windows.items():
            if r != role and w.start is not None and w.end is None:
                w.end = now
        h.slot = (block, role)
        if role == "base":
            if not was_base:
                self._event(srv.address, now, "holdout_start",
                            f"block {block}: baseline {show_table(h.base)} for "
                            f"{h.schedule.window_s:g} s")
            if srv.server_table == h.base and not srv.probing:
                return 0
            pushed = self._push(srv, h.base, HOLDOUT_REASON, now)
            if not pushed:
                self._holdout_spoil(h, "the baseline could not be pushed")
            return pushed
        if was_base:
            self._event(srv.address, now, "holdout_end",
                        f"block {block}: back to the tuned table")
            srv.last_decision = None  # the policy decides (and pushes) in this very tick
        return None

    def _holdout_budget(self, srv: _Server, block: int, drawn: str, now: float) -> str:
        """The role the token budget lets this tick run (:meth:`Budget.admit`), from
        readings before this tick only, never the pair's own outcome."""
        h = srv.holdout
        budget = h.budget
        skipped, cut = budget.skipped, budget.cut
        per_tick = h.last_window_tokens * self.config.interval_s / h.schedule.window_s
        role = budget.admit(block, drawn, pair_open=h.block is not None,
                            window_forecast=h.last_window_tokens,
                            tick_forecast=max(h.tick_tokens, per_tick))
        if budget.skipped != skipped:
            self._event(srv.address, now, "holdout_skip",
                        f"block {block}: the baseline's {budget.base_tokens:.0f} of "
                        f"{budget.tokens:.0f} tokens leave too little of its "
                        f"{budget.fraction:.1%} share for a window like the last one "
                        f"({h.last_window_tokens:.0f} tokens)")
        if budget.cut != cut:
            log.info("%s: switchback: block %d's baseline window ends early, its share of "
                     "the tokens spent", srv.address, block)
        return role

    def _holdout_baseline(self, srv: _Server) -> AnyTable:
        if srv.baseline_version == 0 and srv.start_table is not None:
            return srv.start_table
        base = startup_table(srv.arms)
        log.warning("%s: the server had v%d when first read, so its starting table is unknown; "
                    "the switchback's baseline is SGLang's startup step %s", srv.address,
                    srv.baseline_version, show_table(base))
        return base

    def _holdout_close_pair(self, srv: _Server, now: float) -> None:
        h = srv.holdout
        for w in h.windows.values():
            if w.start is not None and w.end is None:
                w.end = now
        base, control = h.windows["base"], h.windows["control"]
        block, why = h.block, h.void
        h.block, h.windows, h.void = None, {}, None
        if why is None and (base.start is None or control.start is None):
            why = "the pair did not run both windows"
        pair = None
        if why is None:
            pair = Pair(block, {k: tuple(v) for k, v in base.sums.items()},
                        {k: tuple(v) for k, v in control.sums.items()},
                        (base.start, base.end), (control.start, control.end),
                        show_table(h.base),
                        tuple(h.t0 + x for x in h.schedule.block_span(block)))
            if pair.terms() is None:
                why = "no batch-size bucket busy in both windows"
        if why is not None:
            h.voided += 1
            self._event(srv.address, now, "holdout_void", f"block {block}: {why}")
            log.info("%s: switchback pair of block %d dropped: %s", srv.address, block, why)
            return
        h.pairs.append(pair)
        self._event(srv.address, now, "holdout_pair", pair.to_json())
        h.result = estimate(h.pairs, all_tokens=h.tokens, all_busy_s=h.busy_s,
                            base_tokens=h.budget.base_tokens, base_busy_s=h.budget.base_busy_s)
        r = h.result
        log.info("%s: switchback: gain over the baseline %+.1f%% [%+.1f%%, %+.1f%%] from %d "
                 "pairs; cost %.2f%% of goodput", srv.address, 100 * r.ratio, 100 * r.low,
                 100 * r.high if math.isfinite(r.high) else math.inf, r.pairs, 100 * r.cost)

    def _holdout_stop(self, srv: _Server, now: float) -> None:
        """At shutdown: a baseline window in progress ends here (the caller then leaves the
        server on its greedy table, as always)."""
        h = srv.holdout
        if h is None or not h.active:
            return
        h.slot = None
        h.void = h.void or "stopped during the pair"
        self._event(srv.address, now, "holdout_end",
                    "stopped during a baseline window: leaving the greedy table")
