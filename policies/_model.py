"""Model-based policy: predict goodput from acceptance and step time, share across buckets.

``goodput(b, k) = b · E[emitted | α̂, k] / T̂(b, k)`` (per request: ``E[emitted] / T̂``):

- **Acceptance** is a property of the requests, not of the batch size, so one estimate serves
  every bucket. Per arm ``k > 0`` the mean accepted drafts per request-step come straight
  from the accepted/drafted counters (observable whenever ``k > 0``, no exploration needed);
  a chain model (``P(A ≥ i) = α^i δ^(i(i−1)/2)``, α fitted to those means, δ too once arms
  of two depths are measured, around the default δ) fills in arms never run, and shrinks the
  noisy ones (the counts and the fit: :mod:`policies._pooled`).
- **Step time** ``T(b, k)`` per (bucket, arm) is the anchors' cost model (bilinear in ``b``
  and ``k``, plus weight reads that saturate in the tokens a forward carries, as a
  mixture-of-experts step's do) and each cell's deviation from it, a smooth field whose
  scale the measured cells' residuals decide (:mod:`policies._steptime`). Where the model
  fits a cell never run is predicted tightly; where it does not, the cells widen and
  measured neighbours carry them.
- **Acceptance bands** (protocol v2 servers, :mod:`policies._banded`): acceptance is also
  learnt per band of the batch's live acceptance, and the greedy arm of each bucket is
  refined per band from the same step times (``propose_bands``).
- Exploration is posterior (Thompson) sampling over acceptance and step time jointly. No
  arm is excluded by the model alone: an arm is tried about as often as the posterior gives
  it a chance of winning, which is small only where the data (not the model's shape) say
  so, so the policy saves exploration where the model fits and spends it where it does not.
  A draw of an arm the model puts far below the greedy one is also weighed by what its probe
  costs: run with probability ``_EXPLORE_REGRET`` over the expected loss, past that loss.
  A draw also heeds the goodput the bucket measured at the arm itself (the bandits' whole
  evidence): where the model is unsure of an arm its own measurements have already judged,
  they, not the model's doubt, decide how often it is tried.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from policies._acceptance import chain_accepted
from policies._banded import BandBook, BandObservation, BandTable, band_table
from policies._base import ArmEstimate, Observation
from policies._learning import LearnerParams, LearningPolicy, _require
from policies._machine import MachineSpeed
from policies._pooled import PooledAcceptance
from policies._stats import ArmStats, forgetting
from policies._steptime import (
    DEFAULT_ZERO_ARM_SD,
    Cell,
    StepTimePosterior,
    step_time_posterior,
)

__all__ = [
    "DEFAULT_ACCEPTANCE_CORR",
    "DEFAULT_ACCEPTANCE_MEMORY_REQUEST_STEPS",
    "DEFAULT_ACCEPTANCE_MEMORY_S",
    "DEFAULT_ACCEPTANCE_MEMORY_STEPS",
    "DEFAULT_CHAIN_DELTA",
    "ModelParams",
    "ModelPolicy",
]

# Acceptance memory (global, all buckets): discounted per request-step and per decode step,
# so it follows a workload shift within ~30 s of traffic at one request (where information
# is scarce) and within a few seconds at hundreds.
DEFAULT_ACCEPTANCE_MEMORY_REQUEST_STEPS = 100_000.0
DEFAULT_ACCEPTANCE_MEMORY_STEPS = 5_000.0
# ... and in busy seconds, whichever forgets faster: what the two above mean at a GPU's
# step rate. A server that runs a few decode steps a second (a CPU server) would otherwise
# remember the old acceptance for many minutes.
DEFAULT_ACCEPTANCE_MEMORY_S = 30.0
# Memory of a bucket's step times in its busy seconds, beside the learner's decode steps
# (whichever forgets faster): a step time was measured under the conditions of its time
# (the machine's load, the requests' context lengths and acceptance), and a cell measured
# minutes ago against one measured now would compare two machines. 20,000 steps are two
# minutes at a GPU's 6 ms steps and more at larger batches; on a CPU server, tens of steps a
# second, they were minutes of another load held against a fresh measurement of the next arm.
DEFAULT_STEP_TIME_MEMORY_S = 60.0
# Request-steps per independent acceptance sample. A request keeps its α for its whole life,
# so request-steps are not independent; but requests differ far less (α ~ Beta, κ ≈ 20)
# than single steps do, and 30 matches the spread of per-window means in the simulator.
DEFAULT_ACCEPTANCE_CORR = 30.0
# Per-position decay used to extrapolate acceptance to arms not yet run (anchors §3.3).
DEFAULT_CHAIN_DELTA = 0.973
# The spread of the chain's δ around it before arms measured at two depths say otherwise:
# chains of δ 0.85-1 and acceptance that rises with depth (δ above 1) are all seen.
_DELTA_PRIOR_SD = 0.1
DEFAULT_MODEL_SAMPLE_SCALE = 1.0
# An exploring draw of an arm the model puts this far (a share of goodput) below the greedy
# arm is always run; one further below, with probability this over its expected loss (an arm
# at half the greedy one's goodput, one such draw in five).
_EXPLORE_REGRET = 0.1
# Young buckets measure the arm with the best mean + OPTIMISM sd first.
DEFAULT_OPTIMISM = 1.0
DEFAULT_YOUNG_STEPS = 500
# ... or its first this many busy seconds, whichever ends first: youth is for measuring each
# plausible arm once (a few decisions), and 500 steps are a few seconds on a GPU but minutes
# of decisions on a server whose steps take 100 ms or more.
DEFAULT_YOUNG_S = 10.0
# z-score at which the short acceptance memory overrules the long one (a workload shift).
DEFAULT_SHIFT_Z = 3.0
# Busy seconds over which the machine's speed is averaged (policies._machine): a loaded
# server's steps slow and speed up together for every arm over seconds to minutes.
DEFAULT_MACHINE_MEMORY_S = 5.0


@dataclass(frozen=True, kw_only=True)
class ModelParams(LearnerParams):
    """:class:`LearnerParams` plus the model's own.

    Attributes:
        acceptance_memory_request_steps: memory of the acceptance estimate, in request-steps.
        acceptance_memory_steps: ... and in decode steps (both discount).
        acceptance_memory_s: ... and in busy seconds (the shortest of the three counts).
        acceptance_corr: request-steps per independent acceptance sample (>= 1).
        step_time_memory_s: memory of a bucket's step times in its busy seconds (the
            learner's ``memory_steps`` counts too: the shorter forgets).
        chain_delta: per-position decay δ of the chain model, in (0, 1], before arms of two
            depths say otherwise (the fitted δ may then pass 1: acceptance rising with depth).
        sample_scale: posterior draws are scaled by this.
        zero_arm_sd: prior spread of k = 0's own step-time intercept (relative), until k = 0
            runs somewhere.
        optimism: for its first ``young_steps`` decode steps, a bucket runs the arm with
            the best mean + ``optimism`` standard deviations (0 = posterior sampling only).
        young_steps: see ``optimism``.
        young_s: ... and for its first ``young_s`` busy seconds (whichever ends first).
        shift_z: z-score at which recent acceptance overrules the long memory (a shift).
        machine_memory_s: busy seconds over which the machine's speed, shared by every arm,
            is averaged and taken out of each reading's step time (0 = taken as steady;
            ``policies._machine``).
    """

    acceptance_memory_request_steps: float = DEFAULT_ACCEPTANCE_MEMORY_REQUEST_STEPS
    acceptance_memory_steps: float = DEFAULT_ACCEPTANCE_MEMORY_STEPS
    acceptance_memory_s: float = DEFAULT_ACCEPTANCE_MEMORY_S
    acceptance_corr: float = DEFAULT_ACCEPTANCE_CORR
    step_time_memory_s: float = DEFAULT_STEP_TIME_MEMORY_S
    chain_delta: float = DEFAULT_CHAIN_DELTA
    sample_scale: float = DEFAULT_MODEL_SAMPLE_SCALE
    zero_arm_sd: float = DEFAULT_ZERO_ARM_SD
    optimism: float = DEFAULT_OPTIMISM
    young_steps: int = DEFAULT_YOUNG_STEPS
    young_s: float = DEFAULT_YOUNG_S
    shift_z: float = DEFAULT_SHIFT_Z
    machine_memory_s: float = DEFAULT_MACHINE_MEMORY_S

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("acceptance_memory_request_steps", "acceptance_memory_steps"):
            _require(getattr(self, name) >= 1, name, ">= 1 (or inf)", getattr(self, name))
        _require(self.acceptance_memory_s > 0, "acceptance_memory_s", "positive (or inf)",
                 self.acceptance_memory_s)
        _require(self.step_time_memory_s > 0, "step_time_memory_s", "positive (or inf)",
                 self.step_time_memory_s)
        _require(1 <= self.acceptance_corr < math.inf, "acceptance_corr", ">= 1 and finite",
                 self.acceptance_corr)
        _require(0 < self.chain_delta <= 1, "chain_delta", "in (0, 1]", self.chain_delta)
        _require(0 < self.sample_scale < math.inf, "sample_scale", "positive and finite",
                 self.sample_scale)
        _require(0 < self.zero_arm_sd < math.inf, "zero_arm_sd", "positive and finite",
                 self.zero_arm_sd)
        _require(0 <= self.optimism < math.inf, "optimism", ">= 0 and finite", self.optimism)
        _require(isinstance(self.young_steps, int) and self.young_steps >= 0, "young_steps",
                 "an int >= 0", self.young_steps)
        _require(0 <= self.young_s <= math.inf, "young_s", ">= 0 (inf = steps only)",
                 self.young_s)
        _require(0 < self.shift_z <= math.inf, "shift_z", "positive (inf = never)",
                 self.shift_z)
        _require(0 <= self.machine_memory_s < math.inf, "machine_memory_s",
                 ">= 0 and finite (0 = steady)", self.machine_memory_s)


class ModelPolicy(LearningPolicy):
    """Model-based posterior sampling (name ``"model"``). See the module docstring."""

    name = "model"
    params_class = ModelParams
    params: ModelParams

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        p = self.params
        self._pooled = PooledAcceptance(
            self.arms, memory_request_steps=p.acceptance_memory_request_steps,
            memory_steps=p.acceptance_memory_steps, memory_s=p.acceptance_memory_s,
            corr=p.acceptance_corr, chain_delta=p.chain_delta, delta_prior_sd=_DELTA_PRIOR_SD,
            shift_z=p.shift_z)
        # per bucket, per arm: discounted log step time (ArmStats over log seconds)
        self._time = [{k: ArmStats() for k in self.arms} for _ in range(len(self.buckets))]
        self._occ = [[0.0, 0.0] for _ in range(len(self.buckets))]  # discounted steps, steps*b
        self._busy = [0.0] * len(self.buckets)  # busy seconds per bucket (its youth)
        # Busy seconds in all (the sum of _busy) when each (bucket, arm) last ran: the age of
        # a bucket's own measurement of an arm, taken under the acceptance of its time.
        self._ran_at = [dict.fromkeys(self.arms, 0.0) for _ in range(len(self.buckets))]
        self._pred: np.ndarray | None = None  # [bucket, arm] -> (mean, sd) of log goodput/req
        self._comp: tuple[StepTimePosterior, dict[int, float], dict[int, float]] | None = None
        self._alpha = (0.7, 0.3)  # chain-model α and its standard error
        self._delta = self.params.chain_delta  # ... and its δ (per-position factor)
        # Each arm's place on the cost model's draft-token axis: k for a chain (verify k + 1
        # tokens), draft_tokens - 1 for an EAGLE tree's arm (set_verify_tokens). Priced as
        # a 2-deep chain, a 16-token tree looked no dearer than k = 0 at 256 requests, and
        # k = 0 was never tried there.
        self._cost_k = {k: k for k in self.arms}
        self._bands: BandBook | None = None  # acceptance per band, once set_bands is called
        self._band_busy = 0.0  # drafting busy seconds not yet aged into the band book
        # The machine's speed, taken out of every reading before anything learns from it.
        self._machine = (MachineSpeed(p.machine_memory_s, p.step_time_memory_s)
                         if p.machine_memory_s > 0 else None)

    def update(self, obs: Observation) -> bool:
        """Feed one observation, its step time taken as on the machine's average speed."""
        if self._machine is not None and obs.problem() is None and obs.k in self.arms:
            obs = self._machine.correct(obs)
        return super().update(obs)

    def set_verify_tokens(self, tokens: Mapping[int, int]) -> None:
        super().set_verify_tokens(tokens)
        self._cost_k.update({k: n - 1 for k, n in tokens.items()})
        self._comp = self._pred = None

    # --- acceptance bands (protocol v2; policies._banded) ---------------------------------

    def set_bands(self, edges: Sequence[float]) -> None:
        """Learn acceptance per band cut at ``edges`` (the server's band edges) and propose
        banded tables (:meth:`propose_bands`)."""
        self._bands = BandBook(edges, self.arms, self.params.chain_delta)

    def update_bands(self, obs: BandObservation) -> bool:
        """Feed one band's steps; False if unusable or bands are not set (steps at
        ``k = 0`` count only where the bucket's batches sat, and return False)."""
        if self._bands is None:
            return False
        if obs.decode_steps > 0:
            b = max(1, round(obs.request_steps / obs.decode_steps))  # the steps' mean batch
            self._bands.occupy(self.buckets.index(b), obs, self._gamma**obs.decode_steps)
        # Per request-step, as the pooled acceptance, and per drafting busy second since the
        # last band update: after a workload change a band must not hold the old world's
        # acceptance for minutes of light traffic.
        # The shape's evidence ages per request-step only: how acceptance falls with depth
        # is the requests' own and outlasts their acceptance.
        per_rs = self._pooled.gamma_rs ** max(obs.request_steps, 0)
        f = per_rs * math.exp(-self._band_busy / self.params.acceptance_memory_s)
        if not self._bands.update(obs, f, per_rs):
            return False  # refused, nothing aged: the busy seconds wait for the next one
        self._band_busy = 0.0
        return True

    def update_depths(self, k: int, counts: Sequence[int], every: int = 1) -> bool:
        """Feed how many drafts the requests of chain steps at arm ``k`` accepted
        (``counts[a]`` requests accepted ``a``, ``a = 0..k``): what every shallower arm would
        have accepted on them. ``every``: the counts sample one decode step in this many, so
        a counted request-step stands for that many of a contiguous run (up to the
        request-steps per independent sample, ``acceptance_corr``). False (nothing changed)
        if malformed."""
        if (isinstance(k, bool) or not isinstance(k, int) or k < 2 or len(counts) != k + 1
                or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts)
                or not any(counts) or not 1 <= every < math.inf):
            return False
        self._pooled.add_depths(k, counts, min(float(every), self.params.acceptance_corr))
        self._pred = None
        self._comp = None
        return True

    def propose_bands(self) -> BandTable | None:
        """:meth:`propose`, with an arm per band wherever a row runs its greedy arm (None,
        having proposed nothing, if bands are not set)."""
        if self._bands is None:
            return None
        return self._banded(self.buckets.arms_of(self.propose()), self.greedy_arms())

    def greedy_bands(self) -> BandTable | None:
        """The greedy table with an arm per band (None if bands are not set)."""
        if self._bands is None:
            return None
        greedy = self.greedy_arms()
        return self._banded(greedy, greedy)

    def _delta_measured(self) -> bool:
        """Whether the chain's δ is fitted on arms at two depths, not its prior alone."""
        return self._pooled.delta_measured()

    def _banded(self, arms: Sequence[int], greedy: Sequence[int]) -> BandTable:
        assert self._bands is not None
        t, margin, n = self._components()[0], self.params.switch_margin, self._bands.bands
        # the pooled acceptance's shape, every band's prior (and bound, once measured)
        self._bands.set_delta(self._delta, self._delta_measured())
        rows: list[tuple[int, ...]] = []
        for j, arm in enumerate(arms):
            if arm != greedy[j]:  # an exploring row explores in every band
                rows.append((arm,) * (n + 1))
                continue
            log_t = [float(x) for x in t.mean[j]]
            bands = self._bands.arms_for(arm, log_t, margin)
            if arm == 0 and any(bands) and not self._bands.drafting_pays(j, bands, log_t):
                bands = (0,) * n
            drafting = [k for k in bands if k > 0]
            # Protocol rule: where a band drafts the unknown band drafts too (its shallowest
            # arm), so a band that says "off" is measured again once its estimate is stale.
            unknown = min(drafting) if arm == 0 and drafting else arm
            rows.append((unknown, *bands))
        return band_table([self.buckets.bounds(j)[1] for j in range(len(arms))], rows)

    # --- learning -------------------------------------------------------------------------

    def _observed(self, j: int, obs: Observation, r: float, weight: float) -> None:
        s = int(obs.decode_steps)
        factor = self._gamma**s
        aged = forgetting(factor, obs.busy_s, self.params.step_time_memory_s)
        for t in self._time[j].values():
            t.decay(aged)
        self._time[j][obs.k].add(math.log(obs.busy_s / s), weight, weight / s, obs.b, s)
        self._busy[j] += obs.busy_s
        self._ran_at[j][obs.k] = sum(self._busy)
        if obs.k > 0:
            self._band_busy += obs.busy_s
        if self._bands is not None:  # where batches sit forgets as acceptance does, in time
            self._bands.age_occupancy(j, math.exp(-obs.busy_s / self.params.acceptance_memory_s))
        occ = self._occ[j]
        occ[0] = occ[0] * factor + s
        occ[1] = occ[1] * factor + s * obs.b
        if obs.k > 0:
            shift = self._pooled.add(obs.k, s, s * obs.b, obs.accepted_drafts, obs.busy_s)
            if shift is not None:
                self._note(shift)
        self._pred = None
        self._comp = None

    def _learn(self, j: int, obs: Observation, r: float) -> None:
        super()._learn(j, obs, r)
        # Acceptance and step time are shared: every bucket's greedy arm may have moved.
        for i in range(len(self.buckets)):
            if i != j:
                self._refresh_greedy(i)

    # --- the model ------------------------------------------------------------------------

    def _rep_b(self, j: int) -> float:
        steps, sb = self._occ[j]
        if steps > 0:
            return sb / steps
        low, high = self.buckets.bounds(j)
        return (low + high) / 2 if high is not None else low * 1.25

    def _acceptance(self) -> tuple[dict[int, float], dict[int, float]]:
        """Mean accepted drafts per request-step, and its standard deviation, per arm."""
        direct = self._pooled.direct()
        alpha, alpha_sd, self._delta = self._pooled.fit(direct)
        self._alpha = (alpha, alpha_sd)
        mean, sd = {0: 0.0}, {0: 0.0}
        for k in self.arms:
            if k == 0:
                continue
            m_model = chain_accepted(alpha, self._delta, k)
            # Spread of the chain prediction: α's uncertainty, plus the model's own misfit.
            hi = chain_accepted(min(alpha + alpha_sd, 1.0), self._delta, k)
            sd_model = max(hi - m_model, 0.0) + 0.05 * m_model + 1e-6
            if k in direct:
                m_d, sd_d = direct[k]
                w_d, w_m = 1 / (sd_d * sd_d + 1e-12), 1 / (sd_model * sd_model)
                mean[k] = (m_d * w_d + m_model * w_m) / (w_d + w_m)
                sd[k] = math.sqrt(1 / (w_d + w_m))
            else:
                mean[k], sd[k] = m_model, sd_model
        return mean, sd

    def _step_times(self) -> StepTimePosterior:
        """Log step time per (bucket, arm): the cost model plus each cell's learned deviation
        (:mod:`policies._steptime`), conditioned on every bucket's measured step times."""
        p = self.params
        # The jitter a cell's few observations are judged by: the prior's, or what the server
        # shows across every cell, whichever is larger. A loaded CPU server's step times swing
        # 3-5x from one second to the next; an arm measured for two seconds under the prior's
        # few-% jitter would be trusted within 5 % and never run again.
        resid = dof = 0.0
        for per_arm in self._time:
            for t in per_arm.values():
                if t.n > 1:
                    resid += t.resid
                    dof += t.n - 1.0
        jitter = max(p.timing_sd, math.sqrt(resid / dof) if dof >= 2 else 0.0)
        cells = [
            Cell(bucket=j, arm=self._cost_k[k], b=t.mean_b, log_t=t.mean,
                 sd=t.mean_sd(jitter, p.prior_obs), weight=t.w)
            for j, per_arm in enumerate(self._time) for k, t in per_arm.items() if t.seen
        ]
        rep = [self._rep_b(j) for j in range(len(self.buckets))]
        return step_time_posterior(cells, rep, [self._cost_k[k] for k in self.arms],
                                   zero_arm_sd=p.zero_arm_sd)

    def _components(self) -> tuple[StepTimePosterior, dict[int, float], dict[int, float]]:
        """``(log step time posterior, E[emitted] mean per arm, its sd per arm)``."""
        if self._comp is None:
            mean, sd = self._acceptance()
            self._comp = (
                self._step_times(),
                {k: 1.0 + mean[k] for k in self.arms},
                {k: sd[k] for k in self.arms},
            )
        return self._comp

    def _predictions(self) -> np.ndarray:
        """Log goodput per request, [bucket, arm, (mean, sd)].

        Acceptance is global; step time per bucket comes from :meth:`_step_times` (precise
        even where goodput is noisy: at one request, goodput moves with that request's
        acceptance, step time does not).
        """
        if self._pred is None:
            t, em, em_sd = self._components()
            pred = np.zeros((*t.mean.shape, 2))
            for ai, k in enumerate(self.arms):
                rel = em_sd[k] / em[k]
                pred[:, ai, 0] = math.log(em[k]) - t.mean[:, ai]
                pred[:, ai, 1] = np.sqrt(rel * rel + t.sd[:, ai] ** 2)
            self._pred = pred
        return self._pred

    def _posterior(self) -> np.ndarray:
        return self._predictions()

    # --- deciding -------------------------------------------------------------------------

    def _greedy_choice(self, j: int) -> int | None:
        st = self._state[j]
        if not any(other.steps for other in self._state):
            return None
        post = self._posterior()[j]
        order = sorted(range(len(self.arms)), key=lambda ai: (-post[ai, 0], self.arms[ai]))
        best = self.arms[order[0]]
        cur = st.greedy
        if cur is not None:
            ci = self.arms.index(cur)
            if post[order[0], 0] <= post[ci, 0] + self.params.switch_margin:
                return cur
        return best

    def greedy_arms(self) -> tuple[int, ...]:
        # The model predicts every bucket, so none needs to borrow a neighbour's arm.
        if not any(st.steps for st in self._state):
            return super().greedy_arms()
        return tuple(st.greedy if st.greedy is not None else self._fallback_arm()
                     for st in self._state)

    def _explore(self, j: int, greedy: int) -> int:
        """While the bucket is young (its first ``young_steps`` and ``young_s``), measure the arm
        whose optimistic value (mean + ``optimism`` sd) is highest: each plausible arm once,
        early, where a measurement is worth most. Afterwards, posterior sampling."""
        p, st = self.params, self._state[j]
        young = st.steps < p.young_steps and self._busy[j] < p.young_s
        if young and p.optimism > 0:
            t, em, em_sd = self._components()
            values = []
            for ai, arm in enumerate(self.arms):
                lt = t.mean[j, ai] - p.optimism * t.sd[j, ai]
                e = min(em[arm] + p.optimism * em_sd[arm], 1.0 + arm)
                values.append(math.log(e) - lt)
            ai = max(range(len(self.arms)), key=lambda i: (values[i], -self.arms[i]))
            return self.arms[ai]
        return self._sample(j, greedy)

    def _sample(self, j: int, greedy: int) -> int:
        """One posterior draw per arm. Acceptance is one quantity for all arms: one draw of
        the chain model's α moves every arm's emitted tokens together (so an arm cannot look
        better through acceptance that the others do not share), and never past ``k + 1``.
        Step times are drawn jointly per bucket for the same reason."""
        t, em, _ = self._components()
        p, pred, measured = self.params, self._predictions()[j], self._state[j].stats
        now = sum(self._busy)
        scale, gauss = p.sample_scale, self._rng.gauss
        alpha, alpha_sd = self._alpha
        drawn = min(max(alpha + scale * alpha_sd * gauss(0, 1), 0.0), 1.0)
        log_t = t.draw(j, self._rng)
        best_arm, best_draw = greedy, -math.inf
        for ai, arm in enumerate(self.arms):
            shift = (chain_accepted(drawn, self._delta, arm)
                     - chain_accepted(alpha, self._delta, arm))
            e = min(max(em[arm] + shift, 1.0), 1.0 + arm)
            lt = t.mean[j, ai] + scale * (float(log_t[ai]) - t.mean[j, ai])
            draw = math.log(e) - lt
            own = measured[arm]
            if own.seen:
                # The goodput this bucket measured at the arm, as a second opinion: the draw
                # moves to the posterior that holds both, its spread narrowed as much, so
                # an arm the model is unsure of (acceptance seen only while exploring) is
                # not explored past what its own measurements allow. It ages as acceptance
                # does: a bucket back after minutes away measured it under another workload.
                mean, sd = float(pred[ai, 0]), float(pred[ai, 1])
                age = now - self._ran_at[j][arm]
                sd_own = self._mean_sd(own) * math.exp(min(age / (2 * p.acceptance_memory_s),
                                                           50.0))  # ~0 weight past that
                w = sd * sd / (sd * sd + sd_own * sd_own)
                draw = mean + w * (own.mean - mean) + math.sqrt(1 - w) * (draw - mean)
            if draw > best_draw:
                best_arm, best_draw = arm, draw
        if best_arm != greedy:
            # A draw weighs an arm by its chance of winning, not by what a probe costs if it
            # loses: at large batches a probe of a deep arm at half the greedy arm's goodput
            # runs about a decision period, a few points of a minute's traffic. Past
            # _EXPLORE_REGRET, an exploring draw is run with probability _EXPLORE_REGRET /
            # (the expected loss): the dearer the rarer, and never ruled out.
            gi, ai = self.arms.index(greedy), self.arms.index(best_arm)
            regret = 1.0 - math.exp(min(float(pred[ai, 0] - pred[gi, 0]), 0.0))
            if regret > _EXPLORE_REGRET and self._rng.random() > _EXPLORE_REGRET / regret:
                return greedy
        return best_arm

    def _estimates(self) -> tuple[ArmEstimate, ...]:
        if not any(st.steps for st in self._state):
            return ()
        post = self._posterior()
        out = []
        for j, st in enumerate(self._state):
            b = self._rep_b(j)
            for ai, k in enumerate(self.arms):
                g = b * math.exp(post[j, ai, 0])
                out.append(ArmEstimate(bucket=j, arm=k, estimate=g, std=g * post[j, ai, 1],
                                       n=round(st.stats[k].w)))
        return tuple(out)
