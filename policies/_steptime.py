"""Step time per (bucket, arm): a cost model as the mean, a learned deviation of each cell.

``log T(b, k) = log T_θ(b, k) + u(b, k)``

- ``T_θ`` is the anchors' cost model, bilinear in ``b`` and ``k``, plus weight reads that
  saturate in the tokens a forward carries, ``n = b·(k+1)``:
  ``θ·[1, b, k, b·k, s_4(n), s_16(n), s_64(n), s_256(n), [k=0], [k=0]·b]`` with
  ``s_m(n) = 1 − exp(−n/m)`` (fixed, per-request and per-draft-token costs shared by every
  arm; on mixture-of-experts models the experts a step wakes, shared by every arm through
  ``n``, so a 16-token verify at 16 requests says what k = 0 costs at 256; k = 0, which
  verifies nothing, its own offsets), every shared cost non-negative, fitted in relative
  terms to every measured cell. A saturating curve that only some of the cells need weighs
  nothing where they do not: dense tables fit the bilinear part within a few %.
- ``u`` is where a cost surface departs from it: a Gaussian field, smooth in ``log b`` and
  in ``k`` (nearby buckets and arms bend alike), of scale ``τ`` (graph padding, kernels that
  change with the batch, communication: whatever no smooth form of ``b`` and ``k`` says).

``τ`` is not assumed: the residuals of the measured cells beyond their own noise decide it,
and the field's correlation lengths with it (empirical Bayes: the marginal likelihood over a
small grid, the grid's posterior averaged rather than one point picked). Where the model
fits, ``τ`` stays small and a cell never run is predicted tightly from the model (little
exploration); where it does not, ``τ`` grows, cells never run widen towards "anything the
neighbours allow", and the measured neighbours rather than the model carry the prediction.

The model's own parameter uncertainty (linearised around the fit) and the field form one
prior covariance over all cells; the measured cells, each with the noise of its own mean,
condition it (Gaussian-process regression with the cost model as its mean function).
Pure numpy; a few dozen cells and 28 grid points, so a full solve per update costs a few
milliseconds (about 7 with 45 cells measured, on one core of the 2-core dev machine).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "DEFAULT_DEVIATION_GRID",
    "DEFAULT_FIELD_LENGTHS_B",
    "DEFAULT_FIELD_LENGTHS_K",
    "DEFAULT_ZERO_ARM_SD",
    "Cell",
    "StepTimePosterior",
    "cost_features",
    "step_time_posterior",
]

# Scales tried for the cells' deviation from the cost model (log step time), with equal
# prior weight: from "the model is exact" to "it says little".
DEFAULT_DEVIATION_GRID: tuple[float, ...] = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32)
# Correlation lengths of the deviation field tried (every combination with the scales):
# in doublings of the batch size, and in k.
DEFAULT_FIELD_LENGTHS_B: tuple[float, ...] = (1.0, 4.0)
DEFAULT_FIELD_LENGTHS_K: tuple[float, ...] = (2.0, 16.0)
# Prior spread of k = 0's own intercept relative to the typical step: until k = 0 runs
# somewhere, its step time is the k > 0 arms' trend carried to k = 0 within about this much.
DEFAULT_ZERO_ARM_SD = 0.15
# Token counts at which the saturating weight-read features reach 63 % of their height: a
# spread of scales, so the fit can place a curve whose knee it does not know.
_SATURATION_TOKENS: tuple[float, ...] = (2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0)
_N_SHARED = 4 + len(_SATURATION_TOKENS)  # non-negative costs; k = 0's own two come last
_RIDGE = 1e-4
_MAX_SD = 0.5  # posterior spread where nothing is known (log step time)
_JITTER = 1e-10


def cost_features(b: float, k: int) -> list[float]:
    """Features of the cost model at batch size ``b``, arm ``k``."""
    # Per-request cost (b) is shared by every arm, each draft token adds its own (b·k). k = 0
    # (no verify) has its own intercept and slope in b, both held near zero by the prior
    # until k = 0 runs: so its growth in b is learnt from every arm until it has its own.
    # Weight reads that saturate in the tokens a forward carries, n = b·(k+1) (the experts a
    # mixture-of-experts step wakes), share one curve across arms: k = 0 at 256 requests and
    # a 16-token verify at 16 read alike, so one arm's cells say where another's flatten.
    z = 1.0 if k == 0 else 0.0
    bs = b / 64.0
    n = b * (k + 1)
    return [1.0, bs, k / 4.0, bs * k / 4.0,
            *(1.0 - math.exp(-n / n0) for n0 in _SATURATION_TOKENS), z, z * bs]


@dataclass(frozen=True, slots=True)
class Cell:
    """One measured (bucket, arm) cell: mean log step time at mean batch size ``b``, its
    standard error ``sd``, and its weight in the cost-model fit (decode steps)."""

    bucket: int
    arm: int
    b: float
    log_t: float
    sd: float
    weight: float


@dataclass(frozen=True)
class StepTimePosterior:
    """Log step time per [bucket, arm]: posterior ``mean``, ``sd``, and joint draws.

    Attributes:
        mean, sd: ``[bucket, arm]`` arrays of the mixture over ``τ``.
        tau: posterior mean of the deviation scale ``τ`` (how far the data say the cost
            model is off; small on dense tables).
        theta: the cost model's fitted parameters (None without data).
    """

    mean: np.ndarray
    sd: np.ndarray
    tau: float
    theta: np.ndarray | None
    _weights: tuple[float, ...]
    _means: np.ndarray  # [grid, bucket, arm]
    _chols: np.ndarray  # [grid, bucket, arm, arm]

    def draw(self, j: int, rng: random.Random) -> np.ndarray:
        """One joint draw of bucket ``j``'s log step times (arms move together as far as
        their errors are shared: a draw cannot flatter one arm with an error it shares)."""
        g = 0
        if len(self._weights) > 1:
            u, acc = rng.random(), 0.0
            for g, w in enumerate(self._weights):  # noqa: B007 - g is the pick
                acc += w
                if u < acc:
                    break
        z = np.array([rng.gauss(0.0, 1.0) for _ in range(self._chols.shape[-1])])
        return self._means[g, j] + self._chols[g, j] @ z

    def fit_log_t(self, b: float, k: int) -> float:
        """The cost model's log step time at ``(b, k)`` (0 without a fit)."""
        if self.theta is None:
            return 0.0
        return math.log(max(float(np.dot(self.theta, cost_features(b, k))), 1e-9))


def _fit(cells: Sequence[Cell], zero_arm_sd: float) -> tuple[np.ndarray, np.ndarray]:
    """θ and its covariance: least squares in relative terms, each cell weighing by its
    steps (capped so one busy cell cannot drown the shape), every cost non-negative.

    The costs are physical (a fixed part, per request, per draft token, per request and
    draft token): a fit free to make one negative bends the model where it has no data,
    e.g. deep drafts "cheaper" than none at large batches from a mid-batch MoE slope.
    """
    x = np.array([cost_features(c.b, c.arm) for c in cells])
    y = np.exp(np.array([c.log_t for c in cells]))
    sw = np.sqrt(np.array([min(c.weight, 100.0) / 100.0 for c in cells]))
    a = (x / y[:, None]) * sw[:, None]
    gram, rhs = a.T @ a, a.T @ sw
    p = x.shape[1]
    # Prior precision: a whisper of ridge, and k = 0's own intercept near zero (relative
    # spread zero_arm_sd) until k = 0 runs. The ridge is relative to the cells' precision:
    # held absolute, it would grow with the misfit and flatten the features the cells do
    # speak for (b·k on a table measured to 16 requests), widening the misfit further.
    t_typ = math.exp(float(np.mean(np.log(y))))
    ridge = np.eye(p) * _RIDGE * max(float(np.trace(gram)), 1e-12)
    prior = np.zeros(p)
    prior[_N_SHARED:] = 1.0 / (zero_arm_sd * t_typ) ** 2
    dof = max(len(cells) - p, 0)
    unit2 = 0.04**2  # misfit per unit weight: a few % until the residuals say
    for _ in range(2):
        reg = (gram + ridge) / unit2 + np.diag(prior)
        theta = _nnls(reg, rhs / unit2)
        rel = 1.0 - (x @ theta) / y
        unit2 = (4 * 0.04**2 + float(sw**2 @ (rel * rel))) / (4 + dof)
    return theta, np.linalg.inv((gram + ridge) / unit2 + np.diag(prior))


def _nnls(reg: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """argmin θ·reg·θ − 2·θ·rhs with the shared costs θ[:_N_SHARED] >= 0 (Lawson and
    Hanson's active set, for a quadratic with some variables free; reg positive definite)."""
    p = len(rhs)
    theta = np.linalg.solve(reg, rhs)
    if (theta[:_N_SHARED] >= 0).all():
        return theta
    active = np.zeros(p, dtype=bool)  # free to move: k = 0's own two always
    active[_N_SHARED:] = True
    theta = np.zeros(p)

    def solve_on(mask: np.ndarray) -> np.ndarray:
        out = np.zeros(p)
        out[mask] = np.linalg.solve(reg[np.ix_(mask, mask)], rhs[mask])
        return out

    theta = solve_on(active)
    for _ in range(4 * p):
        grad = rhs - reg @ theta  # descent direction of the objective
        grad[active] = 0.0
        j = int(np.argmax(grad[:_N_SHARED]))
        if grad[j] <= 1e-12 * max(float(np.abs(rhs).max()), 1e-300):
            break
        active[j] = True
        while True:
            trial = solve_on(active)
            bad = active[:_N_SHARED] & (trial[:_N_SHARED] <= 0)
            if not bad.any():
                theta = trial
                break
            # Step towards the trial as far as feasibility allows; drop who hits zero.
            idx = np.flatnonzero(bad)
            step = min(theta[i] / (theta[i] - trial[i]) for i in idx)
            theta = theta + step * (trial - theta)
            drop = active.copy()
            drop[_N_SHARED:] = False
            drop &= theta <= 1e-15
            active &= ~drop
            theta[drop] = 0.0
    return theta


def step_time_posterior(
    cells: Sequence[Cell],
    rep_b: Sequence[float],
    arms: Sequence[int],
    *,
    grid: Sequence[float] = DEFAULT_DEVIATION_GRID,
    lengths_b: Sequence[float] = DEFAULT_FIELD_LENGTHS_B,
    lengths_k: Sequence[float] = DEFAULT_FIELD_LENGTHS_K,
    zero_arm_sd: float = DEFAULT_ZERO_ARM_SD,
) -> StepTimePosterior:
    """The posterior of every (bucket, arm) cell's log step time at ``rep_b[bucket]``.

    Args:
        cells: the measured cells (at most one per bucket and arm).
        rep_b: each bucket's representative batch size.
        arms: the arms, in the order of the result's second axis.
        grid: deviation scales ``τ`` to average over (equal prior weight) ...
        lengths_b, lengths_k: ... and correlation lengths of the deviation field (doublings
            of b; k), every combination.
        zero_arm_sd: prior spread of k = 0's own intercept, relative to the typical step.
    """
    nb, na = len(rep_b), len(arms)
    if not cells:
        mean = np.full((nb, na), math.log(0.01))
        sd = np.full((nb, na), _MAX_SD)
        chol = np.broadcast_to(np.eye(na) * _MAX_SD, (1, nb, na, na))
        return StepTimePosterior(mean, sd, float(grid[-1]), None, (1.0,), mean[None], chol)
    theta, cov_theta = _fit(cells, zero_arm_sd)
    y_all = np.array([c.log_t for c in cells])
    t_lo, t_hi = math.exp(float(y_all.min())) * 0.3, math.exp(float(y_all.max())) * 10.0

    # The model at every cell, and its gradient in θ (relative: d log T / dθ).
    feats = np.array([[cost_features(rep_b[j], k) for k in arms] for j in range(nb)])
    pred = feats @ theta
    mu = np.log(np.clip(pred, t_lo, t_hi)).reshape(nb * na)
    grad = (feats / np.maximum(pred, t_lo)[..., None]).reshape(nb * na, -1)
    c_model = grad @ cov_theta @ grad.T

    # Measured cells, moved from their mean batch size to the bucket's by the model's slope.
    col = {k: i for i, k in enumerate(arms)}
    idx = np.array([c.bucket * na + col[c.arm] for c in cells])
    shift = np.array([math.log(max(float(feats[c.bucket, col[c.arm]] @ theta), t_lo))
                      - math.log(max(float(np.dot(theta, cost_features(c.b, c.arm))), t_lo))
                      for c in cells])
    resid = y_all + shift - mu[idx]
    noise = np.array([c.sd * c.sd for c in cells])

    # The deviation field, exponential in log2 b and in k (rough, as measured tables are),
    # for every (τ, length in b, length in k) of the grid at once.
    xb = np.repeat(np.log2(np.maximum(np.asarray(rep_b, dtype=float), 1.0)), na)
    xk = np.tile(np.asarray(arms, dtype=float), nb)
    db = np.abs(xb[:, None] - xb[None, idx])  # [all, measured]
    dk = np.abs(xk[:, None] - xk[None, idx])
    hyper = [(t, lb, lk) for t in grid for lb in lengths_b for lk in lengths_k]
    tau2 = np.array([h[0] ** 2 for h in hyper])[:, None, None]
    lb = np.array([h[1] for h in hyper])[:, None, None]
    lk = np.array([h[2] for h in hyper])[:, None, None]
    c_am = c_model[:, idx] + tau2 * np.exp(-db / lb - dk / lk)  # [hyper, all, measured]
    c_mm = c_am[:, idx, :] + np.diag(noise + _JITTER)
    chol = np.linalg.cholesky(c_mm)
    r = np.broadcast_to(resid[None, :, None], (len(hyper), len(idx), 1))
    sol = np.linalg.solve(chol, np.concatenate([r, c_am.transpose(0, 2, 1)], axis=2))
    alpha, v = sol[:, :, 0], sol[:, :, 1:]  # L⁻¹ r and L⁻¹ C[measured, all]
    lw = -0.5 * (alpha * alpha).sum(axis=1) - np.log(np.diagonal(chol, axis1=1, axis2=2)).sum(1)
    w = np.exp(lw - lw.max())
    w /= w.sum()
    m = (mu + np.einsum("hmn,hm->hn", v, alpha)).reshape(len(hyper), nb, na)

    # Per bucket, the arms' joint posterior covariance; each spread capped at _MAX_SD.
    own = np.exp(-np.abs(xk[:na, None] - xk[None, :na]) / lk)  # [hyper, arm, arm] (same b)
    c_blocks = np.einsum("jajb->jab", c_model.reshape(nb, na, nb, na))
    v4 = v.reshape(len(hyper), -1, nb, na)
    blocks = c_blocks + tau2[..., None] * own[:, None] - np.einsum("hmja,hmjb->hjab", v4, v4)
    var = np.maximum(np.einsum("hjaa->hja", blocks), _JITTER)
    scale = np.minimum(1.0, _MAX_SD / np.sqrt(var))
    blocks = blocks * scale[..., :, None] * scale[..., None, :]
    blocks += np.eye(na) * 1e-9
    chols = np.linalg.cholesky(blocks)
    var = np.einsum("hjaa->hja", blocks)
    mean = np.einsum("g,gja->ja", w, m)
    second = np.einsum("g,gja->ja", w, var + m * m)
    sd = np.sqrt(np.maximum(second - mean * mean, 0.0))
    keep = w > 1e-6  # components the data have ruled out are not drawn from
    weights = w[keep] / w[keep].sum()
    return StepTimePosterior(
        mean, sd, float(w @ np.array([h[0] for h in hyper])), theta,
        tuple(float(x) for x in weights), m[keep], chols[keep],
    )
