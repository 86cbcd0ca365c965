"""Model-based policy: predict goodput from acceptance and step time, share across buckets.

``goodput(b, k) = b · E[emitted | α̂, k] / T̂(b, k)`` (per request: ``E[emitted] / T̂``):

- **Acceptance** is a property of the requests, not of the batch size, so one estimate serves
  every bucket. Per arm ``k > 0`` the mean accepted drafts per request-step come straight
  from the accepted/drafted counters (observable whenever ``k > 0``, no exploration needed);
  a chain model (``P(A ≥ i) = α^i δ^(i(i−1)/2)``, α fitted to those means) fills in arms
  never run, and shrinks the noisy ones.
- **Step time** ``T(b, k)`` is fitted as ``θ·[1, b, k, b·k, [k=0]]`` over every
  bucket's measured mean step times (the anchors' cost model is exactly bilinear in ``b``
  and ``k``), plus a residual field carried over from the nearest buckets where the arm ran
  (measured tables bend where the bilinear form does not), made monotone in ``b``.
- The model's prediction is a **prior** for each (bucket, arm); the bucket's own measured
  goodput is the likelihood, so measurements win where they are plentiful and the model
  decides where they are not. Exploration samples this posterior: an arm the model is sure
  is bad is never tried, which is where this policy saves exploration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from policies._acceptance import expected_accepted
from policies._base import ArmEstimate, Observation
from policies._learning import LearnerParams, LearningPolicy, _require
from policies._stats import ArmStats

__all__ = [
    "DEFAULT_ACCEPTANCE_CORR",
    "DEFAULT_ACCEPTANCE_MEMORY_REQUEST_STEPS",
    "DEFAULT_ACCEPTANCE_MEMORY_STEPS",
    "DEFAULT_CHAIN_DELTA",
    "DEFAULT_EXPLORE_MIN_PROB",
    "DEFAULT_EXPLORE_MIN_RATIO",
    "DEFAULT_TIME_MODEL_SD",
    "ModelParams",
    "ModelPolicy",
]

# Acceptance memory (global, all buckets): discounted per request-step and per decode step,
# so it follows a workload shift within ~30 s of traffic at one request (where information
# is scarce) and within a few seconds at hundreds.
DEFAULT_ACCEPTANCE_MEMORY_REQUEST_STEPS = 100_000.0
DEFAULT_ACCEPTANCE_MEMORY_STEPS = 5_000.0
# Request-steps per independent acceptance sample. A request keeps its α for its whole life,
# so request-steps are not independent; but requests differ far less (α ~ Beta, κ ≈ 20)
# than single steps do, and 30 matches the spread of per-window means in the simulator.
DEFAULT_ACCEPTANCE_CORR = 30.0
# Per-position decay used to extrapolate acceptance to arms not yet run (anchors §3.3).
DEFAULT_CHAIN_DELTA = 0.973
# Relative error of the step-time model one bucket away from where the arm was measured
# (it grows with the square root of the distance between measured buckets, linearly beyond).
DEFAULT_TIME_MODEL_SD = 0.04
DEFAULT_MODEL_SAMPLE_SCALE = 1.0
# Step-time ordering across buckets (see ModelPolicy._order_step_times): cells at most this
# uncertain bound their neighbours, with this much slack (log step time).
DEFAULT_ORDER_CONFIDENT_SD = 0.03
# Young buckets measure the arm with the best mean + OPTIMISM sd first.
DEFAULT_OPTIMISM = 1.0
DEFAULT_YOUNG_STEPS = 500
# z-score at which the short acceptance memory overrules the long one (a workload shift).
DEFAULT_SHIFT_Z = 3.0
# An arm is explored only with at least this posterior chance of beating the greedy one ...
DEFAULT_EXPLORE_MIN_PROB = 0.05
# ... and only if its expected goodput is at least this share of the greedy arm's.
DEFAULT_EXPLORE_MIN_RATIO = 2.0 / 3.0
DEFAULT_ORDER_SLACK = 0.02
_RIDGE = 1e-4
# Shift detector: the short acceptance memory (decode steps) and the evidence it needs.
_FAST_GAMMA = 1.0 - 1.0 / 400.0
_FAST_MIN_REQUEST_STEPS = 2_000.0
_FAR_SD = 0.5  # prediction spread where the model has nothing to go on


@dataclass(frozen=True, kw_only=True)
class ModelParams(LearnerParams):
    """:class:`LearnerParams` plus the model's own.

    Attributes:
        acceptance_memory_request_steps: memory of the acceptance estimate, in request-steps.
        acceptance_memory_steps: ... and in decode steps (both discount).
        acceptance_corr: request-steps per independent acceptance sample (>= 1).
        chain_delta: per-position decay δ of the chain model, in (0, 1].
        time_model_sd: relative error of the step-time model next to measured buckets.
        sample_scale: posterior draws are scaled by this.
        order_confident_sd: step-time cells at most this uncertain bound their neighbours.
        order_slack: slack of that bound (log step time).
        optimism: for its first ``young_steps`` decode steps, a bucket runs the arm with
            the best mean + ``optimism`` standard deviations (0 = posterior sampling only).
        young_steps: see ``optimism``.
        shift_z: z-score at which recent acceptance overrules the long memory (a shift).
        explore_min_prob: an arm is explored only with at least this posterior probability
            of beating the greedy arm (0 = whatever the draw says).
        explore_min_ratio: ... and only if its expected goodput (under the posterior) is at
            least this share of the greedy arm's (0 = no such bar).
    """

    acceptance_memory_request_steps: float = DEFAULT_ACCEPTANCE_MEMORY_REQUEST_STEPS
    acceptance_memory_steps: float = DEFAULT_ACCEPTANCE_MEMORY_STEPS
    acceptance_corr: float = DEFAULT_ACCEPTANCE_CORR
    chain_delta: float = DEFAULT_CHAIN_DELTA
    time_model_sd: float = DEFAULT_TIME_MODEL_SD
    sample_scale: float = DEFAULT_MODEL_SAMPLE_SCALE
    order_confident_sd: float = DEFAULT_ORDER_CONFIDENT_SD
    order_slack: float = DEFAULT_ORDER_SLACK
    optimism: float = DEFAULT_OPTIMISM
    young_steps: int = DEFAULT_YOUNG_STEPS
    shift_z: float = DEFAULT_SHIFT_Z
    explore_min_prob: float = DEFAULT_EXPLORE_MIN_PROB
    explore_min_ratio: float = DEFAULT_EXPLORE_MIN_RATIO

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("acceptance_memory_request_steps", "acceptance_memory_steps"):
            _require(getattr(self, name) >= 1, name, ">= 1 (or inf)", getattr(self, name))
        _require(1 <= self.acceptance_corr < math.inf, "acceptance_corr", ">= 1 and finite",
                 self.acceptance_corr)
        _require(0 < self.chain_delta <= 1, "chain_delta", "in (0, 1]", self.chain_delta)
        _require(0 < self.time_model_sd < math.inf, "time_model_sd", "positive and finite",
                 self.time_model_sd)
        _require(0 < self.sample_scale < math.inf, "sample_scale", "positive and finite",
                 self.sample_scale)
        _require(0 <= self.order_confident_sd < math.inf, "order_confident_sd",
                 ">= 0 and finite", self.order_confident_sd)
        _require(0 <= self.order_slack < math.inf, "order_slack", ">= 0 and finite",
                 self.order_slack)
        _require(0 <= self.optimism < math.inf, "optimism", ">= 0 and finite", self.optimism)
        _require(isinstance(self.young_steps, int) and self.young_steps >= 0, "young_steps",
                 "an int >= 0", self.young_steps)
        _require(0 <= self.explore_min_prob < 0.5, "explore_min_prob", "in [0, 0.5)",
                 self.explore_min_prob)
        _require(0 <= self.explore_min_ratio < 1, "explore_min_ratio", "in [0, 1)",
                 self.explore_min_ratio)
        _require(0 < self.shift_z <= math.inf, "shift_z", "positive (inf = never)",
                 self.shift_z)


class ModelPolicy(LearningPolicy):
    """Model-based posterior sampling (name ``"model"``). See the module docstring."""

    name = "model"
    params_class = ModelParams
    params: ModelParams

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        p = self.params
        self._acc_gamma_rs = (
            1.0 if math.isinf(p.acceptance_memory_request_steps)
            else 1.0 - 1.0 / p.acceptance_memory_request_steps
        )
        self._acc_gamma_s = (
            1.0 if math.isinf(p.acceptance_memory_steps)
            else 1.0 - 1.0 / p.acceptance_memory_steps
        )
        # per arm k > 0: discounted accepted drafts and request-steps
        self._acc = {k: [0.0, 0.0] for k in self.arms if k > 0}
        # The same with a short memory: when it disagrees clearly with the long one, the
        # workload changed, and the long memory restarts from it (detect and restart).
        self._acc_fast = {k: [0.0, 0.0] for k in self.arms if k > 0}
        # per bucket, per arm: discounted log step time (ArmStats over log seconds)
        self._time = [{k: ArmStats() for k in self.arms} for _ in range(len(self.buckets))]
        self._occ = [[0.0, 0.0] for _ in range(len(self.buckets))]  # discounted steps, steps*b
        self._pred: np.ndarray | None = None  # [bucket, arm] -> (mean, sd) of log goodput/req
        self._theta: np.ndarray | None = None
        self._comp: tuple[np.ndarray, dict[int, float], dict[int, float]] | None = None
        self._alpha = (0.7, 0.3)  # chain-model α and its standard error
        self._bounds: tuple[np.ndarray, np.ndarray] | None = None  # log step-time bounds

    # --- learning -------------------------------------------------------------------------

    def _observed(self, j: int, obs: Observation, r: float, weight: float) -> None:
        s = int(obs.decode_steps)
        factor = self._gamma**s
        for t in self._time[j].values():
            t.decay(factor)
        self._time[j][obs.k].add(math.log(obs.busy_s / s), weight, weight / s, obs.b, s)
        occ = self._occ[j]
        occ[0] = occ[0] * factor + s
        occ[1] = occ[1] * factor + s * obs.b
        if obs.k > 0:
            # Acceptance ages only while it is measured: with nothing drafting nothing new can
            # be learned, and forgetting would only buy exploration of arms the last evidence
            # rules out.
            req_steps = s * obs.b
            f = self._acc_gamma_rs**req_steps * self._acc_gamma_s**s
            fast = _FAST_GAMMA**s
            for acc, quick in zip(self._acc.values(), self._acc_fast.values(), strict=True):
                acc[0] *= f
                acc[1] *= f
                quick[0] *= fast
                quick[1] *= fast
            for table in (self._acc, self._acc_fast):
                table[obs.k][0] += obs.accepted_drafts
                table[obs.k][1] += req_steps
            self._detect_shift(obs.k)
        self._pred = None
        self._comp = None

    def _detect_shift(self, k: int) -> None:
        p = self.params
        (a_slow, rs_slow), (a_fast, rs_fast) = self._acc[k], self._acc_fast[k]
        if rs_fast < _FAST_MIN_REQUEST_STEPS or rs_slow <= rs_fast:
            return
        m_slow, m_fast = a_slow / rs_slow, a_fast / rs_fast
        sd = (k / 2) * math.sqrt(p.acceptance_corr / rs_fast + p.acceptance_corr / rs_slow)
        if abs(m_fast - m_slow) > p.shift_z * sd:
            for arm in self._acc:
                self._acc[arm][:] = self._acc_fast[arm]
            self._note(f"acceptance changed: k={k} accepts {m_fast:.2f} drafts per request-"
                       f"step, was {m_slow:.2f}; the acceptance estimate restarts")

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
        p = self.params
        direct: dict[int, tuple[float, float]] = {}
        for k, (acc, rs) in self._acc.items():
            if rs > 0:
                m = min(max(acc / rs, 0.0), float(k))
                sd = (k / 2) * math.sqrt(p.acceptance_corr / rs)
                direct[k] = (m, sd)
        alpha, alpha_sd = self._fit_alpha(direct)
        self._alpha = (alpha, alpha_sd)
        mean, sd = {0: 0.0}, {0: 0.0}
        for k in self.arms:
            if k == 0:
                continue
            m_model = expected_accepted(alpha, p.chain_delta, k)
            # Spread of the chain prediction: α's uncertainty, plus the model's own misfit.
            hi = expected_accepted(min(alpha + alpha_sd, 1.0), p.chain_delta, k)
            sd_model = max(hi - m_model, 0.0) + 0.05 * m_model + 1e-6
            if k in direct:
                m_d, sd_d = direct[k]
                w_d, w_m = 1 / (sd_d * sd_d + 1e-12), 1 / (sd_model * sd_model)
                mean[k] = (m_d * w_d + m_model * w_m) / (w_d + w_m)
                sd[k] = math.sqrt(1 / (w_d + w_m))
            else:
                mean[k], sd[k] = m_model, sd_model
        return mean, sd

    def _fit_alpha(self, direct: dict[int, tuple[float, float]]) -> tuple[float, float]:
        """Least-squares α of the chain model to the measured means (golden section)."""
        if not direct:
            return 0.7, 0.3  # nothing seen yet: a wide prior around typical EAGLE-3 chat
        delta = self.params.chain_delta

        def loss(a: float) -> float:
            return sum(((m - expected_accepted(a, delta, k)) / sd) ** 2
                       for k, (m, sd) in direct.items())

        lo, hi = 0.0, 1.0
        g = (math.sqrt(5) - 1) / 2
        x1, x2 = hi - g * (hi - lo), lo + g * (hi - lo)
        f1, f2 = loss(x1), loss(x2)
        for _ in range(30):
            if f1 < f2:
                hi, x2, f2 = x2, x1, f1
                x1 = hi - g * (hi - lo)
                f1 = loss(x1)
            else:
                lo, x1, f1 = x1, x2, f2
                x2 = lo + g * (hi - lo)
                f2 = loss(x2)
        alpha = (lo + hi) / 2
        # Curvature of the loss gives α's standard error.
        h = 1e-3
        a0, a1, a2 = max(alpha - h, 0.0), alpha, min(alpha + h, 1.0)
        curv = (loss(a2) - 2 * loss(a1) + loss(a0)) / (h * h)
        sd = math.sqrt(2 / curv) if curv > 0 else 0.3
        return alpha, min(sd, 0.3)

    def _features(self, b: float, k: int) -> list[float]:
        # Per-request cost (b) is shared by every arm, each draft token adds its own (b·k):
        # so k = 0's growth in b is learnt from every arm, not only from where k = 0 ran.
        # k = 0 keeps its own intercept (no verify of extra tokens, a lone draft extend).
        z = 1.0 if k == 0 else 0.0
        bs = b / 64.0
        return [1.0, bs, k / 4.0, bs * k / 4.0, z]

    def _time_model(self) -> np.ndarray:
        """Log step time per (bucket, arm) from the other buckets: [bucket, arm, (mean, sd)].

        A least-squares fit of the bilinear form to every measured (bucket, arm) cell, in
        relative terms (each cell weighs by its steps, capped so one busy cell cannot
        drown the shape), plus the residual field of the buckets that ran the arm. Its
        spread is the fit's own parameter uncertainty at that point (large where the data
        cannot tell, e.g. how k = 0 grows with b before it ran at two batch sizes) plus the
        misfit carried by the residual field.
        """
        p = self.params
        rows, ys, ws = [], [], []
        for per_arm in self._time:
            for k, t in per_arm.items():
                if t.seen:
                    rows.append(self._features(t.mean_b, k))
                    ys.append(math.exp(t.mean))
                    ws.append(min(t.w, 100.0) / 100.0)
        nb, na = len(self.buckets), len(self.arms)
        out = np.zeros((nb, na, 2))
        rep = [self._rep_b(j) for j in range(nb)]
        self._theta = None
        if not rows:
            out[:, :, 0] = math.log(0.01)
            out[:, :, 1] = _FAR_SD
            return out
        x, y, w = np.array(rows), np.array(ys), np.array(ws)
        sw = np.sqrt(w)
        a = (x / y[:, None]) * sw[:, None]  # relative errors: rows x/y against target 1
        gram = a.T @ a
        reg = gram + _RIDGE * max(float(np.trace(gram)), 1e-12) * np.eye(x.shape[1])
        inv = np.linalg.inv(reg)
        theta = inv @ (a.T @ sw)
        self._theta = theta
        rel = 1.0 - (x @ theta) / y
        dof = max(len(ys) - x.shape[1], 0)
        # Misfit per unit weight, shrunk towards time_model_sd while cells are few.
        unit2 = (4 * p.time_model_sd**2 + float(w @ (rel * rel))) / (4 + dof)
        unit = math.sqrt(unit2)
        cov = unit2 * inv
        t_lo, t_hi = float(y.min()) * 0.3, float(y.max()) * 10.0

        def fit(b: float, k: int) -> tuple[float, float]:
            f = np.array(self._features(b, k))
            pred = float(f @ theta)
            if pred <= 0:
                return math.log(t_lo), _FAR_SD
            sd = math.sqrt(max(float(f @ cov @ f), 0.0)) / pred
            return math.log(min(max(pred, t_lo), t_hi)), sd

        for ai, k in enumerate(self.arms):
            observed = [j for j in range(nb) if self._time[j][k].seen]
            resid = {j: self._time[j][k].mean - fit(self._time[j][k].mean_b, k)[0]
                     for j in observed}
            prev = -math.inf
            for j in range(nb):
                base, sd_fit = fit(rep[j], k)
                # The residual field of the *other* buckets that ran this arm (the bucket's
                # own measurements enter as the likelihood, not twice): interpolated between
                # the nearest on each side, carried flat beyond the last one.
                left = max((i for i in observed if i < j), default=None)
                right = min((i for i in observed if i > j), default=None)
                if left is not None and right is not None:
                    frac = (j - left) / (right - left)
                    base += (1 - frac) * resid[left] + frac * resid[right]
                    sd_field = unit * math.sqrt(min(j - left, right - j))
                elif left is not None or right is not None:
                    near = left if left is not None else right
                    assert near is not None
                    base += resid[near]
                    sd_field = unit * abs(j - near)
                else:
                    sd_field = unit
                # Monotone in b: a bigger batch never runs a step faster.
                base = max(base, prev)
                prev = base
                out[j, ai] = (base, min(math.hypot(sd_fit, sd_field), _FAR_SD))
        return out

    def _step_times(self) -> np.ndarray:
        """Log step time per [bucket, arm, (mean, sd)]: the model's prior combined with the
        bucket's own measured step times, then held to the physics of speculation."""
        p = self.params
        t = self._time_model()
        for j in range(len(self.buckets)):
            b = self._rep_b(j)
            for ai, k in enumerate(self.arms):
                cell = self._time[j][k]
                if not cell.seen:
                    continue
                # Measured at the cell's mean batch size; moved to the bucket's by the fit's
                # slope. Within-cell spread (other b's, jitter) sets its weight.
                m0, s0 = t[j, ai]
                m1 = cell.mean + self._fit_log_t(b, k) - self._fit_log_t(cell.mean_b, k)
                s1 = cell.mean_sd(p.timing_sd, p.prior_obs)
                w0, w1 = 1 / (s0 * s0), 1 / (s1 * s1)
                t[j, ai] = ((m0 * w0 + m1 * w1) / (w0 + w1), math.sqrt(1 / (w0 + w1)))
        self._order_step_times(t)
        return t

    def _order_step_times(self, t: np.ndarray) -> None:  # noqa: C901 - one rule, two passes
        """More drafting gets relatively dearer as the batch grows.

        For arms ``k > k'`` the ratio ``T(b, k) / T(b, k')`` does not fall as ``b`` grows:
        at small batches a step is bound by reading weights, at large ones by compute, and
        drafting adds tokens. Where a bucket's ratio is unknown but its neighbours' are
        measured, that bounds it: from below by the measured buckets under it, from above by
        those over it (with a little slack for measurement noise). This is what keeps the
        model from exploring deep drafting at large batches it has never run them at.
        """
        p = self.params
        nb, na = len(self.buckets), len(self.arms)
        # Bounds on each cell's log step time, for the sampler (draws are clipped to them).
        lo_b = np.full((nb, na), -np.inf)
        hi_b = np.full((nb, na), np.inf)
        for hi in range(1, na):
            for lo in range(hi):
                sure = np.maximum(t[:, hi, 1], t[:, lo, 1]) <= p.order_confident_sd
                floor = -math.inf  # the ratio measured in the buckets below
                for j in range(nb):
                    d = t[j, hi, 0] - t[j, lo, 0]
                    if sure[j]:
                        floor = max(floor, d)
                        continue
                    if d < floor - p.order_slack:
                        self._move(t, j, hi, lo, floor - p.order_slack)
                    if math.isfinite(floor):
                        lo_b[j, hi] = max(lo_b[j, hi], t[j, lo, 0] + floor - p.order_slack)
                        hi_b[j, lo] = min(hi_b[j, lo], t[j, hi, 0] - floor + p.order_slack)
                ceil = math.inf  # ... and above
                for j in reversed(range(nb)):
                    d = t[j, hi, 0] - t[j, lo, 0]
                    if sure[j]:
                        ceil = min(ceil, d)
                        continue
                    if d > ceil + p.order_slack:
                        self._move(t, j, hi, lo, ceil + p.order_slack)
                    if math.isfinite(ceil):
                        hi_b[j, hi] = min(hi_b[j, hi], t[j, lo, 0] + ceil + p.order_slack)
                        lo_b[j, lo] = max(lo_b[j, lo], t[j, hi, 0] - ceil - p.order_slack)
        self._bounds = (lo_b, np.maximum(hi_b, lo_b))

    @staticmethod
    def _move(t: np.ndarray, j: int, hi: int, lo: int, target: float) -> None:
        # Move the less certain of the two arms onto the bound (log T_hi - log T_lo ==
        # target). The bound is one-sided: the truth may lie well inside it, so the moved
        # arm keeps its spread, widened by how far the model was off (draws are clipped to
        # the bound's side).
        a, other, sign = (hi, lo, 1.0) if t[j, hi, 1] >= t[j, lo, 1] else (lo, hi, -1.0)
        new = t[j, other, 0] + sign * target
        t[j, a, 1] = max(t[j, a, 1], abs(new - t[j, a, 0]))
        t[j, a, 0] = new

    def _components(self) -> tuple[np.ndarray, dict[int, float], dict[int, float]]:
        """``(log step time [bucket, arm, 2], E[emitted] mean per arm, its sd per arm)``."""
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
            pred = np.zeros_like(t)
            for ai, k in enumerate(self.arms):
                rel = em_sd[k] / em[k]
                pred[:, ai, 0] = math.log(em[k]) - t[:, ai, 0]
                pred[:, ai, 1] = np.sqrt(rel * rel + t[:, ai, 1] ** 2)
            self._pred = pred
        return self._pred

    def _fit_log_t(self, b: float, k: int) -> float:
        theta = self._theta
        if theta is None:
            return 0.0
        return math.log(max(float(np.dot(theta, self._features(b, k))), 1e-9))

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
        """While the bucket is young (its first ``young_steps``), measure the arm
        whose optimistic value (mean + ``optimism`` sd) is highest: each plausible arm once,
        early, where a measurement is worth most. Afterwards, posterior sampling."""
        p, st = self.params, self._state[j]
        if st.steps < p.young_steps and p.optimism > 0:
            t, em, em_sd = self._components()
            values = []
            for ai, arm in enumerate(self.arms):
                # Optimistic on both factors, but never past what the step-time ordering
                # allows: a cell pinned by its measured neighbours keeps the model's wide
                # spread (see _move), which must not make it look worth a dwell.
                lt = t[j, ai, 0] - p.optimism * t[j, ai, 1]
                if self._bounds is not None:
                    lt = max(lt, self._bounds[0][j, ai])
                e = min(em[arm] + p.optimism * em_sd[arm], 1.0 + arm)
                values.append(math.log(e) - lt)
            ai = max(range(len(self.arms)), key=lambda i: (values[i], -self.arms[i]))
            arm = self.arms[ai]
        else:
            arm = self._sample(j, greedy)
        return arm if arm == greedy or self._plausible(j, arm, greedy) else greedy

    def _plausible(self, j: int, arm: int, greedy: int) -> bool:
        """Whether a dwell on ``arm`` in bucket ``j`` is worth its price: at least
        ``explore_min_prob`` chance of beating ``greedy``, and an expected goodput of at
        least ``explore_min_ratio`` of the greedy arm's.

        A posterior draw far in an arm's tail buys a whole decision period of it, hundreds of
        decode steps at small batches. An arm never run anywhere has the model's widest
        spread, so it keeps a few percent of chance even where the model puts it at half the
        greedy arm's goodput (k = 0 at one request on a code workload): one such dwell costs
        as much as the phase's whole tolerance. The expected ratio defers it to buckets where
        it is close, which teach the model as much about it for a fraction of the price.
        """
        p = self.params
        post = self._posterior()[j]
        ai, gi = self.arms.index(arm), self.arms.index(greedy)
        diff = post[ai, 0] - post[gi, 0]
        sd = math.hypot(post[ai, 1], post[gi, 1])
        if p.explore_min_ratio > 0 and diff + 0.5 * sd * sd < math.log(p.explore_min_ratio):
            return False  # E[g_arm / g_greedy] (log-normal) below the bar
        if p.explore_min_prob <= 0:
            return True
        if sd <= 0:
            return diff > 0
        return 0.5 * math.erfc(-diff / (sd * math.sqrt(2))) >= p.explore_min_prob

    def _sample(self, j: int, greedy: int) -> int:
        """One posterior draw per arm. Acceptance is one quantity for all arms: one draw of
        the chain model's α moves every arm's emitted tokens together (so an arm cannot look
        better through acceptance that the others do not share), and never past ``k + 1``."""
        t, em, em_sd = self._components()
        p = self.params
        scale, gauss = p.sample_scale, self._rng.gauss
        alpha, alpha_sd = self._alpha
        drawn = min(max(alpha + scale * alpha_sd * gauss(0, 1), 0.0), 1.0)
        best_arm, best_draw = greedy, -math.inf
        for ai, arm in enumerate(self.arms):
            shift = (expected_accepted(drawn, p.chain_delta, arm)
                     - expected_accepted(alpha, p.chain_delta, arm))
            e = min(max(em[arm] + shift, 1.0), 1.0 + arm)
            lt = t[j, ai, 0] + scale * t[j, ai, 1] * gauss(0, 1)
            if self._bounds is not None:
                lt = min(max(lt, self._bounds[0][j, ai]), self._bounds[1][j, ai])
            draw = math.log(e) - lt
            if draw > best_draw:
                best_arm, best_draw = arm, draw
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
