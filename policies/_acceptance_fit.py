"""Acceptance per arm: the chain model as the mean, a learned deviation of each arm.

``log E[emitted | k] = log(1 + chain(α, δ, k)) + u(k)``

- ``chain`` is anchors §3.3's model (:mod:`policies._acceptance`), one α fitted to every
  measured arm, δ fixed. It carries what one arm measures to arms never run.
- ``u`` is where acceptance departs from a chain: conditional acceptance that *rises* with
  depth, a draft that falls off a cliff past the depth it was trained to, requests so
  diverse that the mix of them is no chain of the mean α. A Gaussian field over ``k``
  (nearby arms depart alike) of scale ``τ``.

As for step time (:mod:`policies._steptime`), ``τ`` is not assumed: the measured arms'
residuals beyond their own noise decide it (empirical Bayes over a small grid of scales and
lengths, the grid's posterior averaged). Where the chain fits, arms never run are predicted
tightly and need no exploration; where it misses, they widen and get tried. Each measured
arm's noise comes from the spread of its own measurements, not from an assumed diversity of
requests: at one request a measurement is one request's acceptance.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "DEFAULT_ACCEPTANCE_GRID",
    "DEFAULT_ACCEPTANCE_LENGTHS",
    "AcceptancePosterior",
    "ArmAcceptance",
    "acceptance_posterior",
    "chain_accepted",
]

# Deviation scales of log emitted tokens from the chain tried, with equal prior weight.
DEFAULT_ACCEPTANCE_GRID: tuple[float, ...] = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32)
# Correlation lengths of the deviation in k (every combination with the scales).
DEFAULT_ACCEPTANCE_LENGTHS: tuple[float, ...] = (2.0, 8.0)
# α before any arm drafted: a wide prior around typical EAGLE-3 chat.
_PRIOR_ALPHA = (0.7, 0.3)
_JITTER = 1e-10


def chain_accepted(alpha: float, delta: float, arms: Sequence[int]) -> np.ndarray:
    """Mean accepted drafts per request-step of the chain at each arm (vectorised
    :func:`policies._acceptance.expected_accepted`)."""
    kmax = max(max(arms), 1)
    i = np.arange(1, kmax + 1, dtype=float)
    surv = np.cumprod(alpha * delta ** (i - 1.0))
    cum = np.concatenate([[0.0], np.cumsum(surv)])
    return cum[np.asarray(arms, dtype=int)]


@dataclass(frozen=True, slots=True)
class ArmAcceptance:
    """One arm's measured mean accepted drafts per request-step and its standard error."""

    arm: int
    mean: float
    sd: float


@dataclass(frozen=True)
class AcceptancePosterior:
    """Log emitted tokens per request-step, per arm: posterior ``mean``, ``sd`` and joint
    draws. ``alpha`` is the chain's fit, ``tau`` the posterior mean of the deviation scale
    (small where the chain fits)."""

    arms: tuple[int, ...]
    mean: np.ndarray
    sd: np.ndarray
    alpha: float
    tau: float
    _weights: tuple[float, ...]
    _means: np.ndarray  # [grid, arm]
    _chols: np.ndarray  # [grid, arm, arm]
    cap: np.ndarray  # log(1 + k): no arm emits more than k + 1 tokens a step

    def draw(self, rng: random.Random) -> np.ndarray:
        """One joint draw of every arm's log emitted tokens (arms move together as far as
        their errors are shared), each within ``[0, log(1 + k)]``."""
        g = 0
        if len(self._weights) > 1:
            u, acc = rng.random(), 0.0
            for g, w in enumerate(self._weights):  # noqa: B007 - g is the pick
                acc += w
                if u < acc:
                    break
        z = np.array([rng.gauss(0.0, 1.0) for _ in range(len(self.arms))])
        return np.clip(self._means[g] + self._chols[g] @ z, 0.0, self.cap)


def _chain_table(alphas: np.ndarray, delta: float, arms: Sequence[int]) -> np.ndarray:
    """:func:`chain_accepted` for many α at once: [alpha, arm]."""
    kmax = max(max(arms), 1)
    i = np.arange(1, kmax + 1, dtype=float)
    surv = np.cumprod(alphas[:, None] * delta ** (i - 1.0), axis=1)
    cum = np.concatenate([np.zeros((len(alphas), 1)), np.cumsum(surv, axis=1)], axis=1)
    return cum[:, np.asarray(arms, dtype=int)]


def _fit_alpha(measured: Sequence[ArmAcceptance], delta: float) -> tuple[float, float]:
    """Weighted least-squares α of the chain to the measured means, and its standard error
    (from the curvature), on a grid refined three times: cheap, vectorised and global."""
    ks = [m.arm for m in measured]
    y = np.array([m.mean for m in measured])
    w = 1.0 / np.array([m.sd for m in measured]) ** 2

    def loss(alphas: np.ndarray) -> np.ndarray:
        return ((_chain_table(alphas, delta, ks) - y) ** 2 * w).sum(axis=1)

    lo, hi, best = 0.0, 1.0, 0.5
    for _ in range(3):
        grid = np.linspace(lo, hi, 21)
        best = float(grid[int(np.argmin(loss(grid)))])
        step = (hi - lo) / 20
        lo, hi = max(best - step, 0.0), min(best + step, 1.0)
    h = 1e-3
    f0, f1, f2 = loss(np.array([max(best - h, 0.0), best, min(best + h, 1.0)]))
    curv = (f2 - 2 * f1 + f0) / (h * h)
    sd = math.sqrt(2 / curv) if curv > 0 else _PRIOR_ALPHA[1]
    return best, min(sd, _PRIOR_ALPHA[1])


def acceptance_posterior(
    measured: Sequence[ArmAcceptance],
    arms: Sequence[int],
    *,
    delta: float,
    grid: Sequence[float] = DEFAULT_ACCEPTANCE_GRID,
    lengths: Sequence[float] = DEFAULT_ACCEPTANCE_LENGTHS,
) -> AcceptancePosterior:
    """The posterior of every arm's log emitted tokens per request-step.

    Args:
        measured: the arms that drafted (k > 0), at most one entry each.
        arms: every arm, in the order of the result (k = 0 emits exactly one token).
        delta: the chain's per-position decay.
        grid, lengths: deviation scales and correlation lengths (in k) to average over.
    """
    arms = tuple(arms)
    measured = [m for m in measured if m.arm > 0 and m.sd > 0]
    if measured:
        alpha, alpha_sd = _fit_alpha(measured, delta)
    else:
        alpha, alpha_sd = _PRIOR_ALPHA
    na = len(arms)
    karr = np.asarray(arms, dtype=float)
    cap = np.log1p(karr)
    mu = np.log1p(chain_accepted(alpha, delta, arms))
    h = 1e-4
    grad = (np.log1p(chain_accepted(min(alpha + h, 1.0), delta, arms))
            - np.log1p(chain_accepted(max(alpha - h, 0.0), delta, arms))) / (
        min(alpha + h, 1.0) - max(alpha - h, 0.0))
    drafts = karr > 0  # k = 0 emits one token whatever acceptance is: no spread
    c_model = alpha_sd**2 * np.outer(grad, grad)
    hyper = [(t, ln) for t in grid for ln in lengths]
    tau2 = np.array([t * t for t, _ in hyper])[:, None, None]
    lk = np.array([ln for _, ln in hyper])[:, None, None]
    mask = np.outer(drafts, drafts).astype(float)
    c_all = (c_model + tau2 * np.exp(-np.abs(karr[:, None] - karr[None, :]) / lk)) * mask
    col = {k: i for i, k in enumerate(arms)}
    idx = np.array([col[m.arm] for m in measured], dtype=int)
    if len(idx):
        y = np.log1p(np.array([min(max(m.mean, 0.0), float(m.arm)) for m in measured]))
        noise = np.array([(m.sd / (1.0 + m.mean)) ** 2 for m in measured])
        resid = y - mu[idx]
        c_am = c_all[:, :, idx]  # [hyper, all, measured]
        c_mm = c_am[:, idx, :] + np.diag(noise + _JITTER)
        chol = np.linalg.cholesky(c_mm)
        r = np.broadcast_to(resid[None, :, None], (len(hyper), len(idx), 1))
        sol = np.linalg.solve(chol, np.concatenate([r, c_am.transpose(0, 2, 1)], axis=2))
        a, v = sol[:, :, 0], sol[:, :, 1:]
        lw = (-0.5 * (a * a).sum(axis=1)
              - np.log(np.diagonal(chol, axis1=1, axis2=2)).sum(axis=1))
        w = np.exp(lw - lw.max())
        m = mu + np.einsum("hmn,hm->hn", v, a)
        cov = c_all - np.einsum("hma,hmb->hab", v, v)
    else:
        w = np.ones(len(hyper))
        m = np.broadcast_to(mu, (len(hyper), na))
        cov = c_all
    w /= w.sum()
    cov = cov + np.eye(na) * 1e-9
    var = np.maximum(np.einsum("haa->ha", cov), 0.0)
    mean = w @ m
    sd = np.sqrt(np.maximum(w @ (var + m * m) - mean * mean, 0.0))
    keep = w > 1e-6
    return AcceptancePosterior(
        arms=arms, mean=mean, sd=sd, alpha=alpha,
        tau=float(w @ np.array([t for t, _ in hyper])),
        _weights=tuple(float(x) for x in w[keep] / w[keep].sum()),
        _means=np.array(m[keep]), _chols=np.linalg.cholesky(cov[keep]), cap=cap,
    )
