"""What every learning policy shares: discounted statistics, switching cost, dwell, guardrail
and exploration budget. Subclasses only say how to explore (and, optionally, how to pick the
greedy arm); the mechanics below are written once.

Everything that shapes the *estimates* is a function of the observation sequence alone, so
feeding a stored history through :meth:`BasePolicy.update` again (a daemon restart) rebuilds
the same estimates and greedy table. Only the state of the live exploration (the arm last
proposed per bucket, its dwell, the random generator) depends on calls to ``propose``.
"""

from __future__ import annotations

import abc
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, fields

from policies._base import ArmEstimate, BasePolicy, Buckets, Observation, PolicySnapshot, Table
from policies._guard import guard_check
from policies._stats import ArmStats, discount, forgetting, reward

__all__ = [
    "DEFAULT_EXPLORE_ALLOWANCE_STEPS",
    "DEFAULT_EXPLORE_BUDGET",
    "DEFAULT_GUARD_MARGIN",
    "DEFAULT_GUARD_MEMORY_S",
    "DEFAULT_GUARD_MIN_STEPS",
    "DEFAULT_GUARD_Z",
    "DEFAULT_MEMORY_STEPS",
    "DEFAULT_MIN_DWELL_STEPS",
    "DEFAULT_SETTLE_STEPS",
    "DEFAULT_SETTLE_WEIGHT",
    "DEFAULT_STEP_SD",
    "DEFAULT_SWITCH_MARGIN",
    "LearnerParams",
    "LearningPolicy",
]

# Effective memory of a bucket, in its decode steps: long enough that arm estimates settle
# (thousands of steps at a few ms each), short enough that a workload shift is followed
# within about a minute of traffic.
DEFAULT_MEMORY_STEPS = 20_000.0
# Prior standard deviation of one decode step's log goodput: one request emits 1..k+1 tokens
# a step, so its log goodput varies by ~0.5; a step of b requests averages b of those, and
# adds its own timing jitter (a few %). The data shrinks this prior.
DEFAULT_STEP_SD = 0.5
DEFAULT_TIMING_SD = 0.03
DEFAULT_PRIOR_OBS = 2.0
# An arm stays live at least this many decode steps of its bucket, so a bucket near the
# crossover does not thrash between tables (each switch re-captures nothing, but logs, and
# in SGLang's skip-extend mode costs acceptance). The steps count at their length in steps
# of the greedy arm: an arm whose steps take ten times as long has served its dwell after a
# tenth of them (else the first try of k = 7 at 64 requests on a PCIe MoE box costs seconds).
DEFAULT_MIN_DWELL_STEPS = 8
# Steps right after an arm (re)starts in a bucket carry the switch transient (draft state
# catching up, cold recovery); they count at a reduced weight.
DEFAULT_SETTLE_STEPS = 10
DEFAULT_SETTLE_WEIGHT = 0.25
# The greedy arm changes only for a gain above this (log goodput, 0.005 = 0.5 %).
DEFAULT_SWITCH_MARGIN = 0.005
# Guardrail: revert when the greedy arm is measured > 2 % below an alternative at z > 3.
DEFAULT_GUARD_MARGIN = 0.02
DEFAULT_GUARD_Z = 3.0
DEFAULT_GUARD_MIN_STEPS = 50.0
# ... judged on recent measurements only (this memory, in decode steps of the bucket): an
# arm measured before the workload changed is no evidence against one measured after.
DEFAULT_GUARD_MEMORY_STEPS = 2_000.0
# ... and in busy seconds of the bucket, whichever forgets faster: a server that runs a few
# decode steps a second (a CPU server) would otherwise judge on minutes-old measurements.
DEFAULT_GUARD_MEMORY_S = 30.0
# At most this fraction of a bucket's (discounted) decode steps off its greedy arm. The first
# dwell of an arm never run in the bucket is free, and so are the bucket's first
# DEFAULT_EXPLORE_ALLOWANCE_STEPS steps: none by default, since decode steps come at very
# different rates (hundreds a second at one request, a few with prefills between them at
# hundreds), so a free allowance in steps is either too short somewhere or far too long.
DEFAULT_EXPLORE_BUDGET = 0.1
DEFAULT_EXPLORE_ALLOWANCE_STEPS = 0
# How far (log goodput) an arm's gap to the best may drift per bucket of distance, when an
# untried arm borrows its gap from the nearest bucket that ran it.
DEFAULT_BORROW_SD = 0.15
# Weight of each new reading in an arm's seconds per step (the dwell's unit) ...
_STEP_S_WEIGHT = 0.3
# ... and the bounds of one step's length in greedy steps.
_MIN_STEP_LENGTH, _MAX_STEP_LENGTH = 0.1, 100.0
# Notes kept in a snapshot (guardrail reverts), oldest dropped first.
MAX_NOTES = 50


def _require(ok: bool, name: str, what: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} must be {what}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class LearnerParams:
    """Parameters every learning policy shares. Validated on construction.

    Attributes:
        memory_steps: effective memory per bucket in decode steps (discount ``1 - 1/memory``
            per step); ``math.inf`` disables discounting.
        step_sd: prior standard deviation of one request-step's log goodput.
        timing_sd: prior relative jitter of one decode step's duration.
        prior_obs: pseudo-observations behind ``step_sd``.
        min_dwell_steps: decode steps an arm stays live in a bucket before it may change, in
            steps of the greedy arm's duration.
        settle_steps: steps after an arm (re)starts in a bucket that count at
            ``settle_weight`` (the switching transient).
        settle_weight: weight of those steps, in [0, 1].
        switch_margin: gain in log goodput another arm needs to become greedy.
        guard_margin: loss in log goodput that makes the guardrail revert a greedy arm.
        guard_z: z-score the guardrail needs.
        guard_min_steps: discounted steps both arms need before the guardrail judges.
        guard_memory_steps: memory of the measurements the guardrail judges on.
        guard_memory_s: ... the same in busy seconds of the bucket (the shorter one counts).
        explore_budget: cap on the fraction of a bucket's decode steps off its greedy arm.
        explore_allowance_steps: a bucket's first steps, free of the budget (warm-up).
        borrow_sd: drift per bucket of an arm's gap to the best, when a bucket that has not
            run an arm borrows the gap from the nearest bucket that has.
        initial_arm: the arm for buckets nobody has seen yet; None = the middle arm.
    """

    memory_steps: float = DEFAULT_MEMORY_STEPS
    step_sd: float = DEFAULT_STEP_SD
    timing_sd: float = DEFAULT_TIMING_SD
    prior_obs: float = DEFAULT_PRIOR_OBS
    min_dwell_steps: int = DEFAULT_MIN_DWELL_STEPS
    settle_steps: int = DEFAULT_SETTLE_STEPS
    settle_weight: float = DEFAULT_SETTLE_WEIGHT
    switch_margin: float = DEFAULT_SWITCH_MARGIN
    guard_margin: float = DEFAULT_GUARD_MARGIN
    guard_z: float = DEFAULT_GUARD_Z
    guard_min_steps: float = DEFAULT_GUARD_MIN_STEPS
    guard_memory_steps: float = DEFAULT_GUARD_MEMORY_STEPS
    guard_memory_s: float = DEFAULT_GUARD_MEMORY_S
    explore_budget: float = DEFAULT_EXPLORE_BUDGET
    explore_allowance_steps: int = DEFAULT_EXPLORE_ALLOWANCE_STEPS
    borrow_sd: float = DEFAULT_BORROW_SD
    initial_arm: int | None = None

    def __post_init__(self) -> None:
        for f in fields(LearnerParams):  # subclasses check their own fields
            value = getattr(self, f.name)
            if f.name == "initial_arm":
                _require(
                    value is None or (isinstance(value, int) and not isinstance(value, bool)
                                      and value >= 0),
                    f.name, "None or an int >= 0", value)
                continue
            _require(
                isinstance(value, (int, float)) and not isinstance(value, bool)
                and not math.isnan(value),
                f.name, "a number", value)
        _require(self.memory_steps >= 1, "memory_steps", ">= 1 (or inf)", self.memory_steps)
        _require(0 < self.step_sd < math.inf, "step_sd", "positive and finite", self.step_sd)
        _require(0 <= self.timing_sd < math.inf, "timing_sd", ">= 0 and finite",
                 self.timing_sd)
        _require(0 < self.borrow_sd < math.inf, "borrow_sd", "positive and finite",
                 self.borrow_sd)
        _require(0 <= self.prior_obs < math.inf, "prior_obs", ">= 0 and finite", self.prior_obs)
        for name in ("min_dwell_steps", "settle_steps", "explore_allowance_steps"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 0, name, "an int >= 0", value)
        _require(0 <= self.settle_weight <= 1, "settle_weight", "in [0, 1]", self.settle_weight)
        for name in ("switch_margin", "guard_margin", "guard_z", "guard_min_steps"):
            value = getattr(self, name)
            _require(0 <= value < math.inf, name, ">= 0 and finite", value)
        _require(1 <= self.guard_memory_steps < math.inf, "guard_memory_steps",
                 ">= 1 and finite", self.guard_memory_steps)
        _require(self.guard_memory_s > 0, "guard_memory_s", "positive (or inf)",
                 self.guard_memory_s)
        _require(0 <= self.explore_budget <= 1, "explore_budget", "in [0, 1]",
                 self.explore_budget)


class _BucketState:
    __slots__ = (
        "stats", "recent", "gap", "settle", "steps", "bud_total", "bud_off", "greedy", "live",
        "dwell", "step_s",
        "last_revert",
    )

    def __init__(self, arms: Iterable[int]) -> None:
        arms = tuple(arms)
        self.stats = {a: ArmStats() for a in arms}
        self.recent = {a: ArmStats() for a in arms}  # short memory: the guardrail's evidence
        self.gap = {a: 0 for a in arms}  # steps of other arms since this arm last ran
        self.settle = {a: 0 for a in arms}  # transient steps left for this arm
        self.steps = 0  # raw decode steps of the bucket
        self.bud_total = 0.0  # discounted steps since the free allowance ended
        self.bud_off = 0.0  # ... of which off the greedy arm
        self.greedy: int | None = None
        self.live: int | None = None  # arm last proposed
        self.dwell = 0.0  # greedy-step lengths since `live` was proposed
        self.step_s: dict[int, float] = {}  # recent seconds per decode step, per arm run
        self.last_revert: tuple[int, int] | None = None


class LearningPolicy(BasePolicy):
    """Base of every learning policy (see the module docstring).

    Subclasses implement :meth:`_explore` and may override :meth:`_greedy_choice` (the
    model-based policy predicts instead of measuring) and :meth:`_estimates`.

    Args:
        arms: the arms the server built.
        buckets: the batch-size buckets.
        seed: seeds the policy's ``random.Random``.
        params: a :class:`LearnerParams` (or subclass) instance; defaults to ``params_class()``.
    """

    params_class: type[LearnerParams] = LearnerParams

    def __init__(
        self,
        *,
        arms: Iterable[int],
        buckets: Buckets | None = None,
        seed: int = 0,
        params: LearnerParams | None = None,
    ) -> None:
        super().__init__(arms=arms, buckets=buckets, seed=seed)
        if params is None:
            params = self.params_class()
        if not isinstance(params, self.params_class):
            raise ValueError(
                f"params must be a {self.params_class.__name__}, got {type(params).__name__}"
            )
        if params.initial_arm is not None and params.initial_arm not in self.arms:
            raise ValueError(f"initial_arm {params.initial_arm} is not among arms {self.arms}")
        self.params = params
        self._rng = random.Random(seed)
        self._gamma = discount(params.memory_steps)
        self._guard_gamma = discount(params.guard_memory_steps)
        self._state = [_BucketState(self.arms) for _ in range(len(self.buckets))]
        self._notes: list[str] = []

    # --- learning -------------------------------------------------------------------------

    def update(self, obs: Observation) -> bool:
        """Feed one observation; False (state unchanged) if it is unusable."""
        if obs.problem() is not None or obs.k not in self.arms:
            return False
        try:
            r = reward(obs)
        except (ValueError, ZeroDivisionError, OverflowError):
            return False
        if not math.isfinite(r):
            return False
        self._learn(self.buckets.index(obs.b), obs, r)
        return True

    def _update(self, bucket: int, obs: Observation) -> None:
        self._learn(bucket, obs, reward(obs))

    def _learn(self, j: int, obs: Observation, r: float) -> None:
        p, st, k, s = self.params, self._state[j], obs.k, int(obs.decode_steps)
        factor = self._gamma**s
        for arm_stats in st.stats.values():
            arm_stats.decay(factor)
        recent = forgetting(self._guard_gamma**s, obs.busy_s, p.guard_memory_s)
        for arm_stats in st.recent.values():
            arm_stats.decay(recent)
        if st.steps >= p.explore_allowance_steps:
            st.bud_total = st.bud_total * factor + s
            off = st.greedy is not None and k != st.greedy
            st.bud_off = st.bud_off * factor + (s if off else 0)
        # Switching cost: an arm that resumes after other arms ran starts a settle window.
        if st.steps > 0 and st.gap[k] > p.settle_steps:
            st.settle[k] = p.settle_steps
        transient = min(s, st.settle[k])
        st.settle[k] -= transient
        weight = (s - transient) + transient * p.settle_weight
        st.stats[k].add(r, weight, weight / s, obs.b, s)
        st.recent[k].add(r, weight, weight / s, obs.b, s)
        for arm in self.arms:
            st.gap[arm] = 0 if arm == k else st.gap[arm] + s
        st.steps += s
        step_s = obs.busy_s / s
        st.dwell += s * self._step_length(st, k, step_s)
        last = st.step_s.get(k)
        st.step_s[k] = step_s if last is None else last + _STEP_S_WEIGHT * (step_s - last)
        self._observed(j, obs, r, weight)
        self._refresh_greedy(j)

    @staticmethod
    def _step_length(st: _BucketState, k: int, step_s: float) -> float:
        """A step of ``k`` that took ``step_s``, in steps of the bucket's greedy arm (1 until
        the greedy arm was timed)."""
        base = st.step_s.get(st.greedy) if st.greedy is not None else None
        if not base or k == st.greedy:
            return 1.0
        return min(max(step_s / base, _MIN_STEP_LENGTH), _MAX_STEP_LENGTH)

    def _observed(self, j: int, obs: Observation, r: float, weight: float) -> None:
        """Hook for subclasses with extra state (models, optimisers). Default: nothing."""

    def _refresh_greedy(self, j: int) -> None:
        p, st = self.params, self._state[j]
        choice = self._greedy_choice(j)
        if choice is None:
            st.greedy = None
            return
        verdict = guard_check(
            st.recent, choice, margin=p.guard_margin, z=p.guard_z,
            min_steps=p.guard_min_steps, mean_sd=self._mean_sd,
        )
        if verdict is not None:
            if st.last_revert != (verdict.bad, verdict.better):
                self._note(f"bucket {self.buckets.label(j)}: {verdict.reason}")
            st.last_revert = (verdict.bad, verdict.better)
            choice = verdict.better
        st.greedy = choice

    def _mean_sd(self, a: ArmStats) -> float:
        """Posterior standard deviation of an arm's mean log goodput (inf when unseen)."""
        p = self.params
        b = a.mean_b if a.seen else 1.0
        prior = math.sqrt(p.step_sd * p.step_sd / max(b, 1.0) + p.timing_sd * p.timing_sd)
        return a.mean_sd(prior, p.prior_obs)

    def _borrowed(self, j: int, arm: int) -> tuple[float, float] | None:
        """Prior ``(mean, sd)`` of an arm bucket ``j`` has not run, from the nearest bucket
        that ran both it and its best arm: the same gap to the best, widened with distance.
        None when no bucket can say, or bucket ``j`` has no data at all."""
        here = [a.mean for a in self._state[j].stats.values() if a.seen]
        if not here:
            return None
        for d in range(1, len(self._state)):
            gaps = []
            for i in (j - d, j + d):
                if 0 <= i < len(self._state):
                    st = self._state[i].stats
                    if st[arm].seen:
                        gaps.append(st[arm].mean - max(a.mean for a in st.values() if a.seen))
            if gaps:
                return max(here) + sum(gaps) / len(gaps), self.params.borrow_sd * math.sqrt(d)
        return None

    def _note(self, text: str) -> None:
        self._notes.append(text)
        del self._notes[:-MAX_NOTES]

    def _greedy_choice(self, j: int) -> int | None:
        """The measured best arm of bucket ``j`` with hysteresis, None without data."""
        st = self._state[j]
        seen = [a for a in self.arms if st.stats[a].seen]
        if not seen:
            return None
        best = max(seen, key=lambda a: (st.stats[a].mean, -a))
        cur = st.greedy
        if cur is not None and st.stats[cur].seen:
            if st.stats[best].mean <= st.stats[cur].mean + self.params.switch_margin:
                return cur
        return best

    # --- deciding -------------------------------------------------------------------------

    def _fallback_arm(self) -> int:
        if self.params.initial_arm is not None:
            return self.params.initial_arm
        return self.arms[len(self.arms) // 2]

    def greedy_arms(self) -> tuple[int, ...]:
        """The greedy arm per bucket; a bucket without data borrows its nearest neighbour's."""
        known = [st.greedy for st in self._state]
        if all(g is None for g in known):
            return tuple(self._fallback_arm() for _ in known)
        out = []
        for j, g in enumerate(known):
            if g is None:
                for d in range(1, len(known)):
                    lo = known[j - d] if j - d >= 0 else None
                    hi = known[j + d] if j + d < len(known) else None
                    if lo is not None or hi is not None:
                        g = lo if lo is not None else hi
                        break
            out.append(g)
        return tuple(out)  # type: ignore[arg-type]

    def greedy(self) -> Table:
        return self.buckets.table(self.greedy_arms())

    def _budget_allows(self, j: int, arm: int) -> bool:
        p, st = self.params, self._state[j]
        if st.steps < p.explore_allowance_steps:
            return True
        if st.stats[arm].steps == 0:
            # An arm never run in this bucket gets its first dwell whatever the budget: where
            # steps are scarce (hundreds of requests, prefill between most decode steps) the
            # free allowance can pass before every arm was seen once.
            return True
        # Exploring now costs a dwell, at most this many steps (fewer for an arm slower than
        # the greedy one): check it still fits.
        need = p.min_dwell_steps
        return st.bud_off + need <= p.explore_budget * (st.bud_total + need)

    def propose(self) -> Table:
        """A table that may explore: dwell first, then the subclass's choice within budget."""
        greedy = self.greedy_arms()
        chosen = []
        for j, st in enumerate(self._state):
            g = greedy[j]
            if st.steps == 0:
                arm = g  # nothing to learn from a bucket without traffic
            elif (
                st.live is not None
                and st.dwell < self.params.min_dwell_steps
                and (st.last_revert is None or st.last_revert[0] != st.live)
            ):
                arm = st.live
            else:
                arm = self._explore(j, g)
                if arm != g and not self._budget_allows(j, arm):
                    arm = g
            if arm != st.live:
                st.live = arm
                st.dwell = 0.0
            chosen.append(arm)
        return self.buckets.table(chosen)

    @abc.abstractmethod
    def _explore(self, j: int, greedy: int) -> int:
        """The arm to run in bucket ``j`` (may be ``greedy``). Called only with traffic."""

    # --- reporting ------------------------------------------------------------------------

    def exploration(self, j: int) -> tuple[float, float]:
        """``(off-greedy, total)`` discounted decode steps of bucket ``j`` since warm-up."""
        st = self._state[j]
        return st.bud_off, st.bud_total

    def _estimates(self) -> tuple[ArmEstimate, ...]:
        out = []
        for j, st in enumerate(self._state):
            for arm in self.arms:
                a = st.stats[arm]
                if not a.seen:
                    continue
                g = a.goodput()
                out.append(ArmEstimate(
                    bucket=j, arm=arm, estimate=g, std=g * self._mean_sd(a), n=round(a.w),
                ))
        return tuple(out)

    def snapshot(self) -> PolicySnapshot:
        return PolicySnapshot(
            policy=self.name,
            buckets=self.buckets,
            arms=self.arms,
            chosen=self.greedy_arms(),
            estimates=self._estimates(),
            notes=tuple(self._notes),
        )
