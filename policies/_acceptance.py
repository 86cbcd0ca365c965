"""Chain acceptance arithmetic (``anchors.md`` §3.3), shared by the static SGLang baseline and
the model-based policy.

A request accepts draft position ``i`` with probability ``α·δ^(i−1)`` given the positions
before it were accepted, so ``P(A ≥ i) = α^i·δ^(i(i−1)/2)`` and a step at arm ``k`` emits
``1 + Σ_{i≤k} P(A ≥ i)`` tokens on average (the bonus token included).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from functools import lru_cache

import numpy as np

__all__ = ["chain_accepted", "chain_grid", "expected_accepted", "expected_emitted", "fit_chain"]

# The grid a chain is fitted on: first-position acceptance α, and the per-position factor δ,
# which may pass 1 (acceptance that rises with depth: a draft that got far is on an easy
# stretch) or fall well below the default (a horizon past which the draft loses the thread).
# A fit adds its prior's δ to the grid, so a chain the data cannot tell apart stays exact.
ALPHAS = np.linspace(0.0, 1.0, 201)
DELTAS = tuple(float(d) for d in np.linspace(0.80, 1.12, 17))


def expected_accepted(alpha: float, delta: float, k: int) -> float:
    """Mean accepted drafts per request-step at arm ``k`` (bonus token excluded)."""
    if not (0.0 <= alpha <= 1.0 and 0.0 <= delta <= 1.0):
        raise ValueError(f"alpha and delta must be in [0, 1], got {alpha}, {delta}")
    return chain_accepted(alpha, delta, k)


def expected_emitted(alpha: float, delta: float, k: int) -> float:
    """Mean emitted tokens per request-step at arm ``k`` (bonus token included)."""
    return 1.0 + expected_accepted(alpha, delta, k)


def chain_accepted(alpha: float, delta: float, k: int) -> float:
    """:func:`expected_accepted` for a chain whose ``δ`` may also pass 1 (acceptance rising
    with depth); each position's conditional acceptance ``α·δ^(i−1)`` is capped at 1."""
    if not (0.0 <= alpha <= 1.0 and delta >= 0.0):
        raise ValueError(f"alpha must be in [0, 1] and delta non-negative, got {alpha}, {delta}")
    total, p = 0.0, 1.0
    for i in range(1, k + 1):
        p *= min(alpha * delta ** (i - 1), 1.0)
        total += p
    return total


@lru_cache(maxsize=64)
def chain_grid(arms: tuple[int, ...], deltas: tuple[float, ...]) -> np.ndarray:
    """:func:`chain_accepted` on the (:data:`ALPHAS`, ``deltas``) grid, [α, δ, arm]."""
    grid = np.array([[[chain_accepted(float(a), d, k) for k in arms] for d in deltas]
                     for a in ALPHAS])
    grid.flags.writeable = False
    return grid


def fit_chain(arms: Sequence[int], points: Iterable[tuple[int, float, float]], delta: float,
              delta_sd: float = math.inf) -> tuple[float, float]:
    """The chain ``(α, δ)`` on the grid of least ``Σ weight·(mean − chain)²`` over ``points``
    of ``(arm, mean accepted drafts per request-step, weight)``, plus ``((δ − delta) /
    delta_sd)²``: a normal prior on δ around ``delta`` (``delta_sd`` 0: δ is ``delta``)."""
    deltas = (delta,) if delta_sd == 0 else tuple(sorted({*DELTAS, delta}))
    grid, index = chain_grid(tuple(arms), deltas), {k: i for i, k in enumerate(arms)}
    loss = np.zeros(grid.shape[:2])
    if 0 < delta_sd < math.inf:
        loss += ((np.asarray(deltas) - delta) / delta_sd)[None, :] ** 2
    for k, m, w in points:
        loss += w * (grid[..., index[k]] - m) ** 2
    # Profile over δ: each column's least loss in α, refined between grid points by a
    # parabola, so a δ the data cannot tell from the prior's does not win on the α grid's
    # rounding.
    ia = np.clip(np.argmin(loss, axis=0), 1, len(ALPHAS) - 2)
    cols = np.arange(loss.shape[1])
    lo, mid, hi = loss[ia - 1, cols], loss[ia, cols], loss[ia + 1, cols]
    curv = lo - 2 * mid + hi
    shift = np.where(curv > 0, 0.5 * (lo - hi) / np.where(curv > 0, curv, 1.0), 0.0)
    shift = np.clip(shift, -1.0, 1.0)
    profile = mid - 0.25 * (lo - hi) * shift
    j = int(np.argmin(profile))
    alpha = float(np.clip(ALPHAS[ia[j]] + shift[j] * (ALPHAS[1] - ALPHAS[0]), 0.0, 1.0))
    return alpha, deltas[j]
